from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_common.dag import (
    DagDefinition,
    DagIndex,
    DagMemberSpec,
    DagState,
    DependencyCondition,
    MemberState,
    Phase,
    Resolution,
    admit_mutex,
    dag_state,
    mutex_blocked,
    resolve,
    validate_dag,
)
from lattice_common.dag_yaml import dag_from_mapping, parse_dag_yaml
from lattice_common.errors import NotFound, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState, Dependency

OK = MemberState(Phase.COMPLETED, 0)
BAD = MemberState(Phase.FAILED, 1)
GONE = MemberState(Phase.CANCELLED)
RUN = MemberState(Phase.RUNNING)
QUEUED = MemberState(Phase.RELEASED)


def dag(*members: tuple[str, dict[str, str]] | tuple[str, dict[str, str], Any]) -> DagDefinition:
    """dag(("a", {}), ("b", {"a": "success"}), ("t", {}, "0-3")) -- third item: task_group."""
    out = []
    for m in members:
        spec: dict[str, Any] = {"entrypoint": f"./{m[0]}.sh"}
        if len(m) > 2:
            spec["task_group"] = m[2]
        out.append(
            DagMemberSpec(
                id=m[0], spec=spec, depends_on=tuple(Dependency(r, c) for r, c in m[1].items())
            )
        )
    return DagDefinition(name="t", members=tuple(out))


def apply(states: dict[str, MemberState], r: Resolution) -> None:
    for u in r.release:
        states[u] = QUEUED
    for u, _ in r.cancel:
        states[u] = GONE


def step(idx: DagIndex, states: dict[str, MemberState], **ended: MemberState) -> Resolution:
    states.update({k.replace("__", "-"): v for k, v in ended.items()})
    r = resolve(idx, states, changed=list(ended))
    apply(states, r)
    return r


# ---- examples -------------------------------------------------------------------------------


def test_diamond() -> None:
    idx = DagIndex(
        dag(
            ("a", {}),
            ("b", {"a": "success"}),
            ("c", {"a": "success"}),
            ("d", {"b": "success", "c": "success"}),
        )
    )
    st_: dict[str, MemberState] = {}
    r = resolve(idx, st_)
    assert r.release == ("a",) and r.cancel == () and r.state == DagState.RUNNING
    apply(st_, r)
    assert step(idx, st_, a=OK).release == ("b", "c")
    assert step(idx, st_, b=OK).release == ()
    r = step(idx, st_, c=OK)
    assert r.release == ("d",)
    st_["d"] = OK
    assert dag_state(idx, st_) == DagState.COMPLETED


def test_four_stage_pipeline_failure_cascades_in_one_call() -> None:
    idx = DagIndex(
        dag(
            ("s1", {}),
            ("s2", {"s1": "success"}),
            ("s3", {"s2": "success"}),
            ("s4", {"s3": "success"}),
        )
    )
    st_: dict[str, MemberState] = {}
    apply(st_, resolve(idx, st_))
    r = step(idx, st_, s1=BAD)
    assert [u for u, _ in r.cancel] == ["s2", "s3", "s4"]
    assert r.cancel[0][1] == "dependency never satisfied: s1 failed (needed success)"
    assert r.cancel[1][1] == "dependency never satisfied: s2 cancelled (needed success)"
    assert r.state == DagState.FAILED


ERROR_PATH = dag(
    ("train", {}),
    ("evaluate", {"train": "success"}),
    ("deploy", {"evaluate": "success"}),
    ("notify_failure", {"evaluate": "failure"}),
)


@pytest.mark.parametrize(
    ("train", "evaluate", "notify", "state"),
    [
        (BAD, None, True, DagState.COMPLETED),  # evaluate cancelled -> failure edge holds
        (OK, BAD, True, DagState.COMPLETED),
        (OK, OK, False, DagState.COMPLETED),
    ],
)
def test_error_handling_path(
    train: MemberState, evaluate: MemberState | None, notify: bool, state: DagState
) -> None:
    """The chapter's train -> evaluate -> deploy with notify_failure running if train or
    evaluate fails: edges are ANDed, and a cancelled evaluate counts as not-succeeded,
    so one failure edge from evaluate covers both cases."""
    idx = DagIndex(ERROR_PATH)
    st_: dict[str, MemberState] = {}
    apply(st_, resolve(idx, st_))
    step(idx, st_, train=train)
    if evaluate is not None:
        assert st_["evaluate"] == QUEUED
        step(idx, st_, evaluate=evaluate)
    assert st_["deploy"] == (QUEUED if evaluate == OK else GONE)
    assert st_["notify_failure"] == (QUEUED if notify else GONE)
    for u, s in st_.items():
        if s == QUEUED:
            st_[u] = OK
    assert dag_state(idx, st_) == state  # the failures were caught by notify_failure's edge


