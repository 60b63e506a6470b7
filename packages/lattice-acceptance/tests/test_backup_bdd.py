"""Steps for features/backup.feature: backups of the quorum state through the CLI.

The scenario shares the module's real local cluster (``lattice_cluster``); the backup
files live in the scenario's working directory, where the CLI runs (`--to` a local
path: the server sends the backup back and the CLI saves and verifies it here).
"""

from __future__ import annotations

import json

import pytest
from lattice_acceptance.world import World, shared_world, show
from lattice_common import backup
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("backup.feature")

ADMIN = "ops"
FILE = "cluster.lattice"
COPY = "damaged.lattice"


world = shared_world(World)  # the scenarios share the module's cluster


@given(parsers.parse("a running Lattice cluster with {count:d} nodes and a completed job"))
def cluster_with_a_job(world: World, count: int) -> None:
    world.check_nodes(count)
    world.submit("backed-up", "echo kept in the backup", directives=("--walltime=5m",))
    world.wait_end("backed-up")


@when("the administrator runs lattice admin backup create --to a local file")
def create(world: World) -> None:
    r = world.cli("admin", "backup", "create", "--to", FILE, user=ADMIN)
    assert r.stdout.startswith("Backup written."), show(r)
    assert "Checksum:    sha256:" in r.stdout, show(r)


@then(
    "the file is written and lattice admin backup verify accepts it, counting 2 nodes and the job"
)
def verify_ok(world: World) -> None:
    assert (world.workdir / FILE).stat().st_size > 0
    r = world.cli("admin", "backup", "verify", FILE, "-o", "json", user=ADMIN)
    info = json.loads(r.stdout)
    assert info["valid"] is True and info["nodes"] == 2, show(r)
    assert info["allocations"] >= 1 and info["raft_index"] > 0 and info["format_version"] == 1
    _report, held = backup.verify((world.workdir / FILE).read_bytes())
    job = held.allocations[world.jobs["backed-up"].id]
    assert job.state.value == "Completed", job
    r = world.cli("admin", "backup", "verify", FILE, user=ADMIN)
    assert r.stdout.startswith("OK: the backup is valid."), show(r)


@then("lattice admin backup restore of the file prints the restart steps with --recover-from")
def restore_steps(world: World) -> None:
    r = world.cli("admin", "backup", "restore", FILE, user=ADMIN)
    assert "--recover-from cluster.lattice --bootstrap" in r.stdout, show(r)


@when("one byte in the middle of a copy of the file is changed")
def damage(world: World) -> None:
    data = bytearray((world.workdir / FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (world.workdir / COPY).write_bytes(bytes(data))


@then(parsers.parse('lattice admin backup verify rejects the copy with "{reason}" and a hint'))
def verify_refused(world: World, reason: str) -> None:
    r = world.cli("admin", "backup", "verify", COPY, user=ADMIN, ok=False)
    assert r.returncode == 1, show(r)
    assert r.stderr.startswith(f"Error: {COPY}: backup file is corrupted: {reason}"), show(r)
    assert "\nHint: " in r.stderr, show(r)


@then("lattice admin backup restore rejects the copy too")
def restore_refused(world: World) -> None:
    r = world.cli("admin", "backup", "restore", COPY, user=ADMIN, ok=False)
    assert r.returncode == 1 and "corrupted" in r.stderr, show(r)
    assert "--recover-from" not in r.stdout, show(r)
