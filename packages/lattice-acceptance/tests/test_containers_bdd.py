"""Steps for features/containers.feature: jobs run as their submitting users, in OCI
images from a registry, with private scratch directories.

The module's real local cluster has 2 agents started with `--run-as submitter` and
`node_agent.user_map` tester -> 1000:1000, alice -> 1001:1001 (mallory has no entry
and no account), and max_prologue_retries 2 (one try per node). A real
`docker-registry` on loopback serves busybox images built by the harness. Jobs are
submitted with `lattice submit ... -- sh -c '...'` from a working directory every
user can enter.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.world import TIMEOUT, log_lines, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import TERMINAL, ClusterHandle
from lattice_test_harness.oci_registry import (
    LocalRegistry,
    build_image,
    missing_oci_tools,
    registry_digest,
)
from lattice_test_harness.plugin import make_cluster
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("containers.feature")

USERS = {"tester": 1000, "alice": 1001}


def _searchable(path: Path) -> None:
    """pytest's directories are root-only: let the jobs' users pass through them."""
    for p in [path, *path.parents]:
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o755)


def _open_to_users(path: Path) -> None:
    _searchable(path)
    os.chmod(path, 0o777)


@pytest.fixture(scope="module")
def registry() -> Iterator[LocalRegistry]:
    missing = missing_oci_tools()
    if missing or os.geteuid() != 0:
        pytest.skip("needs root and " + ", ".join(missing or ["root"]))
    with LocalRegistry() as reg:
        build_image(reg, "lattice/tools", "1", {"/etc/motd": "lattice tools\n"})
        yield reg


@pytest.fixture(scope="module")
def users_cluster(
    registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHandle]:
    env = {
        "LATTICE_NODE_AGENT__USER_MAP": json.dumps({u: f"{i}:{i}" for u, i in USERS.items()}),
        "LATTICE_NODE_AGENT__MAX_PROLOGUE_RETRIES": "2",
    }
    base = tmp_path_factory.mktemp("containers-bdd")
    _searchable(base)  # the agents' scratch roots are inside it
    h = make_cluster(
        base,
        members=1,
        agents=2,
        env=env,
        agent_args=("--run-as", "submitter"),
    )
    yield h
    h.cluster.stop()


@dataclass
class World(ClusterWorld):
    registry: LocalRegistry | None = None
    alloc_id: str = ""
    ids: list[str] = field(default_factory=list)

    def submit_command(self, user: str, command: str, *options: str) -> str:
        r = self.cli("submit", "--walltime", "5m", *options, "--", "sh", "-c", command, user=user)
        m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
        assert m, show(r)
        self.alloc_id = m.group(1)
        self.ids.append(self.alloc_id)
        return self.alloc_id

    def end(self, timeout: float = 60.0) -> dict[str, Any]:
        return self.cluster.wait_state(self.alloc_id, TERMINAL, timeout=timeout)

    def output(self) -> list[str]:
        return log_lines(self.cli("logs", self.alloc_id))


@pytest.fixture
def world(users_cluster: ClusterHandle, registry: LocalRegistry, tmp_path: Path) -> Iterator[World]:
    work = tmp_path / "work"
    work.mkdir()
    _open_to_users(work)
    w = World.on(users_cluster, work)
    w.registry = registry
    yield w
    for aid in w.ids:
        if users_cluster.get(aid)["state"] not in TERMINAL:
            users_cluster.cancel(aid)
    w.wait_idle()


# --- given ------------------------------------------------------------------------------


@given(
    "a running Lattice cluster with 2 nodes that runs jobs as their users, and an image registry"
)
def running_cluster(world: World) -> None:
    world.check_nodes(2)


@given(parsers.parse('the registry has the image "{name}"'))
def registry_has(world: World, name: str) -> None:
    assert world.registry is not None
    repo, tag = name.split(":")
    assert registry_digest(world.registry, repo, tag).startswith("sha256:")


# --- when -------------------------------------------------------------------------------


def _ref(world: World, name: str) -> str:
    assert world.registry is not None
    return f"{world.registry.host}/{name}"


@when(
    parsers.parse(
        '"{user}" submits a job in the image "{name}" that reports who it is and tries to '
        "write to /"
    )
)
def submit_in_image(world: World, user: str, name: str) -> None:
    command = (
        "id -u; cat /etc/motd; (touch /written 2>/dev/null && echo wrote-root) || "
        "echo root-refused; echo mine > mine.txt"
    )
    world.submit_command(user, command, "--image", _ref(world, name))


@when(parsers.parse('"{user}" submits a job in the image "{name}"'))
def submit_missing_image(world: World, user: str, name: str) -> None:
    world.submit_command(user, "true", "--image", _ref(world, name))


@when(
    parsers.parse(
        '"{user}" submits a job that writes to its scratch directory and shows its owner and mode'
    )
)
def submit_scratch(world: World, user: str) -> None:
    world.submit_command(
        user,
        'id -u; echo data > "$LATTICE_SCRATCH/f"; stat -c "%u %a" "$LATTICE_SCRATCH"; '
        'echo "$LATTICE_SCRATCH"; test "$TMPDIR" = "$LATTICE_SCRATCH" && echo tmpdir',
    )


@when(parsers.parse('"{user}" submits a job that reports who it is'))
def submit_whoami(world: World, user: str) -> None:
    world.submit_command(user, "id -u")


# --- then -------------------------------------------------------------------------------


@then("the job completes as uid 1000 and its attempt to write to / was refused")
def completes_read_only(world: World) -> None:
    a = world.end()
    assert a["state"] == "Completed", (a["reason"], world.output())
    assert world.output() == ["1000", "lattice tools", "root-refused"]


@then("the file it wrote in its working directory belongs to uid 1000")
def file_owner(world: World) -> None:
    assert (world.workdir / "mine.txt").stat().st_uid == 1000


@then(parsers.parse('`lattice status -o json` shows the digest the registry has for "{name}"'))
def digest_shown(world: World, name: str) -> None:
    assert world.registry is not None
    repo, tag = name.split(":")
    r = world.cli("status", world.alloc_id, "-o", "json")
    assert json.loads(r.stdout)["image_digest"] == registry_digest(world.registry, repo, tag)
    human = world.status_field(world.alloc_id, "Image")
    assert human.endswith(f"({registry_digest(world.registry, repo, tag)})"), human


@then("the job ends Failed with a reason that says the image is not found in the registry")
def failed_not_found(world: World) -> None:
    a = world.end(timeout=TIMEOUT * 2)
    assert a["state"] == "Failed", a
    assert a["reason"].startswith("prologue_failed: image "), a["reason"]
    assert "not found in registry" in a["reason"], a["reason"]


@then("it was tried on both nodes")
def tried_on_both(world: World) -> None:
    r = world.cli("status", world.alloc_id, "-o", "json")
    a = json.loads(r.stdout)
    assert sorted(a["excluded_nodes"]) == world.node_ids() and a["prologue_failures"] == 2


@then(
    parsers.parse(
        "the job completes as uid {uid:d} with a scratch directory it owns with mode {mode:d}"
    )
)
def scratch_owned(world: World, uid: int, mode: int) -> None:
    a = world.end()
    assert a["state"] == "Completed", (a["reason"], world.output())
    lines = world.output()
    assert lines[0] == str(uid) and lines[1] == f"{uid} {mode}" and lines[3] == "tmpdir", lines


@then("the scratch directory no longer exists")
def scratch_gone(world: World) -> None:
    path = Path(world.output()[2])
    assert path.name == world.alloc_id
    world.cluster.wait_for("the scratch wiped", lambda: not path.exists(), timeout=10)


@then(
    parsers.parse('the job ends Failed with a reason that says "{user}" has no account on the node')
)
def failed_no_account(world: World, user: str) -> None:
    a = world.end()
    assert a["state"] == "Failed", a
    assert f"user {user} has no account on node" in a["reason"], a["reason"]