def test_literal_two_failure_edges_are_anded() -> None:
    """Both edges of the chapter's drawing on one member: AND means it runs only when
    neither succeeded (train failed, so evaluate was cancelled)."""
    idx = DagIndex(
        dag(
            ("train", {}),
            ("evaluate", {"train": "success"}),
            ("n", {"train": "failure", "evaluate": "failure"}),
        )
    )
    st_: dict[str, MemberState] = {}
    apply(st_, resolve(idx, st_))
    r = step(idx, st_, train=OK)  # cancelled at once: train's failure edge can never hold
    assert r.cancel == (("n", "dependency never satisfied: train succeeded (needed failure)"),)
    r = step(idx, st_, evaluate=BAD)
    assert st_["n"] == GONE and r.cancel == ()
    assert (
        r.state == DagState.FAILED
    )  # evaluate failed and nothing ran because of it  # evaluate's failure has a catching edge


def test_any_cleanup_runs_either_way_and_failure_without_catch_fails_dag() -> None:
    for end in (OK, BAD, GONE):
        idx = DagIndex(dag(("run_experiment", {}), ("cleanup", {"run_experiment": "any"})))
        st_ = {"run_experiment": end}
        assert resolve(idx, st_).release == ("cleanup",)
        st_["cleanup"] = OK
        assert dag_state(idx, st_) == DagState.COMPLETED
    idx = DagIndex(dag(("a", {}), ("b", {"a": "success"})))
    assert resolve(idx, {"a": BAD}).state == DagState.FAILED
    assert resolve(idx, {"a": MemberState(Phase.COMPLETED, 3)}).state == DagState.FAILED
    assert resolve(idx, {"a": GONE}).state == DagState.CANCELLED  # cancelled from outside
    assert resolve(idx, {"a": OK, "b": RUN}).state == DagState.RUNNING


def test_aftercorr_equal_sizes() -> None:
    idx = DagIndex(dag(("pre", {}, "0-3"), ("train", {"pre": "corresponding"}, "0-3")))
    st_: dict[str, MemberState] = {}
    r = resolve(idx, st_)
    assert r.release == ("pre[0]", "pre[1]", "pre[2]", "pre[3]")
    apply(st_, r)
    assert step(idx, st_, **{"pre[2]": OK}).release == ("train[2]",)
    r = step(idx, st_, **{"pre[3]": BAD})
    assert r.cancel == (
        ("train[3]", "dependency never satisfied: pre[3] failed (needed corresponding)"),
    )
    assert "train[0]" not in st_  # still held, independent of its siblings


def test_aftercorr_mismatched_sizes_extra_indices_start_at_once() -> None:
    idx = DagIndex(dag(("pre", {}, "0-9"), ("train", {"pre": "corresponding"}, "0-14")))
    r = resolve(idx, {})
    assert [u for u in r.release if u.startswith("train")] == [f"train[{i}]" for i in range(10, 15)]


def test_success_edge_from_a_task_group_waits_for_every_element() -> None:
    idx = DagIndex(dag(("g", {}, "0-2"), ("after", {"g": "success"}), ("h", {"g": "failure"})))
    st_ = {"g[0]": OK, "g[1]": OK, "g[2]": RUN}
    assert resolve(idx, st_, ["g[0]", "g[1]"]).release == ()
    st_["g[2]"] = BAD
    r = resolve(idx, st_, ["g[2]"])
    assert r.release == ("h",) and r.cancel == (
        ("after", "dependency never satisfied: g failed (needed success)"),
    )


def test_singleton_mutex() -> None:
    d = dag(("a", {"nightly-db": "mutex"}), ("b", {"nightly-db": "singleton"}))
    idx = DagIndex(d)
    assert idx.mutexes == {"a": ("nightly-db",), "b": ("nightly-db",)}
    assert resolve(idx, {}).release == ("a", "b")  # mutex never orders; it gates the start
    assert mutex_blocked("nightly-db", {"nightly-db"})
    assert not mutex_blocked("nightly-db", {"nightly-db": 0})
    assert admit_mutex([("a", ["nightly-db"]), ("b", ["nightly-db"]), ("c", [])], set()) == [
        "a",
        "c",
    ]
    assert admit_mutex([("b", ["nightly-db"])], {"nightly-db"}) == []


