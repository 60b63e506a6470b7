"""Which pending allocation follows on which busy node (pure).

The quorum hands a node to its ``next_allocation`` in the commit that ends the node's
owner (``lattice_quorum.handlers.handoff``), which spares a short job's successor the
round trip through this scheduler. The choice is the solver's: its reservations say
which top-ranked allocation starts where once running work ends. A one-node
reservation on a busy node of this vCluster's own pool becomes that node's next
allocation; sensitive allocations (claims) and tasks of a group with a concurrency
limit (counted here, not by the quorum) never do. Entries the cycle no longer reserves
are cleared, so a newly arrived, better-ranked job is not stuck behind a stale one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from lattice_common import assignment
from lattice_common.types import AllocationState, Node, NodeState
from lattice_common.watch import StateMirror

from lattice_scheduler.solver import Reservation


def next_allocations(
    m: StateMirror, vc: str, reservations: Sequence[Reservation], proposed: Collection[str]
) -> dict[str, str]:
    """The changes to propose (``SetNextAllocations.next``): node id -> allocation id,
    "" to clear; empty when the mirror already says it."""
    wanted: dict[str, str] = {}
    used: set[str] = set(proposed)
    for r in reservations:
        if len(r.node_ids) != 1 or r.allocation_id in used:
            continue
        a = m.allocations.get(r.allocation_id)
        if (
            a is None
            or a.state != AllocationState.PENDING
            or a.spec.nodes != 1
            or a.held
            or (a.task_group_id and a.task_group_concurrency)
            or assignment.is_sensitive(a, m.vclusters)
        ):
            continue
        nid = r.node_ids[0]
        n = m.nodes.get(nid)
        if n is None or nid in wanted or not _own_busy(n, vc):
            continue
        wanted[nid] = a.id
        used.add(a.id)
    changes = {nid: aid for nid, aid in wanted.items() if m.nodes[nid].next_allocation != aid}
    for n in m.nodes.values():
        if n.next_allocation and n.id not in wanted and n.owner_vcluster == vc:
            changes[n.id] = ""
    return changes


def _own_busy(n: Node, vc: str) -> bool:
    return (
        bool(n.owner)
        and n.state == NodeState.READY
        and n.owner_vcluster == vc
        and n.home_vcluster in ("", vc)
    )
