"""Node health signals in the broker (lattice_checkpoint.health): the GPUs' ECC errors
and temperatures the agents push to the TSDB become each node's signals, the worst
node of an allocation raises its failure probability, and a node with errors gets a
checkpoint that a healthy one would not. Against a real VictoriaMetrics with samples
labelled as the agents label them; without a TSDB nothing is counted."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_checkpoint import cost
from lattice_checkpoint.broker import evaluate
from lattice_checkpoint.health import (
    ECC_CORRECTED,
    ECC_UNCORRECTED,
    TEMPERATURE,
    TsdbHealth,
    node_health,
)
from lattice_common.types import Allocation, AllocationState, Node, NodeCapabilities, NodeState
from lattice_test_harness import builders as b
from lattice_test_harness.victoria import VictoriaMetrics, available

NOW = 1_000_000.0
# slow enough storage that a healthy one-hour run is not worth a checkpoint
SLOW = cost.StorageView(write_bandwidth_bytes_per_s=1e8)


def row(node: str, value: float, name: str = "", gpu: str = "0") -> dict:  # type: ignore[type-arg]
    metric = {"node_id": node, "gpu": gpu}
    if name:
        metric["__name__"] = name
    return {"metric": metric, "value": [NOW, str(value)]}


def test_ecc_counts_sum_over_gpus_and_an_uncorrected_error_weighs_ten() -> None:
    h = node_health(
        [
            row("n0", 3, ECC_CORRECTED, "0"),
            row("n0", 2, ECC_CORRECTED, "1"),
            row("n1", 1, ECC_UNCORRECTED, "0"),
            row("n2", 0, ECC_CORRECTED),  # no errors: no signal
            row("n3", float("nan"), ECC_CORRECTED),  # junk
            {"metric": {"gpu": "0"}, "value": [NOW, "5"]},  # no node
            {"value": [NOW, "5"]},
        ],
        [],
    )
    assert h == {"n0": cost.NodeHealth(ecc_errors=5), "n1": cost.NodeHealth(ecc_errors=10)}


def test_a_thermal_warning_per_gpu_at_or_over_the_limit() -> None:
    h = node_health(
        [],
        [row("n0", 85, gpu="0"), row("n0", 91, gpu="1"), row("n0", 60, gpu="2"), row("n1", 84.9)],
    )
    assert h == {"n0": cost.NodeHealth(thermal_warnings=2)}
    assert node_health([], [row("n1", 84.9)], thermal_limit_c=80) == {
        "n1": cost.NodeHealth(thermal_warnings=1)
    }


def gpu_node(i: int, state: NodeState = NodeState.READY) -> Node:
    return Node(id=f"n{i}", state=state, capabilities=NodeCapabilities(cpu_cores=8))


def running(aid: str, nodes: tuple[str, ...]) -> Allocation:
    spec = b.spec(
        tenant="t",
        vcluster="v",
        checkpoint="auto",
        checkpoint_protocol="signal",
        nodes=len(nodes),
        walltime_seconds=86_400,
    )
    return Allocation(
        id=aid,
        spec=spec,
        state=AllocationState.RUNNING,
        assigned_nodes=list(nodes),
        started_at=NOW - 3600.0,
    )


def decide(health: dict[str, cost.NodeHealth] | None) -> dict[str, cost.Decision]:
    allocs = [running("a", ("n0",)), running("b", ("n1", "n2"))]
    ev = evaluate(
        {a.id: a for a in allocs},
        {n.id: n for n in (gpu_node(0), gpu_node(1), gpu_node(2))},
        NOW,
        SLOW,
        interval=30.0,
        health=health,
    )
    return {d.allocation_id: d for d in ev.decisions}


def test_the_worst_node_raises_the_failure_probability_and_earns_a_checkpoint() -> None:
    healthy = decide(None)
    assert not healthy["a"].checkpoint and not healthy["b"].checkpoint
    # n2, the second node of b, has had ECC errors; nothing is wrong with n0
    sick = decide({"n2": cost.NodeHealth(ecc_errors=40)})
    assert sick["a"] == healthy["a"]
    assert sick["b"].value.failure_probability > 10 * healthy["b"].value.failure_probability
    assert sick["b"].checkpoint and sick["b"].reason == "recompute_saved"
    hot = decide({"n0": cost.NodeHealth(thermal_warnings=8)})
    assert hot["a"].value.failure_probability > healthy["a"].value.failure_probability
    assert hot["b"] == healthy["b"]


# --- against a real VictoriaMetrics -------------------------------------------------------

needs_vm = pytest.mark.skipif(not available(), reason="victoria-metrics is not installed")


@pytest.fixture
def vm() -> Iterator[VictoriaMetrics]:
    with VictoriaMetrics() as v:
        yield v


def push(vm: VictoriaMetrics, samples: list[tuple[str, str, str, str, float]]) -> None:
    """(series, node, gpu, agg, value) as a node agent labels them, a moment ago."""
    ts = int((time.time() - 2) * 1000)
    lines = [
        f'{name}{{alloc_id="a-{node}",node_id="{node}",tenant="t",user="u",vcluster="v",'
        f'gpu="{gpu}",agg="{agg}"}} {value} {ts}'
        for name, node, gpu, agg, value in samples
    ]
    vm.push("\n".join(lines) + "\n")
    vm.flush()


@needs_vm
async def test_signals_are_read_from_the_tsdb_the_agents_push_to(vm: VictoriaMetrics) -> None:
    push(
        vm,
        [
            (ECC_CORRECTED, "n0", "0", "max", 4),
            (ECC_CORRECTED, "n0", "0", "count", 30),  # a count of samples, not errors
            (ECC_CORRECTED, "n0", "1", "max", 2),
            (ECC_UNCORRECTED, "n0", "1", "max", 1),
            (ECC_CORRECTED, "n1", "0", "raw", 0),
            (TEMPERATURE, "n1", "0", "max", 90),
            (TEMPERATURE, "n1", "0", "mean", 70),
            (TEMPERATURE, "n1", "1", "max", 60),
            (TEMPERATURE, "n2", "0", "raw", 88),
        ],
    )
    source = TsdbHealth(vm.url)
    got = await source.read()
    assert got == {
        "n0": cost.NodeHealth(ecc_errors=4 + 2 + 10),
        "n1": cost.NodeHealth(thermal_warnings=1),
        "n2": cost.NodeHealth(thermal_warnings=1),
    }
    assert source.available
    # and the broker's evaluation counts them: n2 is b's second node
    allocs = [running("a", ("n0",)), running("b", ("n1", "n2")), running("c", ("n3",))]
    ev = evaluate(
        {a.id: a for a in allocs},
        {n.id: n for n in (gpu_node(i) for i in range(4))},
        NOW,
        SLOW,
        interval=30.0,
        health=got,
    )
    p = {d.allocation_id: d.value.failure_probability for d in ev.decisions}
    assert p["a"] > p["b"] > p["c"]


@needs_vm
async def test_no_tsdb_answer_counts_nothing_and_comes_back(vm: VictoriaMetrics) -> None:
    push(vm, [(TEMPERATURE, "n0", "0", "max", 95)])
    source = TsdbHealth("http://127.0.0.1:9")  # nothing listens there
    assert await source.read() == {}
    assert source.available is False
    source.url = vm.url
    assert await source.read() == {"n0": cost.NodeHealth(thermal_warnings=1)}
    assert source.available is True


@needs_vm
def test_the_broker_reads_the_signals_before_each_evaluation(
    vm: VictoriaMetrics, tmp_path: Path
) -> None:
    from lattice_checkpoint.broker import Broker
    from lattice_checkpoint.storage import LocalCheckpointStore
    from test_broker_service import RecordingQuorum

    push(vm, [(ECC_UNCORRECTED, "n1", "3", "max", 2)])
    broker = Broker(
        RecordingQuorum(),  # type: ignore[arg-type]
        LocalCheckpointStore(str(tmp_path), probe_bytes=1 << 16),
        interval=30.0,
        health=TsdbHealth(vm.url),
    )
    for i in range(2):
        a = running(f"a{i}", (f"n{i}",))
        a.started_at = time.time() - 3600.0
        broker.mirror.allocations[a.id] = a
        broker.mirror.nodes[f"n{i}"] = gpu_node(i)
    ev = asyncio.run(broker.evaluate_once())
    p = {d.allocation_id: d.value.failure_probability for d in ev.decisions}
    # n1's GPU 3 had two uncorrected errors: 20 ECC errors' worth on top of the base rate
    signals = 1 + cost.ECC_ERROR_WEIGHT * 20
    assert p["a1"] == pytest.approx(1 - math.exp(-signals / 1000), rel=1e-3)
    assert p["a0"] == pytest.approx(1 - math.exp(-1 / 1000), rel=1e-3)
