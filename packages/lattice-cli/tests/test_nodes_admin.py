"""``lattice nodes``, ``lattice node ...`` and ``lattice admin ...`` against the real REST
API (over a LocalQuorum, in a thread: the ``api`` fixture): the tables and messages users
see, and the requests the commands send."""

from __future__ import annotations

import json

from lattice_cli.main import app, load_commands
from typer.testing import CliRunner

load_commands()  # main() registers only the command it runs; these tests call `app` directly


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def test_nodes_and_node_actions(api):
    node = "x1000c0s0b0n0"
    api.names(["physics"], ["hpc-batch"])
    caps = {"gpu_type": "GH200", "gpu_count": 4}
    api.nodes(node, capabilities=caps, group=3, conformance_group="a1b2c3")
    api.running([node], tenant="physics", vcluster="hpc-batch")  # owns it: drain waits
    table = run("nodes").stdout.splitlines()
    assert table[0].split() == [
        "NODE",
        "STATE",
        "GPUS",
        "VCLUSTER",
        "TENANT",
        "GROUP",
        "CONFORMANCE",
    ]
    assert table[1].split() == [
        "x1000c0s0b0n0",
        "Ready",
        "4×GH200",
        "hpc-batch",
        "physics",
        "3",
        "a1b2c3",
    ]
    run("nodes", "--state", "ready")
    assert api.last()["query"] == {"state": "ready"}
    assert "4×GH200" in run("nodes", "x1000c0s0b0n0").stdout
    drained = run("node", "drain", "x1000c0s0b0n0", "--reason", "maintenance")
    assert drained.stdout.strip() == "Node x1000c0s0b0n0 is now Draining"
    assert api.last()["json"] == {"reason": "maintenance"}
    refused = run("node", "disable", "x1000c0s0b0n0", input="n\n")
    assert refused.exit_code == 1
    assert api.last()["path"].endswith("/drain")
    assert run("node", "disable", "x1000c0s0b0n0", "--yes").exit_code == 0
    assert api.quorum.state.nodes[node].disabled is True
    assert run("node", "undrain", "nope").exit_code == 1


def test_admin_commands(api):
    created = run("admin", "tenant", "create", "--name", "physics", "--max-nodes", "200")
    assert created.exit_code == 0 and "Created tenant physics" in created.stdout
    assert api.last("POST")["json"] == {"name": "physics", "max_nodes": 200}
    run("admin", "tenant", "update", "physics", "--max-nodes", "250", "--fair-share-target", "0.3")
    assert api.last("PATCH")["json"] == {"max_nodes": 250, "fair_share_target": 0.3}
    run("admin", "tenant", "set-quota", "--name", "physics", "--max-concurrent-allocations", "9")
    assert api.last("PATCH")["json"] == {"max_concurrent_allocations": 9}
    assert run("admin", "tenant", "update", "physics").exit_code == 2
    tenants = run("admin", "tenant", "list").stdout.splitlines()
    assert tenants[1].split()[:3] == ["physics", "250", "9"]
    dup = run("admin", "tenant", "create", "--name", "physics")
    assert dup.exit_code == 1 and "already exists" in dup.stderr

    vc = run(
        "admin",
        "vcluster",
        "create",
        "--name",
        "hpc-batch",
        "--scheduler",
        "hpc-backfill",
        "--tenant",
        "physics",
    )
    assert vc.exit_code == 0
    assert api.last("POST")["json"] == {
        "name": "hpc-batch",
        "scheduler_type": "hpc-backfill",
        "tenant": "physics",
    }
    assert run("admin", "vcluster", "create", "--name", "x", "--scheduler", "magic").exit_code == 2
    assert run("admin", "vcluster", "list").stdout.splitlines()[1].split()[:3] == [
        "hpc-batch",
        "hpc-backfill",
        "physics",
    ]
    run(
        "admin",
        "vcluster",
        "set-weights",
        "--name",
        "hpc-batch",
        "--weight",
        "priority=0.3",
        "--weight",
        "energy=0.1",
    )
    assert api.last("PATCH")["json"] == {"weights": {"priority": 0.3, "energy": 0.1}}
    assert (
        run(
            "admin", "vcluster", "set-weights", "--name", "hpc-batch", "--weight", "luck=1"
        ).exit_code
        == 2
    )

    raft = run("admin", "raft", "status")
    assert raft.exit_code == 0 and "Commit index" in raft.stdout
    raft_json = json.loads(run("admin", "raft", "status", "-o", "json").stdout)
    assert raft_json["term"] == api.quorum.status()["term"]