def test_dag_cancel_cancels_held_members_and_ends_cancelled() -> None:
    idx = DagIndex(dag(("a", {}), ("b", {"a": "success"}), ("c", {"b": "any"})))
    st_ = {"a": RUN}
    r = resolve(idx, st_, ["a"], cancel_requested=True)
    assert (
        r.cancel == (("b", "DAG cancelled"), ("c", "DAG cancelled")) and r.state == DagState.RUNNING
    )
    apply(st_, r)
    st_["a"] = GONE
    assert dag_state(idx, st_, cancel_requested=True) == DagState.CANCELLED


def test_member_state_from_allocation_state() -> None:
    assert MemberState.of(AllocationState.PENDING, held=True).phase == Phase.HELD
    assert MemberState.of("Pending").phase == Phase.RELEASED
    assert MemberState.of("Checkpointing").phase == Phase.RUNNING
    assert MemberState.of("Failed", 2) == MemberState(Phase.FAILED, 2)


def test_chain_and_fanout_of_1000_are_incremental() -> None:
    n = 1000
    chain = DagIndex(dag(*[(f"m{i}", {f"m{i - 1}": "success"} if i else {}) for i in range(n)]))
    st_: dict[str, MemberState] = {}
    apply(st_, resolve(chain, st_))
    t = time.perf_counter()
    for i in range(n):
        r = step(chain, st_, **{f"m{i}": OK})
        assert r.release == ((f"m{i + 1}",) if i + 1 < n else ())
    chain_s = time.perf_counter() - t
    fan = DagIndex(dag(("root", {}), *[(f"f{i}", {"root": "success"}) for i in range(n - 1)]))
    st_ = {"root": OK}
    t = time.perf_counter()
    assert len(resolve(fan, st_, ["root"], with_state=False).release) == n - 1
    assert chain_s < 2.0 and time.perf_counter() - t < 0.5


# ---- parsing ----------------------------------------------------------------------------------

USER_GUIDE = """\
# workflow.yaml
name: training-pipeline
allocations:
  - name: preprocess
    entrypoint: "python preprocess.py"
    nodes: 2
    walltime: "2h"
  - name: train
    entrypoint: "torchrun train.py"
    nodes: 64
    walltime: "72h"
    uenv: "prgenv-gnu/24.11:v1"
    depends_on:
      - preprocess: success
  - name: evaluate
    entrypoint: "python eval.py"
    nodes: 1
    walltime: "1h"
    depends_on:
      - train: success
  - name: notify-failure
    entrypoint: "python notify.py --status=failed"
    nodes: 1
    walltime: "10m"
    depends_on:
      - train: failure
"""

API_FORM = """\
dag:
  allocations:
    - id: "stage-data"
      entrypoint: "python stage.py"
      resources: { nodes: 1 }
      lifecycle: { type: "bounded", walltime: "2h" }
    - id: "train"
      entrypoint: "torchrun train.py"
      resources: { nodes: 64, constraints: { topology: "tight" } }
      lifecycle: { type: "bounded", walltime: "72h" }
      depends_on: [{ ref: "stage-data", condition: "success" }]
    - id: "evaluate"
      entrypoint: "python eval.py"
      resources: { nodes: 4 }
      depends_on: [{ ref: "train", condition: "any" }]
"""


def test_parse_user_guide_form() -> None:
    d = parse_dag_yaml(USER_GUIDE)
    assert d.name == "training-pipeline"
    assert [m.id for m in d.members] == ["preprocess", "train", "evaluate", "notify-failure"]
    train = d.members[1]
    assert train.spec == {
        "name": "train",
        "entrypoint": "torchrun train.py",
        "nodes": 64,
        "walltime": "72h",
        "uenv": "prgenv-gnu/24.11:v1",
    }
    assert train.depends_on == (Dependency("preprocess", "success"),)
    assert validate_dag(d) == ["preprocess", "train", "evaluate", "notify-failure"]


