"""The checkpoint cost model: its promises as properties (backlog and node health only
ever raise Value, checkpoint size and slow storage only ever raise Cost, no bandwidth
never checkpoints) and the specification's decision table."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st
from lattice_checkpoint import cost
from lattice_checkpoint.cost import JobView, NodeHealth, QueueView, StorageView

GB = 1e9

healths = st.builds(
    NodeHealth,
    ecc_errors=st.integers(0, 1000),
    thermal_warnings=st.integers(0, 100),
    degraded=st.booleans(),
)
jobs = st.builds(
    JobView,
    allocation_id=st.just("a"),
    node_count=st.integers(1, 512),
    gpus_per_node=st.integers(0, 8),
    gpu_memory_bytes_per_node=st.floats(0, 2e12),
    running_seconds=st.floats(0, 1e7),
    seconds_since_checkpoint=st.floats(0, 1e7),
    walltime_remaining_seconds=st.none() | st.floats(-1e4, 1e7),
    preemption_class=st.integers(0, 10),
    borrowed=st.booleans(),
    measured_checkpoint_bytes=st.none() | st.integers(1, 10**14),
    health=healths,
)
storages = st.builds(
    StorageView,
    write_bandwidth_bytes_per_s=st.floats(1.0, 1e12),
    cost_gpu_hours_per_gb=st.floats(0, 1.0),
)
queues = st.builds(
    QueueView, backlog_pressure=st.floats(0, 1), higher_class_demand=st.floats(0, 20)
)
params = st.builds(
    cost.ModelParams,
    node_mtbf_hours=st.floats(0.01, 1e6),
    default_checkpoint_bytes_per_node=st.floats(1.0, 1e13),
)


def worse(h: NodeHealth, ecc: int, thermal: int, degrade: bool) -> NodeHealth:
    return NodeHealth(
        ecc_errors=h.ecc_errors + ecc,
        thermal_warnings=h.thermal_warnings + thermal,
        degraded=h.degraded or degrade,
    )


@given(jobs, storages, queues, params, st.floats(0, 1))
def test_more_backlog_never_lowers_value(job, storage, queue, p, more) -> None:
    busier = QueueView(
        backlog_pressure=min(1.0, queue.backlog_pressure + more),
        higher_class_demand=queue.higher_class_demand + more,
    )
    low = cost.should_checkpoint(job, storage, queue, p).value.total
    high = cost.should_checkpoint(job, storage, busier, p).value.total
    assert high >= low


@given(jobs, storages, queues, params, st.integers(0, 50), st.integers(0, 50), st.booleans())
def test_worse_node_health_never_lowers_value(job, storage, queue, p, ecc, thermal, deg) -> None:
    sick = replace(job, health=worse(job.health, ecc, thermal, deg))
    assert (
        cost.should_checkpoint(sick, storage, queue, p).value.total
        >= cost.should_checkpoint(job, storage, queue, p).value.total
    )


@given(jobs, storages, params, st.integers(0, 10**13))
def test_larger_checkpoints_never_lower_cost(job, storage, p, extra) -> None:
    base = cost.checkpoint_bytes(job, p)
    bigger = replace(job, measured_checkpoint_bytes=int(base) + extra + 1)
    smaller = replace(job, measured_checkpoint_bytes=int(base) + 1)
    assert cost.cost(bigger, storage, p).total >= cost.cost(smaller, storage, p).total


@given(jobs, storages, params, st.floats(0, 1))
def test_slower_storage_never_lowers_cost(job, storage, p, fraction) -> None:
    slower = StorageView(
        storage.write_bandwidth_bytes_per_s * fraction, storage.cost_gpu_hours_per_gb
    )
    assert cost.cost(job, slower, p).total >= cost.cost(job, storage, p).total


@given(jobs, queues, params, st.floats(0, 1.0))
def test_zero_bandwidth_never_checkpoints(job, queue, p, price) -> None:
    d = cost.should_checkpoint(job, StorageView(0.0, price), queue, p)
    assert not d.checkpoint
    assert math.isinf(d.cost.total) and d.reason == "storage_unavailable"


# --------------------------------------------------------------- the decision table

H100 = 80 * GB
STORAGE = StorageView(write_bandwidth_bytes_per_s=10 * GB)  # a healthy parallel FS


def job(**kw: object) -> JobView:
    base = {
        "allocation_id": "a",
        "node_count": 4,
        "gpus_per_node": 4,
        "gpu_memory_bytes_per_node": 4 * H100,
        "running_seconds": 3600.0,
        "seconds_since_checkpoint": 3600.0,
        "preemption_class": 3,
    }
    return JobView(**{**base, **kw})  # type: ignore[arg-type]


def test_quiet_system_healthy_nodes_checkpoints_infrequently() -> None:
    # an hour since the last checkpoint: not yet; most of a day: yes
    assert not cost.should_checkpoint(job(), STORAGE, QueueView()).checkpoint
    later = job(running_seconds=20 * 3600.0, seconds_since_checkpoint=20 * 3600.0)
    d = cost.should_checkpoint(later, STORAGE, QueueView())
    assert d.checkpoint and d.reason == "recompute_saved"


def test_deep_queue_with_higher_class_work_waiting_checkpoints_now() -> None:
    d = cost.should_checkpoint(
        job(), STORAGE, QueueView(backlog_pressure=0.9, higher_class_demand=2)
    )
    assert d.checkpoint and d.reason == "preemptability", d.explain()


def test_degrading_node_checkpoints_proactively() -> None:
    sick = job(health=NodeHealth(ecc_errors=40, thermal_warnings=5, degraded=True))
    assert not cost.should_checkpoint(job(), STORAGE, QueueView()).checkpoint
    d = cost.should_checkpoint(sick, STORAGE, QueueView())
    assert d.checkpoint and d.reason == "recompute_saved"


def test_large_job_near_walltime_checkpoints_for_restart() -> None:
    d = cost.should_checkpoint(job(walltime_remaining_seconds=120.0), STORAGE, QueueView())
    assert d.checkpoint and d.value.failure_probability > 0.5


def test_sensitive_class_is_never_worth_preempting() -> None:
    d = cost.should_checkpoint(
        job(preemption_class=10), STORAGE, QueueView(backlog_pressure=1, higher_class_demand=5)
    )
    assert d.value.preemptability == 0 and d.value.backlog_relief == 0


def test_estimate_prefers_the_measured_duration() -> None:
    j = job()
    assert cost.estimated_checkpoint_minutes(j, STORAGE, cost.ModelParams(), 90.0) == 1.5
    by_bandwidth = cost.estimated_checkpoint_minutes(j, STORAGE, cost.ModelParams(), None)
    assert by_bandwidth == (16 * H100 / (10 * GB)) / 60.0
    assert cost.estimated_checkpoint_minutes(j, StorageView(0.0), cost.ModelParams(), None) is None
