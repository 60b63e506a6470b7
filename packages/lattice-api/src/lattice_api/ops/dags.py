"""DAG operations of AllocationService: submit a workflow (Submit's ``dag`` kind, or
``POST /api/v1/dags``), get, list and cancel one.

A DAG is refused as a whole, with nothing stored, when any part of it is wrong: the
graph (``lattice_common.dag.validate_dag``: unknown refs, cycles with their path, the
size limit ``scheduling.max_dag_size``) or any member's spec, which goes through exactly
what a single submission gets (``AllocationOps.validate``: the caller is the user, the
tenant defaults to the caller's, admission refuses what can never run), with the
member named in the error. ``depends_on`` refs stay DAG-local ids; the quorum turns
them into edges and holds members until their conditions hold
(lattice_quorum.handlers.dags).

Defaults for members that name no ``tenant``/``vcluster``: the DAG's own (``dag:`` or
the top level of the document), then the request's (``{"yaml": TEXT, "tenant": ...,
"vcluster": ...}``, what ``lattice dag submit`` sends from its configuration).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from lattice_common import commands as c
from lattice_common.dag import DagDefinition, DagState, validate_dag
from lattice_common.dag_yaml import MAX_DAG_TEXT_BYTES, dag_from_mapping, parse_dag_yaml
from lattice_common.errors import NotFound, ValidationError
from lattice_common.types import Allocation, AllocationSpec, AllocationState, Dag, DagEdge
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from lattice_quorum.state import GlobalState

from lattice_api import access
from lattice_api.auth import Identity
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.base import raise_if_error

BLOCKED = "Blocked"  # a member's state while it waits for its dependencies (held)
DEFAULT_LIST_LIMIT = 100  # ListDags' limit 0, or REST without ?limit=
_DEFAULTED = ("tenant", "vcluster")


class DagMemberView(msgspec.Struct, kw_only=True):
    """proto ``DagMember``."""

    ref: str
    allocation_id: str = ""
    state: str = ""  # the allocation's state, or "Blocked" while held


class DagView(msgspec.Struct, kw_only=True):
    """A DAG as both transports show it (proto ``Dag``): members in submission order
    with their allocation's state, and the edges."""

    id: str
    name: str = ""
    tenant: str = ""
    user: str = ""
    state: str = ""
    members: list[DagMemberView] = msgspec.field(default_factory=list)
    edges: list[DagEdge] = msgspec.field(default_factory=list)
    submitted_at: float = 0.0
    finished_at: float | None = None
    revision: int = 0


class SubmittedDag(msgspec.Struct, kw_only=True):
    dag: DagView
    allocations: list[Allocation]  # as committed, in submission order


def member_state(state: AllocationState, held: bool) -> str:
    return BLOCKED if held and state == AllocationState.PENDING else state.value


def dag_view(source: Quorum | GlobalState, d: Dag) -> DagView:
    """``d`` in its wire form, its members' states read from ``source`` (a quorum, or
    the state itself inside a ``quorum.read``)."""
    if isinstance(source, GlobalState):
        states = queries.dag_member_states(source, d)
    else:
        states = source.read(queries.dag_member_states, d)
    return _view(d, states)


def _view(d: Dag, states: Mapping[str, tuple[AllocationState, bool]]) -> DagView:
    members = []
    for ref, alloc_id in d.members.items():
        st = states.get(ref)
        members.append(
            DagMemberView(ref=ref, allocation_id=alloc_id, state=member_state(*st) if st else "")
        )
    return DagView(
        id=d.id,
        name=d.name,
        tenant=d.tenant,
        user=d.user,
        state=d.state,
        members=members,
        edges=list(d.edges),
        submitted_at=d.submitted_at,
        finished_at=d.finished_at,
        revision=d.revision,
    )


def _view_by_id(s: GlobalState, dag_id: str) -> DagView | None:
    d = queries.dag(s, dag_id)
    return None if d is None else dag_view(s, d)


