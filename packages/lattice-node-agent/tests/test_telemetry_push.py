"""Pushing to a real VictoriaMetrics (lattice_test_harness.victoria): the text exposition
lines, aggregated windows queried back, label values that need escaping, and the ways
telemetry degrades: a dead endpoint, one that never answers, a full queue."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
from lattice_agent.telemetry.aggregate import Windows
from lattice_agent.telemetry.push import (
    VictoriaPusher,
    escape_label,
    format_sample,
    import_url,
)
from lattice_agent.telemetry.samples import AGGS, AllocLabels, Reading, Sample
from lattice_test_harness.victoria import VictoriaMetrics, available
from prometheus_client import REGISTRY


@pytest.fixture(scope="module")
def vm() -> Iterator[VictoriaMetrics]:
    if not available():
        pytest.skip("victoria-metrics is not installed (Debian: apt-get install victoria-metrics)")
    with VictoriaMetrics() as v:
        yield v


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def _aid() -> str:
    return f"a-{uuid.uuid4().hex[:10]}"


def test_exposition_lines() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    s = Sample("cpu_utilization", (("agg", "mean"), ("user", 'x"y')), 150.25, 1_700_000_000_123)
    assert format_sample(s) == 'cpu_utilization{agg="mean",user="x\\"y"} 150.25 1700000000123'
    assert format_sample(Sample("m", (), 3.0, 5)) == "m{} 3 5"
    assert import_url("http://127.0.0.1:8428/") == "http://127.0.0.1:8428/api/v1/import/prometheus"
    assert import_url("vm:8428") == "http://vm:8428/api/v1/import/prometheus"
    full = "http://h/api/v1/import/prometheus"
    assert import_url(full) == full


async def test_windows_pushed_and_queried_back(vm: VictoriaMetrics) -> None:
    aid = _aid()
    labels = AllocLabels(aid, "node-007", "physics", "alice", "hpc")
    w = Windows(30)
    # the window that ended last, at least the pusher's minimum age (1 s) in the past
    end = ((int(time.time()) - 2) // 30) * 30
    for i in range(30):
        w.add(Reading(labels, end - 30 + i, {"cpu_utilization": 150.0 + i, "memory_used": 2e9}))
    samples = w.close(time.time(), lag=0)
    assert len(samples) == 2 * len(AGGS)
    pushed0 = _metric("lattice_agent_telemetry_samples_total")
    latency0 = _metric("lattice_agent_telemetry_push_latency_seconds_count")
    p = VictoriaPusher(vm.url)
    try:
        p.offer(samples)
        assert await p.flush()
    finally:
        await p.close()
    assert p.pending == 0 and p.pushed == len(samples)
    assert _metric("lattice_agent_telemetry_samples_total") - pushed0 == len(samples)
    assert _metric("lattice_agent_telemetry_push_latency_seconds_count") > latency0
    vm.flush()
    got = vm.query(f'last_over_time(cpu_utilization{{alloc_id="{aid}",agg="mean"}}[1m])')
    assert len(got) == 1
    assert float(got[0]["value"][1]) == pytest.approx(164.5)
    assert {k: v for k, v in got[0]["metric"].items() if k != "__name__"} == {
        "agg": "mean",
        "alloc_id": aid,
        "node_id": "node-007",
        "tenant": "physics",
        "user": "alice",
        "vcluster": "hpc",
    }
    aggs = vm.query(f'last_over_time(cpu_utilization{{alloc_id="{aid}"}}[1m])')
    by = {r["metric"]["agg"]: float(r["value"][1]) for r in aggs}
    assert set(by) == set(AGGS)
    assert by["p50"] <= by["p95"] <= by["p99"] <= by["max"] == 179.0
    assert by["count"] == 30
    ts = vm.query(f'timestamp(memory_used{{alloc_id="{aid}",agg="max"}})', time=str(end + 5))
    assert float(ts[0]["value"][1]) == end  # stamped with the window's end


async def test_label_values_that_need_escaping_round_trip(vm: VictoriaMetrics) -> None:
    aid = _aid()
    odd = 'o"brien\\lab\nnext line'
    ts = round((time.time() - 5) * 1000)
    samples = [
        Sample("memory_used", AllocLabels(aid, "n1", "t", odd, "v").pairs("mean"), 1.0, ts),
        # the next line must not be broken by the one above
        Sample("memory_used", AllocLabels(aid, "n2", "t", "plain", "v").pairs("mean"), 2.0, ts),
    ]
    p = VictoriaPusher(vm.url)
    try:
        p.offer(samples)
        assert await p.flush()
    finally:
        await p.close()
    vm.flush()
    got = vm.query(f'last_over_time(memory_used{{alloc_id="{aid}"}}[1m])')
    users = {r["metric"]["user"]: float(r["value"][1]) for r in got}
    assert users == {odd: 1.0, "plain": 2.0}


async def test_young_samples_wait_until_a_second_old(vm: VictoriaMetrics) -> None:
    aid = _aid()
    labels = AllocLabels(aid, "n1").pairs("raw")
    now = time.time()
    p = VictoriaPusher(vm.url, min_age=1.0)
    try:
        p.offer([Sample("cpu_utilization", labels, 5.0, round(now * 1000))])
        p.offer([Sample("cpu_utilization", labels, 4.0, round((now - 3) * 1000))])
        assert await p.flush()
        assert (p.pushed, p.pending) == (1, 1)  # the old one went, the young one waits
        await asyncio.sleep(1.1)
        assert await p.flush()
        assert (p.pushed, p.pending) == (2, 0)
    finally:
        await p.close()
    vm.flush()
    got = vm.query(f'count_over_time(cpu_utilization{{alloc_id="{aid}",agg="raw"}}[1m])')
    assert float(got[0]["value"][1]) == 2


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def _samples(n: int, aid: str = "dead") -> list[Sample]:
    ts = round((time.time() - 10) * 1000)
    return [
        Sample("cpu_utilization", AllocLabels(aid, "n").pairs("mean"), float(i), ts + i)
        for i in range(n)
    ]


async def test_dead_endpoint_counts_failures_and_never_raises() -> None:
    failures0 = _metric("lattice_agent_telemetry_push_failures_total")
    p = VictoriaPusher(f"http://127.0.0.1:{_dead_port()}", interval=0.05, timeout=1.0)
    p.offer(_samples(100))
    assert await p.flush() is False  # no exception
    assert p.failures == 1 and p.pending == 100  # kept for the next try
    assert "Connect" in p.last_error or "refused" in p.last_error.lower()
    task = asyncio.create_task(p.run())  # backs off, keeps going
    await asyncio.sleep(0.3)
    assert not task.done()
    p.offer(_samples(10))  # offering never waits
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await p.close()
    assert _metric("lattice_agent_telemetry_push_failures_total") - failures0 >= 1
    assert p.pending == 110


async def test_endpoint_that_never_answers_times_out_without_blocking() -> None:
    with socket.socket() as srv:  # accepts connections (backlog) but never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        p = VictoriaPusher(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=0.5)
        p.offer(_samples(5))
        push = asyncio.create_task(p.flush())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        p.offer(_samples(5))  # while a push hangs: at once
        assert time.perf_counter() - t0 < 0.05
        assert await asyncio.wait_for(push, 5) is False
        assert "Timeout" in p.last_error
        await p.close(final_flush_timeout=0)
    assert p.pending == 10


async def test_bounded_queue_drops_the_oldest() -> None:
    dropped0 = _metric("lattice_agent_telemetry_samples_dropped_total")
    p = VictoriaPusher("http://127.0.0.1:1", max_queue=10)
    assert p.offer(_samples(25)) == 15
    assert p.pending == 10
    assert p.dropped == 15
    assert _metric("lattice_agent_telemetry_samples_dropped_total") - dropped0 == 15
    kept = [s.value for s in p._take()]
    assert kept == [float(v) for v in range(15, 25)]  # the newest stay
    await p.close(final_flush_timeout=0)
