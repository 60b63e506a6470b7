"""DAG workflows as plain data: validation and dependency resolution, nothing else.

The quorum's apply calls :func:`resolve` when a DAG member ends and carries out what
it says in the same command (release a held member into its vCluster queue, cancel one
whose dependency can never hold): resolution is then as durable as the state change
that caused it, survives any member's crash and leader change, and costs no extra
round trip or scheduling cycle (lattice_quorum.handlers.dags). Keeping the decision a
pure function of (graph, states) makes it replayable, property-testable and
deterministic, as apply must be.

Semantics (Slurm-compatible, spec chapter "DAG Scheduling"):

* A member's incoming edges are ANDed: it is released when every edge holds, and
  cancelled (``dependency never satisfied: ...``) as soon as one edge can never hold.
* ``success`` (afterok): the predecessor Completed with exit 0.
* ``failure`` (afternotok): the predecessor ended any other way -- Failed, Completed with
  a non-zero exit, *or Cancelled* (like Slurm, where afternotok fires on cancel and
  timeout too). A member cancelled because its own dependency failed therefore triggers
  its failure-successors: ``train -> evaluate -(failure)-> notify`` runs ``notify`` when
  either ``train`` or ``evaluate`` fails.
* ``any`` (afterany): the predecessor reached any terminal state.
* ``corresponding`` (aftercorr): both ends are task groups; element ``i`` waits for the
  predecessor's element ``i`` to succeed; indices the predecessor lacks hold at once.
* ``mutex`` (singleton): ``ref`` is a mutex *name*, not a member; it never orders
  members. The scheduler keeps at most one holder per name running
  (:func:`mutex_blocked`, :func:`admit_mutex`).
* success/failure/any edges from a task group look at the whole group: it succeeded when
  every element succeeded, failed when all ended and one failed, else cancelled.

DAG state (:func:`dag_state`): ``Running`` while any unit is not terminal. Once all are:
``Failed`` if a unit Failed (or Completed non-zero) and was not *caught*; else
``Cancelled`` if the DAG was cancelled, or a unit was cancelled from outside (not by
dependency resolution) and not caught; else ``Completed``. A unit is caught when a
successor on one of its failure/any edges ran (was not cancelled by resolution), or when
a successor that resolution cancelled (the failure spread to it) is caught. Units
cancelled by resolution never end the DAG Failed by themselves.
"""

from __future__ import annotations

import enum
import heapq
import re
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import msgspec

from lattice_common.errors import LatticeError, ValidationError
from lattice_common.taskgroup import parse_task_group
from lattice_common.types import AllocationState, Dependency

DEFAULT_MAX_DAG_SIZE = 1000
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_ID_HINT = "Member ids are 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit."


class DependencyCondition(enum.StrEnum):
    SUCCESS = "success"  # afterok
    FAILURE = "failure"  # afternotok
    ANY = "any"  # afterany
    CORRESPONDING = "corresponding"  # aftercorr
    MUTEX = "mutex"  # singleton

    @classmethod
    def parse(cls, text: object) -> DependencyCondition:
        """Case-insensitive; Slurm's names (afterok, singleton, ...) are accepted too."""
        key = str(text).strip().lower()
        key = _SLURM_NAMES.get(key, key)
        for c in cls:
            if c.value == key:
                return c
        valid = ", ".join(c.value for c in cls)
        raise ValidationError(
            f"unknown dependency condition {text!r} (valid: {valid})",
            details={"valid": valid},
            hint="Use success, failure, any, corresponding or mutex "
            "(or Slurm's afterok, afternotok, afterany, aftercorr, singleton).",
        )


_SLURM_NAMES = {
    "afterok": "success",
    "afternotok": "failure",
    "afterany": "any",
    "aftercorr": "corresponding",
    "singleton": "mutex",
}


class DagMemberSpec(msgspec.Struct, frozen=True):
    """``spec`` is the flat body the API validates for a single allocation (entrypoint,
    nodes, walltime, ...; ``task_group`` makes the member a job array)."""

    id: str
    spec: dict[str, Any]
    depends_on: tuple[Dependency, ...] = ()


class DagDefinition(msgspec.Struct, frozen=True):
    name: str
    members: tuple[DagMemberSpec, ...]


