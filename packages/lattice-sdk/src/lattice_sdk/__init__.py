"""Async Python client for the Lattice REST API.

::

    from lattice_sdk import LatticeClient, AllocationSpec

    async with LatticeClient("127.0.0.1", 8080) as client:
        alloc = await client.submit(AllocationSpec(entrypoint="python train.py", nodes=4))

Importing this package is cheap: the HTTP library (aiohttp) is imported when a client
opens, not here.
"""

from lattice_sdk._version import __version__
from lattice_sdk.client import LatticeClient
from lattice_sdk.errors import (
    LatticeAuthError,
    LatticeConflictError,
    LatticeError,
    LatticeNotFoundError,
    LatticeUnavailableError,
    LatticeValidationError,
)
from lattice_sdk.models import (
    TERMINAL_STATES,
    Allocation,
    AllocationEvent,
    AllocationSpec,
    LogLine,
    LogLines,
    Node,
    NodeCapabilities,
    QueueEntry,
    StartEstimate,
    Tenant,
    VCluster,
)

__all__ = [
    "TERMINAL_STATES",
    "Allocation",
    "AllocationEvent",
    "AllocationSpec",
    "LatticeAuthError",
    "LatticeClient",
    "LatticeConflictError",
    "LatticeError",
    "LatticeNotFoundError",
    "LatticeUnavailableError",
    "LatticeValidationError",
    "LogLine",
    "LogLines",
    "Node",
    "NodeCapabilities",
    "QueueEntry",
    "StartEstimate",
    "Tenant",
    "VCluster",
    "__version__",
]
