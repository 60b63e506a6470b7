"""Logs survive their node: a real dev cluster whose agents flush allocation output into
an S3 log store (moto's real HTTP server, credentials as env:// secret references).

* a job prints N lines and ends; its agent is killed with SIGKILL and not restarted,
  its log files removed: ``GET /api/v1/allocations/{id}/logs`` still returns every line,
  from the store, in the layout of the specification;
* ``lattice logs --follow`` on a running job shows each new line within a second.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from lattice_common.logstore import S3LogStore
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

N = 300


@pytest.fixture(scope="module")
def bucket(s3_server: Any) -> str:
    name = f"logs-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, s3_server: Any, bucket: str
) -> Iterator[ClusterHandle]:
    env = {
        **s3_server.env(bucket),
        # the credentials as secret references, resolved by every process at start
        "LATTICE_STORAGE__S3_ACCESS_KEY_ID": "env://LOGSTORE_TEST_KEY_ID",
        "LATTICE_STORAGE__S3_SECRET_ACCESS_KEY": "env://LOGSTORE_TEST_SECRET",
        "LOGSTORE_TEST_KEY_ID": ACCESS_KEY_ID,
        "LOGSTORE_TEST_SECRET": SECRET_ACCESS_KEY,
        "LATTICE_STORAGE__LOG_FLUSH_INTERVAL_SECONDS": "0.5",
    }
    h = make_cluster(tmp_path_factory.mktemp("logstore"), members=1, agents=2, env=env)
    yield h
    h.cluster.stop()


def stored_keys(s3_server: Any, bucket: str, prefix: str) -> list[str]:
    async def run() -> list[str]:
        store = S3LogStore(
            bucket=bucket,
            endpoint_url=s3_server.endpoint,
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
        )
        try:
            return await store.list(prefix)
        finally:
            await store.close()

    return asyncio.run(run())


def test_logs_outlive_the_agent_and_its_files(
    cluster: ClusterHandle, s3_server: Any, bucket: str
) -> None:
    t0 = time.monotonic()
    a = cluster.submit(
        f"for i in $(seq 1 {N}); do echo line $i; done; echo done >&2", project="survey"
    )
    done = cluster.wait_state(a["id"], ("Completed", "Failed"), timeout=30)
    assert done["state"] == "Completed", done
    node = done["assigned_nodes"][0]
    agent = next(x for x in cluster.cluster.agents if x.node_id == node)
    # the node goes away with everything on it
    cluster.cluster.stop_agent(agent, signal.SIGKILL)
    shutil.rmtree(agent.dir / "logs" / a["id"], ignore_errors=True)

    got = cluster.request("GET", f"/api/v1/allocations/{a['id']}/logs")["lines"]
    out = [ln["line"] for ln in got if ln["stream"] == "stdout"]
    assert out == [f"line {i}" for i in range(1, N + 1)]
    assert [ln["line"] for ln in got if ln["stream"] == "stderr"] == ["done"]
    assert {ln["node_id"] for ln in got} == {node}
    assert all(isinstance(ln["timestamp"], float) and ln["timestamp"] > 0 for ln in got)

    tail = cluster.request("GET", f"/api/v1/allocations/{a['id']}/logs?tail=2&stream=stdout")
    assert [ln["line"] for ln in tail["lines"]] == [f"line {N - 1}", f"line {N}"]
    page = cluster.request("GET", f"/api/v1/allocations/{a['id']}/logs?offset=10&limit=5")
    assert [ln["line"] for ln in page["lines"]] == [f"line {i}" for i in range(11, 16)]
    assert page["truncated"] is True
    mid = got[N // 2]["timestamp"]
    since = cluster.request("GET", f"/api/v1/allocations/{a['id']}/logs?since={mid}")["lines"]
    assert since and all(ln["timestamp"] >= mid for ln in since)
    assert cluster.request("GET", f"/api/v1/allocations/{a['id']}/logs?node=other")["lines"] == []

    # the specification's layout, under the allocation's project
    prefix = f"{cluster.cluster.tenant}/survey/{a['id']}/logs/"
    keys = stored_keys(s3_server, bucket, prefix)
    assert prefix + "metadata.json" in keys
    assert prefix + f"stdout/{node}/chunk_000000.log.zst" in keys
    assert prefix + f"stderr/{node}/chunk_000000.log.zst" in keys

    # the CLI reads the same, with a window
    cli = cluster.cli("logs", a["id"], "--no-timestamps", "--stdout", "--tail", "3")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == [f"line {i}" for i in range(N - 2, N + 1)]
    cli = cluster.cli("logs", a["id"], "--no-timestamps", "--since", "1h", "--tail", "2")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == [f"line {N}"]
    assert cli.stderr.splitlines() == ["done"]
    cli = cluster.cli("logs", a["id"], "--no-timestamps", "--until", "2000-01-01")
    assert cli.returncode == 0 and cli.stdout == "", cli.stderr
    assert time.monotonic() - t0 < 30


def test_follow_shows_new_lines_within_a_second(cluster: ClusterHandle) -> None:
    # a node whose agent an earlier test killed stays schedulable until it is Down: a
    # job placed there never runs, and goes back to the queue once the node is found lost
    for gone in (x for x in cluster.cluster.agents if x.proc is None):
        cluster.wait_for(
            f"{gone.node_id} Down",
            lambda n=gone.node_id: cluster.node(n)["state"] == "Down",
            timeout=60,
        )
    a = cluster.submit("for i in 1 2 3 4; do sleep 0.7; date +%s.%N; done; sleep 60")
    cluster.wait_state(a["id"], "Running", timeout=20)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lattice_cli.main", "logs", a["id"], "--follow", "--no-timestamps"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cluster.cli_env(),
    )
    delays: list[float] = []
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        deadline = time.monotonic() + 20
        while len(delays) < 4 and time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                continue
            chunk = proc.stdout.read() or b""
            now = time.time()
            buf += chunk
            *complete, buf = buf.split(b"\n")
            delays += [now - float(line) for line in complete if line.strip()]
        assert len(delays) == 4, (delays, proc.poll(), proc.stderr and proc.stderr.read())
        # the first line may have been written before the stream opened
        assert all(d < 1.0 for d in delays[1:]), delays
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        cluster.cancel(a["id"])