def task_indices(member: DagMemberSpec) -> tuple[int, ...] | None:
    """The element indices of a task-group member, None for a single allocation."""
    tg = member.spec.get("task_group")
    if tg in (None, ""):
        return None
    try:
        if isinstance(tg, Mapping):
            text = f"{int(tg.get('start', 0))}-{int(tg['end'])}:{int(tg.get('step') or 1)}"
        else:
            text = str(tg)
        start, end, step, _ = parse_task_group(text)
    except (KeyError, TypeError, ValueError, ValidationError) as e:
        raise ValidationError(
            f"member {member.id!r}: invalid task_group {tg!r}",
            details={"member": member.id, "field": "task_group"},
            hint=getattr(e, "hint", "") or "Use START-END[:STEP], e.g. task_group: 0-9.",
        ) from None
    return tuple(range(start, end + 1, step))


# ---- validation --------------------------------------------------------------------------


def validate_dag(
    dag: DagDefinition,
    *,
    max_size: int = DEFAULT_MAX_DAG_SIZE,
    validate_spec: Callable[[Mapping[str, Any]], object] | None = None,
) -> list[str]:
    """Check the graph and return member ids in topological order (predecessors first,
    ties in definition order). O(V+E) plus ``validate_spec`` once per member."""
    n = len(dag.members)
    if n > max_size:
        raise ValidationError(
            f"DAG exceeds maximum size ({n} allocations, limit: {max_size})",
            details={"allocations": n, "limit": max_size},
            hint="Split the workflow into smaller DAGs or increase the limit via system "
            "configuration.",
        )
    if n == 0:
        raise ValidationError("DAG has no allocations", hint="List at least one allocation.")
    ids: set[str] = set()
    for m in dag.members:
        if not isinstance(m.id, str) or not _ID.match(m.id):
            raise ValidationError(f"invalid member id {m.id!r}", hint=_ID_HINT)
        if m.id in ids:
            raise ValidationError(
                f"duplicate member id {m.id!r}", hint="Give every allocation its own id."
            )
        ids.add(m.id)
    groups = {m.id: task_indices(m) for m in dag.members}
    succs: dict[str, list[str]] = {i: [] for i in ids}
    indeg = dict.fromkeys(ids, 0)
    for m in dag.members:
        seen: set[str] = set()
        for e in m.depends_on:
            cond = _condition(m.id, e)
            if cond is DependencyCondition.MUTEX:
                if not str(e.ref).strip():
                    raise ValidationError(
                        f"member {m.id!r}: a mutex dependency needs a name in ref",
                        hint="e.g. depends_on: [{ref: nightly-db, condition: mutex}].",
                    )
                continue
            if e.ref == m.id:
                raise ValidationError(
                    f"member {m.id!r} depends on itself",
                    details={"member": m.id},
                    hint="Remove the self-dependency.",
                )
            if e.ref not in ids:
                raise ValidationError(
                    f"member {m.id!r} depends on unknown member {e.ref!r}",
                    details={"member": m.id, "ref": e.ref},
                    hint="depends_on refs must name another allocation id of the same DAG.",
                )
            if e.ref in seen:
                raise ValidationError(
                    f"member {m.id!r} lists dependency {e.ref!r} twice",
                    hint="List each dependency once, with one condition.",
                )
            seen.add(e.ref)
            if cond is DependencyCondition.CORRESPONDING and (
                groups[m.id] is None or groups[e.ref] is None
            ):
                raise ValidationError(
                    f"member {m.id!r}: corresponding dependency on {e.ref!r} needs two task groups",
                    hint="Give both allocations a task_group, or use success instead.",
                )
            succs[e.ref].append(m.id)
            indeg[m.id] += 1
    if validate_spec is not None:
        for m in dag.members:
            try:
                validate_spec(m.spec)
            except LatticeError as err:
                raise type(err)(
                    f"member {m.id!r}: {err.message}",
                    details={"member": m.id, **err.details},
                    hint=err.hint,
                ) from None
    order = [m.id for m in dag.members if indeg[m.id] == 0]
    q = deque(order)
    while q:
        for s in succs[q.popleft()]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
                q.append(s)
    if len(order) < n:
        cycle = _find_cycle({i for i, d in indeg.items() if d > 0}, succs)
        raise ValidationError(
            "dependency cycle: " + " -> ".join(cycle),
            details={"cycle": " -> ".join(cycle)},
            hint="A DAG must be acyclic: remove one of these dependencies.",
        )
    return order


