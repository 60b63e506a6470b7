"""Checkpoints in an S3 bucket, end to end on a real one-node dev cluster whose
``checkpoint_root`` is ``s3://BUCKET/PREFIX`` on a real S3-compatible server (moto's
server mode as a process of its own):

* a signal-protocol application is suspended: it writes its checkpoint on the node, the
  agent uploads it, the record names the object's ``s3://`` path (and the objects are
  there), the staged copy is gone; resumed, it is downloaded again and the application
  continues from its saved counter;
* the S3 server is stopped: the checkpoint broker reports
  ``lattice_checkpoint_storage_unavailable 1``, and a suspend now stops the application
  without asking it for a checkpoint: the allocation ends Failed with the reason and
  ``lattice_preemption_failed_checkpoint_total`` counts it. With the server back the
  gauge returns to 0."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_checkpoint.storage import AllocationKey, open_checkpoint_store
from lattice_common.config import StorageConfig
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, MotoS3Process

pytestmark = pytest.mark.timeout(150)

APP = Path(__file__).parent.parent / "packages/lattice-node-agent/tests/apps/ckpt_signal.py"
BUCKET = "lattice-ckpt"
ROOT = f"s3://{BUCKET}/site-a"
LIMIT = 120  # the application counts to this, 0.05 s a step, then finishes


class S3Cluster:
    def __init__(self, h: ClusterHandle, s3: MotoS3Process) -> None:
        self.h = h
        self.s3 = s3

    def storage(self) -> StorageConfig:
        return StorageConfig(
            s3_endpoint=self.s3.endpoint,
            s3_access_key_id=ACCESS_KEY_ID,  # type: ignore[arg-type]
            s3_secret_access_key=SECRET_ACCESS_KEY,  # type: ignore[arg-type]
        )

    def stored(self, key: AllocationKey, checkpoint_id: str) -> dict[str, bytes]:
        """The checkpoint's files as the bucket holds them."""

        async def read() -> dict[str, bytes]:
            store = open_checkpoint_store(ROOT, self.storage())
            try:
                dest = self.h.cluster.base / "downloaded" / key.alloc
                await store.download(key, checkpoint_id, dest)
                return {p.name: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
            finally:
                await store.close()

        return asyncio.run(read())


@pytest.fixture(scope="module")
def s3c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Cluster]:
    base = tmp_path_factory.mktemp("ckpt-s3")
    s3 = MotoS3Process().start()
    s3.create_bucket(BUCKET)
    try:
        h = make_cluster(
            base,
            members=1,
            agents=1,
            checkpoint_broker=True,
            env={
                "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": ROOT,
                "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "10",
                "LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS": "1",
                "LATTICE_STORAGE__S3_ENDPOINT": s3.endpoint,
                "LATTICE_STORAGE__S3_ACCESS_KEY_ID": ACCESS_KEY_ID,
                "LATTICE_STORAGE__S3_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            },
        )
    except BaseException:
        s3.stop()
        raise
    h.cluster.stop_broker()  # started by the outage test, with the server down
    yield S3Cluster(h, s3)
    h.cluster.stop()
    s3.stop()


def metric(url: str, name: str, h: ClusterHandle | None = None) -> float | None:
    headers: dict[str, str] = {}
    context = None
    if h is not None:
        auth, context = h.cluster.auth_for(url)
        headers = {"x-lattice-user": h.user, **auth}
    try:
        req = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def failed_checkpoints(h: ClusterHandle) -> float:
    return metric(h.url + "/metrics", "lattice_preemption_failed_checkpoint_total", h) or 0.0


def broker_gauge(h: ClusterHandle) -> float | None:
    url = f"http://127.0.0.1:{h.cluster.broker_metrics_port}/metrics"
    return metric(url, "lattice_checkpoint_storage_unavailable")


def running_app(h: ClusterHandle, *args: str) -> dict[str, Any]:
    entry = f"{sys.executable} {APP} {' '.join(args)}"
    a = h.submit(entry, checkpoint="signal", project="climate", preemption_class=3)
    h.wait_state(a["id"], "Running", timeout=60)
    h.wait_for("it counts", lambda: "count 5" in h.logs(a["id"]), timeout=30, interval=0.2)
    return a


def test_suspend_uploads_the_checkpoint_and_resume_downloads_it(s3c: S3Cluster) -> None:
    h = s3c.h
    job = running_app(h, str(LIMIT), "0.05")
    aid = job["id"]
    out = h.cli("suspend", aid)
    assert out.returncode == 0, out.stderr
    a = h.wait_state(aid, "Suspended", timeout=60)
    ck = a["last_checkpoint"]
    key = AllocationKey(h.cluster.tenant, "climate", aid)
    assert ck["path"] == f"{ROOT}/{h.cluster.tenant}/climate/{aid}/checkpoints/ckpt-1/", ck
    files = s3c.stored(key, "ckpt-1")
    saved = int(files["counter"])
    assert saved >= 5 and "CHECKPOINT_DONE" in files
    assert ck["size_bytes"] == sum(len(v) for v in files.values())
    # what the application wrote on the node was uploaded, not kept there
    staging = h.cluster.agents[0].dir / "work" / ".checkpoint-staging"
    assert not (staging / h.cluster.tenant / "climate" / aid / "checkpoints" / "ckpt-1").exists()
    out = h.cli("resume", aid)
    assert out.returncode == 0, out.stderr
    done = h.wait_state(aid, ("Completed", "Failed"), timeout=90)
    assert done["state"] == "Completed", done
    lines = h.logs(aid)
    assert f"resumed from {saved}" in lines, lines  # downloaded before it started
    assert f"count {saved + 1}" in lines[lines.index(f"resumed from {saved}") :]
    assert lines[-1] == f"finished at {LIMIT}", lines[-5:]


def test_storage_outage_fails_the_suspend_and_the_broker_says_so(s3c: S3Cluster) -> None:
    h = s3c.h
    job = running_app(h, "1000000", "0.05")
    aid = job["id"]
    before = failed_checkpoints(h)
    s3c.s3.stop()
    h.cluster.start_broker()
    try:
        h.wait_for("the gauge at 1", lambda: broker_gauge(h) == 1.0, timeout=40, interval=0.5)
        out = h.cli("suspend", aid)
        assert out.returncode == 0, out.stderr
        seen = h.states_seen(aid, timeout=60)
        assert seen[-1] == "Failed" and "Suspended" not in seen, seen
        a = h.get(aid)
        assert a["reason"].startswith("checkpoint storage unavailable: "), a["reason"]
        assert a.get("last_checkpoint") is None, a
        # never asked: the application did not write a checkpoint
        assert not any(ln.startswith("checkpointed at") for ln in h.logs(aid))
        assert failed_checkpoints(h) == before + 1
        # the server back (empty: moto keeps nothing), the bucket made again: recovered
        s3c.s3.start()
        s3c.s3.create_bucket(BUCKET)
        h.wait_for("the gauge at 0", lambda: broker_gauge(h) == 0.0, timeout=30, interval=0.5)
    finally:
        h.cluster.stop_broker()