def test_parse_api_form_flattens_resources_and_lifecycle() -> None:
    d = parse_dag_yaml(API_FORM.encode())
    assert [m.id for m in d.members] == ["stage-data", "train", "evaluate"]
    assert d.members[1].spec == {
        "entrypoint": "torchrun train.py",
        "nodes": 64,
        "constraints": {"topology": "tight"},
        "lifecycle": "bounded",
        "walltime": "72h",
    }
    assert d.members[2].depends_on == (Dependency("train", "any"),)
    assert validate_dag(d) == ["stage-data", "train", "evaluate"]


def test_validate_spec_is_called_per_member_and_prefixed() -> None:
    seen = []

    def check(body: Mapping[str, Any]) -> None:
        seen.append(body["entrypoint"])
        if body.get("nodes") == 64:
            raise NotFound("unknown tenant", details={"x": 1}, hint="pick one")

    with pytest.raises(NotFound) as e:
        validate_dag(parse_dag_yaml(USER_GUIDE), validate_spec=check)
    assert e.value.message == "member 'train': unknown tenant"
    assert e.value.details == {"member": "train", "x": 1} and e.value.hint == "pick one"
    assert seen == ["python preprocess.py", "torchrun train.py"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"name: x\xff", "not valid UTF-8"),
        ("- a\n- b", "must be a mapping, not a list"),
        ("name: [unclosed", "not valid YAML at line"),
        ("a: b: c", "not valid YAML"),
        ("allocations: []", "non-empty `allocations`"),
        ("dag: 3", "`dag` must be a mapping"),
        (
            "allocations: [{name: a, entrypoint: x}, {name: a, entrypoint: y}]",
            "duplicate allocation id 'a'",
        ),
        ("allocations: [{name: a}]", "member 'a': missing entrypoint"),
        ("allocations: [{entrypoint: x}]", "allocation 1 has no id"),
        (
            "allocations: [{name: a, entrypoint: x, depends_on: [{b: later}]}]",
            "unknown dependency condition 'later' (valid: success, failure, any, corresponding, mutex)",
        ),
        ("allocations: [{name: a, entrypoint: x, depends_on: [{ref: b}]}]", "has no condition"),
        ("allocations: [{name: a, entrypoint: x, depends_on: b}]", "depends_on must be a list"),
        ("allocations: [{name: a, entrypoint: x, depends_on: [b]}]", "cannot read dependency"),
        (
            "allocations: [{id: a, nodes: 2, resources: {nodes: 3}, entrypoint: x}]",
            "nodes is given twice",
        ),
        ("allocations: [{id: a, resources: 3, entrypoint: x}]", "resources must be a mapping"),
        ("allocations: [3]", "allocation 1 must be a mapping"),
        ("x: 2001-13-45", "not valid YAML"),
        ("[" * 5000, "not valid YAML"),
    ],
)
def test_parse_refusals(text: str | bytes, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_dag_yaml(text)
    assert message in e.value.message
    assert e.value.hint


def test_size_limit_has_the_spec_text() -> None:
    d = dag(*[(f"m{i}", {}) for i in range(1234)])
    with pytest.raises(ValidationError) as e:
        validate_dag(d)
    assert e.value.message == "DAG exceeds maximum size (1234 allocations, limit: 1000)"
    assert e.value.hint == (
        "Split the workflow into smaller DAGs or increase the limit via system configuration."
    )
    assert len(validate_dag(d, max_size=2000)) == 1234


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (dag(("a", {}), ("b", {"zz": "success"})), "member 'b' depends on unknown member 'zz'"),
        (dag(("a", {"a": "success"})), "member 'a' depends on itself"),
        (
            dag(("a", {"c": "success"}), ("b", {"a": "success"}), ("c", {"b": "success"})),
            "dependency cycle: a -> b -> c -> a",
        ),
        (dag(("a", {}), ("b", {"a": "nope"})), "member 'b': unknown dependency condition 'nope'"),
        (dag(("a", {}), ("b", {"a": "corresponding"}, "0-3")), "needs two task groups"),
        (dag(("a", {}), ("b", {}, "9-3")), "member 'b': invalid task_group '9-3'"),
        (dag(("a[1]", {})), "invalid member id"),
        (dag(("a", {"": "mutex"})), "mutex dependency needs a name"),
        (DagDefinition("x", ()), "DAG has no allocations"),
        (
            DagDefinition("x", (DagMemberSpec("a", {}), DagMemberSpec("a", {}))),
            "duplicate member id 'a'",
        ),
    ],
)
def test_validate_refusals(d: DagDefinition, message: str) -> None:
    with pytest.raises(ValidationError) as e:
        validate_dag(d)
    assert message in e.value.message
    assert e.value.hint


