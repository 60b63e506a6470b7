"""The agent's telemetry task: a real burner measured by the /proc collector, aggregated
in 1 s windows and pushed to a real VictoriaMetrics, then switched to debug mode (raw
samples) and back; modes and auto-revert on a simulated clock; a failing source, a
failing target list and a dead TSDB do not stop it; targets from the runtime's reports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from lattice_agent.cgroups import CgroupsV2, NoCgroups
from lattice_agent.telemetry import (
    ProcCollector,
    TelemetryLoop,
    VictoriaPusher,
    running_targets,
    telemetry_loop,
)
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_common.config import TelemetryConfig
from lattice_common.types import Allocation, AllocationReport, AllocationSpec
from lattice_test_harness.victoria import VictoriaMetrics, available
from prometheus_client import REGISTRY


@pytest.fixture(scope="module")
def vm() -> Iterator[VictoriaMetrics]:
    if not available():
        pytest.skip("victoria-metrics is not installed (Debian: apt-get install victoria-metrics)")
    with VictoriaMetrics() as v:
        yield v


async def _eventually(what: str, fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(fn)
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def _query(vm: VictoriaMetrics, promql: str) -> list[dict]:
    vm.flush()
    return vm.query(promql)


async def test_burner_aggregated_then_debug_raw_in_victoria(vm: VictoriaMetrics) -> None:
    aid = f"loop-{uuid.uuid4().hex[:8]}"
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time() + 15\nwhile time.time() < t: pass"],
        start_new_session=True,
    )
    target = Target(AllocLabels(aid, "node-001", "physics", "alice", "hpc"), (burner.pid,))
    collect0 = REGISTRY.get_sample_value("lattice_agent_telemetry_collect_seconds_count") or 0
    loop = TelemetryLoop(
        lambda: [target],
        [ProcCollector()],
        pusher=VictoriaPusher(vm.url, interval=0.2),
        window_seconds=1.0,
    )
    task = asyncio.create_task(loop.run())
    try:
        t0 = time.monotonic()
        mean = f'last_over_time(cpu_utilization{{alloc_id="{aid}",agg="mean"}}[1m])'
        got = await _eventually("an aggregated window", lambda: _query(vm, mean))
        print(f"first mean after {time.monotonic() - t0:.1f}s: {got[0]['value'][1]}")
        assert float(got[0]["value"][1]) > 50
        m = got[0]["metric"]
        assert (m["tenant"], m["user"], m["vcluster"], m["node_id"]) == (
            "physics",
            "alice",
            "hpc",
            "node-001",
        )
        for agg in ("p50", "p95", "p99", "max", "count"):
            q = f'cpu_utilization{{alloc_id="{aid}",agg="{agg}"}}'
            assert _query(vm, f"last_over_time({q}[1m])"), agg
        raw = f'cpu_utilization{{alloc_id="{aid}",agg="raw"}}'
        assert _query(vm, f"count_over_time({raw}[1m])") == []  # prod: no raw series
        # debug for 3 s: one raw sample per second, then back to prod by itself
        until = loop.set_mode(aid, "debug", 3.0)
        assert until is not None and loop.mode(aid) == "debug"
        got = await _eventually(
            "three raw samples",
            lambda: [
                r for r in _query(vm, f"count_over_time({raw}[1m])") if float(r["value"][1]) >= 3
            ],
        )
        assert float(_query(vm, f"last_over_time({raw}[1m])")[0]["value"][1]) > 50
        await asyncio.sleep(max(0.0, until - time.time()) + 1.5)
        assert loop.mode(aid) == "prod"
        n = float(_query(vm, f"count_over_time({raw}[1m])")[0]["value"][1])
        await asyncio.sleep(2.0)
        assert float(_query(vm, f"count_over_time({raw}[1m])")[0]["value"][1]) == n
        print(f"raw samples in debug: {n:.0f}")
        assert 2 <= n <= 5
        latest = loop.latest(aid)
        assert latest is not None and latest.values["cpu_utilization"] > 50
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        burner.kill()
        burner.wait(10)
    assert loop.pusher is not None and loop.pusher._session is None  # closed on the way out
    assert REGISTRY.get_sample_value("lattice_agent_telemetry_collect_seconds_count") > collect0
    assert REGISTRY.get_sample_value("lattice_agent_telemetry_source", {"source": "proc"}) == 1


class FakeSource:
    def __init__(self, name: str = "fake", values: dict[str, float] | None = None) -> None:
        self.name = name
        self.values = values or {"cpu_utilization": 100.0}
        self.forgotten: list[str] = []

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        return {t.alloc_id: dict(self.values) for t in targets}

    def forget(self, alloc_id: str) -> None:
        self.forgotten.append(alloc_id)


class Boom:
    name = "boom"

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        raise RuntimeError("no eBPF here")

    def forget(self, alloc_id: str) -> None:
        raise RuntimeError("still none")


async def test_modes_windows_and_sources_on_a_simulated_clock() -> None:
    now = [1000.0]
    targets = [Target(AllocLabels("a", "n")), Target(AllocLabels("b", "n"))]
    gpu = FakeSource("nvml", {"gpu_utilization": 80.0, "cpu_utilization": 1.0})
    proc = FakeSource("proc")
    loop = TelemetryLoop(
        lambda: list(targets), [proc, Boom(), gpu], window_seconds=30, clock=lambda: now[0]
    )
    loop.set_mode("a", "debug", 5)
    out = await loop.tick()  # a failing source is skipped, the others merge (later wins)
    raw = [s for s in out if dict(s.labels)["agg"] == "raw"]
    assert {(s.name, s.value) for s in raw} == {("cpu_utilization", 1.0), ("gpu_utilization", 80.0)}
    assert {dict(s.labels)["alloc_id"] for s in raw} == {"a"}
    assert raw[0].timestamp_ms == 1_000_000
    for _ in range(4):
        now[0] += 1
        await loop.tick()
    now[0] = 1005.0
    out = await loop.tick()  # the debug period is over
    assert loop.mode("a") == "prod"
    assert not [s for s in out if dict(s.labels)["agg"] == "raw"]
    targets.pop()  # b leaves the node: every source forgets it
    now[0] = 1021.0  # [990, 1020) ends; closed a second later (this reading opens the next)
    out = await loop.tick()
    assert proc.forgotten == ["b"] and gpu.forgotten == ["b"]
    counts = {
        (dict(s.labels)["alloc_id"], s.name): s.value
        for s in out
        if dict(s.labels)["agg"] == "count"
    }
    assert counts == {
        ("a", "cpu_utilization"): 6,
        ("a", "gpu_utilization"): 6,
        ("b", "cpu_utilization"): 6,
        ("b", "gpu_utilization"): 6,
    }
    assert {s.timestamp_ms for s in out if dict(s.labels)["agg"] != "raw"} == {1_020_000}
    assert loop.latest("b") is None and loop.latest("a") is not None


async def test_loop_survives_failures_and_a_dead_tsdb() -> None:
    calls = [0]

    def targets() -> list[Target]:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("runtime hiccup")
        return [Target(AllocLabels("a", "n"))]

    failures0 = REGISTRY.get_sample_value("lattice_agent_telemetry_push_failures_total") or 0
    loop = TelemetryLoop(
        targets,
        [FakeSource()],
        pusher=VictoriaPusher("http://127.0.0.1:1", interval=0.1, timeout=0.5),
        window_seconds=0.25,
        interval=0.1,
    )
    loop.modes.set("a", "debug", None, now=time.time())
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(1.5)
    assert not task.done()
    assert calls[0] >= 10  # kept collecting after the failure
    t0 = time.perf_counter()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert time.perf_counter() - t0 < 2.0  # shutting down does not hang on the TSDB
    assert loop.pusher is not None and loop.pusher.pending > 0
    assert REGISTRY.get_sample_value("lattice_agent_telemetry_push_failures_total") > failures0


def _alloc(aid: str) -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(entrypoint="true", tenant="physics", vcluster="hpc", user="alice"),
    )


def test_running_targets_from_reports(tmp_path: Path) -> None:
    assigned = {a: _alloc(a) for a in ("r1", "r2", "gone")}
    reports = [
        AllocationReport(allocation_id="r1", phase="running", pid=4242),
        AllocationReport(allocation_id="r2", phase="exited", pid=4343),
        AllocationReport(allocation_id="r3", phase="running", pid=4444),  # not assigned
        AllocationReport(allocation_id="gone", phase="running", pid=0),
    ]
    (t,) = running_targets("node-001", assigned, reports, NoCgroups())
    assert t.labels == AllocLabels("r1", "node-001", "physics", "alice", "hpc")
    assert (t.pgids, t.scope) == ((4242,), None)
    cg = CgroupsV2(tmp_path, slice_name="x.slice")
    (t,) = running_targets("node-001", assigned, reports, cg)
    assert t.scope is not None and t.scope.dirs[""] == tmp_path / "x.slice" / "alloc-r1.scope"


def test_launched_ranks_and_attach_sessions_are_counted_with_their_allocation() -> None:
    assigned = {a: _alloc(a) for a in ("head", "other", "idle")}
    reports = [AllocationReport(allocation_id="head", phase="running", pid=100)]
    extra = {"head": [200, 201], "other": [300], "idle": [], "unknown": [400]}
    got = {t.alloc_id: t.pgids for t in running_targets("n", assigned, reports, None, extra)}
    # the batch script's group and the ranks beside it; an allocation whose script runs
    # on another node is measured here through its ranks; nothing for the rest
    assert got == {"head": (100, 200, 201), "other": (300,)}


def test_loop_from_config() -> None:
    loop = telemetry_loop(TelemetryConfig(), targets=list)
    assert loop.pusher is None and [s.name for s in loop.sources] == ["proc"]
    assert loop.windows.window == 30.0 and loop.modes.debug_seconds == 1800.0
    cfg = TelemetryConfig(
        tsdb_endpoint="http://127.0.0.1:8428", aggregation_window_seconds=2, mode="debug"
    )
    loop = telemetry_loop(cfg, targets=list)
    assert loop.pusher is not None
    assert loop.pusher.url == "http://127.0.0.1:8428/api/v1/import/prometheus"
    assert loop.windows.window == 2.0 and loop.mode("any") == "debug"
