"""Steps for features/node_runtime.feature: uenv images staged on every node before a
job runs, tampered images refused and retried elsewhere, and mounts private to the job.

The module's real local cluster has 3 agents and a directory uenv registry (published
before the cluster starts, so the API and every agent read the same index). Images are
real SquashFS files built with mksquashfs; each agent has its own node-local cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lattice_acceptance.world import TIMEOUT, Job, StateRecorder, log_lines, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import TERMINAL, ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.uenv_images import build_squashfs, index_entry, mount_support
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("node_runtime.feature")

GOOD = "prgenv/1.0:v1"
TAMPERED = "prgenv/1.0:tampered"


def _publish(root: Path, build: Path) -> None:
    image = build_squashfs(
        build / "prgenv.sqfs", {"bin/hello": '#!/bin/sh\necho "hello from $(dirname "$0")"\n'}
    )
    root.mkdir(parents=True)
    shutil.copy(image, root / "prgenv.sqfs")
    shutil.copy(image, root / "prgenv-tampered.sqfs")
    signed_off = hashlib.sha256(b"what the site signed off").hexdigest()
    index = {
        GOOD: index_entry(root / "prgenv.sqfs"),
        TAMPERED: index_entry(root / "prgenv-tampered.sqfs", sha256=signed_off),
    }
    (root / "index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def uenv_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    why = mount_support()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("node-runtime-bdd")
    _publish(base / "registry", base / "build")
    env = {"LATTICE_NODE_AGENT__UENV_REGISTRY": str(base / "registry")}
    h = make_cluster(base / "cluster", members=1, agents=3, env=env)
    yield h
    h.cluster.stop()


@dataclass
class World(ClusterWorld):
    registry: Path = Path()
    recorders: dict[str, StateRecorder] = field(default_factory=dict)

    def cache_refs(self, node_id: str) -> set[str]:
        """The refs of the images in a node's uenv cache (``<sha256>.ref`` files)."""
        d = self.cluster.cluster.base / "agents" / node_id / "cache" / "uenv"
        return {p.read_text().strip() for p in d.glob("*.ref")}


