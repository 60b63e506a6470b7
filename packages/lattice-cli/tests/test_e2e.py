"""The real ``lattice`` command and the SDK against a real local cluster.

Uses the ``lattice_cluster`` fixture of lattice-test-harness (lattice-server, a scheduler
and two agents as processes on loopback). Slower than the other CLI tests, so marked
``cluster``.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.cluster


def _json(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _wait_terminal(cluster, alloc_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alloc = _json(cluster.cli("status", alloc_id, "-o", "json"))
        if alloc["state"] in ("Completed", "Failed", "Cancelled"):
            return alloc
        time.sleep(0.2)
    raise AssertionError(f"{alloc_id} did not finish (last: {alloc['state']})")


def test_submit_script_status_logs(lattice_cluster, tmp_path):
    script = tmp_path / "hello.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=hello-e2e\n"
        "#SBATCH --time=00:05:00\n"
        "#SBATCH --mail-type=END\n"
        'echo "hello from $1"\n'
        "echo oops >&2\n"
    )
    proc = lattice_cluster.cli("submit", str(script), "--", "lattice", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Submitted allocation ")
    assert "--mail-type" in proc.stderr  # unknown #SBATCH directive: a warning
    alloc_id = proc.stdout.split()[-1]

    alloc = _wait_terminal(lattice_cluster, alloc_id)
    assert alloc["state"] == "Completed", alloc
    assert alloc["spec"]["name"] == "hello-e2e"
    assert alloc["spec"]["walltime_seconds"] == 300
    assert alloc["spec"]["submit_dir"] == str(tmp_path)

    table = lattice_cluster.cli("status", "--all")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert any(line.startswith(alloc_id) for line in table.stdout.splitlines())

    detail = lattice_cluster.cli("status", alloc_id)
    assert "Exit code:" in detail.stdout and "hello-e2e" in detail.stdout

    def logs_ready():
        out = lattice_cluster.cli("logs", alloc_id, "--no-timestamps")
        return out if "hello from lattice" in out.stdout else None

    out = lattice_cluster.wait_for("logs", logs_ready, timeout=20, interval=0.3)
    assert out.stdout.strip().splitlines() == ["hello from lattice"]
    assert "oops" in out.stderr


def test_cancel_and_errors(lattice_cluster):
    proc = lattice_cluster.cli("submit", "-t", "10m", "-J", "sleeper", "--", "sleep", "300")
    assert proc.returncode == 0, proc.stderr
    alloc_id = proc.stdout.split()[-1]
    cancel = lattice_cluster.cli("cancel", alloc_id)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"Cancelled allocation {alloc_id}"
    assert _wait_terminal(lattice_cluster, alloc_id)["state"] == "Cancelled"

    missing = lattice_cluster.cli("status", "does-not-exist")
    assert missing.returncode == 1
    assert missing.stderr.startswith("Error: allocation does-not-exist not found")
    assert "Hint:" in missing.stderr

    no_walltime = lattice_cluster.cli("submit", "--", "true")
    assert no_walltime.returncode == 1
    assert "walltime" in no_walltime.stderr and "Traceback" not in no_walltime.stderr


def test_nodes_and_raft(lattice_cluster):
    nodes = lattice_cluster.cli("nodes")
    assert nodes.returncode == 0, nodes.stderr
    lines = nodes.stdout.splitlines()
    assert lines[0].split() == [
        "NODE",
        "STATE",
        "GPUS",
        "VCLUSTER",
        "TENANT",
        "GROUP",
        "CONFORMANCE",
    ]
    assert len(lines) >= 3  # two agents
    raft = _json(lattice_cluster.cli("admin", "raft", "status", "-o", "json"))
    assert raft["leader_address"] and raft["members"]
    text = lattice_cluster.cli("admin", "raft", "status")
    assert text.returncode == 0 and "Commit index" in text.stdout


@pytest.mark.parametrize("transport", ["aiohttp", "asyncio"])
async def test_sdk_watch_and_logs_on_real_server(lattice_cluster, transport):
    from lattice_sdk import AllocationSpec, LatticeClient, LatticeNotFoundError

    client = LatticeClient.from_url(lattice_cluster.url, transport=transport, user="tester")
    async with client:
        alloc = await client.submit(
            AllocationSpec(
                entrypoint="echo sdk-says-hi",
                walltime="5m",
                tenant=lattice_cluster.cluster.tenant,
                vcluster=lattice_cluster.cluster.vclusters[0],
                name="sdk-e2e",
            )
        )
        states = [event.state async for event in client.watch(alloc.id)]
        assert states[-1] == "Completed", states
        lines = [line.message for line in await client.logs(alloc.id)]
        assert "sdk-says-hi" in lines
        with pytest.raises(LatticeNotFoundError):
            await client.status("nope")
        assert (await client.health())["status"] == "ok"
