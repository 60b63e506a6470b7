"""A real dev cluster whose secrets are references: the agent token in a real OpenBao
(vault://, AppRole, KV v2), the fabric manager token in a file (file://). The cluster
runs a few operations (jobs that print their environment, logs, a live log stream, node
listing), the token is rotated in OpenBao while it runs, and then no file the cluster
wrote (process logs, job output, state, the Raft journal) holds a secret value."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lattice_test_harness.plugin import make_cluster

pytestmark = pytest.mark.cluster

AGENT_TOKEN_V1 = "agent-token-v1-5e1c7d0a93b24f6e"
AGENT_TOKEN_V2 = "agent-token-v2-b8d2e4f6a1c3957d"
FABRIC_TOKEN = "fabric-token-0c4e8a2f6b1d3957"


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def test_secret_values_never_reach_logs(openbao: Any, tmp_path: Path) -> None:
    openbao.put("lattice/agent", token=AGENT_TOKEN_V1)
    secret_id = openbao.secret_id()
    fabric = tmp_path / "fabric-token"
    fabric.write_text(FABRIC_TOKEN + "\n")
    fabric.chmod(0o600)
    env = {
        "LATTICE_AGENT_TOKEN": "vault://secret/lattice/agent#token",
        "LATTICE_FABRIC_MANAGER_TOKEN": f"file://{fabric}",
        "LATTICE_SECRETS__VAULT_ADDRESS": openbao.address,
        "LATTICE_SECRETS__VAULT_ROLE_ID": openbao.role_id,
        "LATTICE_SECRETS__REFRESH_INTERVAL_SECONDS": "0.5",
        "VAULT_SECRET_ID": secret_id,
        "LATTICE_LOG_LEVEL": "debug",
    }
    base = tmp_path / "cluster"
    h = make_cluster(base, members=1, agents=2, env=env)
    try:
        # agents and the scheduler authenticated with the token from OpenBao
        assert len(h.nodes()) == 2
        a = h.submit("env; echo done-$LATTICE_JOB_ID", nodes=1)
        done = h.wait_state(a["id"], ("Completed", "Failed"), timeout=60)
        assert done["state"] == "Completed"
        lines = h.logs(a["id"])
        assert any(ln.startswith("done-") for ln in lines)
        # a live log stream through the API and the agent (the API's agent channel)
        b = h.submit("for i in 1 2 3; do echo tick $i; sleep 0.2; done", nodes=1)
        h.wait_state(b["id"], ("Running", "Completed"), timeout=60)
        req = urllib.request.Request(
            f"{h.url}/api/v1/allocations/{b['id']}/logs/stream",
            headers={"x-lattice-user": h.user},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            streamed = [json.loads(x)["line"] for x in r.read().splitlines() if x.strip()]
        assert "tick 3" in streamed
        # rotation in OpenBao while the cluster runs: the server picks it up
        openbao.put("lattice/agent", token=AGENT_TOKEN_V2)
        server_log = h.cluster.log_path("member-1")
        h.wait_for(
            "the rotation in the server log",
            lambda: "api.agent_token rotated" in server_log.read_text(errors="replace"),
            timeout=20,
        )
        # the cluster keeps working with the agents' start-time token
        c = h.submit("echo after-rotation", nodes=1)
        assert h.wait_state(c["id"], ("Completed", "Failed"), timeout=60)["state"] == "Completed"
        assert "after-rotation" in h.logs(c["id"])
        time.sleep(1.0)  # one more refresh round into the logs
        with urllib.request.urlopen(f"{h.url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "lattice_api_requests_total" in metrics
        for s in (AGENT_TOKEN_V1, AGENT_TOKEN_V2, FABRIC_TOKEN, secret_id):
            assert s not in metrics
    finally:
        h.cluster.stop()
    secrets = [AGENT_TOKEN_V1, AGENT_TOKEN_V2, FABRIC_TOKEN, secret_id]
    files = _files(base)
    logs = [p for p in files if p.suffix == ".log" or "logs" in p.parts]
    assert any(p.parent == base / "logs" for p in logs) and len(logs) >= 4
    leaks = []
    for p in files:
        data = p.read_bytes()
        leaks += [f"{p.relative_to(base)}: {s[:6]}..." for s in secrets if s.encode() in data]
    assert leaks == []
    # the references themselves are fine to log, and the job saw none of the secrets
    assert "VAULT_SECRET_ID" not in "\n".join(lines)
