"""Command handlers of DAG workflows, and the dependency resolution that runs in apply.

Why in the quorum's apply and not in an API-side controller: a member's end and what it
means for its successors (released into the queue, or cancelled because a condition can
never hold) commit in the same command. Nothing is lost when an API member crashes or
the leader changes, nothing runs twice, and a released successor is visible to the
scheduler in the same watch delta as the end that released it, so a chain costs no extra
round trip per stage. The decisions themselves are ``lattice_common.dag.resolve`` (pure),
fed only the ended member's ref: it touches that member's successors and their cascade,
not the whole DAG.

A member with dependencies is stored Pending with ``held`` set; the scheduler skips held
allocations and ``assign_nodes`` refuses them. Mutex (singleton) names are kept on the
members' specs; enforcing them at start time is the scheduler's part.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec
from lattice_common import commands as c
from lattice_common.dag import (
    DagDefinition,
    DagIndex,
    DagMemberSpec,
    DagState,
    DependencyCondition,
    MemberState,
    dag_state,
    dependency_verdict,
    resolve,
    unit_key,
)
from lattice_common.errors import InvalidTransition, NotFound, ValidationError
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Dag,
    DagEdge,
    Dependency,
)

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers import common
from lattice_quorum.handlers.common import (
    admitted,
    bump,
    check_names,
    finish,
    next_id,
    reused_request,
    task_spec,
    touch_alloc,
)

__all__ = ["cancel_dag", "check_dependencies", "ended", "hold", "submit_dag"]


def _index(d: Dag) -> DagIndex:
    """The record's graph, prepared once per record object: derived data, never
    replicated (kept in the record's ``__dict__``, rebuilt after a snapshot install)."""
    idx: DagIndex | None = d.__dict__.get("lattice_index")
    if idx is None:
        refs = list(dict.fromkeys(ref.split("[", 1)[0] for ref in d.members))
        deps: dict[str, list[Dependency]] = {ref: [] for ref in refs}
        for e in d.edges:
            deps[e.downstream].append(Dependency(e.upstream, e.condition))
        members = tuple(
            DagMemberSpec(
                id=ref,
                spec={"task_group": d.task_groups[ref]} if ref in d.task_groups else {},
                depends_on=tuple(deps[ref]),
            )
            for ref in refs
        )
        idx = DagIndex(DagDefinition(name=d.name, members=members), max_size=len(members))
        d.__dict__["lattice_index"] = idx
    return idx


class _States(Mapping[str, MemberState]):
    """Member states read from the allocations when resolution asks (not copied)."""

    def __init__(self, state: GlobalState, d: Dag) -> None:
        self._state = state
        self._d = d

    def __getitem__(self, ref: str) -> MemberState:
        a = self._state.allocations.get(self._d.members.get(ref, ""))
        if a is None:
            raise KeyError(ref)
        return MemberState.of(a.state, a.exit_code, held=a.held)

    def __iter__(self) -> Iterator[str]:
        return iter(self._d.members)

    def __len__(self) -> int:
        return len(self._d.members)


def submit_dag(state: GlobalState, cmd: c.SubmitDag, ch: Changes) -> c.CommandResult:
    if cmd.request_id and cmd.request_id in state.request_ids:
        known = state.request_ids[cmd.request_id]
        d = state.dags.get(known)
        if d is None:
            raise reused_request(cmd.request_id, "allocation", known)
        return c.CommandResult(revision=state.revision, dag=d, allocations=_members(state, d))
    if not cmd.members:
        raise ValidationError("a DAG needs at least one allocation")
    for m in cmd.members:
        check_names(state, m.spec.tenant, m.spec.vcluster)
    definition = DagDefinition(
        name=cmd.name,
        members=tuple(
            DagMemberSpec(
                id=m.ref,
                spec={"task_group": m.task_group} if m.task_group else {},
                depends_on=tuple(m.spec.depends_on),
            )
            for m in cmd.members
        ),
    )
    index = DagIndex(definition, max_size=cmd.max_size)  # validates: refs, cycles, size
    bump(state)
    d = Dag(
        id=next_id(state, cmd.now),
        name=cmd.name,
        tenant=cmd.members[0].spec.tenant,
        user=cmd.members[0].spec.user,
        submitted_at=cmd.now,
        revision=state.revision,
    )
    created: list[Allocation] = []
    for m in cmd.members:
        waits = any(
            DependencyCondition.parse(e.condition) is not DependencyCondition.MUTEX
            for e in m.spec.depends_on
        )
        spec = admitted(state, msgspec.structs.replace(m.spec, request_id=""))
        indices = index.indices[m.ref]
        group = next_id(state, cmd.now) if indices is not None else ""
        if indices is not None:
            d.task_groups[m.ref] = m.task_group
        for i in indices if indices is not None else (None,):
            a = Allocation(
                id=next_id(state, cmd.now),
                spec=spec if i is None else task_spec(spec, group, i),
                submitted_at=cmd.now,
                dag_id=d.id,
                dag_ref=unit_key(m.ref, i),
                held=waits,
                pending_reason="waiting for dependencies" if waits else "",
                task_group_id=group,
                task_index=i,
                task_group_concurrency=_concurrency(m.task_group),
                uenv_sha256=m.uenv_sha256,
            )
            state.allocations[a.id] = a
            d.members[a.dag_ref] = a.id
            touch_alloc(state, a, ch)
            created.append(a)
        if group:
            state.task_groups[group] = [d.members[unit_key(m.ref, i)] for i in indices or ()]
        for e in m.spec.depends_on:
            if DependencyCondition.parse(e.condition) is not DependencyCondition.MUTEX:
                d.edges.append(DagEdge(e.ref, m.ref, DependencyCondition.parse(e.condition)))
    state.dags[d.id] = d
    d.__dict__["lattice_index"] = index
    # what holds already (aftercorr elements without a predecessor element)
    for ref in resolve(index, _States(state, d), with_state=False).release:
        m = state.allocations[d.members[ref]]
        m.held, m.pending_reason = False, ""
    if cmd.request_id:
        state.request_ids[cmd.request_id] = d.id
    return c.CommandResult(revision=state.revision, dag=d, allocations=created)


def cancel_dag(state: GlobalState, cmd: c.CancelDag, ch: Changes) -> c.CommandResult:
    d = state.dags.get(cmd.dag_id)
    if d is None:
        raise NotFound(
            f"DAG {cmd.dag_id} not found", hint="List your DAGs with `lattice dag list`."
        )
    if d.finished_at is not None:
        raise InvalidTransition(f"DAG {d.id} already ended ({d.state})", hint="Nothing to cancel.")
    d.cancel_requested = True
    cancelled: list[Allocation] = []
    for aid in d.members.values():
        a = state.allocations[aid]
        if not a.terminal:
            finish(
                state,
                a,
                AllocationState.CANCELLED,
                cmd.now,
                cmd.reason,
                None,
                ch,
                resolve_dag=False,
            )
            a.held = False
            cancelled.append(a)
    _settle(state, d, cmd.now)
    return c.CommandResult(revision=state.revision, dag=d, allocations=cancelled)


def ended(state: GlobalState, a: Allocation, now: float, ch: Changes) -> None:
    """``a`` just ended: release or cancel what depends on it (its DAG's members, and
    allocations submitted alone that named it), cascading without recursion."""
    todo = [(a, False)]
    while todo:
        done, dag_resolved = todo.pop()
        if done.dag_id and not dag_resolved:
            # members the DAG's resolution cancels may have dependents of their own
            todo.extend((m, True) for m in _member_ended(state, done, now, ch))
        for sid in state.dependents.pop(done.id, ()):
            s = state.allocations.get(sid)
            if s is None or not s.held or s.terminal:
                continue
            holds, reason = dependency_verdict(_deps_of(state, s))
            if holds:
                s.held = False
                s.pending_reason = ""
                touch_alloc(state, s, ch)
            elif holds is False:
                finish(
                    state, s, AllocationState.CANCELLED, now, reason, None, ch, resolve_dag=False
                )
                s.held = False
                todo.append((s, False))


def check_dependencies(state: GlobalState, spec: AllocationSpec) -> bool:
    """Before ``spec`` (submitted alone) is stored: its dependencies name existing
    allocations and can still hold. True when it must wait for one; raises (nothing is
    stored) when one names nothing or can never hold."""
    if not spec.depends_on:
        return False
    for d in spec.depends_on:
        if DependencyCondition.parse(d.condition) is DependencyCondition.MUTEX:
            continue
        if d.ref not in state.allocations:
            raise NotFound(
                f"dependency {d.ref} is not an allocation",
                hint="Name existing allocation ids: --dependency=afterok:ID[:ID...]",
            )
    holds, reason = dependency_verdict(_deps_of(state, spec))
    if holds is False:
        raise InvalidTransition(
            reason, hint="Its predecessor has already ended in a way the condition excludes."
        )
    return holds is None


def hold(state: GlobalState, a: Allocation) -> None:
    """Keep ``a`` out of the queue until its predecessors end (see :func:`ended`)."""
    a.held = True
    a.pending_reason = "waiting for dependencies"
    for d in a.spec.depends_on:
        p = state.allocations.get(d.ref)
        if p is not None and not p.terminal:
            waiting = state.dependents.setdefault(d.ref, [])
            if a.id not in waiting:
                waiting.append(a.id)


def _deps_of(
    state: GlobalState, target: Allocation | AllocationSpec
) -> Iterator[tuple[str, DependencyCondition, MemberState]]:
    spec = target.spec if isinstance(target, Allocation) else target
    for d in spec.depends_on:
        p = state.allocations.get(d.ref)
        if p is not None:
            yield (
                d.ref,
                DependencyCondition.parse(d.condition),
                MemberState.of(p.state, p.exit_code, held=p.held),
            )


def _member_ended(state: GlobalState, a: Allocation, now: float, ch: Changes) -> list[Allocation]:
    """Resolve ``a``'s DAG for its end; the members it cancelled."""
    d = state.dags.get(a.dag_id)
    if d is None or d.finished_at is not None or d.members.get(a.dag_ref) != a.id:
        return []
    cancelled: list[Allocation] = []
    res = resolve(
        _index(d),
        _States(state, d),
        changed=[a.dag_ref],
        cancel_requested=d.cancel_requested,
        with_state=False,
    )
    for ref in res.release:
        m = state.allocations[d.members[ref]]
        if m.held and m.state == AllocationState.PENDING:
            m.held = False
            m.pending_reason = ""
            touch_alloc(state, m, ch)
    for ref, reason in res.cancel:
        m = state.allocations[d.members[ref]]
        if not m.terminal:
            finish(state, m, AllocationState.CANCELLED, now, reason, None, ch, resolve_dag=False)
            m.held = False
            cancelled.append(m)
    _settle(state, d, now)
    return cancelled


def _settle(state: GlobalState, d: Dag, now: float) -> None:
    """Record the DAG's end once every member has ended."""
    st = dag_state(_index(d), _States(state, d), cancel_requested=d.cancel_requested)
    if st is not DagState.RUNNING:
        d.state = st.value
        d.finished_at = now
    d.revision = state.revision


def _concurrency(task_group: str) -> int:
    _, _, limit = task_group.partition("%")
    return int(limit) if limit.isdigit() else 0


def _members(state: GlobalState, d: Dag) -> list[Allocation]:
    return [state.allocations[aid] for aid in d.members.values()]


common.on_ended = ended
