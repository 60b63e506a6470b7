"""The replay's checkpoint model (a victim's ``checkpoint`` and the broker switch, lost
work) and its reactive allocations (scaled by the real ``autoscale.decide``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import ScalingSpec
from rm_replay.engine import simulate
from rm_replay.inventory import inventory_from_mapping
from rm_replay.model import TraceError
from rm_replay.trace import dump_trace_line, parse_trace_line
from rmr_helpers import T0, H, inventory, submit


def by_id(result):  # type: ignore[no-untyped-def]
    return {j.id: j for j in result.jobs}


def preemption(checkpoint: str = "") -> list:  # type: ignore[type-arg]
    return [
        submit(
            "low",
            0,
            nodes=2,
            walltime=10 * H,
            runtime=4 * H,
            preemption_class=1,
            checkpoint=checkpoint,
        ),
        submit("high", H, nodes=2, walltime=H, preemption_class=8),
    ]


@pytest.mark.parametrize("protocol", ["signal", "grpc", "auto", ""])
def test_a_checkpointing_victim_keeps_its_work(protocol: str) -> None:
    r = simulate(
        preemption(protocol), inventory(2), checkpoint_success_rate=1.0, checkpoint_seconds=60
    )
    j = by_id(r)
    assert j["high"].start == T0 + H + 60  # after the victim's checkpoint
    assert j["low"].end == j["low"].last_start + 3 * H  # the first hour was kept
    assert j["low"].lost_node_seconds == 0.0


def test_a_victim_without_a_checkpoint_is_stopped_at_once_and_loses_its_run() -> None:
    r = simulate(
        preemption("none"), inventory(2), checkpoint_success_rate=1.0, checkpoint_seconds=60
    )
    j = by_id(r)
    assert j["high"].start == T0 + H  # no checkpoint to wait for
    low = j["low"]
    assert (low.preempted_count, low.checkpoints_attempted) == (1, 0)
    assert low.lost_node_seconds == 2 * H  # one hour on two nodes, done again
    assert low.end == low.last_start + 4 * H


def test_without_the_broker_every_victim_is_stopped() -> None:
    on = by_id(simulate(preemption("signal"), inventory(2), checkpoint_success_rate=1.0))
    off = by_id(
        simulate(
            preemption("signal"), inventory(2), checkpoint_success_rate=1.0, checkpoint_broker=False
        )
    )
    assert on["low"].lost_node_seconds == 0.0
    assert off["low"].lost_node_seconds == 2 * H
    assert off["high"].start == T0 + H < on["high"].start


def test_a_failed_checkpoint_counts_as_lost_work() -> None:
    low = by_id(simulate(preemption("shmem"), inventory(2), checkpoint_success_rate=0.0))["low"]
    assert (low.checkpoints_attempted, low.checkpoints_succeeded) == (1, 0)
    assert low.lost_node_seconds == 2 * H  # its run's work up to the preemption


SCALING = ScalingSpec(
    evaluation_interval=60,
    target=0.8,
    scale_down_threshold=0.25,
    scale_up_window=120,
    scale_down_window=300,
    cooldown=180,
)


def service(load: tuple[tuple[float, float], ...], *, runtime: float = 4 * H, **kw):  # type: ignore[no-untyped-def]
    return submit(
        "svc",
        0,
        nodes=kw.pop("nodes", 6),
        min_nodes=kw.pop("min_nodes", 2),
        walltime=0,
        runtime=runtime,
        reactive=True,
        load=load,
        scaling=SCALING,
        checkpoint="signal",
        **kw,
    )


def sizes(result) -> list[tuple[float, int]]:  # type: ignore[no-untyped-def]
    """(t, nodes held by the tenant) from the samples, where it changes."""
    out: list[tuple[float, int]] = []
    for s in result.samples:
        n = s.per_tenant_busy_nodes.get("t", 0)
        if not out or out[-1][1] != n:
            out.append((s.t - T0, n))
    return out


def test_a_reactive_allocation_grows_to_max_and_shrinks_to_min() -> None:
    r = simulate([service(((0, 0.9), (2 * H, 0.05)))], inventory(8), sample_interval=60)
    svc = by_id(r)["svc"]
    got = sizes(r)
    assert got[0] == (0, 2)  # starts at min_nodes
    counts = [n for _, n in got]
    assert counts[-1] == 0  # sampled after its end
    assert counts[:-1] == [2, 3, 4, 5, 6, 5, 4, 3, 2]  # one node at a time, up and down
    assert (svc.scale_ups, svc.scale_downs) == (4, 4)
    ups = [t for (t, n), (_, m) in zip(got[1:], got, strict=False) if n > m]
    # the first step after the start's cooldown and up-window; each later one a cooldown
    # after the previous one
    assert ups[0] >= SCALING.cooldown
    assert all(b - a >= SCALING.cooldown for a, b in itertools.pairwise(ups))
    # its node time is the integral of its size
    held = sum((t2 - t1) * n for (t1, n), (t2, _) in zip(got, [*got[1:], (4 * H, 0)], strict=False))
    assert svc.node_seconds == pytest.approx(held, abs=2 * 60 * 6)
    assert svc.state == "completed"


def test_scale_up_stops_at_the_tenant_quota_and_free_nodes() -> None:
    inv = inventory_from_mapping(
        {
            "name": "q",
            "node_classes": [{"name": "n", "count": 8}],
            "tenants": {"t": {"max_nodes": 4}},
        }
    )
    r = simulate([service(((0, 0.9),), runtime=2 * H)], inv, sample_interval=60)
    assert max(n for _, n in sizes(r)) == 4
    r = simulate(
        [
            service(((0, 0.9),), runtime=2 * H),
            submit("other", 0, nodes=5, walltime=3 * H, tenant="u"),
        ],
        inventory(8),
        sample_interval=60,
    )
    assert by_id(r)["svc"].scale_ups == 1  # 8 nodes: 5 taken, 2 + 1 for the service


def test_a_preempted_reactive_allocation_restarts_at_min_nodes() -> None:
    trace = [
        service(((0, 0.9),), runtime=3 * H, preemption_class=3),
        submit("urgent", 2 * H, nodes=8, walltime=30 * 60, preemption_class=8),
    ]
    r = simulate(trace, inventory(8), sample_interval=60, checkpoint_success_rate=1.0)
    svc = by_id(r)["svc"]
    assert svc.preempted_count == 1 and svc.lost_node_seconds == 0.0
    assert svc.scale_ups > 4  # grew again after its restart
    after = [n for t, n in sizes(r) if t >= 2.5 * H + 60]
    assert after[0] == 2


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.floats(0.0, 1.0)), min_size=1, max_size=5),
    st.integers(1, 4),
    st.integers(2, 7),
)
def test_never_outside_the_node_range(steps, lo, hi) -> None:  # type: ignore[no-untyped-def]
    hi = max(hi, lo + 1)
    t, load = 0.0, []
    for minutes, v in steps:
        load.append((t, v))
        t += minutes * 20 * 60
    r = simulate(
        [service(tuple(load), nodes=hi, min_nodes=lo, runtime=2 * H)],
        inventory(8),
        sample_interval=60,
    )
    running = [n for _, n in sizes(r)][:-1]  # the last sample is after its end
    assert running and all(lo <= n <= hi for n in running), running


def test_trace_fields_round_trip_and_bad_input_is_explained() -> None:
    ev = service(((0, 0.9), (3600, 0.1)))
    assert parse_trace_line(dump_trace_line(ev)) == ev
    bad = [
        ('"checkpoint": "sometimes"', "checkpoint must be one of"),
        ('"lifecycle": "reactive", "load": [[0, 1]]', "a reactive allocation needs a node range"),
        ('"lifecycle": "reactive", "nodes": {"min": 1, "max": 3}', "needs a load profile"),
        (
            '"lifecycle": "reactive", "nodes": {"min": 1, "max": 3}, "load": [[5, 1]]',
            "start at 0 s",
        ),
        (
            '"lifecycle": "reactive", "nodes": {"min": 1, "max": 3}, "load": [[0, 1], [0, 2]]',
            "ascend",
        ),
        (
            '"lifecycle": "reactive", "nodes": {"min": 1, "max": 3}, "load": [[0, 1]], '
            '"scaling": {"cooldown": "soon"}',
            "scaling:",
        ),
    ]
    for fields, message in bad:
        line = '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t", ' + fields + "}}"
        with pytest.raises(TraceError) as e:
            parse_trace_line(line, 7)
        assert message in str(e.value), (fields, str(e.value))
        assert e.value.hint
