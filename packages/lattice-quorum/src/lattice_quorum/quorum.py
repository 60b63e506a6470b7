"""The quorum as its users see it: one protocol, two implementations (the Patroni pattern).

``QuorumMember`` (member.py) runs Raft through pysyncobj; ``LocalQuorum`` (local.py)
applies commands in process with no Raft, for tests and tools. The API, the node
monitor and the log proxy are written against :class:`Quorum` only, so the same code
serves a real cluster and an in-process one.

The watch encoding lives here too, so both implementations feed watchers byte-for-byte
the same snapshot and deltas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from lattice_common import commands as c
from lattice_common.watch import StateDelta, encode_delta

from lattice_quorum.state import Changes, GlobalState

T = TypeVar("T")


@runtime_checkable
class Quorum(Protocol):
    """What lattice-api needs from the replicated state: propose commands, read it under
    the apply lock, watch it change, and know whether this member leads."""

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        """Commit ``cmd`` and return its result (``error`` set when rejected)."""
        ...

    async def propose_many(self, cmds: list[c.Command]) -> list[c.CommandResult]: ...

    def read(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(state, *args, **kwargs)`` under the apply lock; ``fn`` copies what it
        returns (the functions of :mod:`lattice_quorum.queries` do)."""
        ...

    def subscribe(self, maxsize: int = 0) -> asyncio.Queue[bytes | None]:
        """A snapshot first, then one encoded delta per applied entry; ``None`` means
        the state was replaced (resubscribe)."""
        ...

    def unsubscribe(self, q: asyncio.Queue[bytes | None]) -> None: ...

    def snapshot_delta(self) -> bytes: ...

    @property
    def revision(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def caught_up(self) -> bool: ...

    def require_caught_up(self) -> None:
        """Raise Unavailable unless this member's state reflects the cluster."""
        ...

    @property
    def leader_raft_address(self) -> str | None: ...

    def status(self) -> dict[str, Any]:
        """member_id, leader_address, is_leader, term, commit_index, last_applied,
        log_len, revision, members."""
        ...

    def on_leadership(self, cb: Callable[[bool], None]) -> None:
        """``cb(is_leader)`` runs on the event loop whenever this member's role changes."""
        ...


def encode_snapshot(state: GlobalState) -> bytes:
    """The whole state as one snapshot delta (the first message every watcher gets)."""
    return encode_delta(
        StateDelta(
            revision=state.revision,
            snapshot=True,
            allocations=list(state.allocations.values()),
            nodes=list(state.nodes.values()),
            tenants=list(state.tenants.values()),
            vclusters=list(state.vclusters.values()),
        )
    )


def encode_changes(state: GlobalState, ch: Changes) -> bytes:
    """The records one apply touched, at the state's new revision."""
    return encode_delta(
        StateDelta(
            revision=state.revision,
            allocations=[state.allocations[k] for k in ch.allocations],
            nodes=[state.nodes[k] for k in ch.nodes],
            tenants=[state.tenants[k] for k in ch.tenants],
            vclusters=[state.vclusters[k] for k in ch.vclusters],
            removed_allocations=sorted(ch.removed_allocations),
        )
    )


__all__ = ["Quorum", "encode_changes", "encode_snapshot"]