def _condition(member: str, e: Dependency) -> DependencyCondition:
    try:
        return DependencyCondition.parse(e.condition)
    except ValidationError as err:
        raise ValidationError(
            f"member {member!r}: {err.message} on dependency {e.ref!r}",
            details={"member": member, **err.details},
            hint=err.hint,
        ) from None


def _find_cycle(left: set[str], succs: Mapping[str, list[str]]) -> list[str]:
    """A cycle among the nodes Kahn's algorithm could not order (each has an unordered
    predecessor, so walking predecessors backwards must revisit a node)."""
    preds: dict[str, str] = {}
    for u in sorted(left):
        for s in succs[u]:
            if s in left:
                preds.setdefault(s, u)
    node, path, at = min(left), [], {}
    while node not in at:
        at[node] = len(path)
        path.append(node)
        node = preds[node]
    loop = path[at[node] :][::-1]  # walked against the edges: reverse into run order
    first = loop.index(min(loop))
    loop = loop[first:] + loop[:first]
    return [*loop, loop[0]]


# ---- resolution ----------------------------------------------------------------------------


class Phase(enum.StrEnum):
    HELD = "held"  # Pending, waiting for its dependencies (DagMember state "Blocked")
    RELEASED = "released"  # Pending in its vCluster queue
    RUNNING = "running"  # Staging, Running, Checkpointing, Suspended
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_TERMINAL = frozenset({Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED})


class MemberState(msgspec.Struct, frozen=True):
    phase: Phase = Phase.HELD
    exit_code: int | None = None

    @classmethod
    def of(
        cls, state: AllocationState | str, exit_code: int | None = None, *, held: bool = False
    ) -> MemberState:
        s = AllocationState.parse(str(state))
        if s == AllocationState.PENDING:
            return cls(Phase.HELD if held else Phase.RELEASED)
        if not s.terminal:
            return cls(Phase.RUNNING)
        return cls(Phase(s.value.lower()), exit_code)


HELD = MemberState()


class DagState(enum.StrEnum):
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class Resolution(msgspec.Struct, frozen=True):
    """What to do now. Units are member ids, or ``id[i]`` for task-group elements; both
    lists are in topological order."""

    release: tuple[str, ...]
    cancel: tuple[tuple[str, str], ...]  # (unit, reason)
    state: DagState | None  # after applying release/cancel; None if not asked for


def unit_key(member: str, index: int | None) -> str:
    return member if index is None else f"{member}[{index}]"


class DagIndex:
    """The graph prepared once per DAG (O(V+E) plus task-group sizes) for :func:`resolve`."""

    def __init__(self, dag: DagDefinition, *, max_size: int = DEFAULT_MAX_DAG_SIZE) -> None:
        order = validate_dag(dag, max_size=max_size)
        by_id = {m.id: m for m in dag.members}
        self.order: tuple[str, ...] = tuple(order)
        self.indices: dict[str, tuple[int, ...] | None] = {i: task_indices(by_id[i]) for i in order}
        self.index_sets = {i: frozenset(x) for i, x in self.indices.items() if x is not None}
        self.units: dict[str, tuple[str, ...]] = {
            i: (i,) if x is None else tuple(unit_key(i, k) for k in x)
            for i, x in self.indices.items()
        }
        self.unit_of: dict[str, tuple[str, int | None]] = {}
        self.rank: dict[str, int] = {}
        for i in order:
            for k, u in zip(self.indices[i] or (None,), self.units[i], strict=True):
                self.unit_of[u] = (i, k)
                self.rank[u] = len(self.rank)
        self.ins: dict[str, list[tuple[str, DependencyCondition]]] = {i: [] for i in order}
        self.outs: dict[str, list[tuple[str, DependencyCondition]]] = {i: [] for i in order}
        self.mutexes: dict[str, tuple[str, ...]] = {}
        for m in dag.members:
            names = []
            for e in m.depends_on:
                cond = DependencyCondition.parse(e.condition)
                if cond is DependencyCondition.MUTEX:
                    names.append(str(e.ref).strip())
                else:
                    self.ins[m.id].append((e.ref, cond))
                    self.outs[e.ref].append((m.id, cond))
            self.mutexes[m.id] = tuple(names)


_OK, _BAD, _CANCELLED = "succeeded", "failed", "cancelled"
_CATCH = (DependencyCondition.FAILURE, DependencyCondition.ANY)


