"""Native PMI server core for the node agent (ADR-010): MPI wire-up without ssh.

``wire`` parses/formats PMI-1 lines and PMI-2 frames; ``kvs`` is the pure
per-launch state machine; ``server`` is the socket shell (PMI_FD per rank)
and ``fence`` the head agent's side of the cross-node fence.
"""

from lattice_agent.pmi.fence import (
    DuplicateContribution,
    EpochMismatch,
    FenceAborted,
    FenceCoordinator,
    FenceError,
    FenceRegistry,
    FenceTimeout,
    UnknownNode,
)
from lattice_agent.pmi.kvs import (
    Abort,
    Action,
    Close,
    FenceReady,
    Launch,
    PmiStateError,
    Reply,
    abort_exit_status,
    block_process_mapping,
)
from lattice_agent.pmi.server import (
    FENCE_TIMEOUT_REASON,
    FenceFn,
    LaunchResult,
    LocalLaunch,
    OutputLine,
    local_fence,
)
from lattice_agent.pmi.wire import (
    Message,
    PmiDecoder,
    PmiProtocolError,
    format_pmi1,
    format_pmi2,
    parse_pmi1_line,
    parse_pmi2_body,
    parse_pmi2_frame,
)

__all__ = [
    "FENCE_TIMEOUT_REASON",
    "Abort",
    "Action",
    "Close",
    "DuplicateContribution",
    "EpochMismatch",
    "FenceAborted",
    "FenceCoordinator",
    "FenceError",
    "FenceFn",
    "FenceReady",
    "FenceRegistry",
    "FenceTimeout",
    "Launch",
    "LaunchResult",
    "LocalLaunch",
    "Message",
    "OutputLine",
    "PmiDecoder",
    "PmiProtocolError",
    "PmiStateError",
    "Reply",
    "UnknownNode",
    "abort_exit_status",
    "block_process_mapping",
    "format_pmi1",
    "format_pmi2",
    "local_fence",
    "parse_pmi1_line",
    "parse_pmi2_body",
    "parse_pmi2_frame",
]
