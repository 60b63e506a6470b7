"""A service with an HTTP liveness probe on a real local cluster (2 agents): it is
registered in the service registry while it runs (``lattice services`` shows it); when
its health endpoint starts answering 500 the agent stops it after failure_threshold
probes, it ends Failed with ``liveness_probe_failed``, is requeued per its policy
(always, max_requeue 1), runs again with its registry entry following it, and after the
second failure stays Failed with no entry left."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_cli.devcluster import free_port as _free_port
from lattice_test_harness.cluster import ApiError, ClusterHandle
from lattice_test_harness.plugin import make_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

SERVER = """
import http.server, os, sys
port, marker = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 500 if os.path.exists(marker) else 200
        self.send_response(code); self.end_headers(); self.wfile.write(b"x")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("probes"), members=1, agents=2)
    yield h
    h.cluster.stop()


def _endpoints(cluster: ClusterHandle, name: str) -> list[dict]:  # type: ignore[type-arg]
    try:
        return list(cluster.request("GET", f"/api/v1/services/{name}")["endpoints"])
    except ApiError as e:
        if e.status == 404:
            return []
        raise


def test_failing_liveness_probe_fails_requeues_and_moves_the_registry_entry(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    port, name = _free_port(), f"web-{uuid.uuid4().hex[:6]}"
    marker = tmp_path / "unhealthy"
    script = tmp_path / "serve.py"
    script.write_text(SERVER)
    a = cluster.submit(
        f"{sys.executable} {script} {port} {marker}",
        lifecycle="unbounded",
        requeue_policy="always",
        max_requeue=1,
        liveness_probe={
            "probe_type": "http",
            "port": port,
            "path": "/healthz",
            "period_secs": 1,
            "initial_delay_secs": 1,
            "failure_threshold": 2,
            "timeout_secs": 1,
        },
        expose=[{"name": name, "port": port, "protocol": "http"}],
    )
    aid = a["id"]
    first = cluster.wait_state(aid, "Running", timeout=30)
    eps = cluster.wait_for("registered", lambda: _endpoints(cluster, name), timeout=10)
    assert [(e["allocation_id"], e["node_id"], e["port"]) for e in eps] == [
        (aid, first["assigned_nodes"][0], port)
    ]
    r = cluster.cli("services", "-o", "json")
    assert r.returncode == 0, r.stderr
    listed = {s["name"]: s for s in json.loads(r.stdout)}
    assert listed[name]["endpoints"][0]["allocation_id"] == aid
    r = cluster.cli("services", name)
    assert r.returncode == 0 and name in r.stdout and f":{port}" in r.stdout

    # healthy for a while: probes pass (past the initial delay), nothing happens
    time.sleep(2.5)
    assert cluster.get(aid)["state"] == "Running"

    marker.touch()  # the endpoint answers 500 from now on
    cluster.wait_for(
        "the first liveness failure to requeue it",
        lambda: cluster.get(aid)["requeue_count"] == 1,
        timeout=30,
        interval=0.02,
    )
    marker.unlink()  # the next run is healthy again
    got = cluster.get(aid)
    if got["state"] == "Pending":  # placing it again clears the reason
        assert got["reason"] == "liveness_probe_failed"
    assert got["requeue_count"] == 1
    second = cluster.wait_state(aid, "Running", timeout=30)
    eps = cluster.wait_for("registered again", lambda: _endpoints(cluster, name), timeout=10)
    assert [(e["allocation_id"], e["node_id"]) for e in eps] == [(aid, second["assigned_nodes"][0])]

    marker.touch()  # fails again: max_requeue reached, it stays Failed
    final = cluster.wait_state(aid, "Failed", timeout=30)
    assert final["reason"] == "liveness_probe_failed" and final["requeue_count"] == 1
    assert _endpoints(cluster, name) == []
    r = cluster.cli("services", "-o", "json")
    assert name not in {s["name"] for s in json.loads(r.stdout)}
