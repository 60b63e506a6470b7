"""State deltas for the watch-state stream, and a local mirror that applies them.

The quorum publishes a snapshot, then one delta per applied command, each stamped
with the GlobalState revision. Schedulers (and stateless API servers) keep a
:class:`StateMirror` up to date from that stream and decide on a consistent view.
"""

from __future__ import annotations

import msgspec

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


def decode_delta(raw: bytes) -> StateDelta:
    return _dec.decode(raw)


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

    def apply(self, d: StateDelta) -> None:
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
