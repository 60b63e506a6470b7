"""Checkpoint storage: where checkpoints are written and kept (spec: Checkpoint Broker,
"Checkpoint Destinations", "Storage Outage Behavior"; Data Retention).

- :mod:`.layout` — ``checkpoint_root`` parsed; ``{root}/{tenant}/{project}/{alloc}/checkpoints/{id}/``
- :mod:`.base` — the :class:`CheckpointStore` interface, :class:`ProbeResult`
- :mod:`.local` — a shared directory (NFS); :mod:`.s3` — an S3-compatible bucket
- :mod:`.factory` — the store the configuration names
- :mod:`.outage` — probe results -> unavailable, the gauge, recovery order
- :mod:`.retention` — checkpoints of ended allocations deleted after the retention
"""

from lattice_checkpoint.storage.base import (
    DEFAULT_PROBE_BYTES,
    DEFAULT_PROBE_TIMEOUT_S,
    CheckpointStorageError,
    CheckpointStore,
    ProbeResult,
)
from lattice_checkpoint.storage.factory import open_checkpoint_store, store_from_config
from lattice_checkpoint.storage.layout import (
    AllocationKey,
    CheckpointRoot,
    allocation_key,
    parse_checkpoint_root,
)
from lattice_checkpoint.storage.local import LocalCheckpointStore
from lattice_checkpoint.storage.outage import (
    DEFAULT_FAILURES_TO_UNAVAILABLE,
    STORAGE_UNAVAILABLE,
    OutageState,
    StorageOutageTracker,
    Transition,
    observe,
    recovery_order,
)
from lattice_checkpoint.storage.retention import (
    DEFAULT_RETENTION_DAYS,
    SweepReport,
    expired,
    sweep_expired_checkpoints,
    terminal_times,
)
from lattice_checkpoint.storage.s3 import S3CheckpointStore

__all__ = [
    "DEFAULT_FAILURES_TO_UNAVAILABLE",
    "DEFAULT_PROBE_BYTES",
    "DEFAULT_PROBE_TIMEOUT_S",
    "DEFAULT_RETENTION_DAYS",
    "STORAGE_UNAVAILABLE",
    "AllocationKey",
    "CheckpointRoot",
    "CheckpointStorageError",
    "CheckpointStore",
    "LocalCheckpointStore",
    "OutageState",
    "ProbeResult",
    "S3CheckpointStore",
    "StorageOutageTracker",
    "SweepReport",
    "Transition",
    "allocation_key",
    "expired",
    "observe",
    "open_checkpoint_store",
    "parse_checkpoint_root",
    "recovery_order",
    "store_from_config",
    "sweep_expired_checkpoints",
    "terminal_times",
]