def _outcome(s: MemberState) -> str | None:
    if s.phase not in _TERMINAL:
        return None
    if s.phase == Phase.COMPLETED:
        return _OK if not s.exit_code else _BAD
    return _BAD if s.phase == Phase.FAILED else _CANCELLED


class _View:
    """Member states with this call's own decisions laid over them."""

    def __init__(self, index: DagIndex, states: Mapping[str, MemberState]) -> None:
        self.index, self.states = index, states
        self.overlay: dict[str, MemberState] = {}
        self.groups: dict[str, str | None] = {}  # memo: aggregate outcome of a task group

    def get(self, unit: str) -> MemberState:
        s = self.overlay.get(unit)
        return s if s is not None else self.states.get(unit, HELD)

    def set(self, unit: str, s: MemberState) -> None:
        self.overlay[unit] = s
        self.groups.pop(self.index.unit_of[unit][0], None)

    def outcome(self, member: str) -> str | None:
        if self.index.indices[member] is None:
            return _outcome(self.get(member))
        if member not in self.groups:
            seen = set()
            for u in self.index.units[member]:
                o = _outcome(self.get(u))
                if o is None:
                    break
                seen.add(o)
            else:
                self.groups[member] = next((o for o in (_BAD, _CANCELLED) if o in seen), _OK)
                return self.groups[member]
            self.groups[member] = None
        return self.groups[member]

    def verdict(self, unit: str) -> tuple[bool | None, str]:
        """(True, "") release; (False, reason) never satisfiable; (None, "") wait."""
        member, k = self.index.unit_of[unit]
        ready = True
        for p, cond in self.index.ins[member]:
            who = p
            if cond is DependencyCondition.CORRESPONDING:
                if k not in self.index.index_sets[p]:
                    continue  # no matching element: holds at once
                who = unit_key(p, k)
                o = _outcome(self.get(who))
            else:
                o = self.outcome(p)
            if o is None:
                ready = False
                continue
            if not _holds(cond, o):
                return False, _never(who, o, cond)
        return (True, "") if ready else (None, "")

    def successors(self, unit: str) -> Iterable[str]:
        member, k = self.index.unit_of[unit]
        for s, cond in self.index.outs[member]:
            if cond is DependencyCondition.CORRESPONDING:
                if k in self.index.index_sets[s]:
                    yield unit_key(s, k)
            elif self.outcome(member) is not None:  # a group matters once it has ended
                yield from self.index.units[s]


def _holds(cond: DependencyCondition, outcome: str) -> bool:
    if cond is DependencyCondition.ANY:
        return True
    if cond is DependencyCondition.FAILURE:
        return outcome != _OK
    return outcome == _OK  # success, corresponding


def _never(who: str, outcome: str, cond: DependencyCondition) -> str:
    return f"dependency never satisfied: {who} {outcome} (needed {cond.value})"


def dependency_verdict(
    deps: Iterable[tuple[str, DependencyCondition, MemberState]],
) -> tuple[bool | None, str]:
    """One allocation's dependencies outside a DAG (``submit --dependency``): each is
    (predecessor id, condition, its state). (True, "") all hold; (False, reason) one can
    never hold; (None, "") wait. Mutex and corresponding conditions are not checked here
    (mutex: the scheduler; corresponding: only between task groups of one DAG)."""
    ready = True
    for who, cond, state in deps:
        if cond in (DependencyCondition.MUTEX, DependencyCondition.CORRESPONDING):
            continue
        o = _outcome(state)
        if o is None:
            ready = False
        elif not _holds(cond, o):
            return False, _never(who, o, cond)
    return (True, "") if ready else (None, "")