def test_edges_match_the_wire_dependency_message() -> None:
    fields = {f.name for f in dataclasses.fields(v1.Dependency)}
    assert fields == set(Dependency.__struct_fields__) == {"ref", "condition"}
    assert {f.name for f in dataclasses.fields(v1.DagAllocation)} == {"id", "spec"}
    wire = v1.Dependency(**msgspec.structs.asdict(Dependency("train", "success")))
    assert (wire.ref, wire.condition) == ("train", "success")


def test_slurm_condition_names() -> None:
    assert [
        DependencyCondition.parse(n)
        for n in ("afterok", "AfterNotOK", "afterany", "aftercorr", "singleton")
    ] == list(DependencyCondition)


# ---- properties -------------------------------------------------------------------------------

CONDS = ["success", "failure", "any"]


@st.composite
def random_dags(draw: st.DrawFn, max_members: int = 9) -> DagDefinition:
    n = draw(st.integers(1, max_members))
    groups = [draw(st.one_of(st.none(), st.integers(0, 3))) for _ in range(n)]
    members = []
    for i in range(n):
        deps: dict[str, str] = {}
        for j in draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else ():
            both = groups[i] is not None and groups[j] is not None
            deps[f"m{j}"] = draw(st.sampled_from(CONDS + ["corresponding"] * both * 2))
        if draw(st.integers(0, 9)) == 0:
            deps["lock"] = "mutex"
        members.append((f"m{i}", deps) if groups[i] is None else (f"m{i}", deps, f"0-{groups[i]}"))
    perm = draw(st.permutations(range(n)))
    return dag(*[members[p] for p in perm])


def edges_of(d: DagDefinition) -> list[tuple[str, str]]:
    return [(e.ref, m.id) for m in d.members for e in m.depends_on if e.condition != "mutex"]


@given(random_dags())
def test_topological_order_respects_edges(d: DagDefinition) -> None:
    order = validate_dag(d)
    pos = {m: i for i, m in enumerate(order)}
    assert sorted(order) == sorted(m.id for m in d.members)
    assert all(pos[a] < pos[b] for a, b in edges_of(d))


@given(random_dags(), st.data())
def test_back_edges_are_always_reported_as_a_real_cycle(
    d: DagDefinition, data: st.DataObject
) -> None:
    edges = edges_of(d)
    if not edges:
        return
    up, down = data.draw(st.sampled_from(edges))
    preds = {m.id: [e.ref for e in m.depends_on if e.condition != "mutex"] for m in d.members}
    start = up  # walk further back so the cycle is longer than one edge
    while preds[start] and data.draw(st.booleans()):
        start = data.draw(st.sampled_from(preds[start]))
    members = [
        DagMemberSpec(
            m.id,
            m.spec,
            (*tuple(e for e in m.depends_on if e.ref != down), Dependency(down, "any")),
        )
        if m.id == start
        else m
        for m in d.members
    ]
    with pytest.raises(ValidationError) as e:
        validate_dag(DagDefinition("c", tuple(members)))
    msg = e.value.message
    assert msg.startswith("dependency cycle: ")
    path = msg.removeprefix("dependency cycle: ").split(" -> ")
    assert path[0] == path[-1] and len(path) >= 3
    deps = {(e.ref, m.id) for m in members for e in m.depends_on}
    assert all((a, b) in deps for a, b in itertools.pairwise(path))


@given(
    st.lists(
        st.tuples(
            st.integers(0, 8), st.integers(0, 8), st.sampled_from([*CONDS, "bogus", "mutex"])
        ),
        max_size=20,
    )
)
def test_validate_never_crashes(edges: list[tuple[int, int, str]]) -> None:
    deps: dict[int, dict[str, str]] = {i: {} for i in range(6)}
    for a, b, c in edges:
        if b < 6:
            deps[b][f"m{a}"] = c
    try:
        validate_dag(dag(*[(f"m{i}", deps[i]) for i in range(6)]))
    except ValidationError:
        pass


