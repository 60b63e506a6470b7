"""The pure parts of checkpoint storage: the root setting and layout, outage tracking from
probe results, the recovery order, and which checkpoints retention deletes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.checkpoint.paths import checkpoint_dir
from lattice_checkpoint.storage import (
    AllocationKey,
    ProbeResult,
    StorageOutageTracker,
    Transition,
    allocation_key,
    expired,
    observe,
    open_checkpoint_store,
    parse_checkpoint_root,
    recovery_order,
    terminal_times,
)
from lattice_checkpoint.storage.layout import checkpoint_relpath
from lattice_checkpoint.storage.outage import OutageState
from lattice_common.config import StorageConfig
from lattice_common.errors import ValidationError
from lattice_common.types import Allocation, AllocationSpec, AllocationState
from prometheus_client import CollectorRegistry, Gauge

OK = ProbeResult(True, 100e6)
DOWN = ProbeResult(False, 0.0, "checkpoint storage s3://b: probe write failed: refused")

# --- the root setting and the layout ---------------------------------------------------


def test_roots_parse() -> None:
    fs = parse_checkpoint_root("/scratch/ckpt/")
    assert (fs.kind, fs.path) == ("fs", "/scratch/ckpt")
    s3 = parse_checkpoint_root("s3://lattice-ckpt/site/a/")
    assert (s3.kind, s3.bucket, s3.prefix) == ("s3", "lattice-ckpt", "site/a")
    assert str(s3) == "s3://lattice-ckpt/site/a"
    bare = parse_checkpoint_root("s3://lattice-ckpt")
    assert (bare.bucket, bare.prefix, str(bare)) == ("lattice-ckpt", "", "s3://lattice-ckpt")


@pytest.mark.parametrize(
    ("root", "says", "hint"),
    [
        ("gs://bucket/x", "unknown scheme gs://", "s3://BUCKET/PREFIX"),
        ("s3:///prefix", "no bucket", "s3://BUCKET"),
        ("s3://", "no bucket", "s3://BUCKET"),
        ("s3:bucket", "not an S3 URL", "two slashes"),
        ("checkpoints", "a relative path", "absolute path"),
        ("", "is empty", "checkpoint_root"),
        ("s3://b/a/../x", "'..'", "plain names"),
    ],
)
def test_bad_roots_are_refused_with_a_hint(root: str, says: str, hint: str) -> None:
    with pytest.raises(ValidationError) as e:
        open_checkpoint_store(root)
    assert says in e.value.message
    assert hint in e.value.hint
    assert "Hint: " in e.value.render()


def test_half_the_s3_credentials_is_refused() -> None:
    cfg = StorageConfig(s3_endpoint="http://127.0.0.1:1", s3_access_key_id="only-the-id")
    with pytest.raises(ValidationError) as e:
        open_checkpoint_store("s3://bucket", cfg)
    assert "s3_secret_access_key" in e.value.message
    assert "Set both" in e.value.hint


def test_layout_follows_the_specification() -> None:
    fs = open_checkpoint_store("/scratch/ckpt")
    assert fs.checkpoint_path("physics", "lhc", "a-1", "c7") == (
        "/scratch/ckpt/physics/lhc/a-1/checkpoints/c7/"
    )
    s3 = open_checkpoint_store("s3://bkt/lattice")
    assert s3.checkpoint_path("physics", "lhc", "a-1", "c7") == (
        "s3://bkt/lattice/physics/lhc/a-1/checkpoints/c7/"
    )
    assert open_checkpoint_store("s3://bkt").checkpoint_path("t", "p", "a", "c") == (
        "s3://bkt/t/p/a/checkpoints/c/"
    )


@pytest.mark.parametrize("bad", ["", "..", ".hidden", "a/b", "a b", "x\n"])
def test_checkpoint_ids_that_are_not_plain_names_are_refused(bad: str) -> None:
    with pytest.raises(ValidationError) as e:
        checkpoint_relpath(AllocationKey("t", "p", "a"), bad)
    assert "ckpt-3" in e.value.hint


@pytest.mark.parametrize(
    ("tenant", "project", "alloc", "path"),
    [
        ("../etc", "p", "a", ".._etc/p/a/checkpoints/ckpt-1"),
        ("", " ", "a", "default/default/a/checkpoints/ckpt-1"),
        ("t", "..", "/", "t/default/_/checkpoints/ckpt-1"),
        ("t", "my project", "a\0b", "t/my project/a_b/checkpoints/ckpt-1"),
    ],
)
def test_names_never_leave_the_root_as_the_agent_writes_them(
    tenant: str, project: str, alloc: str, path: str
) -> None:
    assert checkpoint_relpath(AllocationKey(tenant, project, alloc), "ckpt-1") == path
    # the node agent computes the same directory for the allocation
    a = Allocation(
        id=alloc,
        spec=AllocationSpec(entrypoint="x", tenant=tenant, vcluster="v", project=project),
    )
    agent = checkpoint_dir(Path("/root"), a)
    assert str(agent) == "/root/" + path
    assert checkpoint_relpath(allocation_key(a), "ckpt-1") == path


def test_an_allocation_without_project_is_under_default() -> None:
    a = _alloc("a-1", AllocationState.RUNNING, project="")
    assert allocation_key(a) == AllocationKey("physics", "default", "a-1")


# --- outages ---------------------------------------------------------------------------


def test_consecutive_failures_make_an_outage_and_one_success_ends_it() -> None:
    gauge = Gauge("probe_test_unavailable", "test", registry=CollectorRegistry())
    t = StorageOutageTracker(failures_to_unavailable=2, gauge=gauge)
    assert t.observe(OK, 0.0) is Transition.NONE
    assert t.write_bandwidth_bytes_per_s == 100e6
    assert t.observe(DOWN, 30.0) is Transition.NONE  # one failure: a blip, not yet down
    assert not t.unavailable and gauge._value.get() == 0
    assert t.observe(DOWN, 60.0) is Transition.BECAME_UNAVAILABLE
    assert t.unavailable and gauge._value.get() == 1
    assert t.write_bandwidth_bytes_per_s == 0.0  # write_time infinite: nothing checkpoints
    assert t.state.since == 60.0 and t.state.last_error == DOWN.error
    assert t.observe(DOWN, 90.0) is Transition.NONE  # still down, reported once
    assert t.observe(ProbeResult(True, 50e6), 120.0) is Transition.RECOVERED
    assert not t.unavailable and gauge._value.get() == 0
    assert t.write_bandwidth_bytes_per_s == 50e6 and t.state.since == 120.0


probes = st.lists(st.booleans(), max_size=40)


@given(probes, st.integers(min_value=1, max_value=5))
def test_unavailable_exactly_after_n_failures_in_a_row(seq: list[bool], n: int) -> None:
    state, run, downs, ups = OutageState(), 0, 0, 0
    for i, ok in enumerate(seq):
        state, change = observe(state, OK if ok else DOWN, float(i), failures_to_unavailable=n)
        run = 0 if ok else run + 1
        assert state.unavailable == (run >= n)
        assert (state.write_bandwidth_bytes_per_s == 0.0) == (
            state.unavailable or not any(seq[: i + 1])
        )
        downs += change is Transition.BECAME_UNAVAILABLE
        ups += change is Transition.RECOVERED
    # every recovery follows an outage that began before it
    assert ups <= downs <= ups + 1


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.floats(allow_nan=True)))
def test_recovery_order_is_highest_recompute_value_first(values: dict[str, float]) -> None:
    order = recovery_order(values)
    assert sorted(order) == sorted(values)
    ranked = [(-math.inf if math.isnan(values[a]) else values[a]) for a in order]
    assert ranked == sorted(ranked, reverse=True)


def test_recovery_order_example() -> None:
    assert recovery_order({"small": 2.0, "big": 40.0, "mid": 9.5, "tie-b": 9.5}) == [
        "big",
        "mid",
        "tie-b",
        "small",
    ]


# --- retention -------------------------------------------------------------------------

DAY = 86400.0
NOW = 100 * DAY


def _alloc(
    aid: str, state: AllocationState, finished_at: float | None = None, project: str = "lhc"
) -> Allocation:
    spec = AllocationSpec(entrypoint="train.py", tenant="physics", vcluster="ml", project=project)
    return Allocation(id=aid, spec=spec, state=state, finished_at=finished_at)


def test_retention_deletes_only_expired_checkpoints_of_ended_allocations() -> None:
    allocs = [
        _alloc("done-old", AllocationState.COMPLETED, NOW - 8 * DAY),
        _alloc("failed-old", AllocationState.FAILED, NOW - 30 * DAY),
        _alloc("cancelled-edge", AllocationState.CANCELLED, NOW - 7 * DAY),
        _alloc("done-recent", AllocationState.COMPLETED, NOW - 6 * DAY),
        _alloc("suspended", AllocationState.SUSPENDED, NOW - 60 * DAY),
        _alloc("running", AllocationState.RUNNING),
    ]
    stored = [allocation_key(a) for a in allocs] + [AllocationKey("physics", "lhc", "unknown")]
    gone = expired(stored, terminal_times(allocs), NOW, 7 * DAY)
    assert [k.alloc for k in gone] == ["cancelled-edge", "done-old", "failed-old"]
    assert expired(stored, terminal_times(allocs), NOW, 0) == []  # 0 = kept forever


keys = st.builds(
    AllocationKey,
    st.sampled_from(["t1", "t2"]),
    st.just("p"),
    st.text("abc", min_size=1, max_size=3),
)


@given(
    st.lists(keys, max_size=20),
    st.dictionaries(keys, st.floats(0, 100 * DAY)),
    st.floats(0, 200 * DAY),
    st.floats(0, 200 * DAY),
    st.floats(1, 50 * DAY),
)
def test_retention_properties(
    stored: list[AllocationKey],
    ended: dict[AllocationKey, float],
    now: float,
    later: float,
    retention: float,
) -> None:
    gone = expired(stored, ended, now, retention)
    # only what is stored, ended, and ended at least the retention ago
    assert set(gone) <= set(stored) & set(ended)
    assert all(now - ended[k] >= retention for k in gone)
    # time only adds to what is due; a longer retention only removes from it
    assert set(gone) <= set(expired(stored, ended, now + later, retention))
    assert set(expired(stored, ended, now, retention + later)) <= set(gone)