def _views(s: GlobalState, **filters: Any) -> list[DagView]:
    return [dag_view(s, d) for d in queries.dags(s, **filters)]


def parse_dag_states(state: str | None) -> set[str] | None:
    """``"running,failed"`` -> DAG states (None = any); unknown names list the valid."""
    if not state:
        return None
    by_key = {s.value.lower(): s.value for s in DagState}
    out = set()
    for word in state.split(","):
        if not word.strip():
            continue
        found = by_key.get(word.strip().lower())
        if found is None:
            valid = ", ".join(s.value for s in DagState)
            raise ValidationError(
                f"unknown DAG state {word.strip()!r}",
                details={"available": valid},
                hint=f"Use one of {valid}.",
            )
        out.add(found)
    return out or None


def _load_yaml(text: Any) -> Any:
    """The decoded document of a DAG file. Anything wrong is parse_dag_yaml's error
    (line and column, size, encoding): the same words as every other reader of DAG
    files."""
    try:
        ok = isinstance(text, str) and len(text.encode("utf-8")) <= MAX_DAG_TEXT_BYTES
    except UnicodeEncodeError:
        ok = False
    if ok:
        import yaml

        try:
            return yaml.safe_load(text)
        except Exception:  # worded below
            pass
    parse_dag_yaml(text)  # raises the error with its place in the file
    raise ValidationError("the DAG file is not valid YAML", hint="Check the file's syntax.")


