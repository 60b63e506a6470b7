"""State deltas for the watch-state stream, and a local mirror that applies them.

The quorum publishes a snapshot, then one delta per applied command, each stamped
with the GlobalState revision. Schedulers (and stateless API servers) keep a
:class:`StateMirror` up to date from that stream and decide on a consistent view.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from lattice_common import heap
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    Node,
    Tenant,
    VCluster,
)


class StateDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    revision: int
    snapshot: bool = False  # True: replaces the whole mirror
    allocations: list[Allocation] = msgspec.field(default_factory=list)
    nodes: list[Node] = msgspec.field(default_factory=list)
    tenants: list[Tenant] = msgspec.field(default_factory=list)
    vclusters: list[VCluster] = msgspec.field(default_factory=list)
    # ids of terminal allocations that left the state after their retention (their
    # records are in the history store, lattice_common.history)
    removed_allocations: list[str] = msgspec.field(default_factory=list)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StateDelta)


def encode_delta(d: StateDelta) -> bytes:
    return _enc.encode(d)


GC_PAUSE_BYTES = 64 * 1024
"""Deltas at least this large decode with the cyclic garbage collector paused."""


def decode_delta(raw: bytes) -> StateDelta:
    """Decode one delta. A large one (a task group, a snapshot) allocates tens of
    thousands of containers, each allocation counting towards a collection that walks
    the whole heap, i.e. the whole mirror: with 100,000 allocations mirrored that
    multiplied the decode time by ten. Decoded records form no reference cycles, so
    nothing is lost by not collecting while decoding."""
    if len(raw) < GC_PAUSE_BYTES or not gc.isenabled():
        return _dec.decode(raw)
    gc.disable()
    try:
        return _dec.decode(raw)
    finally:
        gc.enable()


GC_FREEZE_ALLOCATIONS = 10_000
"""A snapshot with at least this many allocations is moved out of the collector's reach
(``gc.freeze``) once applied."""

_ABSENT: Any = object()


class AllocationsSnapshot(Mapping[str, Allocation]):
    """The mirror's allocations as they were when taken, in O(1) and kept so by the
    mirror (which saves the previous record of whatever it changes afterwards, for as
    long as the snapshot lives). The holder may write records into it: they stay its
    own. A forward simulation reads a consistent state across event-loop turns
    without copying every allocation of the mirror."""

    __slots__ = ("__weakref__", "_base", "_own", "_saved")

    def __init__(self, base: dict[str, Allocation]) -> None:
        self._base = base
        self._saved: dict[str, Allocation] = {}  # _ABSENT: added to base since taken
        self._own: dict[str, Allocation] = {}

    def _preserve(self, base: dict[str, Allocation], aid: str) -> None:
        if base is self._base and aid not in self._saved:
            self._saved[aid] = base.get(aid, _ABSENT)

    def __getitem__(self, aid: str) -> Allocation:
        a = self._own.get(aid, _ABSENT)
        if a is _ABSENT:
            a = self._saved.get(aid, _ABSENT)
            if a is _ABSENT:
                if aid in self._saved:
                    raise KeyError(aid)
                return self._base[aid]
        return a

    def get(self, aid: str, default: Any = None) -> Any:
        try:
            return self[aid]
        except KeyError:
            return default

    def __contains__(self, aid: object) -> bool:
        try:
            self[aid]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __setitem__(self, aid: str, a: Allocation) -> None:
        self._own[aid] = a

    def __iter__(self) -> Iterator[str]:
        saved = self._saved
        for aid in self._base:
            if aid not in saved:
                yield aid
        for aid, a in saved.items():
            if a is not _ABSENT:
                yield aid
        for aid in self._own:
            was = saved.get(aid, _ABSENT)
            if was is _ABSENT and (aid in saved or aid not in self._base):
                yield aid

    def __len__(self) -> int:
        return sum(1 for _ in self)


class StateMirror:
    """A read-only copy of GlobalState kept current from StateDelta messages."""

    def __init__(self) -> None:
        self.revision = 0
        self.allocations: dict[str, Allocation] = {}
        self.nodes: dict[str, Node] = {}
        self.tenants: dict[str, Tenant] = {}
        self.vclusters: dict[str, VCluster] = {}
        # indexes kept with every change, so readers need not scan all allocations
        self.pending: dict[str, None] = {}
        self.holding: dict[str, None] = {}
        # live snapshots by serial (weakly held: a dropped one costs nothing more)
        self._snapshots: weakref.WeakValueDictionary[int, AllocationsSnapshot] = (
            weakref.WeakValueDictionary()
        )
        self._serial = 0

    def snapshot_allocations(self) -> AllocationsSnapshot:
        """The allocations as they are now, unaffected by later deltas (see
        :class:`AllocationsSnapshot`)."""
        s = AllocationsSnapshot(self.allocations)
        self._serial += 1
        self._snapshots[self._serial] = s
        return s

    def apply(self, d: StateDelta) -> None:
        snaps = list(self._snapshots.values()) if not d.snapshot else []
        if snaps:  # keep what live snapshots saw (a snapshot delta swaps the dict)
            base = self.allocations
            for s in snaps:
                for a in d.allocations:
                    s._preserve(base, a.id)
                for aid in d.removed_allocations:
                    s._preserve(base, aid)
        if d.snapshot:
            self.allocations = {}
            self.nodes = {}
            self.tenants = {}
            self.vclusters = {}
            self.pending = {}
            self.holding = {}
        for a in d.allocations:
            self.allocations[a.id] = a
            if a.state == AllocationState.PENDING:
                self.pending[a.id] = None
            else:
                self.pending.pop(a.id, None)
            if a.state in HOLDING_STATES:
                self.holding[a.id] = None
            else:
                self.holding.pop(a.id, None)
        for aid in d.removed_allocations:
            self.allocations.pop(aid, None)
            self.pending.pop(aid, None)
            self.holding.pop(aid, None)
        for n in d.nodes:
            self.nodes[n.id] = n
        for t in d.tenants:
            self.tenants[t.name] = t
        for v in d.vclusters:
            self.vclusters[v.name] = v
        self.revision = max(self.revision, d.revision) if not d.snapshot else d.revision
        if d.snapshot and len(d.allocations) >= GC_FREEZE_ALLOCATIONS:
            # the mirror lives as long as the process: keep its records out of the
            # collector's full walks (every delta's records counted towards one and
            # walked all of them; halves a 10,000-record delta at 100,000 mirrored).
            # Replaced records are still freed by their reference counts.
            heap.freeze()
