"""Pending reasons: the troubleshooting table's words, with the numbers behind them.

A reason has a fixed *kind* (the table's wording, which the scheduler's own logic
compares: borrowing, preemption and node ranges act on "all suitable nodes occupied")
and a *detail* with the figures a user needs to act (``needs 8 nodes, vCluster default
has 4``). Users see ``kind: detail``.

Only figures that change when the situation changes go into a detail (quota usage,
node counts): a reason is re-published to the quorum whenever its text changes. So
"all suitable nodes occupied" says nothing of reservations: which allocations hold one
changes from cycle to cycle (and a cycle with no free node makes none), and their
starts move whenever a running job ends early; a text that followed them went through
Raft nearly every cycle (measured: -10 % end-to-end job throughput). The reservation
is the allocation's estimated start instead (START_TIME, basis ``reservation``, and
``lattice queue``'s reserved start).
"""

from __future__ import annotations

from lattice_common.types import Tenant

QUOTA = "waiting for quota headroom"
NO_MATCH = "no nodes matching constraints"
OCCUPIED = "all suitable nodes occupied"
CONFORMANCE = "insufficient conformance group"
POWER = "waiting for power budget headroom"
TASK_GROUP_LIMIT = "task group concurrency limit"
WAITING_FOR_CAPACITY = "waiting for capacity"
MUTEX = "waiting for its singleton mutex"


def text(kind: str, detail: str = "") -> str:
    """What users read: ``kind`` alone, or ``kind: detail``."""
    return f"{kind}: {detail}" if detail else kind


def nodes_word(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def quota(t: Tenant, used_nodes: int, used_allocs: int, k: int) -> str:
    """The hard quota of ``t`` that ``k`` more nodes (one more allocation) would exceed,
    with its figures; "" when neither would."""
    if t.max_nodes is not None and used_nodes + k > t.max_nodes:
        return quota_nodes(t.name, used_nodes, t.max_nodes, k)
    limit = t.max_concurrent_allocations
    if limit is not None and used_allocs + 1 > limit:
        return quota_allocations(t.name, used_allocs, limit)
    return ""


def quota_nodes(tenant: str, used: int, limit: int, requested: int) -> str:
    return (
        f"tenant {tenant} holds {used} of max_nodes {limit}, this allocation needs {requested} more"
    )


def quota_allocations(tenant: str, running: int, limit: int) -> str:
    return f"tenant {tenant} has {running} of max_concurrent_allocations {limit} running"


def too_few_nodes(needed: int, vcluster: str, usable: int, unusable: int) -> str:
    """More nodes asked for than the vCluster's pool offers now; ``unusable``: matching
    nodes that are down, failed or disabled (capacity that may come back)."""
    where = f"vCluster {vcluster}" if vcluster else "the cluster"
    out = f"needs {nodes_word(needed)}, {where} has {usable} that match"
    if unusable:
        out += f" ({unusable} more down or disabled)"
    return out


def conformance(needed: int, largest: int) -> str:
    return f"needs {nodes_word(needed)} with one conformance fingerprint, the largest group has {largest}"


def over_share(tenant: str) -> str:
    return f"tenant {tenant} holds at least its fair share, so other tenants' work goes first"
