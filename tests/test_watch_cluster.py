"""``lattice watch`` and ``lattice telemetry`` end to end on a real dev cluster
(lattice-server, a scheduler and an agent as processes; the CLI as a subprocess), with
2 s aggregation windows and one alert rule configured through the environment: CPU
below 10% for 3 s.

* A job that sleeps raises that alert: ``lattice watch ID --alerts-only -o json``
  delivers it within the rule's 3 s (plus the first collections after the start).
* ``lattice telemetry --alloc ID --mode=debug --duration=5s`` makes an open
  ``lattice watch`` stream 1 s raw values at once, and after 5 s it is back to 2 s
  windows of means by itself; the stream ends when the job is cancelled."""

from __future__ import annotations

import itertools
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

WINDOW = 2.0
IDLE_FOR = 3.0
RULES = [
    {
        "name": "cpu_idle",
        "metric": "cpu_utilization",
        "comparison": "<",
        "threshold": 10,
        "for_seconds": IDLE_FOR,
        "message": "CPU below 10% for 3 s (is it sleeping?)",
    }
]


class Watch:
    """``lattice watch ARGS`` running, its stdout lines readable with a timeout."""

    def __init__(self, h: ClusterHandle, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lattice_cli.main", "watch", *args],
            env=h.cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float) -> dict[str, Any] | None:
        line = self.lines.get(timeout=timeout)
        return None if line is None else json.loads(line)

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err or ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {
        "LATTICE_TELEMETRY__AGGREGATION_WINDOW_SECONDS": str(WINDOW),
        "LATTICE_TELEMETRY__ALERT_RULES": json.dumps(RULES),
    }
    h = make_cluster(tmp_path_factory.mktemp("watch"), members=1, agents=1, env=env)
    yield h
    h.cluster.stop()


@pytest.fixture(scope="module")
def sleeper(cluster: ClusterHandle) -> Iterator[tuple[str, float]]:
    a = cluster.submit("sleep 120", nodes=1)
    cluster.wait_state(a["id"], "Running", timeout=30)
    yield a["id"], time.monotonic()
    if cluster.get(a["id"])["state"] not in ("Completed", "Failed", "Cancelled"):
        cluster.cancel(a["id"])


def test_alert_for_a_sleeping_job(cluster: ClusterHandle, sleeper: tuple[str, float]) -> None:
    alloc_id, running_at = sleeper
    w = Watch(cluster, alloc_id, "--alerts-only", "-o", "json")
    try:
        rec = w.next(timeout=IDLE_FOR + 10)
        took = time.monotonic() - running_at
    finally:
        err = w.close()
    assert rec is not None, err
    print(f"low-utilization alert {took:.1f} s after the job was Running")
    assert (rec["event"], rec["allocation_id"], rec["node_id"]) == ("alert", alloc_id, "node-001")
    (ev,) = rec["alert_events"]
    assert (ev["rule"], ev["state"], ev["metric"]) == ("cpu_idle", "firing", "cpu_utilization")
    assert ev["value"] < 10 and ev["threshold"] == 10 and ev["for_seconds"] == IDLE_FOR
    assert ev["timestamp"] - ev["since"] >= IDLE_FOR
    assert rec["alerts"] == [RULES[0]["message"]]
    # within the rule's window, plus the first two collections (a rate needs two) and the
    # CLI's start
    assert took < IDLE_FOR + 6.0


def test_debug_mode_for_five_seconds_then_back(
    cluster: ClusterHandle, sleeper: tuple[str, float]
) -> None:
    alloc_id, _ = sleeper
    w = Watch(cluster, alloc_id, "-o", "json")
    records: list[dict[str, Any]] = []

    def read_until(done: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out: {[(r['event'], r['telemetry_mode']) for r in records]}"
            rec = w.next(timeout=left)
            assert rec is not None, w.close()
            records.append(rec)

    try:
        read_until(lambda: records, 15)
        first = records[0]
        assert (first["event"], first["telemetry_mode"]) == ("metrics", "prod")
        assert first["resolution_seconds"] == WINDOW
        # a window of means first, in prod mode
        read_until(lambda: any(r["event"] == "metrics" for r in records[1:]), 2 * WINDOW + 3)

        r = cluster.cli("telemetry", "--alloc", alloc_id, "--mode=debug", "--duration=5s")
        assert r.returncode == 0, r.stderr
        assert f"Telemetry of {alloc_id} is now debug on 1 node until " in r.stdout
        mark = len(records)

        def modes() -> list[dict[str, Any]]:
            return [x for x in records[mark:] if x["event"] == "mode"]

        read_until(lambda: [m["telemetry_mode"] for m in modes()] == ["debug", "prod"], 15)
        debug_at, prod_at = (m["timestamp"] for m in modes())
        assert modes()[0]["resolution_seconds"] == 1.0 and modes()[0]["mode_until"]
        assert 4.0 <= prod_at - debug_at <= 6.5  # reverted by itself after 5 s
        raw = [
            x
            for x in records[mark:]
            if x["event"] == "metrics" and debug_at <= x["timestamp"] < prod_at
        ]
        assert len(raw) >= 3
        assert all(x["resolution_seconds"] == 1.0 and x["telemetry_mode"] == "debug" for x in raw)
        assert {s["labels"]["agg"] for x in raw for s in x["samples"]} == {"raw"}
        gaps = [b["timestamp"] - a["timestamp"] for a, b in itertools.pairwise(raw)]
        assert all(0.5 <= g <= 1.6 for g in gaps), gaps  # one per second
        # back to 2 s windows of means
        after = len(records)
        read_until(
            lambda: sum(x["event"] == "metrics" for x in records[after:]) >= 2, 3 * WINDOW + 3
        )
        means = [x for x in records[after:] if x["event"] == "metrics"]
        assert all(x["resolution_seconds"] == WINDOW for x in means)
        assert {s["labels"]["agg"] for x in means for s in x["samples"]} == {"mean"}
        assert means[1]["timestamp"] - means[0]["timestamp"] == pytest.approx(WINDOW, abs=0.01)

        cluster.cancel(alloc_id)  # the stream ends with the job
        read_until(lambda: records[-1]["event"] == "end", 15)
        assert w.proc.wait(timeout=10) == 0
    finally:
        w.close()
