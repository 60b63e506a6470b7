"""The checkpoint broker on a real one-node dev cluster (quorum member, scheduler, agent
and ``lattice-checkpoint`` as separate processes): a running application using the
signal protocol gets checkpoint hints and keeps running, each checkpoint recorded on
the allocation; the broker is killed with SIGKILL while a checkpoint is in progress and
started again, and still no allocation is ever checkpointed twice for one hint or
twice within an evaluation interval.

The broker is made eager for the test (a tiny node MTBF: every second of work is at
risk; a 1 MiB checkpoint estimate) and evaluates every 2 s."""

from __future__ import annotations

import itertools
import re
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = pytest.mark.timeout(180)

APP = Path(__file__).parent.parent / "packages/lattice-node-agent/tests/apps/ckpt_signal.py"
INTERVAL = 2.0
STEP = 0.05  # seconds per count of the test application
SLOW = 3.0  # seconds each checkpoint of the application takes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("broker-cluster")
    h = make_cluster(
        base,
        members=1,
        agents=1,
        checkpoint_broker=True,
        env={
            "LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS": str(INTERVAL),
            "LATTICE_CHECKPOINT__NODE_MTBF_HOURS": "0.0001",
            "LATTICE_CHECKPOINT__DEFAULT_CHECKPOINT_GIB_PER_NODE": "0.001",
            "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "20",
            "CKPT_SLOW": str(SLOW),
        },
    )
    yield h
    h.cluster.stop()


def broker_metric(h: ClusterHandle, name: str) -> float | None:
    url = f"http://127.0.0.1:{h.cluster.broker_metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def checkpoints_in_log(h: ClusterHandle, alloc_id: str) -> list[int]:
    return [
        int(m.group(1)) for ln in h.logs(alloc_id) if (m := re.match(r"checkpointed at (\d+)", ln))
    ]


def outstanding(a: dict[str, Any]) -> bool:
    hint = a.get("checkpoint_hint") or {}
    return bool(hint.get("id")) and hint.get("done_at") is None


def test_hints_checkpoint_and_continue_and_survive_a_broker_kill(cluster: ClusterHandle) -> None:
    h = cluster
    entry = f"{sys.executable} {APP} 100000 {STEP} slow"
    a = h.submit(entry, checkpoint="signal", project="climate", preemption_class=3)
    aid = a["id"]
    h.wait_state(aid, "Running", timeout=30)
    # the first hint is recorded in the quorum; kill -9 the broker while it is outstanding
    # (the application is writing its checkpoint) and start it again at once
    h.wait_for("an outstanding hint", lambda: outstanding(h.get(aid)), timeout=30, interval=0.1)
    first = h.get(aid)
    assert first["state"] == "Running" and first["checkpoint_hints"] == 1, first
    h.cluster.stop_broker(signal.SIGKILL)
    h.cluster.start_broker()
    # the hint completes: checkpoint recorded, the application still running
    done = h.wait_for(
        "hint-1 recorded",
        lambda: ((x := h.get(aid)).get("checkpoint_hint") or {}).get("outcome") and x,
        timeout=30,
        interval=0.2,
    )
    assert done["checkpoint_hint"]["outcome"] == "ok", done["checkpoint_hint"]
    assert done["state"] == "Running" and done["checkpoint_hints"] == 1
    ck = done["last_checkpoint"]
    path = Path(ck["path"])
    assert path.name == "ckpt-1-hint-1" and path.parent.name == "checkpoints"
    saved = int((path / "counter").read_text())
    assert saved > 0 and ck["size_bytes"] > 0 and ck["duration_seconds"] >= SLOW * 0.5
    # the restarted broker goes on hinting, one at a time
    h.wait_for("a third hint", lambda: h.get(aid).get("checkpoint_hints", 0) >= 3, timeout=40)
    h.wait_for("it is recorded", lambda: not outstanding(h.get(aid)), timeout=30, interval=0.2)
    h.cluster.stop_broker()
    final = h.get(aid)
    assert final["state"] == "Running", final  # never stopped by a hint
    hints = final["checkpoint_hints"]
    # every hint made the application checkpoint exactly once: as many checkpoints in
    # its output, and directories on disk, as hints in the quorum
    counters = checkpoints_in_log(h, aid)
    assert len(counters) == hints, (hints, counters)
    dirs = sorted(p.name for p in path.parent.iterdir() if p.name.startswith("ckpt-1-hint-"))
    assert dirs == [f"ckpt-1-hint-{i}" for i in range(1, hints + 1)], dirs
    # ... never two in a row: at least an evaluation interval of counting in between
    gaps = [b - a for a, b in itertools.pairwise(counters)]
    assert all(g >= INTERVAL / STEP for g in gaps), gaps
    # it kept counting after its checkpoints
    out = h.logs(aid)
    assert any(ln == f"count {counters[-1] + 1}" for ln in out), out[-5:]
    assert broker_metric(h, "lattice_checkpoint_storage_unavailable") is None  # stopped
    h.cancel(aid)


def test_the_broker_serves_its_metrics_and_probes_storage(cluster: ClusterHandle) -> None:
    h = cluster
    h.cluster.start_broker()
    try:
        h.wait_for(
            "an evaluation",
            lambda: (broker_metric(h, "lattice_checkpoint_evaluations_total") or 0) >= 1,
            timeout=20,
            interval=0.2,
        )
        assert broker_metric(h, "lattice_checkpoint_storage_unavailable") == 0
        assert (broker_metric(h, "lattice_checkpoint_storage_write_bandwidth_bytes") or 0) > 0
    finally:
        h.cluster.stop_broker()
