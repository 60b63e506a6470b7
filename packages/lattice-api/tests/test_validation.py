"""validate_submission: every rejection explains itself (message and hint), valid bodies
become the right AllocationSpec, and no input at all makes it raise anything but a
LatticeError (Hypothesis fuzz over JSON-ish values)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_api.validation import MAX_NODES_PER_ALLOCATION, validate_submission
from lattice_common import commands as c
from lattice_common.errors import LatticeError, NotFound, ValidationError
from lattice_common.types import (
    AllocationSpec,
    Constraints,
    LifecycleType,
    RequeuePolicy,
)

TENANTS = {"physics", "bio"}
VCLUSTERS = {"hpc-batch", "interactive"}

_DROP = object()  # leave the key out of the body


def body(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "entrypoint": "python train.py",
        "tenant": "physics",
        "vcluster": "hpc-batch",
        "walltime": "2h",
    }
    out.update(kw)
    return {k: v for k, v in out.items() if v is not _DROP}


def validate(b: Any, **kw: Any) -> AllocationSpec:
    kw.setdefault("user", "alice")
    kw.setdefault("tenants", TENANTS)
    kw.setdefault("vclusters", VCLUSTERS)
    return validate_submission(b, **kw)


def reject(b: Any, exc: type[LatticeError] = ValidationError, **kw: Any) -> LatticeError:
    with pytest.raises(exc) as ei:
        validate(b, **kw)
    assert type(ei.value) is exc
    assert ei.value.message
    return ei.value


# --- rejections, each with a hint ----------------------------------------------------


@pytest.mark.parametrize("entrypoint", ["", "   ", None, _DROP])
def test_empty_entrypoint(entrypoint: Any) -> None:
    e = reject(body(entrypoint=entrypoint))
    assert e.message == "empty entrypoint: nothing to run"
    assert "lattice submit" in e.hint


@pytest.mark.parametrize("nodes", [0, -1, "0", " -5 "])
def test_nodes_below_one(nodes: Any) -> None:
    e = reject(body(nodes=nodes))
    assert e.message.startswith("nodes must be at least 1")
    assert e.details == {"nodes": int(str(nodes).strip())}
    assert "--nodes" in e.hint


@pytest.mark.parametrize("nodes", ["abc", "1.5", 2.0, True, [], {}])
def test_nodes_not_a_whole_number(nodes: Any) -> None:
    e = reject(body(nodes=nodes))
    assert "nodes must be a whole number" in e.message


@pytest.mark.parametrize("field", ["nodes", "preemption_class", "max_requeue", "walltime_seconds"])
def test_not_a_whole_number_has_a_hint(field: str) -> None:
    e = reject(body(**{field: "abc"}))
    assert e.hint


def test_too_many_nodes() -> None:
    e = reject(body(nodes=MAX_NODES_PER_ALLOCATION + 1))
    assert str(MAX_NODES_PER_ALLOCATION) in e.message
    validate(body(nodes=MAX_NODES_PER_ALLOCATION))


@pytest.mark.parametrize("pclass", [-1, 11, "11", 100])
def test_preemption_class_out_of_range(pclass: Any) -> None:
    e = reject(body(preemption_class=pclass))
    assert "between 0 and 10" in e.message
    assert e.details == {"preemption_class": int(pclass)}
    assert "best-effort" in e.hint


@pytest.mark.parametrize("pclass", [0, 10, "7"])
def test_preemption_class_bounds_accepted(pclass: Any) -> None:
    assert validate(body(preemption_class=pclass)).preemption_class == int(pclass)


@pytest.mark.parametrize("wall", [{"walltime": _DROP}, {"walltime": ""}, {"walltime": None}])
def test_bounded_without_walltime(wall: dict[str, Any]) -> None:
    e = reject(body(**wall))
    assert e.message == "walltime is required for a bounded (batch) allocation"
    assert "--walltime" in e.hint


@pytest.mark.parametrize("walltime", ["2 hours", "abc", "-1h", "1:2:3:4", "25:61:00", "0", "0s"])
def test_malformed_walltime(walltime: str) -> None:
    e = reject(body(walltime=walltime))
    assert "walltime" in e.message
    assert "HH:MM:SS" in e.hint


def test_nonpositive_walltime_seconds() -> None:
    e = reject(body(walltime=_DROP, walltime_seconds=-5))
    assert "greater than zero" in e.message


def test_unknown_lifecycle() -> None:
    e = reject(body(lifecycle="forever"))
    assert "forever" in e.message
    assert "bounded" in e.hint


def test_unknown_tenant_lists_available() -> None:
    e = reject(body(tenant="chemistry"), NotFound)
    assert e.message == 'unknown tenant "chemistry"'
    assert e.details == {"available": "bio, physics"}
    assert "--tenant" in e.hint


def test_no_tenant_given() -> None:
    e = reject(body(tenant=_DROP))
    assert e.message == "no tenant given"
    assert e.details == {"available": "bio, physics"}
    assert "LATTICE_TENANT" in e.hint


def test_unknown_vcluster_lists_available() -> None:
    e = reject(body(vcluster="gpu"), NotFound)
    assert e.message == 'unknown vCluster "gpu"'
    assert e.details == {"available": "hpc-batch, interactive"}
    assert "--vcluster" in e.hint


def test_no_vcluster_given() -> None:
    e = reject(body(vcluster=_DROP), NotFound)
    assert e.message == "no vCluster given"
    assert e.details["available"] == "hpc-batch, interactive"
    assert e.hint


def test_nothing_available() -> None:
    e = reject(body(), NotFound, tenants=set(), vclusters=set())
    assert e.details == {"available": "(none)"}


@pytest.mark.parametrize("policy", ["sometimes", "requeue", 3])
def test_bad_requeue_policy(policy: Any) -> None:
    e = reject(body(requeue_policy=policy))
    assert "requeue policy" in e.message
    assert "on_node_failure" in e.hint


@pytest.mark.parametrize("max_requeue", [-1, 101])
def test_max_requeue_out_of_range(max_requeue: int) -> None:
    e = reject(body(max_requeue=max_requeue))
    assert "max_requeue" in e.message


@pytest.mark.parametrize(
    "extra",
    [
        {"constraints": {"gpu_count": "four"}},
        {"constraints": {"features": "nvme"}},
        {"constraints": ["gpu"]},
        {"constraints": {"gpu_count": -1}},
        {"constraints": {"memory_gb": -2}},
        {"env": {"A": 1}},
        {"env": ["A=1"]},
        {"tags": {"k": ["v"]}},
    ],
)
def test_invalid_structured_fields(extra: dict[str, Any]) -> None:
    reject(body(**extra))


@pytest.mark.parametrize("raw", [[], "job.sh", None, 42])
def test_body_must_be_an_object(raw: Any) -> None:
    e = reject(raw)
    assert "JSON object" in e.message


# --- valid bodies --------------------------------------------------------------------


def test_minimal_body_gets_the_defaults() -> None:
    spec = validate(body())
    assert spec == AllocationSpec(
        entrypoint="python train.py",
        tenant="physics",
        vcluster="hpc-batch",
        nodes=1,
        walltime_seconds=7200,
        lifecycle=LifecycleType.BOUNDED,
        preemption_class=5,
        user="alice",
        requeue_policy=RequeuePolicy.ON_NODE_FAILURE,
        max_requeue=3,
    )


def test_full_body() -> None:
    spec = validate(
        {
            "entrypoint": "  torchrun train.py  ",
            "tenant": "bio",
            "vcluster": "interactive",
            "nodes": "64",
            "walltime": "1-00:00:00",
            "lifecycle": "Bounded",
            "preemption_class": 7,
            "name": "train",
            "project": "p1",
            "constraints": {"gpu_type": "GH200", "gpu_count": 4, "features": ["nvme"]},
            "env": {"OMP_NUM_THREADS": "8"},
            "tags": {"team": "ml"},
            "submit_dir": "/home/alice",
            "uenv": "prgenv/24.1",
            "requeue_policy": "always",
            "max_requeue": 5,
            "request_id": "req-123",
            "user": "mallory",  # ignored: the user comes from authentication
        }
    )
    assert spec.entrypoint == "torchrun train.py"
    assert (spec.tenant, spec.vcluster, spec.nodes) == ("bio", "interactive", 64)
    assert spec.walltime_seconds == 86400
    assert spec.preemption_class == 7
    assert (spec.name, spec.project, spec.submit_dir, spec.uenv) == (
        "train",
        "p1",
        "/home/alice",
        "prgenv/24.1",
    )
    assert spec.constraints == Constraints(gpu_type="GH200", gpu_count=4, features=["nvme"])
    assert spec.env == {"OMP_NUM_THREADS": "8"}
    assert spec.tags == {"team": "ml"}
    assert (spec.requeue_policy, spec.max_requeue) == (RequeuePolicy.ALWAYS, 5)
    assert spec.request_id == "req-123"
    assert spec.user == "alice"


@pytest.mark.parametrize(
    ("wall", "seconds"),
    [
        ({"walltime": "90s"}, 90),
        ({"walltime": "30m"}, 1800),
        ({"walltime": "72h"}, 259200),
        ({"walltime": "01:30:00"}, 5400),
        ({"walltime": "30"}, 1800),  # Slurm: bare number is minutes
        ({"walltime": 30}, 1800),
        ({"walltime": _DROP, "walltime_seconds": 600}, 600),
        ({"walltime": _DROP, "walltime_seconds": "600"}, 600),
        ({"walltime": "1h", "walltime_seconds": 5}, 3600),  # the human form wins
    ],
)
def test_walltime_forms(wall: dict[str, Any], seconds: int) -> None:
    assert validate(body(**wall)).walltime_seconds == seconds


@pytest.mark.parametrize("lifecycle", ["unbounded", "REACTIVE"])
def test_services_need_no_walltime(lifecycle: str) -> None:
    # a reactive allocation scales between min_nodes and max_nodes (test_autoscaling_validation)
    bounds = {"min_nodes": 1, "max_nodes": 2} if lifecycle == "REACTIVE" else {}
    spec = validate(body(walltime=_DROP, lifecycle=lifecycle, **bounds))
    assert spec.lifecycle == LifecycleType(lifecycle.lower())
    assert spec.walltime_seconds == 0


def test_defaults_for_tenant_and_vcluster() -> None:
    spec = validate(
        body(tenant=_DROP, vcluster=_DROP), default_tenant="bio", default_vcluster="interactive"
    )
    assert (spec.tenant, spec.vcluster) == ("bio", "interactive")
    spec = validate(body(), default_tenant="bio", default_vcluster="interactive")
    assert (spec.tenant, spec.vcluster) == ("physics", "hpc-batch")


def test_long_name_and_request_id_are_truncated() -> None:
    spec = validate(body(name="n" * 1000, request_id="r" * 1000))
    assert len(spec.name) == 256
    assert len(spec.request_id) == 128


def test_valid_spec_round_trips_through_a_command() -> None:
    spec = validate(body(constraints={"gpu_count": 4}, env={"A": "b"}))
    cmd = c.decode_command(c.encode_command(c.SubmitAllocation(spec=spec)))
    assert isinstance(cmd, c.SubmitAllocation)
    assert cmd.spec == spec


@pytest.mark.parametrize(
    "raw",
    [
        '{"walltime": null, "walltime_seconds": 1000000000000000000000000000000}',
        '{"walltime": "9999999999999999999999999999999d"}',
        '{"constraints": {"gpu_count": 1000000000000000000000000000000}}',
        '{"name": "\\ud800"}',
        '{"env": {"A": "\\udfff"}}',
    ],
    ids=["walltime_seconds", "walltime", "gpu_count", "name-surrogate", "env-surrogate"],
)
def test_accepted_specs_are_encodable(raw: str) -> None:
    b = body(**json.loads(raw))
    try:
        spec = validate(b)
    except LatticeError:
        return  # a clean rejection is fine
    c.encode_command(c.SubmitAllocation(spec=spec))


# --- fuzz ----------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)

PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "entrypoint": st.sampled_from(["true", "", "  ", "echo hi"]),
    "nodes": st.sampled_from([1, 2, "3", 0, -1, "x", 100_001]),
    "walltime": st.sampled_from(["1h", "00:10:00", "1-00:00:00", "30", "0", "bad", "", 5]),
    "walltime_seconds": st.sampled_from([0, 60, "60", -1, "x"]),
    "lifecycle": st.sampled_from(["bounded", "unbounded", "reactive", "Service", ""]),
    "preemption_class": st.sampled_from([0, 5, 10, 11, -1, "5"]),
    "tenant": st.sampled_from([*sorted(TENANTS), "ghost", ""]),
    "vcluster": st.sampled_from([*sorted(VCLUSTERS), "ghost", ""]),
    "requeue_policy": st.sampled_from([*(p.value for p in RequeuePolicy), "sometimes"]),
    "max_requeue": st.sampled_from([0, 3, 100, 101, -1]),
    "constraints": st.fixed_dictionaries(
        {},
        optional={
            "gpu_type": st.sampled_from(["GH200", ""]) | json_values,
            "gpu_count": st.integers(-2, 8) | json_values,
            "features": st.lists(st.text(max_size=5), max_size=3) | json_values,
            "memory_gb": st.integers(-1, 1024) | json_values,
            "topology": st.sampled_from(["tight", "any"]) | json_values,
        },
    ),
    "env": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    "tags": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
}
FIELDS = [
    *PLAUSIBLE,
    "name",
    "project",
    "submit_dir",
    "uenv",
    "request_id",
    "user",
    "unknown_field",
]

bodies = st.fixed_dictionaries(
    {},
    optional={f: (PLAUSIBLE[f] | json_values) if f in PLAUSIBLE else json_values for f in FIELDS},
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=bodies | json_values)
def test_fuzz_only_lattice_errors(b: Any) -> None:
    try:
        spec = validate(b, default_tenant="", default_vcluster="")
    except LatticeError as e:
        assert e.message
        return
    # Whatever is accepted satisfies the documented bounds.
    assert isinstance(spec, AllocationSpec)
    assert spec.entrypoint and spec.entrypoint == spec.entrypoint.strip()
    assert 1 <= spec.nodes <= MAX_NODES_PER_ALLOCATION
    assert 0 <= spec.preemption_class <= 10
    assert 0 <= spec.max_requeue <= 100
    assert spec.tenant in TENANTS and spec.vcluster in VCLUSTERS
    assert spec.user == "alice"
    assert spec.walltime_seconds >= 0
    if spec.lifecycle == LifecycleType.BOUNDED:
        assert spec.walltime_seconds > 0
    assert spec.constraints.gpu_count >= 0 and spec.constraints.memory_gb >= 0
