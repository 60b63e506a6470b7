"""Admission: refuse at submit what can never run, with the numbers and a hint.

A pure check of one AllocationSpec against the cluster as registered (nodes, tenants,
vClusters). Three refusals, in this order:

1. **Tenant hard limit.** More nodes than the tenant's ``max_nodes`` (or a tenant whose
   ``max_concurrent_allocations`` is 0): no headroom can ever come. Text from the
   quota-enforcement document: ``allocation rejected: tenant "physics" would exceed
   max_nodes quota (current: .., requested: .., limit: ..)`` (QuotaExceeded).
2. **Constraints no registered node meets**: an unknown ``gpu_type`` or feature, more
   GPUs or memory per node than any node has. The error lists what exists
   (Unsatisfiable).
3. **Capacity**: more nodes than the vCluster could ever offer: the nodes of its pool
   and of the shared pool that meet the constraints, plus those it may borrow from
   other pools (when it allows borrowing and the work is preemptible, as
   ``decide.borrow``), counting Down, Failed and Drained nodes as capacity that may
   come back and leaving Disabled ones out (Unsatisfiable).

``wait_for_capacity`` lets 2 and 3 through (new nodes may be added); the scheduler then
explains what the allocation waits for (lattice_scheduler.reasons). A node range asks
for its minimum. A cluster with no registered node at all refuses nothing: it is being
brought up and its shape is not known yet.

The same function serves single allocations, task groups (one spec for every task)
and the test-only submission.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from lattice_common.errors import QuotaExceeded, Unsatisfiable
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationSpec,
    Node,
    SchedulerType,
    Tenant,
    VCluster,
)
from msgspec.structs import replace

from lattice_scheduler.filters import SOLVER_FLAGS, node_satisfies
from lattice_scheduler.preemption import non_preemptible

WAIT_HINT = "or submit with --wait-for-capacity to wait until such nodes are added"


def requested_nodes(spec: AllocationSpec) -> int:
    """The fewest nodes the allocation can run on (a range's minimum)."""
    return spec.min_nodes or spec.nodes


def tenant_nodes_in_use(allocations: Iterable[Allocation], tenant: str) -> int:
    return sum(
        len(a.assigned_nodes)
        for a in allocations
        if a.spec.tenant == tenant and a.state in HOLDING_STATES
    )


def check_tenant_limits(
    spec: AllocationSpec, tenant: Tenant | None, allocations: Iterable[Allocation] = ()
) -> None:
    """Refusal 1: a request the tenant's hard limits can never admit. ``allocations``:
    those holding nodes, for the tenant's current usage in the text."""
    if tenant is None:
        return
    k = requested_nodes(spec)
    if tenant.max_nodes is not None and k > tenant.max_nodes:
        current = tenant_nodes_in_use(allocations, tenant.name)
        raise QuotaExceeded(
            f'allocation rejected: tenant "{tenant.name}" would exceed max_nodes quota '
            f"(current: {current}, requested: {k}, limit: {tenant.max_nodes})",
            details={
                "tenant": tenant.name,
                "current": current,
                "requested": k,
                "limit": tenant.max_nodes,
            },
            hint=f"The tenant may hold at most {tenant.max_nodes} nodes at once: ask for "
            f"{tenant.max_nodes} or fewer, or ask your tenant admin to raise max_nodes.",
        )
    if tenant.max_concurrent_allocations == 0:
        raise QuotaExceeded(
            f'allocation rejected: tenant "{tenant.name}" may run no allocations '
            "(max_concurrent_allocations: 0)",
            details={"tenant": tenant.name, "limit": 0},
            hint="Ask your tenant admin to raise max_concurrent_allocations.",
        )


def _listing(values: Iterable[object]) -> str:
    counts = Counter(str(v) for v in values if v not in ("", None))
    if not counts:
        return "none"
    return ", ".join(f"{v} ({n})" for v, n in sorted(counts.items()))


def check_constraints(spec: AllocationSpec, nodes: Iterable[Node]) -> None:
    """Refusal 2: a constraint that no registered (enabled) node meets, one dimension at
    a time so the error can say what exists instead."""
    c = spec.constraints
    pool = [n for n in nodes if not n.disabled]
    if not pool:
        return
    caps = [n.capabilities for n in pool]
    if c.gpu_type and not any(x.gpu_type.lower() == c.gpu_type.lower() for x in caps):
        available = _listing(x.gpu_type for x in caps)
        _refuse(
            f'no registered node has gpu_type "{c.gpu_type}"',
            {"gpu_type": c.gpu_type, "available": available},
            "Ask for one of the GPU types listed (--constraint gpu_type=TYPE)"
            if available != "none"
            else "No registered node has GPUs: drop the gpu_type constraint",
        )
    if c.gpu_count and not any(x.gpu_count >= c.gpu_count for x in caps):
        most = max(x.gpu_count for x in caps)
        _refuse(
            f"no registered node has {c.gpu_count} GPUs (the most on one node is {most})",
            {"gpus_per_node": c.gpu_count, "max_available": most},
            f"Ask for {most} GPUs per node or fewer, and more nodes",
        )
    features = [f for f in c.features if f not in SOLVER_FLAGS]
    known = {f for x in caps for f in x.features}
    missing = [f for f in features if f not in known]
    if missing:
        _refuse(
            f"no registered node has the feature{'s' if len(missing) > 1 else ''} "
            + ", ".join(f'"{f}"' for f in missing),
            {"features": ", ".join(missing), "available": _listing(sorted(known))},
            "Ask for features from the list (--constraint FEATURE; lattice nodes -o json shows "
            "each node's)",
        )
    mem = _memory_only(spec)
    if c.memory_gb and not any(node_satisfies(n, mem) for n in pool):
        most = max(x.memory_gb + x.cxl_memory_gb for x in caps)
        _refuse(
            f"no registered node has {c.memory_gb} GB of memory (the most is {most} GB)",
            {"memory_gb": c.memory_gb, "max_available_gb": most},
            f"Ask for {most} GB per node or less",
        )


def _memory_only(spec: AllocationSpec) -> AllocationSpec:
    """``spec`` with only its memory requirement (and the CXL opt-in flag)."""
    c = spec.constraints
    keep = [f for f in c.features if f in SOLVER_FLAGS]
    return replace(
        spec, constraints=replace(c, gpu_type="", gpu_count=0, features=keep, topology="")
    )


def capacity(
    spec: AllocationSpec,
    nodes: Iterable[Node],
    vclusters: Mapping[str, VCluster],
) -> tuple[int, int]:
    """(nodes of the vCluster's own and the shared pool, nodes it may borrow) that meet
    ``spec``'s constraints, Down/Failed/Drained included, Disabled not."""
    vc = spec.vcluster
    v = vclusters.get(vc)
    sensitive = v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION
    may_borrow = (
        not sensitive
        and (v is None or v.allow_borrowing)
        and not non_preemptible(Allocation(id="", spec=spec))
    )
    own = borrowable = 0
    for n in nodes:
        if n.disabled or not node_satisfies(n, spec):
            continue
        if n.home_vcluster in ("", vc):
            own += 1
        elif may_borrow:
            lender = vclusters.get(n.home_vcluster)
            if lender is None or lender.scheduler_type != SchedulerType.SENSITIVE_RESERVATION:
                borrowable += 1
    return own, borrowable


def check_capacity(
    spec: AllocationSpec, nodes: Iterable[Node], vclusters: Mapping[str, VCluster]
) -> None:
    """Refusal 3: more nodes than the vCluster could ever offer."""
    k = requested_nodes(spec)
    own, borrowable = capacity(spec, nodes, vclusters)
    if own + borrowable >= k:
        return
    most = own + borrowable
    _refuse(
        f'allocation rejected: needs {k} node{"s" if k != 1 else ""}, vCluster "{spec.vcluster}" '
        f"could offer at most {most} that match",
        {"requested": k, "in_pool": own, "borrowable": borrowable},
        f"Ask for {most} nodes or fewer" if most else "Relax the constraints",
    )


def _refuse(message: str, details: dict[str, object], hint: str) -> None:
    raise Unsatisfiable(message, details=details, hint=f"{hint}, {WAIT_HINT}.")


def check(
    spec: AllocationSpec,
    *,
    nodes: Mapping[str, Node],
    tenants: Mapping[str, Tenant],
    vclusters: Mapping[str, VCluster],
    allocations: Iterable[Allocation] = (),
) -> None:
    """Every refusal above, in order; returns when the allocation may be stored.
    ``allocations``: those holding nodes (for the tenant's current usage in the text)."""
    check_tenant_limits(spec, tenants.get(spec.tenant), allocations)
    if not nodes or spec.wait_for_capacity:
        return
    check_constraints(spec, nodes.values())
    check_capacity(spec, nodes.values(), vclusters)


__all__ = [
    "capacity",
    "check",
    "check_capacity",
    "check_constraints",
    "check_tenant_limits",
    "requested_nodes",
    "tenant_nodes_in_use",
]
