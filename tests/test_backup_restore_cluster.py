"""Backup and restore of a real 3-member quorum with agents, schedulers and work:
``lattice admin backup create`` -> every member stopped and its data dir wiped ->
``lattice-server --recover-from FILE --bootstrap`` on member 1 and the others started
as usual -> every allocation, node, tenant and vCluster is as before (through the API),
the agents carry on (a restored running allocation is cancelled through its agent), and
a one-byte corruption is refused by verify and by restore with the reason."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _server(cl: Any, member: Any, *extra: str) -> subprocess.CompletedProcess[str]:
    """lattice-server in the foreground (for runs that must refuse and exit)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lattice_api.main",
            "--config",
            str(member.dir / "config.yaml"),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=cl.env,
        timeout=120,
    )


def test_create_wipe_restore_gives_back_the_same_cluster(cluster_factory, tmp_path: Path) -> None:
    # generous failure detection: the agents must not be declared dead while the whole
    # quorum is down for the restore
    h = cluster_factory(members=3, agents=2, heartbeat_timeout=60.0, grace_period=120.0)
    cl = h.cluster
    h.request("POST", "/api/v1/tenants", {"name": "bio", "max_nodes": 7})
    h.request(
        "POST",
        "/api/v1/vclusters",
        {"name": "gpu", "tenant": "bio", "scheduler_type": "hpc-backfill"},
    )
    done = h.submit("echo finished")["id"]
    running = h.submit("sleep 600")["id"]
    h.wait_state(done, "Completed", timeout=60)
    run = h.wait_state(running, "Running", timeout=60)
    # the gpu vCluster has no scheduler: this one stays Pending
    waiting = h.submit("true", tenant="bio", vcluster="gpu")["id"]
    busy = run["assigned_nodes"][0]
    idle = next(n["id"] for n in h.nodes() if n["id"] != busy)
    h.request("POST", f"/api/v1/nodes/{idle}/drain", {"reason": "before the backup"})
    h.wait_for("the idle node drained", lambda: h.node(idle)["state"] == "Drained")
    before = h.state_view()
    assert set(before["allocations"]) >= {done, running, waiting}

    backup = tmp_path / "cluster.lattice"
    out = h.cli("admin", "backup", "create", "--to", str(backup), "-o", "json", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Taking a backup" in out.stderr and backup.exists()
    out = h.cli("admin", "backup", "verify", str(backup))
    assert out.returncode == 0, out.stderr
    assert "OK: the backup is valid" in out.stdout and "2 tenants" in out.stdout

    damaged = tmp_path / "damaged.lattice"
    data = bytearray(backup.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    out = h.cli("admin", "backup", "verify", str(damaged))
    assert out.returncode == 1 and "corrupted: checksum mismatch" in out.stderr, out.stderr
    out = h.cli("admin", "backup", "restore", str(damaged))
    assert out.returncode == 1 and "corrupted" in out.stderr

    out = h.cli("admin", "backup", "restore", str(backup))
    assert out.returncode == 0, out.stderr
    assert "--recover-from" in out.stdout and "--bootstrap" in out.stdout

    # every member down
    for m in cl.members:
        cl.stop_member(m, signal.SIGTERM)
    m1 = cl.members[0]
    # a data dir that holds state is not overwritten without --force
    refused = _server(cl, m1, "--recover-from", str(backup), "--bootstrap")
    assert refused.returncode == 1 and "already holds Raft state" in refused.stderr
    for m in cl.members:
        shutil.rmtree(m.dir / "raft")
    # a damaged file is refused before anything starts
    refused = _server(cl, m1, "--recover-from", str(damaged), "--bootstrap")
    assert refused.returncode == 1 and "corrupted: checksum mismatch" in refused.stderr
    assert not (m1.dir / "raft" / "cluster.json").exists()

    # restore: member 1 from the file, the others join as usual
    cl.start_member(m1, recover_from=backup)  # --bootstrap: its data dir is empty
    for m in cl.members[1:]:
        cl.start_member(m)
    cl.leader(timeout=60)
    # member 1 serves only once the restore is committed
    h.wait_for(
        "member 1 serving the restored state",
        lambda: cl._get(m1.rest_url + "/healthz", quiet=True),
        timeout=120,
    )
    after = h.state_view()
    assert h.state_differences(before, after) == []

    # every member holds it, not only the one that restored it
    for m in cl.members:
        got = h.wait_for(
            f"member {m.id} caught up",
            lambda m=m: (
                h.request("GET", "/api/v1/tenants/bio", url=m.rest_url).get("max_nodes") == 7
            ),
            timeout=60,
        )
        assert got

    # the restored cluster works: agents report again and act on the restored state
    h.wait_for(
        "the agents heartbeat to the restored quorum",
        # (what an agent reports with its heartbeats, which the leader keeps in memory)
        lambda: all(n.get("telemetry") for n in h.nodes()),
        timeout=60,
    )
    h.cancel(running)
    h.wait_state(running, "Cancelled", timeout=60)
    fresh = h.submit("echo after the restore")["id"]
    assert fresh not in before["allocations"]
    h.request("POST", f"/api/v1/nodes/{idle}/undrain", {})
    h.wait_state(fresh, "Completed", timeout=60)
    # the restored audit log goes on: the backup's entries, then the undrain, verified
    entries = h.request("GET", "/api/v1/admin/audit?limit=1000")["entries"]
    assert any(e["action"] == "node.drain" and e["target"] == f"node:{idle}" for e in entries)
    h.wait_for(
        "the undrain in the restored audit log",
        lambda: any(
            e["action"] == "node.undrain"
            for e in h.request("GET", "/api/v1/admin/audit?limit=1000")["entries"]
        ),
        timeout=30,
    )
    verdict = h.request("POST", "/api/v1/admin/audit/verify", {})
    assert verdict["valid"], verdict
