"""Preemption through checkpoints, end to end on a real one-node dev cluster: a
class-3 test application is preempted by a class-8 job, passes through Checkpointing
and Suspended (seen by `watch`), its checkpoint is on disk at the recorded path, the
class-8 job starts only after the victim released the node, and afterwards the victim
resumes from its checkpoint (its output proves it continued from the saved counter).
Also: an unresponsive application ends Failed and counts in
lattice_preemption_failed_checkpoint_total; `lattice suspend` / `lattice resume`."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = pytest.mark.timeout(300)

APPS = Path(__file__).parent / "apps"
LIMIT = 160  # the victim counts to this, 0.05 s a step, then finishes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("ckpt-cluster")
    h = make_cluster(
        base,
        members=1,
        agents=1,  # one node: the class-8 job needs the victim's node
        env={
            "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(base / "checkpoints"),
            "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "4",
        },
    )
    h.root = base / "checkpoints"  # type: ignore[attr-defined]
    yield h
    h.cluster.stop()


class Watch:
    """The states `watch` streams for one allocation, in order, with when they came."""

    def __init__(self, h: ClusterHandle, alloc_id: str) -> None:
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        url = h.url + f"/api/v1/allocations/{alloc_id}/watch"
        auth, context = h.cluster.auth_for(url)
        req = urllib.request.Request(url, headers={"x-lattice-user": h.user, **auth})
        self._resp = urllib.request.urlopen(req, timeout=120, context=context)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for raw in self._resp:
                if raw.strip():
                    a = json.loads(raw)["allocation"]
                    if not self.events or self.events[-1][0] != a["state"]:
                        self.events.append((a["state"], time.time(), a))
        except (OSError, ValueError):
            return

    def states(self) -> list[str]:
        return [s for s, _, _ in self.events]

    def first(self, state: str) -> dict[str, Any]:
        return next(a for s, _, a in self.events if s == state)


def logs(h: ClusterHandle, alloc_id: str) -> list[str]:
    return h.logs(alloc_id)


def wait_line(h: ClusterHandle, alloc_id: str, prefix: str, timeout: float = 60.0) -> str:
    return h.wait_for(
        f"{alloc_id} printing {prefix!r}",
        lambda: next((ln for ln in logs(h, alloc_id) if ln.startswith(prefix)), None),
        timeout,
        interval=0.2,
    )


def failed_checkpoints(h: ClusterHandle) -> float:
    url = h.url + "/metrics"
    auth, context = h.cluster.auth_for(url)
    req = urllib.request.Request(url, headers={"x-lattice-user": h.user, **auth})
    with urllib.request.urlopen(req, timeout=15, context=context) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("lattice_preemption_failed_checkpoint_total "):
            return float(line.split()[1])
    return 0.0


def submit_app(h: ClusterHandle, protocol: str, *args: str, cls: int = 3) -> dict[str, Any]:
    entry = f"{sys.executable} {APPS / f'ckpt_{protocol}.py'} {' '.join(args)}"
    return h.submit(entry, preemption_class=cls, checkpoint=protocol, project="climate")


@pytest.mark.parametrize("protocol", ["signal", "shmem", "grpc"])
def test_preempted_by_class_8_suspends_with_a_checkpoint_and_resumes_from_it(
    cluster: ClusterHandle, protocol: str
) -> None:
    h = cluster
    victim = submit_app(h, protocol, str(LIMIT), "0.05")
    h.wait_state(victim["id"], "Running", timeout=60)
    wait_line(h, victim["id"], "count 10")
    watch = Watch(h, victim["id"])
    boss = h.submit("echo urgent done", preemption_class=8)
    done = h.wait_state(victim["id"], ("Completed", "Failed"), timeout=180)
    assert done["state"] == "Completed", done
    b = h.wait_state(boss["id"], "Completed", timeout=60)
    # Running -> Checkpointing -> Suspended (watch saw each) -> Pending -> Running -> Completed
    states = watch.states()
    assert states[:3] == ["Running", "Checkpointing", "Suspended"], states
    assert states[-1] == "Completed" and "Pending" in states[3:], states
    suspended = watch.first("Suspended")
    assert suspended["assigned_nodes"] == []  # the node was released on Suspended
    ck = suspended["last_checkpoint"]
    path = Path(ck["path"])
    assert path == h.root / h.cluster.tenant / "climate" / victim["id"] / "checkpoints" / "ckpt-1"  # type: ignore[attr-defined]
    saved = int((path / "counter").read_text())
    assert saved >= 10 and ck["size_bytes"] >= 2 and ck["duration_seconds"] >= 0
    # the class-8 job started only after the victim had checkpointed and let go
    assert b["started_at"] >= ck["at"], (b, ck)
    a = h.get(victim["id"])
    assert a["preempted_count"] == 1 and a["requeue_count"] == 0
    assert a["submitted_at"] == victim["submitted_at"]
    assert a["resume_from_checkpoint"] is True and a["last_checkpoint"]["path"] == str(path)
    out = logs(h, victim["id"])
    assert out.count("started fresh") == 1, out
    assert f"resumed from {saved}" in out, out  # continued from the saved counter
    assert f"count {saved + 1}" in out[out.index(f"resumed from {saved}") :]
    assert out[-1] == f"finished at {LIMIT}", out[-5:]
    # lattice status shows the checkpoint
    status = h.cli("status", victim["id"])
    assert status.returncode == 0, status.stderr
    assert "ckpt-1" in status.stdout and str(path) in status.stdout, status.stdout


def test_unresponsive_application_ends_failed_and_is_counted(cluster: ClusterHandle) -> None:
    h = cluster
    before = failed_checkpoints(h)
    victim = submit_app(h, "signal", "1000000", "0.05", "hang")
    h.wait_state(victim["id"], "Running", timeout=60)
    wait_line(h, victim["id"], "count 5")
    boss = h.submit("echo urgent done", preemption_class=8)
    seen = h.states_seen(victim["id"], timeout=90)
    assert seen[-1] == "Failed" and "Suspended" not in seen, seen
    a = h.get(victim["id"])
    assert a["reason"] == "checkpoint_timeout" and a.get("last_checkpoint") is None, a
    h.wait_state(boss["id"], "Completed", timeout=60)
    assert failed_checkpoints(h) == before + 1


def test_owner_suspends_and_resumes_with_the_cli(cluster: ClusterHandle) -> None:
    h = cluster
    job = submit_app(h, "shmem", str(LIMIT), "0.05")
    h.wait_state(job["id"], "Running", timeout=60)
    wait_line(h, job["id"], "count 5")
    out = h.cli("suspend", job["id"])
    assert out.returncode == 0 and "Suspending allocation" in out.stdout, out.stderr
    a = h.wait_state(job["id"], "Suspended", timeout=60)
    saved = int((Path(a["last_checkpoint"]["path"]) / "counter").read_text())
    time.sleep(2)  # an owner's suspend is not requeued on its own
    assert h.get(job["id"])["state"] == "Suspended"
    out = h.cli("resume", job["id"])
    assert out.returncode == 0 and "Resumed allocation" in out.stdout, out.stderr
    h.wait_state(job["id"], "Completed", timeout=120)
    assert f"resumed from {saved}" in logs(h, job["id"])
    # a job without a protocol cannot be suspended: a clear error, nothing changes
    plain = h.submit("sleep 30")
    h.wait_state(plain["id"], "Running", timeout=60)
    out = h.cli("suspend", plain["id"])
    assert out.returncode == 1 and "--checkpoint" in out.stderr, (out.stdout, out.stderr)
    assert h.get(plain["id"])["state"] == "Running"
    h.cancel(plain["id"])


def test_two_victims_checkpoint_in_parallel_for_a_two_node_job(tmp_path: Path) -> None:
    h = make_cluster(
        tmp_path / "c2",
        members=1,
        agents=2,
        env={"LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(tmp_path / "checkpoints")},
    )
    try:
        victims = [submit_app(h, p, str(LIMIT), "0.05") for p in ("signal", "grpc")]
        for v in victims:
            h.wait_state(v["id"], "Running", timeout=60)
            wait_line(h, v["id"], "count 10")
        watches = [Watch(h, v["id"]) for v in victims]
        boss = h.submit("echo urgent done", preemption_class=8, nodes=2)
        b = h.wait_state(boss["id"], "Completed", timeout=120)
        hints, records = [], []
        for v, w in zip(victims, watches, strict=True):
            h.wait_state(v["id"], "Completed", timeout=180)
            assert w.states()[:3] == ["Running", "Checkpointing", "Suspended"], w.states()
            hints.append(w.first("Checkpointing")["checkpoint_hint_at"])
            records.append(w.first("Suspended")["last_checkpoint"])
            out = logs(h, v["id"])
            saved = int((Path(records[-1]["path"]) / "counter").read_text())
            assert f"resumed from {saved}" in out, out
        # both were asked at once (one preemption decision) and the two-node job started
        # only once both had released their nodes
        assert abs(hints[0] - hints[1]) < 2.0, hints
        assert b["started_at"] >= max(r["at"] for r in records), (b, records)
    finally:
        h.cluster.stop()
