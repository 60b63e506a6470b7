"""Named reads over GlobalState, for ``quorum.read(queries.x, ...)``.

Each function runs under the apply lock (the quorum calls it) and returns copies or
fresh values, never a record the state machine will go on mutating. Callers name what
they want instead of reaching into GlobalState's dictionaries, so the state's layout can
change behind these functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

import msgspec
from lattice_common.audit import AuditEntry, AuditEvent
from lattice_common.ledger import Usage, budget_status, node_gpu_counts, usage, usage_by
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    Dag,
    Node,
    NodeState,
    ServiceEndpoint,
    Session,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror

from lattice_quorum.state import GlobalState

T = TypeVar("T")

_copy = msgspec.structs.replace


# --- allocations -----------------------------------------------------------------------


def tenant_and_vcluster_names(s: GlobalState) -> tuple[set[str], set[str]]:
    return set(s.tenants), set(s.vclusters)


def allocation(s: GlobalState, alloc_id: str) -> Allocation | None:
    a = s.allocations.get(alloc_id)
    return None if a is None else _copy(a)


def allocations_matching(
    s: GlobalState,
    *,
    states: Collection[AllocationState] | None = None,
    tenant: str | None = None,
    vcluster: str | None = None,
    user: str | None = None,
    task_group: str | None = None,
    limit: int | None = None,
) -> list[Allocation]:
    """Allocations passing every given filter (None = any), oldest submission first;
    ``limit`` keeps the newest ``limit`` of them."""
    out = []
    for a in s.allocations.values():
        if states is not None and a.state not in states:
            continue
        if tenant and a.spec.tenant != tenant:
            continue
        if vcluster and a.spec.vcluster != vcluster:
            continue
        if user and a.spec.user != user:
            continue
        if task_group and a.task_group_id != task_group:
            continue
        out.append(a)
    out.sort(key=lambda a: a.submitted_at)
    if limit:
        out = out[-limit:]
    return [_copy(a) for a in out]


# --- DAGs ------------------------------------------------------------------------------


def _copy_dag(d: Dag) -> Dag:
    return _copy(d, members=dict(d.members), edges=list(d.edges))


def dag(s: GlobalState, dag_id: str) -> Dag | None:
    d = s.dags.get(dag_id)
    return None if d is None else _copy_dag(d)


def dags(
    s: GlobalState,
    *,
    tenant: str | None = None,
    user: str | None = None,
    state_filter: Collection[str] | None = None,
    limit: int | None = None,
) -> list[Dag]:
    """DAGs passing every given filter (None = any; ``state_filter``: DAG states such as
    ``"Running"``), newest submission first; ``limit`` keeps the first ``limit``."""
    out = []
    for d in reversed(s.dags.values()):  # newest first among equal submission times
        if tenant and d.tenant != tenant:
            continue
        if user and d.user != user:
            continue
        if state_filter is not None and d.state not in state_filter:
            continue
        out.append(d)
    out.sort(key=lambda d: -d.submitted_at)
    if limit:
        out = out[:limit]
    return [_copy_dag(d) for d in out]


def dag_member_states(s: GlobalState, d: Dag) -> dict[str, tuple[AllocationState, bool]]:
    """ref -> (its allocation's state, whether it is held) for the members of ``d``
    whose allocation exists."""
    out = {}
    for ref, alloc_id in d.members.items():
        a = s.allocations.get(alloc_id)
        if a is not None:
            out[ref] = (a.state, a.held)
    return out


# --- nodes -----------------------------------------------------------------------------


def node(s: GlobalState, node_id: str) -> Node | None:
    n = s.nodes.get(node_id)
    return None if n is None else _copy(n)


def node_liveness(s: GlobalState, node_id: str) -> tuple[NodeState, bool, str] | None:
    """(state, disabled, conformance group) of a node, no copy: what every heartbeat
    needs of its node's record; None for an unknown node."""
    n = s.nodes.get(node_id)
    return None if n is None else (n.state, n.disabled, n.conformance_group)


def nodes(s: GlobalState, states: Collection[NodeState] | None = None) -> list[Node]:
    """Nodes by id, only those in ``states`` when given."""
    return [
        _copy(n)
        for n in sorted(s.nodes.values(), key=lambda n: n.id)
        if states is None or n.state in states
    ]


def node_ids(s: GlobalState) -> list[str]:
    return list(s.nodes)


def node_state_counts(s: GlobalState) -> dict[NodeState, int]:
    counts = dict.fromkeys(NodeState, 0)
    for n in s.nodes.values():
        counts[n.state] += 1
    return counts


def each_node_of(s: GlobalState, ids: Iterable[str], fn: Callable[[Node], T]) -> list[T]:
    """``fn`` of the nodes named (those that exist), in one consistent read."""
    return [fn(n) for i in ids if (n := s.nodes.get(i)) is not None]


def each_node(s: GlobalState, fn: Callable[[Node], T]) -> list[T]:
    """``fn`` of every node, in one consistent read; ``fn`` must return values, not the
    node itself (e.g. ``(n.id, n.state)``)."""
    return [fn(n) for n in s.nodes.values()]


class DesiredSet(NamedTuple):
    """What a node should be doing, read in one consistent view."""

    generation: int  # the revision the set reflects
    allocations: list[Allocation]  # what the node should run; anything else is stopped
    # the node's sensitive claim (a user), "" when unclaimed: work on a claimed node is
    # sensitive, and its agent needs no round trip per allocation to know
    claimed_by: str

    def content(self) -> tuple[tuple[tuple[str, str, int], ...], str]:
        """What the agent acts on: a node-only change (its next allocation, a health
        note) leaves it unchanged, and a set with the same content is not sent again."""
        return tuple((a.id, a.state, a.revision) for a in self.allocations), self.claimed_by


def desired_for(s: GlobalState, node_id: str) -> DesiredSet:
    """The allocations a node should be running now, the revision they reflect and the
    node's sensitive claim."""
    n = s.nodes.get(node_id)
    if n is None:
        return DesiredSet(s.revision, [], "")
    if not n.owner:
        return DesiredSet(n.revision, [], n.claimed_by)
    a = s.allocations.get(n.owner)
    if a is None or a.state not in HOLDING_STATES:
        return DesiredSet(n.revision, [], n.claimed_by)
    return DesiredSet(max(n.revision, a.revision), [_copy(a)], n.claimed_by)


def desired_generation(s: GlobalState, node_id: str) -> int:
    """``desired_for(s, node_id)[0]`` without copying the allocation."""
    n = s.nodes.get(node_id)
    if n is None or not n.owner:
        return n.revision if n else s.revision
    a = s.allocations.get(n.owner)
    if a is None or a.state not in HOLDING_STATES:
        return n.revision
    return max(n.revision, a.revision)


# --- tenants and vClusters -------------------------------------------------------------


def tenants(s: GlobalState) -> list[Tenant]:
    return [_copy(t) for t in sorted(s.tenants.values(), key=lambda t: t.name)]


def tenant(s: GlobalState, name: str) -> Tenant | None:
    t = s.tenants.get(name)
    return None if t is None else _copy(t)


def vclusters(s: GlobalState) -> list[VCluster]:
    return [_copy(v) for v in sorted(s.vclusters.values(), key=lambda v: v.name)]


def vcluster(s: GlobalState, name: str) -> VCluster | None:
    v = s.vclusters.get(name)
    return None if v is None else _copy(v)


# --- scheduling views ------------------------------------------------------------------


def admit(s: GlobalState, check: Callable[..., T], spec: Any) -> T:
    """``check(spec, nodes=, tenants=, vclusters=, allocations=)`` over the live state,
    without copying it (lattice_scheduler.admission.check: read-only, raises to
    refuse); ``allocations``, those holding nodes, is a lazy iterable that the check
    reads only to word a refusal (it runs under the read lock)."""
    return check(
        spec,
        nodes=s.nodes,
        tenants=s.tenants,
        vclusters=s.vclusters,
        allocations=(s.allocations[i] for i in s.active),
    )


def scheduling_view(s: GlobalState, *, history: bool = False) -> StateMirror:
    """A StateMirror copy of what scheduling decisions read: nodes, tenants, vClusters
    and the allocations that are Pending or hold nodes; with ``history`` every
    allocation (the cost function's budget penalty reads past usage)."""
    m = StateMirror()
    m.revision = s.revision
    m.nodes = {k: _copy(n) for k, n in s.nodes.items()}
    m.tenants = {k: _copy(t) for k, t in s.tenants.items()}
    m.vclusters = {k: _copy(v) for k, v in s.vclusters.items()}
    allocs = s.allocations.values()
    if not history:
        allocs = (a for a in allocs if a.state == AllocationState.PENDING or a.id in s.active)
    for a in allocs:
        m.allocations[a.id] = _copy(a)
        if a.state == AllocationState.PENDING:
            m.pending[a.id] = None
        elif a.state in HOLDING_STATES:
            m.holding[a.id] = None
    return m


# --- usage (the internal budget ledger over committed records) --------------------------


def _usage_fields(u: Any) -> dict[str, Any]:
    return {
        "node_hours": u.node_hours,
        "gpu_hours": u.gpu_hours,
        "allocations": u.allocations,
        "running_allocations": u.running_allocations,
        "nodes_in_use": u.nodes_in_use,
    }


def _with_history(s: GlobalState, history: Iterable[Allocation]) -> list[Allocation]:
    """The state's allocations plus ``history`` records it no longer holds."""
    live = s.allocations
    return [*live.values(), *(a for a in history if a.id not in live)]


StoredSums = Mapping[float, Mapping[tuple[str, str], tuple[float, float, int]]]
"""The history store's ledger sums (``HistoryStore.usage_sums``) by window in days:
(tenant, user) -> (node_hours, gpu_hours, allocations)."""


def _plus(
    u: Usage,
    sums: Mapping[tuple[str, str], tuple[float, float, int]] | None,
    tenant: str | None = None,
    user: str | None = None,
) -> Usage:
    if not sums:
        return u
    picked = [
        v
        for (t, us), v in sorted(sums.items())
        if (tenant is None or t == tenant) and (user is None or us == user)
    ]
    return msgspec.structs.replace(
        u,
        node_hours=math.fsum([u.node_hours, *(v[0] for v in picked)]),
        gpu_hours=math.fsum([u.gpu_hours, *(v[1] for v in picked)]),
        allocations=u.allocations + sum(v[2] for v in picked),
    )


def _plus_by(
    groups: dict[str, Usage],
    key: str,
    sums: Mapping[tuple[str, str], tuple[float, float, int]] | None,
    *,
    now: float,
    window: float,
    tenant: str | None = None,
    user: str | None = None,
) -> dict[str, Usage]:
    if not sums:
        return groups
    out = dict(groups)
    names = {
        (t if key == "tenant" else us)
        for (t, us), v in sums.items()
        if v[2] and (tenant is None or t == tenant) and (user is None or us == user)
    }
    for name in names:
        base = out.get(name) or Usage(since=now - window * 86400.0, until=now, window_days=window)
        out[name] = _plus(
            base,
            sums,
            tenant=name if key == "tenant" else tenant,
            user=name if key == "user" else user,
        )
    return {name: out[name] for name in sorted(out)}


def _live(
    s: GlobalState, history: Iterable[Allocation], stored_ids: Collection[str]
) -> list[Allocation]:
    if not stored_ids:
        return _with_history(s, history)
    # counted by the store's sums: never twice
    return [a for a in _with_history(s, history) if a.id not in stored_ids]


def tenant_usage(
    s: GlobalState,
    tenant: str,
    *,
    window_days: float,
    period_days: float,
    now: float,
    history: Iterable[Allocation] = (),
    stored: StoredSums | None = None,
    stored_ids: Collection[str] = (),
) -> dict[str, Any] | None:
    """A tenant's usage over ``window_days``, its budgets judged over ``period_days``,
    its quotas and a per-user breakdown; None when the tenant does not exist.
    ``history``: records moved to the history store (lattice_common.history); or,
    cheaper, ``stored``: the store's sums by window, with ``stored_ids``, the live
    allocations the store already holds (counted there, so left out here)."""
    t = s.tenants.get(tenant)
    if t is None:
        return None
    window, period = window_days, period_days
    inv = node_gpu_counts(s.nodes.values())
    allocs = _live(s, history, stored_ids)
    sw = None if stored is None else stored.get(window)
    sp = None if stored is None else stored.get(period)
    u = _plus(usage(allocs, now=now, window_days=window, tenant=tenant, node_gpus=inv), sw, tenant)
    p = (
        u
        if window == period
        else _plus(
            usage(allocs, now=now, window_days=period, tenant=tenant, node_gpus=inv), sp, tenant
        )
    )
    total = _plus(usage(allocs, now=now, window_days=window, node_gpus=inv), sw).node_hours
    users = _plus_by(
        usage_by(allocs, "user", now=now, window_days=window, tenant=tenant, node_gpus=inv),
        "user",
        sw,
        now=now,
        window=window,
        tenant=tenant,
    )
    b = budget_status(p, t)
    return {
        "tenant": tenant,
        "days": window,
        "since": u.since,
        "until": u.until,
        **_usage_fields(u),
        "max_nodes": t.max_nodes,
        "max_concurrent_allocations": t.max_concurrent_allocations,
        "fair_share_target": t.fair_share_target,
        "fair_share_usage": u.node_hours / total if total > 0 else 0.0,
        "budget_period_days": period,
        "node_hours_used": p.node_hours,
        "gpu_hours_used": p.gpu_hours,
        "node_hours_budget": t.node_hours_budget,
        "gpu_hours_budget": t.gpu_hours_budget,
        "budget_fraction_used": b.fraction,
        "node_budget_fraction": b.node_fraction,
        "gpu_budget_fraction": b.gpu_fraction,
        "node_hours_remaining": b.node_hours_remaining,
        "gpu_hours_remaining": b.gpu_hours_remaining,
        "budget_source": "internal",
        "users": [
            {"user": name, **_usage_fields(x)}
            for name, x in sorted(users.items(), key=lambda kv: (-kv[1].node_hours, kv[0]))
        ],
    }


def user_usage(
    s: GlobalState,
    user: str,
    *,
    tenant: str | None,
    window_days: float,
    now: float,
    history: Iterable[Allocation] = (),
    stored: StoredSums | None = None,
    stored_ids: Collection[str] = (),
) -> dict[str, Any] | None:
    """A user's usage over ``window_days`` in every tenant (or only ``tenant``), with a
    per-tenant breakdown; None when ``tenant`` is given and does not exist.
    ``history`` / ``stored`` / ``stored_ids``: as :func:`tenant_usage`'s."""
    if tenant is not None and tenant not in s.tenants:
        return None
    window = window_days
    inv = node_gpu_counts(s.nodes.values())
    allocs = _live(s, history, stored_ids)
    sw = None if stored is None else stored.get(window)
    u = _plus(
        usage(allocs, now=now, window_days=window, tenant=tenant, user=user, node_gpus=inv),
        sw,
        tenant,
        user,
    )
    by_tenant = _plus_by(
        usage_by(
            allocs, "tenant", now=now, window_days=window, tenant=tenant, user=user, node_gpus=inv
        ),
        "tenant",
        sw,
        now=now,
        window=window,
        tenant=tenant,
        user=user,
    )
    return {
        "user": user,
        "tenant": tenant or "",
        "days": window,
        "since": u.since,
        "until": u.until,
        **_usage_fields(u),
        "tenants": [{"tenant": name, **_usage_fields(x)} for name, x in by_tenant.items()],
    }


__all__ = [
    "DesiredSet",
    "admit",
    "allocation",
    "allocations_matching",
    "certificate_authority",
    "dag",
    "dag_member_states",
    "dags",
    "desired_for",
    "each_node",
    "node",
    "node_ids",
    "node_state_counts",
    "nodes",
    "scheduling_view",
    "tenant",
    "tenant_and_vcluster_names",
    "tenant_usage",
    "tenants",
    "user_usage",
    "vcluster",
    "vclusters",
]


# --- sessions -------------------------------------------------------------------------------


def session_view(s: GlobalState, session_id: str) -> tuple[Session, Allocation | None] | None:
    """A session (a copy) with its allocation (a copy), or None."""
    sess = s.sessions.get(session_id)
    if sess is None:
        return None
    a = s.allocations.get(sess.allocation_id)
    return _copy(sess), None if a is None else _copy(a)


def user_sessions(s: GlobalState, user: str | None) -> list[tuple[Session, Allocation | None]]:
    """Sessions (of ``user``; all when None), newest first, with their allocations."""
    out = []
    for sess in sorted(s.sessions.values(), key=lambda x: (-x.created_at, x.id)):
        if user is None or sess.user == user:
            a = s.allocations.get(sess.allocation_id)
            out.append((_copy(sess), None if a is None else _copy(a)))
    return out


# --- service registry -----------------------------------------------------------------------


def services(
    s: GlobalState, tenants: Collection[str] | None = None
) -> dict[str, list[ServiceEndpoint]]:
    """The registry (copies), by name: the endpoints of ``tenants``' allocations (all when
    None); names with no endpoint left after the filter are not listed."""
    out: dict[str, list[ServiceEndpoint]] = {}
    for name in sorted(s.services):
        eps = [_copy(e) for e in s.services[name] if tenants is None or e.tenant in tenants]
        if eps:
            out[name] = eps
    return out


def service(
    s: GlobalState, name: str, tenants: Collection[str] | None = None
) -> list[ServiceEndpoint]:
    """The endpoints (copies) registered under ``name`` for ``tenants`` (all when None)."""
    return [_copy(e) for e in s.services.get(name, ()) if tenants is None or e.tenant in tenants]


# --- the audit log --------------------------------------------------------------------------
# Entries are never changed once appended (handlers.audit), so a list of the same records
# is a copy a caller may keep.


def audit_tail(s: GlobalState) -> tuple[int, str]:
    """(seq, hash) of the last audit entry; (0, GENESIS) for an empty log."""
    from lattice_quorum.handlers.audit import tail

    return tail(s)


def audit_outbox(s: GlobalState, limit: int = 256) -> list[AuditEvent]:
    """The oldest ``limit`` events the state machine queued for the log (copies)."""
    return [_copy(ev) for ev in s.audit_outbox[:limit]]


def audit_outbox_size(s: GlobalState) -> int:
    return len(s.audit_outbox)


def audit_entries(
    s: GlobalState,
    *,
    since: float | None = None,
    until: float | None = None,
    user: str | None = None,
    action: str | None = None,
    tenant: str | None = None,
    target: str | None = None,
    after_seq: int = 0,
    limit: int = 100,
) -> tuple[list[AuditEntry], int]:
    """Entries after ``after_seq`` matching every filter given, oldest first, at most
    ``limit``; and the seq to continue after (0 when nothing matches beyond them).
    ``action`` matches exactly or as a prefix ending in a dot (``node.`` = every node
    action); ``target`` exactly or its id (``n1`` = ``node:n1``)."""
    out: list[AuditEntry] = []
    for e in s.audit_log[max(after_seq, 0) :]:
        if since is not None and e.time < since:
            continue
        if until is not None and e.time > until:
            continue
        if user and e.actor != user:
            continue
        if (
            action
            and e.action != action
            and not (action.endswith(".") and e.action.startswith(action))
        ):
            continue
        if tenant and e.tenant != tenant:
            continue
        if target and e.target != target and e.target.split(":", 1)[-1] != target:
            continue
        if len(out) == limit:
            return out, out[-1].seq
        out.append(e)
    return out, 0


def audit_log(s: GlobalState) -> tuple[list[AuditEntry], dict[str, str]]:
    """The whole log (oldest first) and the PEM of each key that signed it, by key id."""
    return list(s.audit_log), dict(s.audit_keys)


# --- the internal CA ----------------------------------------------------------------------


def certificate_authority(s: GlobalState) -> tuple[str, str, list[str]]:
    """(certificate PEM, key PEM, rotated-out certificates still trusted); empty
    strings when the cluster has no CA (`lattice admin ca init`)."""
    return s.ca_cert_pem, s.ca_key_pem, list(s.ca_previous)