class DagOps:
    def __init__(self, quorum: Quorum, allocations: AllocationOps, *, max_size: int) -> None:
        self.quorum = quorum
        self.allocations = allocations
        self.max_size = max_size

    # --- submit ---------------------------------------------------------------------

    def _definition(self, body: Mapping[str, Any]) -> tuple[DagDefinition, dict[str, Any], str]:
        """The graph, the defaults for members, and the request id of a request body
        (either documented form, or ``{"yaml": TEXT}``)."""
        if not isinstance(body, Mapping):
            raise ValidationError("a DAG submission must be a JSON object")
        doc: Any = _load_yaml(body["yaml"]) if "yaml" in body else body
        dag = dag_from_mapping(doc)  # refuses what is not a mapping
        inner = doc.get("dag") if isinstance(doc.get("dag"), Mapping) else {}
        layers = (inner, doc, body)

        def first(key: str) -> Any:
            for layer in layers:
                value = layer.get(key)
                if value not in (None, ""):
                    return value
            return None

        defaults = {k: v for k in _DEFAULTED if (v := first(k)) is not None}
        return dag, defaults, str(first("request_id") or "")[:128]

    def _member_spec(
        self, who: Identity, m_id: str, body: Mapping[str, Any], defaults: Mapping[str, Any]
    ) -> AllocationSpec:
        merged = {k: v for k, v in body.items() if k != "task_group"}
        for key, value in defaults.items():
            if merged.get(key) in (None, ""):
                merged[key] = value
        if merged.get("name") in (None, ""):
            merged["name"] = m_id
        return self.allocations.validate(who, merged)

    async def submit(self, who: Identity, body: Mapping[str, Any]) -> SubmittedDag:
        dag, defaults, request_id = self._definition(body)
        by_body = {id(m.spec): m for m in dag.members}
        specs: dict[str, AllocationSpec] = {}

        def check(member_body: Mapping[str, Any]) -> None:
            m = by_body[id(member_body)]
            spec = self._member_spec(who, m.id, member_body, defaults)
            # the edges are the DAG's; a member's own request id would claim the key
            specs[m.id] = msgspec.structs.replace(
                spec, depends_on=list(m.depends_on), request_id=""
            )

        validate_dag(dag, max_size=self.max_size, validate_spec=check)
        shas: dict[str, str] = {}
        for ref, spec in specs.items():  # the registry's image for each member's uenv
            specs[ref], shas[ref] = await self.allocations.resolve_uenv(spec)
        refs = [m.id for m in dag.members]
        counts = [_task_count(_range_text(m.spec.get("task_group"))) for m in dag.members]
        gate = self.allocations.gate.hold(  # accounting: the whole DAG reserved first
            [specs[r] for r in refs], request_id=request_id, counts=counts, set_request_id=False
        )
        async with gate as held:
            specs.update(zip(refs, held.specs, strict=True))
            cmd = c.SubmitDag(
                name=dag.name,
                members=[
                    c.DagMemberSubmission(
                        ref=m.id,
                        spec=specs[m.id],
                        task_group=_range_text(m.spec.get("task_group")),
                        uenv_sha256=shas[m.id],
                    )
                    for m in dag.members
                ],
                request_id=request_id or (held.request_id if held.key else ""),
                max_size=self.max_size,
                now=time.time(),
            )
            res = raise_if_error(await self.quorum.propose(cmd))
        assert res.dag is not None
        created = list(res.allocations or [])
        states = {a.dag_ref: (a.state, a.held) for a in created}
        return SubmittedDag(dag=_view(res.dag, states), allocations=created)

    # --- reads ----------------------------------------------------------------------

    def get(self, who: Identity, dag_id: str) -> DagView:
        self.quorum.require_caught_up()
        view = self.quorum.read(_view_by_id, dag_id)
        if view is None:
            raise NotFound(
                f"DAG {dag_id} not found", hint="List your DAGs with `lattice dag list`."
            )
        return view

    def list(
        self,
        who: Identity,
        *,
        tenant: str | None = None,
        user: str | None = None,
        state: str | None = None,
        all_users: bool = False,
        limit: int | None = None,
    ) -> list[DagView]:
        """Newest first; the caller's own unless ``all_users`` or a ``user`` is given
        (lattice_api.access.listing_user, as for allocations)."""
        self.quorum.require_caught_up()
        return self.quorum.read(
            _views,
            tenant=access.listing_tenant(who, tenant),
            user=access.listing_user(who, user, all_users),
            state_filter=parse_dag_states(state),
            limit=limit or DEFAULT_LIST_LIMIT,
        )

    # --- cancel ---------------------------------------------------------------------

    async def cancel(
        self, who: Identity, dag_id: str, reason: str = ""
    ) -> tuple[DagView, list[str]]:
        """Cancel every member that has not ended (the submitter, or a system or tenant
        admin); the DAG afterwards and the ids of the allocations cancelled."""
        self.quorum.require_caught_up()
        d = self.quorum.read(queries.dag, dag_id)
        if d is None:
            raise NotFound(
                f"DAG {dag_id} not found", hint="List your DAGs with `lattice dag list`."
            )
        access.check_dag_cancel(who, d)
        cmd = c.CancelDag(dag_id=dag_id, reason=reason or "DAG cancelled", now=time.time())
        res = raise_if_error(await self.quorum.propose(cmd))
        assert res.dag is not None
        cancelled = list(res.allocations or [])
        states = self.quorum.read(queries.dag_member_states, res.dag)
        states.update({a.dag_ref: (a.state, a.held) for a in cancelled})
        return _view(res.dag, states), [a.id for a in cancelled]


__all__ = [
    "BLOCKED",
    "DagMemberView",
    "DagOps",
    "DagView",
    "SubmittedDag",
    "dag_view",
    "member_state",
    "parse_dag_states",
]


def _task_count(text: str) -> int:
    """How many allocations a member's task-group text makes (1 for none)."""
    if not text:
        return 1
    from lattice_common.taskgroup import parse_task_group

    start, end, step, _ = parse_task_group(text)
    return max(len(range(start, end + 1, step or 1)), 1)


def _range_text(tg: Any) -> str:
    """A member's ``task_group`` (text, or {start, end, step, concurrency}) as the text
    form the quorum takes; "" for a single allocation. Already checked by validate_dag."""
    if tg in (None, ""):
        return ""
    if isinstance(tg, Mapping):
        text = f"{int(tg.get('start', 0))}-{int(tg['end'])}:{int(tg.get('step') or 1)}"
        return text + (f"%{int(tg['concurrency'])}" if tg.get("concurrency") else "")
    return str(tg)
