"""Steps for features/checkpoint.feature: preemption through checkpoints, suspend and
resume, on a fresh one-node real cluster per scenario whose agents keep checkpoints in
the scenario's directory. The jobs are batch scripts that `exec` the counting test
applications of lattice-node-agent (tests/apps): they save their counter when asked and
print where they resumed. User actions go through the real `lattice` CLI; the REST
watch stream shows each state change as it is committed."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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

scenarios("checkpoint.feature")

APPS = Path(__file__).resolve().parents[2] / "lattice-node-agent" / "tests" / "apps"


class Watch(threading.Thread):
    """The allocation's states as the REST watch stream (what `watch` clients see)
    delivers them, in order, each with the allocation at that moment."""

    def __init__(self, cluster: ClusterHandle, alloc_id: str) -> None:
        super().__init__(daemon=True, name=f"watch-{alloc_id}")
        url = cluster.url + f"/api/v1/allocations/{alloc_id}/watch"
        auth, context = cluster.cluster.auth_for(url)
        req = urllib.request.Request(url, headers={"x-lattice-user": cluster.user, **auth})
        self._resp = urllib.request.urlopen(req, timeout=TIMEOUT * 4, context=context)
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.start()

    def run(self) -> None:
        try:
            for raw in self._resp:
                if raw.strip():
                    a = json.loads(raw)["allocation"]
                    if not self.events or self.events[-1][0] != a["state"]:
                        self.events.append((a["state"], a))
        except (OSError, ValueError):
            return

    def states(self) -> list[str]:
        return [s for s, _ in self.events]


@dataclass
class World(ClusterWorld):
    watches: dict[str, Watch] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)  # job -> its checkpointed counter


@pytest.fixture
def world(cluster_factory: Callable[..., ClusterHandle], tmp_path: Path) -> Iterator[World]:
    root = tmp_path / "checkpoints"

    def make(**kw: Any) -> ClusterHandle:
        env = {
            "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(root),
            "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "4",
        }
        return cluster_factory(env=env, **kw)

    w = World(make=make, workdir=tmp_path / "work")
    w.workdir.mkdir()
    yield w
    w.clean_up()


def show(world: World) -> str:
    return _show(world.last) if world.last is not None else ""


def wait(world: World, what: str, fn: Callable[[], Any], timeout: float = TIMEOUT * 3) -> Any:
    return world.cluster.wait_for(what, fn, timeout=timeout, interval=0.2)


def logs(world: World, name: str) -> list[str]:
    return log_lines(world.cli("logs", world.jobs[name].id))


# --------------------------------------------------------------------------- given


@given("a Lattice cluster with 1 node that keeps checkpoints")
def one_node(world: World) -> None:
    world.start_cluster(1)


@given(
    parsers.re(
        r'a class-(?P<cls>\d+) job "(?P<name>[^"]+)" submitted with "(?P<flag>[^"]+)" '
        r"that (?P<what>counts to \d+|ignores checkpoint requests|"
        r"runs its application as a child of its script)"
    )
)
def counting_job(world: World, cls: str, name: str, flag: str, what: str) -> None:
    protocol = flag.split("=", 1)[1]
    args = f"{what.split()[-1]} 0.05" if what.startswith("counts") else "1000000 0.05 hang"
    app = APPS / f"ckpt_{protocol}.py"
    script = f"exec {sys.executable} {app} {args}"
    if what.startswith("runs"):  # no exec: the script's shell waits for the application
        script = f"{sys.executable} {app} 1000000 0.05\necho the application ended"
    job = world.submit(
        name, script, directives=("--walltime=10m", f"--preemption-class={cls}", flag)
    )
    a = world.wait_running(job)
    world.node = a["assigned_nodes"][0]
    wait(world, f"{name} counting", lambda: "count 5" in logs(world, name))
    world.watches[name] = Watch(world.cluster, job.id)


# --------------------------------------------------------------------------- when


@when(parsers.parse('I submit a job "{name}" of class {cls:d}'))
def submit_of_class(world: World, name: str, cls: int) -> None:
    world.submit(
        name, "echo urgent work", directives=("--walltime=5m", f"--preemption-class={cls}")
    )


@when(parsers.parse('the owner runs "lattice {verb}" on "{name}"'))
def owner_runs(world: World, verb: str, name: str) -> None:
    r = world.cli(verb, world.jobs[name].id)
    said = {"suspend": "Suspending", "resume": "Resumed", "checkpoint": "Checkpointing"}[verb]
    assert said in r.stdout, show(world)


# --------------------------------------------------------------------------- then


@then(parsers.parse('the watch of "{name}" shows Running, Checkpointing, then Suspended'))
def watch_shows(world: World, name: str) -> None:
    w = world.watches[name]
    wait(world, f"{name} Suspended in watch", lambda: "Suspended" in w.states())
    states = w.states()
    assert states[:3] == ["Running", "Checkpointing", "Suspended"], states


@then(
    parsers.parse('lattice status of "{name}" names its checkpoint, and the saved counter is there')
)
def status_names_checkpoint(world: World, name: str) -> None:
    suspended = next(a for s, a in world.watches[name].events if s == "Suspended")
    path = Path(suspended["last_checkpoint"]["path"])
    assert path.parts[-2:] == ("checkpoints", "ckpt-1") and world.jobs[name].id in path.parts
    world.saved[name] = int((path / "counter").read_text())
    # after it ran again too, status keeps naming the checkpoint it resumed from
    line = world.status_field(world.jobs[name].id, "Last checkpoint")
    assert line.startswith("ckpt-1") and str(path) in line, show(world)


@then(
    parsers.parse('"{name}" started only after "{victim}" had released its node and ends Completed')
)
def started_after_release(world: World, name: str, victim: str) -> None:
    a = world.wait_end(name)
    suspended = next(s for s in world.watches[victim].events if s[0] == "Suspended")[1]
    assert suspended["assigned_nodes"] == []
    assert a["started_at"] >= suspended["last_checkpoint"]["at"], (a, suspended)


@then(parsers.parse('"{name}" runs again, resumes from its saved counter and ends Completed'))
def resumes(world: World, name: str) -> None:
    a = world.wait_end(name)
    if name not in world.saved:
        path = Path(a["last_checkpoint"]["path"])
        world.saved[name] = int((path / "counter").read_text())
    saved = world.saved[name]
    out = logs(world, name)
    assert f"resumed from {saved}" in out, out
    assert out.count("started fresh") == 1, out
    assert any(re.fullmatch(r"finished at \d+", ln) for ln in out), out
    assert a["preempted_count"] == 1 and a["requeue_count"] == 0, a


@then(parsers.parse('"{name}" ends Failed with reason "{reason}" and was never Suspended'))
def ends_failed(world: World, name: str, reason: str) -> None:
    a = world.wait_end(name, "Failed")
    assert a["reason"] == reason, a
    assert "Suspended" not in world.watches[name].states(), world.watches[name].states()
    assert world.status_field(a["id"], "State") == "Failed"


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: World, name: str) -> None:
    world.wait_end(name)


@then(parsers.parse('"{name}" becomes Suspended and stays Suspended'))
def stays_suspended(world: World, name: str) -> None:
    aid = world.jobs[name].id
    a = world.cluster.wait_state(aid, "Suspended", timeout=TIMEOUT * 2)
    world.saved[name] = int((Path(a["last_checkpoint"]["path"]) / "counter").read_text())
    time.sleep(2.0)  # an owner's suspend is not requeued on its own
    assert world.cluster.get(aid)["state"] == "Suspended"
    assert world.status_field(aid, "State") == "Suspended"


@then(parsers.parse('lattice status of "{name}" names a checkpoint while it is still Running'))
def checkpointed_running(world: World, name: str) -> None:
    aid = world.jobs[name].id
    a = wait(
        world,
        f"{name} checkpointed",
        lambda: (x := world.cluster.get(aid)).get("last_checkpoint") and x,
    )
    assert a["state"] == "Running", a
    path = Path(a["last_checkpoint"]["path"])
    assert path.parts[-2:] == ("checkpoints", "ckpt-1-hint-1"), path
    world.saved[name] = int((path / "counter").read_text())
    line = world.status_field(aid, "Last checkpoint")
    assert line.startswith("ckpt-1-hint-1") and str(path) in line, show(world)
    assert world.status_field(aid, "State") == "Running"


@then(parsers.parse('"{name}" keeps counting past its saved counter'))
def keeps_counting(world: World, name: str) -> None:
    saved = world.saved[name]
    wait(world, f"{name} past {saved}", lambda: f"count {saved + 20}" in logs(world, name))
    out = logs(world, name)
    assert f"checkpointed at {saved}" in out and out.count("started fresh") == 1, out[-10:]
    world.cli("cancel", world.jobs[name].id)


@then(
    parsers.parse(
        'the checkpoint of "{name}" times out without a signal, and it is still Running '
        "and counting"
    )
)
def no_fatal_signal(world: World, name: str) -> None:
    aid = world.jobs[name].id

    def answered_or_ended() -> dict[str, Any] | None:
        x = world.cluster.get(aid)
        done = (x.get("checkpoint_hint") or {}).get("done_at")
        return x if done or x["state"] != "Running" else None

    a = wait(world, f"{name}'s checkpoint request answered", answered_or_ended)
    assert a["state"] == "Running" and not a.get("last_checkpoint"), a
    counted = max(int(ln.split()[1]) for ln in logs(world, name) if ln.startswith("count "))
    wait(world, f"{name} counting on", lambda: f"count {counted + 10}" in logs(world, name))
    assert world.cluster.get(aid)["state"] == "Running"
    agent_log = world.cluster.cluster.log_path(f"agent-{world.node}").read_text()
    assert f"allocation {aid}: checkpoint signal held back" in agent_log
    world.cli("cancel", aid)
