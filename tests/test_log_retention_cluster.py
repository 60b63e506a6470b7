"""Log retention on a real dev cluster (lattice-server + agents as processes, the
file-system log store): a job's logs reach the store, the leader's sweeper deletes them
once the job ended longer ago than ``storage.log_retention_days`` (a few seconds here),
and ``lattice logs`` then says the retention removed them instead of answering nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

RETENTION_SECONDS = 4.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = {
        "LATTICE_STORAGE__LOG_FLUSH_INTERVAL_SECONDS": "0.5",
        "LATTICE_STORAGE__LOG_RETENTION_DAYS": repr(RETENTION_SECONDS / 86400),
        "LATTICE_STORAGE__LOG_RETENTION_INTERVAL_SECONDS": "1",
    }
    h = make_cluster(tmp_path_factory.mktemp("retention"), members=1, agents=1, env=env)
    yield h
    h.cluster.stop()


def store_files(cluster: ClusterHandle, alloc_id: str) -> list[Path]:
    root = Path(cluster.cluster.base).resolve() / "log-store"
    return [p for p in root.rglob("*") if p.is_file() and alloc_id in p.parts]


def test_logs_are_removed_after_the_retention_and_logs_says_why(cluster: ClusterHandle) -> None:
    a = cluster.submit("echo kept for a while; echo bye >&2")
    done = cluster.wait_state(a["id"], ("Completed", "Failed"), timeout=30)
    assert done["state"] == "Completed", done
    # right after the end: in the store, and served
    cli = cluster.cli("logs", a["id"], "--no-timestamps")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == ["kept for a while"]

    deadline = time.monotonic() + 60
    while store_files(cluster, a["id"]):
        assert time.monotonic() < deadline, "the sweeper never removed the logs"
        time.sleep(0.5)
    assert time.time() - float(done["finished_at"]) >= RETENTION_SECONDS

    cli = cluster.cli("logs", a["id"], "--no-timestamps")
    assert cli.returncode != 0
    assert "removed by the retention policy" in cli.stderr, cli.stderr
    assert "storage.log_retention_days" in cli.stderr
    assert cli.stdout == ""
    # a job that is still running is never touched, however old its first output
    r = cluster.submit("echo still here; sleep 60")
    cluster.wait_state(r["id"], "Running", timeout=20)
    deadline = time.monotonic() + 30
    while not store_files(cluster, r["id"]):
        assert time.monotonic() < deadline, "the running job's logs never reached the store"
        time.sleep(0.3)
    time.sleep(RETENTION_SECONDS + 2.5)
    assert store_files(cluster, r["id"])
    cluster.cancel(r["id"])