def satisfied(idx: DagIndex, states: Mapping[str, MemberState], unit: str) -> bool:
    """Oracle: the chapter's conditions, written out independently of dag.py."""
    member, k = idx.unit_of[unit]

    def ok(s: MemberState) -> bool:
        return s.phase == Phase.COMPLETED and not s.exit_code

    def units(p: str) -> list[MemberState]:
        return [states.get(u, MemberState()) for u in idx.units[p]]

    for p, cond in idx.ins[member]:
        if cond == "corresponding":
            if k in (idx.indices[p] or ()) and not ok(states.get(f"{p}[{k}]", MemberState())):
                return False
            continue
        ss = units(p)
        if not all(s.phase in (Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED) for s in ss):
            return False
        if cond == "success" and not all(map(ok, ss)):
            return False
        if cond == "failure" and all(map(ok, ss)):
            return False
    return True


def preds_terminal(idx: DagIndex, states: Mapping[str, MemberState], unit: str) -> bool:
    member, k = idx.unit_of[unit]
    ends = (Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED)
    for p, cond in idx.ins[member]:
        us = idx.units[p]
        if cond == "corresponding":
            us = [f"{p}[{k}]"] if k in (idx.indices[p] or ()) else []
        if not all(states.get(u, MemberState()).phase in ends for u in us):
            return False
    return True


ENDS = st.sampled_from([OK, OK, BAD, MemberState(Phase.COMPLETED, 2), GONE])


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(), st.data())
def test_random_completion_sequences(d: DagDefinition, data: st.DataObject) -> None:
    idx = DagIndex(d)
    all_units = [u for m in idx.order for u in idx.units[m]]
    states: dict[str, MemberState] = {}
    released: set[str] = set()
    cancelled: set[str] = set()
    changed: list[str] | None = None
    for _ in range(4 * len(all_units) + 2):
        full = resolve(idx, states)
        assert full == resolve(idx, dict(states))  # deterministic
        if changed is not None:
            assert resolve(idx, states, changed) == full  # incremental == full scan
        assert not set(full.release) & {u for u, _ in full.cancel}
        seen = states | dict.fromkeys((u for u, _ in full.cancel), GONE)  # cascades count
        for u in full.release:
            assert satisfied(idx, seen, u)
        # a cancelled unit's conditions can never hold (checked as: they do not hold now)
        assert all(not satisfied(idx, seen, u) for u, _ in full.cancel)
        released |= set(full.release)
        cancelled |= {u for u, _ in full.cancel}
        apply(states, full)
        for u in all_units:  # nothing stays held once everything it waits on has ended
            if states.get(u, MemberState()).phase == Phase.HELD:
                assert not preds_terminal(idx, states, u)
        again = resolve(idx, states)
        assert again.release == () and again.cancel == () and again.state == full.state
        live = [
            u
            for u in all_units
            if states.get(u, MemberState()).phase in (Phase.RELEASED, Phase.RUNNING)
        ]
        if not live:
            break
        u = data.draw(st.sampled_from(live))
        states[u] = RUN if states[u] == QUEUED and data.draw(st.booleans()) else data.draw(ENDS)
        changed = [u]
    assert not released & cancelled
    assert all(states.get(u, MemberState()).phase != Phase.HELD for u in all_units)
    assert released | cancelled == set(all_units)
    assert dag_state(idx, states) != DagState.RUNNING


@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_parse_fuzz_text_only_raises_validation_error(text: str | bytes) -> None:
    try:
        parse_dag_yaml(text)
    except ValidationError:
        pass


YAMLISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.integers(), c, max_size=3)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "id",
        "name",
        "entrypoint",
        "depends_on",
        "resources",
        "lifecycle",
        "nodes",
        "ref",
        "condition",
        "task_group",
    ]
)


@settings(max_examples=300)
@given(
    st.lists(
        st.dictionaries(KEYS, YAMLISH | st.sampled_from(["success", "a", "x"]), max_size=6),
        max_size=4,
    ),
    st.booleans(),
)
def test_parse_fuzz_structured_only_raises_validation_error(
    allocs: list[dict[str, Any]], api: bool
) -> None:
    doc: dict[str, Any] = (
        {"dag": {"allocations": allocs}} if api else {"name": "n", "allocations": allocs}
    )
    try:
        d = parse_dag_yaml(yaml.safe_dump(doc))
    except ValidationError:
        return
    assert d == dag_from_mapping(doc)
    try:
        validate_dag(d)
    except ValidationError:
        pass
