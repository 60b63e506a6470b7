"""Steps for features/checkpoint_filesystem.feature: a checkpoint root on a shared
directory that goes away (renamed, as an unmount leaves an empty mount point's parent
without it), on a fresh one-node real cluster. The job is a batch script that `exec`s
the counting test application of lattice-node-agent (tests/apps). The checkpoint broker
runs only once the storage is down, to report the outage."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.steps import *  # noqa: F403 (shared step definitions)
from lattice_acceptance.world import TIMEOUT, log_lines
from lattice_acceptance.world import World as ClusterWorld
from lattice_acceptance.world import show as _show
from lattice_test_harness.cluster import ClusterHandle
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("checkpoint_filesystem.feature")

APPS = Path(__file__).resolve().parents[2] / "lattice-node-agent" / "tests" / "apps"


@dataclass
class World(ClusterWorld):
    root: Path | None = None


@pytest.fixture
def world(cluster_factory: Callable[..., ClusterHandle], tmp_path: Path) -> Iterator[World]:
    root = tmp_path / "shared" / "checkpoints"
    root.mkdir(parents=True)

    def make(**kw: Any) -> ClusterHandle:
        env = {
            "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(root),
            "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "60",
            "LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS": "1",
        }
        return cluster_factory(env=env, checkpoint_broker=True, **kw)

    w = World(make=make, workdir=tmp_path / "work", root=root)
    w.workdir.mkdir()
    try:
        yield w
    finally:
        w.clean_up()


def show(world: World) -> str:
    return _show(world.last) if world.last is not None else ""


def logs(world: World, name: str) -> list[str]:
    return log_lines(world.cli("logs", world.jobs[name].id))


def broker_gauge(world: World) -> float | None:
    url = f"http://127.0.0.1:{world.cluster.cluster.broker_metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("lattice_checkpoint_storage_unavailable "):
            return float(line.split()[1])
    return None


@given("a Lattice cluster with 1 node that keeps checkpoints in a shared directory")
def one_node_fs(world: World) -> None:
    world.start_cluster(1)
    world.cluster.cluster.stop_broker()  # started when the storage goes down


@given(
    parsers.re(
        r'a class-(?P<cls>\d+) job "(?P<name>[^"]+)" submitted with "(?P<flag>[^"]+)" '
        r"that counts to (?P<limit>\d+)"
    )
)
def counting_job(world: World, cls: str, name: str, flag: str, limit: str) -> None:
    app = APPS / f"ckpt_{flag.split('=', 1)[1]}.py"
    job = world.submit(
        name,
        f"exec {sys.executable} {app} {limit} 0.05",
        directives=("--walltime=10m", f"--preemption-class={cls}", flag),
    )
    world.wait_running(job)
    world.cluster.wait_for(
        f"{name} counting", lambda: "count 5" in logs(world, name), timeout=TIMEOUT, interval=0.2
    )


@when("the shared checkpoint directory is unmounted")
def unmounted(world: World) -> None:
    assert world.root is not None
    world.root.rename(world.root.with_name("unmounted"))
    world.cluster.cluster.start_broker()


@when(parsers.parse('the owner runs "lattice {verb}" on "{name}"'))
def owner_runs(world: World, verb: str, name: str) -> None:
    r = world.cli(verb, world.jobs[name].id)
    assert "Suspending" in r.stdout, show(world)


@then("the checkpoint broker reports checkpoint storage unavailable")
def broker_reports(world: World) -> None:
    world.cluster.wait_for(
        "lattice_checkpoint_storage_unavailable 1",
        lambda: broker_gauge(world) == 1.0,
        timeout=TIMEOUT * 3,
        interval=0.2,
    )


@then(
    parsers.parse(
        '"{name}" ends Failed because checkpoint storage is unavailable and was never Suspended'
    )
)
def ends_failed(world: World, name: str) -> None:
    seen = world.cluster.states_seen(world.jobs[name].id, timeout=TIMEOUT * 2)
    assert seen[-1] == "Failed" and "Suspended" not in seen, seen
    a = world.cluster.get(world.jobs[name].id)
    assert a["reason"].startswith("checkpoint storage unavailable: "), a
    assert "does not exist" in a["reason"], a
    assert world.status_field(a["id"], "State") == "Failed"


@then(parsers.parse('"{name}" never wrote a checkpoint'))
def never_wrote(world: World, name: str) -> None:
    assert world.cluster.get(world.jobs[name].id).get("last_checkpoint") is None
    assert not any(ln.startswith("checkpointed at") for ln in logs(world, name))