@pytest.fixture
def world(uenv_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World.on(uenv_cluster, tmp_path)
    w.registry = uenv_cluster.cluster.base.parent / "registry"
    yield w
    for r in w.recorders.values():
        r.stop()
    w.clean_up()
    w.wait_idle()


# --- given ------------------------------------------------------------------------------


@given(parsers.parse("a running Lattice cluster with {count:d} nodes and a uenv registry"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)
    assert (world.registry / "index.json").is_file()


@given(parsers.parse('the registry has "{ref}" with a program "{program}"'))
def registry_has(world: World, ref: str, program: str) -> None:
    index = json.loads((world.registry / "index.json").read_text())
    image = world.registry / index[ref]["file"]
    assert hashlib.sha256(image.read_bytes()).hexdigest() == index[ref]["sha256"]
    listing = subprocess.run(
        ["unsquashfs", "-l", str(image)], capture_output=True, text=True, check=True
    ).stdout
    assert f"/bin/{program}" in listing


@given(parsers.parse('the registry has "{ref}" whose index hash does not match the image'))
def registry_has_tampered(world: World, ref: str) -> None:
    index = json.loads((world.registry / "index.json").read_text())
    image = world.registry / index[ref]["file"]
    assert hashlib.sha256(image.read_bytes()).hexdigest() != index[ref]["sha256"]


# --- when -------------------------------------------------------------------------------


def _submit(world: World, name: str, nodes: int, body: str, uenv: str = "") -> Job:
    directives = (f"--nodes={nodes}", "--walltime=5m", *((f"--uenv={uenv}",) if uenv else ()))
    job = world.submit(name, body, directives=directives)
    rec = StateRecorder(world.cluster, job.id)
    rec.start()
    world.recorders[name] = rec
    world.current = job
    return job


@when(parsers.parse('I submit a {nodes:d}-node job with uenv "{ref}" that runs "{command}"'))
def submit_with_uenv(world: World, nodes: int, ref: str, command: str) -> None:
    _submit(world, "job", nodes, command, ref)


_MOUNTS = 'awk \'$5 == "/user-environment" {print "mount", $6}\' /proc/self/mountinfo'


@when(
    parsers.parse(
        'I submit a {nodes:d}-node job with uenv "{ref}" that lists its mounts until released'
    )
)
def submit_lister_with_uenv(world: World, nodes: int, ref: str) -> None:
    d = world.workdir / "with-uenv"
    body = f"{_MOUNTS}\ntouch {d}/listed\nwhile [ ! -e {d}/release ]; do sleep 0.1; done"
    job = _submit(world, "with-uenv", nodes, body, ref)
    world.cluster.wait_for("the uenv job listed its mounts", (job.dir / "listed").exists, TIMEOUT)


@when(parsers.parse("I submit a {nodes:d}-node job without a uenv that lists its mounts"))
def submit_lister_without_uenv(world: World, nodes: int) -> None:
    job = _submit(world, "without-uenv", nodes, _MOUNTS)
    world.cluster.wait_state(job.id, TERMINAL, timeout=TIMEOUT)


# --- then -------------------------------------------------------------------------------


@then("the job was Staging until every node reported its prologue done, then ran and completed")
def staged_then_running(world: World) -> None:
    job = world.current
    assert job is not None
    a = world.wait_end(job.name)
    # the quorum records each node's prologue; Running only once all had reported
    assert sorted(a["staged_nodes"]) == sorted(a["assigned_nodes"]), a
    rec = world.recorders[job.name]
    rec.join(TIMEOUT)
    assert rec.error is None, rec.error
    seen = [s for s in rec.states if s != "Pending"]
    assert seen[-2:] == ["Running", "Completed"] and set(seen) <= {"Staging", *seen[-2:]}, seen


@then(parsers.parse('its output is "{text}"'))
def output_is(world: World, text: str) -> None:
    job = world.current
    assert job is not None
    lines = log_lines(world.cli("logs", job.id))
    assert text in lines, lines


@then(parsers.parse('every node\'s uenv cache holds "{ref}"'))
def caches_hold(world: World, ref: str) -> None:
    job = world.current
    assert job is not None
    for node in world.get(job.name)["assigned_nodes"]:
        assert ref in world.cache_refs(node), node


@then(parsers.parse('no node\'s uenv cache holds "{ref}"'))
def caches_do_not_hold(world: World, ref: str) -> None:
    for node in world.node_ids():
        assert ref not in world.cache_refs(node), node


@then("/user-environment is not mounted on the host")
def not_on_host(world: World) -> None:
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    assert not [m for m in mounts if m.split()[4] == "/user-environment"]


@then(parsers.parse('the job ends Failed with a reason that starts "{prefix}"'))
def ends_failed(world: World, prefix: str) -> None:
    job = world.current
    assert job is not None
    a = world.cluster.wait_state(job.id, TERMINAL, timeout=60)
    assert a["state"] == "Failed", a
    assert a["reason"].startswith(prefix), a["reason"]


@then(
    parsers.parse(
        "`lattice status` shows it failed its prologue {count:d} times, once on each node"
    )
)
def failed_on_each_node(world: World, count: int) -> None:
    job = world.current
    assert job is not None
    r = world.cli("status", job.id, "-o", "json")
    a = json.loads(r.stdout)
    assert a["prologue_failures"] == count, show(r)
    assert sorted(a["excluded_nodes"]) == world.node_ids(), show(r)
    assert a["reason"].endswith(f"({count} tries)") or f"{count} tries" in a["reason"], show(r)


@then("every node is Ready and idle again")
def idle_again(world: World) -> None:
    world.wait_idle()


@then("the job with the uenv sees /user-environment mounted read-only")
def uenv_job_sees_it(world: World) -> None:
    job = world.jobs["with-uenv"]
    lines = log_lines(world.cli("logs", job.id))
    mounts = [ln for ln in lines if ln.startswith("mount ")]
    assert len(mounts) == 1 and mounts[0].split()[1].split(",")[0] == "ro", lines
    world.release("with-uenv")
    world.wait_end("with-uenv")


@then("the job without a uenv does not see /user-environment")
def other_job_does_not(world: World) -> None:
    job = world.jobs["without-uenv"]
    a = world.get("without-uenv")
    assert a["state"] == "Completed", a
    lines = log_lines(world.cli("logs", job.id))
    assert "started without-uenv" in lines and "finished without-uenv" in lines, lines
    assert not [ln for ln in lines if ln.startswith("mount ")], lines


# --- lattice cache: warm, status, evict ---------------------------------------------------


@when(parsers.parse('the administrator runs "{command}"'))
def admin_runs(world: World, command: str) -> None:
    import shlex

    args = shlex.split(command)
    assert args[0] == "lattice", command
    world.cli(*args[1:], "-o", "json", user="admin")  # exits 0


@then(parsers.parse('it reports "{ref}" cached on every node'))
def warmed_everywhere(world: World, ref: str) -> None:
    out = json.loads(world.last.stdout)
    assert out["image"] == ref, out
    assert [r["node"] for r in out["results"]] == world.node_ids(), out
    for r in out["results"]:
        assert r["ok"] and r["image"]["ref"] == ref and not r["image"]["in_use"], r
    for node in world.node_ids():  # each agent's own cache directory
        assert ref in world.cache_refs(node), node


def _cached_on(world: World, ref: str) -> dict[str, bool]:
    r = world.cli("cache", "status", "-o", "json", user="alice")  # any user may look
    nodes = json.loads(r.stdout)
    assert all(n["ok"] and n["enabled"] for n in nodes), show(r)
    return {n["node"]: ref in [i["ref"] for i in n["images"]] for n in nodes}


@then(parsers.parse('`lattice cache status -o json` shows "{ref}" on every node'))
def status_everywhere(world: World, ref: str) -> None:
    assert _cached_on(world, ref) == dict.fromkeys(world.node_ids(), True)


@then(parsers.parse('`lattice cache status -o json` shows "{ref}" on every node but {node}'))
def status_but_one(world: World, ref: str, node: str) -> None:
    assert _cached_on(world, ref) == {n: n != node for n in world.node_ids()}
    assert ref not in world.cache_refs(node)


@then(
    parsers.parse(
        'a user without the admin role is refused "{command}" with a permission error and a Hint'
    )
)
def non_admin_refused(world: World, command: str) -> None:
    """The development cluster trusts every caller as an administrator, so the refusal is
    asked of a server that authenticates (the same API code in process, with signed
    tokens) that knows this cluster's nodes and agents; nothing reaches them."""
    import shlex
    import sys
    import time

    import jwt
    from lattice_acceptance.world import assert_hint_line
    from lattice_test_harness.local_api import ThreadedLocalApi

    secret = "node-runtime-bdd-secret-long-enough"
    before = {n: world.cache_refs(n) for n in world.node_ids()}
    with ThreadedLocalApi(hmac_secret=secret) as api:
        for n in world.cluster.nodes():
            api.add_node(n["id"], agent_address=n["agent_address"], group=n["group"])
        claims = {"sub": "alice", "exp": int(time.time()) + 600}
        env = {
            **world.cluster.cli_env(),
            "LATTICE_ENDPOINT": api.rest_url,
            "LATTICE_TOKEN": jwt.encode(claims, secret, algorithm="HS256"),
            "USER": "alice",
        }
        args = shlex.split(command)[1:]
        r = subprocess.run(
            [sys.executable, "-m", "lattice_cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=world.workdir,
        )
    assert r.returncode == 1, show(r)
    assert "Traceback" not in r.stderr, show(r)
    assert r.stderr.startswith("Error: alice (user) may not perform cache.admin"), show(r)
    assert_hint_line(r)
    assert {n: world.cache_refs(n) for n in world.node_ids()} == before
