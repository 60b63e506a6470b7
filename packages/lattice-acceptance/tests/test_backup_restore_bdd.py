"""Steps for features/backup_restore.feature: the leader's scheduled snapshots and a
restore of the quorum from a backup file into a wiped data directory.

The module's own real local cluster: one quorum member and one agent, a scheduled
snapshot every second into the cluster's ``snapshots`` directory, two kept. The agent's
failure detection is generous: its node must not be declared dead while the quorum is
down for the restore. The restore scenario goes last: its cluster is the restored one."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_acceptance.world import World, module_world, show
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

scenarios("backup_restore.feature")

ADMIN = "ops"
FILE = "before-the-disaster.lattice"
KEEP = 2


@pytest.fixture(scope="module")
def snapshot_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("backups")
    env = {
        "LATTICE_BACKUP__SCHEDULE_INTERVAL_SECONDS": "1",
        "LATTICE_BACKUP__RETENTION_COUNT": str(KEEP),
        "LATTICE_BACKUP__DESTINATION": str(base / "snapshots"),
    }
    h = make_cluster(
        base / "cluster",
        members=1,
        agents=1,
        env=env,
        heartbeat_timeout=60.0,
        grace_period=120.0,
    )
    yield h
    h.cluster.stop()


world = module_world("snapshot_cluster")  # the scenarios share the module's cluster


def _snapshots(world: World) -> Path:
    return Path(world.cluster.cluster.env["LATTICE_BACKUP__DESTINATION"])


@given(
    parsers.parse(
        "a running Lattice cluster of one quorum member and {count:d} node that takes a "
        "snapshot every second and keeps {keep:d}"
    )
)
def running_cluster(world: World, count: int, keep: int) -> None:
    assert keep == KEEP
    world.check_nodes(count)


# --- scheduled snapshots -------------------------------------------------------------


@when(parsers.parse("the leader has taken at least {n:d} scheduled snapshots"))
def snapshots_taken(world: World, n: int) -> None:
    world.cluster.wait_for(
        f"{n} scheduled snapshots",
        lambda: world.server_metric("lattice_backup_snapshot_pause_seconds_count") >= n,
        timeout=30,
    )


@then(
    parsers.parse(
        "the snapshot directory never holds more than {keep:d} timestamped snapshots, "
        "besides snap-latest.bin"
    )
)
def pruned(world: World, keep: int) -> None:
    seen = set()
    deadline = time.monotonic() + 3.0  # three more snapshots while it looks
    while time.monotonic() < deadline:
        names = sorted(p.name for p in _snapshots(world).iterdir() if not p.name.startswith("."))
        stamped = [x for x in names if x.startswith("snap-") and x != "snap-latest.bin"]
        assert "snap-latest.bin" in names, names
        assert len(stamped) <= keep, names
        seen.update(stamped)
        time.sleep(0.1)
    assert len(seen) > keep, f"no snapshot was written and pruned while looking: {seen}"


@then("no scheduled snapshot failed")
def no_failures(world: World) -> None:
    assert world.server_metric("lattice_backup_failures_total") == 0
    assert world.server_metric("lattice_backup_last_success_timestamp_seconds") > time.time() - 10


@then('"lattice admin backup verify" without a file accepts the latest scheduled snapshot')
def latest_verifies(world: World) -> None:
    r = world.cli("admin", "backup", "verify", user=ADMIN)
    assert r.stdout.startswith("OK: the backup is valid."), show(r)
    info = json.loads(world.cli("admin", "backup", "verify", "-o", "json", user=ADMIN).stdout)
    assert info["valid"] is True and info["nodes"] == 1, info
    assert info["path"].endswith("snap-latest.bin"), info


# --- restore -------------------------------------------------------------------------


@given(parsers.parse('a tenant "{tenant}" with a vCluster "{vcluster}" that no scheduler serves'))
def tenant_and_vcluster(world: World, tenant: str, vcluster: str) -> None:
    world.cli("admin", "tenant", "create", "--name", tenant, "--max-nodes", "7", user=ADMIN)
    world.cli(
        "admin", "vcluster", "create", "--name", vcluster, "--tenant", tenant, user=ADMIN
    )  # fmt: skip


@given(parsers.parse('a completed job and a job of "{tenant}" waiting in "{vcluster}"'))
def jobs(world: World, tenant: str, vcluster: str) -> None:
    world.submit("done-before", "echo kept", directives=("--walltime=5m",))
    world.wait_end("done-before")
    world.submit(
        "waiting", directives=("--walltime=5m", f"--tenant={tenant}", f"--vcluster={vcluster}")
    )
    assert world.get("waiting")["state"] == "Pending"


@when("the administrator backs the cluster up with lattice admin backup create --to a local file")
def backup_create(world: World) -> None:
    world.state_before = world.cluster.state_view()
    r = world.cli("admin", "backup", "create", "--to", FILE, user=ADMIN)
    assert r.stdout.startswith("Backup written."), show(r)


@when("the quorum member is stopped and its Raft data directory wiped")
def wipe(world: World) -> None:
    cl = world.cluster.cluster
    member = cl.members[0]
    cl.stop_member(member, signal.SIGTERM)
    shutil.rmtree(member.dir / "raft")


@when("lattice-server is started with --recover-from the backup file")
def recover(world: World) -> None:
    cl = world.cluster.cluster
    cl.start_member(cl.members[0], recover_from=world.workdir / FILE)
    cl.leader(timeout=60)
    world.cluster.wait_for(
        "the restored member serving",
        lambda: world.cluster.get(world.jobs["done-before"].id),
        timeout=60,
    )


@then("every allocation, node, tenant and vCluster is as it was when the backup was taken")
def as_before(world: World) -> None:
    before = world.state_before
    after = world.cluster.state_view()
    assert set(before["allocations"]) >= {j.id for j in world.jobs.values()}
    assert world.cluster.state_differences(before, after) == []
    r = world.cli("status", world.jobs["done-before"].id)
    assert "Completed" in r.stdout, show(r)


@then("a job submitted after the restore runs to completion")
def runs_after(world: World) -> None:
    world.cluster.wait_for(
        "the agent reporting to the restored quorum",
        lambda: all(n.get("telemetry") for n in world.cluster.nodes()),
        timeout=60,
    )
    job = world.submit("after-the-restore", "echo still working", directives=("--walltime=5m",))
    world.wait_end("after-the-restore")
    assert "still working" in world.cli("logs", job.id).stdout