def resolve(
    index: DagIndex,
    states: Mapping[str, MemberState],
    changed: Iterable[str] | None = None,
    *,
    cancel_requested: bool = False,
    with_state: bool = True,
) -> Resolution:
    """Decide which held units to release or cancel, cascading within the call.

    ``states`` maps units (see :func:`unit_key`) to their state; a missing unit is HELD.
    ``changed=None`` examines every unit: O(V+E) plus task-group sizes (use it at
    submission and after a restart). Otherwise only the units in ``changed`` (those whose
    state changed since the last call, or that are new) and their successors are
    examined, plus the successors of whatever this call cancels: a chain costs O(1) per
    event and a fan-out O(width log width). Examining a unit costs O(in-degree); an edge
    from a task group costs O(group size) once per call. ``cancel_requested`` (DAG cancel) cancels
    every held unit; the caller cancels queued and running ones itself.
    ``with_state=False`` skips :func:`dag_state` (a scan that stops at the first live
    unit, O(V) worst case).
    """
    view = _View(index, states)
    # a heap in topological rank: every unit is examined after this call has decided
    # all of its predecessors, so the outcome (and the reason) never depends on the order
    # of ``changed`` -- the incremental answer equals the full scan's
    work: list[tuple[int, str]] = []
    queued: set[str] = set()

    def push(units: Iterable[str]) -> None:
        for u in units:
            if u not in queued:
                queued.add(u)
                heapq.heappush(work, (index.rank[u], u))

    if changed is None or cancel_requested:
        push(index.unit_of)
    else:
        for u in changed:
            if u in index.unit_of:
                push((u,))
                push(view.successors(u))
    release: list[str] = []
    cancel: list[tuple[str, str]] = []
    while work:
        u = heapq.heappop(work)[1]
        if view.get(u).phase != Phase.HELD:
            continue
        if cancel_requested:
            ok, why = False, "DAG cancelled"
        else:
            ok, why = view.verdict(u)
        if ok:
            view.set(u, MemberState(Phase.RELEASED))
            release.append(u)
        elif ok is False:
            view.set(u, MemberState(Phase.CANCELLED))
            cancel.append((u, why))
            push(view.successors(u))
    state = _state(view, cancel_requested) if with_state else None
    return Resolution(tuple(release), tuple(cancel), state)


def dag_state(
    index: DagIndex, states: Mapping[str, MemberState], *, cancel_requested: bool = False
) -> DagState:
    """The DAG's overall state (see the module docstring for the definition)."""
    return _state(_View(index, states), cancel_requested)


def _state(view: _View, cancel_requested: bool) -> DagState:
    index = view.index
    for m in reversed(index.order):  # sinks end last: usually finds a live unit at once
        for u in index.units[m]:
            if view.get(u).phase not in _TERMINAL:
                return DagState.RUNNING
    # caught: a failure/any successor ran (was not cancelled by resolution), or a
    # successor that resolution cancelled -- the failure spread to it -- is caught itself:
    # train fails, evaluate is cancelled, evaluate -(failure)-> notify runs.
    caught: dict[str, bool] = {}
    skipped: dict[str, bool] = {}
    failed, cancelled = False, cancel_requested
    for m in reversed(index.order):
        for u in index.units[m]:
            o = _outcome(view.get(u))
            skipped[u] = o == _CANCELLED and view.verdict(u)[0] is False
            caught[u] = False
            for s, cond in index.outs[m]:
                vs = index.units[s]
                if cond is DependencyCondition.CORRESPONDING:
                    k = index.unit_of[u][1]
                    vs = (unit_key(s, k),) if k in index.index_sets[s] else ()
                if any(skipped[v] and caught[v] for v in vs) or (
                    cond in _CATCH and not all(skipped[v] for v in vs)
                ):
                    caught[u] = True
                    break
            failed |= o == _BAD and not caught[u]
            cancelled |= o == _CANCELLED and not skipped[u] and not caught[u]
    if failed:
        return DagState.FAILED
    return DagState.CANCELLED if cancelled else DagState.COMPLETED


# ---- mutex (singleton) ------------------------------------------------------------------------


def mutex_blocked(name: str, running_mutexes: Collection[str] | Mapping[str, int]) -> bool:
    """Whether an allocation holding mutex ``name`` must wait: another holder runs.
    Names are global to whatever scope the caller keys them by (Slurm: per user)."""
    if isinstance(running_mutexes, Mapping):
        return running_mutexes.get(name, 0) > 0
    return name in running_mutexes


def admit_mutex(
    candidates: Iterable[tuple[str, Collection[str]]], running_mutexes: Collection[str]
) -> list[str]:
    """Of ``(id, mutex names)`` candidates in priority order, those that may start in one
    scheduling cycle: none of their names is running or taken by an earlier candidate."""
    taken = set(running_mutexes)
    admitted = []
    for cid, names in candidates:
        if not any(n in taken for n in names):
            taken.update(names)
            admitted.append(cid)
    return admitted
