"""Steps for features/allocation_lifecycle.feature: submit, run, walltime, cancel, drain.

Every scenario runs against the module's real local cluster (``lattice_cluster``: one
quorum member, a scheduler and two agents running real processes). User-visible steps
go through the real ``lattice`` CLI; the REST API is used to observe state precisely
(poll allocation and node records) and for the API-level scenario.

Scenarios share one cluster, so the ``world`` fixture cleans up after each one: it
cancels what is still running, releases and undrains, and waits until both nodes are
Ready and idle again.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.world import StateRecorder, log_lines
from lattice_acceptance.world import show as _show
from lattice_test_harness.cluster import TERMINAL, ApiError, ClusterHandle, process_group_alive
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

FEATURE = "allocation_lifecycle.feature"

# The fixture's agents use a 1 s SIGTERM->SIGKILL grace period (walltime_grace).
GRACE_SECONDS = 1.0
# A job that outlives its walltime must be stopped long before its own 60 s would end.
STOPPED_WELL_BEFORE = 20.0
# Long enough to span several scheduler cycles (cycle_interval is 1 s in the fixture).
OBSERVE_SECONDS = 3.0


# --------------------------------------------------------------------------- bindings


scenarios(FEATURE)


# --------------------------------------------------------------------------- world


@dataclass
class Job:
    id: str
    marker_dir: Path
    ack: dict[str, Any] | None = None  # what `lattice submit -o json` answered
    walltime: int = 0
    recorder: StateRecorder | None = None

    @property
    def pgid_file(self) -> Path:
        return self.marker_dir / "pgid"

    @property
    def release_file(self) -> Path:
        return self.marker_dir / "release"


@dataclass
class World:
    cluster: ClusterHandle
    workdir: Path
    jobs: dict[str, Job] = field(default_factory=dict)
    current: Job | None = None
    long_jobs: list[Job] = field(default_factory=list)
    waiting: Job | None = None
    cancelled_node: str = ""
    node: str = ""
    last: subprocess.CompletedProcess[str] | None = None
    drained_nodes: set[str] = field(default_factory=set)
    monitor: OverlapMonitor | None = None

    # --- CLI --------------------------------------------------------------------------

    def cli(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        r = self.cluster.cli(*args, cwd=self.workdir)
        self.last = r
        if ok:
            assert r.returncode == 0, _show(r)
        return r

    def submit_script(self, name: str, body: str, *, directives: tuple[str, ...] = ()) -> Job:
        """Write a batch script (as a user would) and `lattice submit` it."""
        marker = self.workdir / f"{name}-{len(self.jobs)}"
        marker.mkdir()
        script = marker / f"{name}.sh"
        lines = ["#!/bin/bash", f"#LATTICE --name={name}"]
        lines += [f"#LATTICE {d}" for d in directives or ("--walltime=5m",)]
        # Record the job's process group, so a step can tell whether anything survived.
        lines.append(f'read -r -a _st < /proc/$$/stat; echo "${{_st[4]}}" > {marker}/pgid')
        script.write_text("\n".join([*lines, body.format(marker=marker), ""]))
        r = self.cli("submit", str(script))
        m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
        assert m, f"lattice submit did not print 'Submitted allocation <id>':\n{_show(r)}"
        job = Job(id=m.group(1), marker_dir=marker)
        self.jobs[job.id] = job
        return job

    def status_field(self, alloc_id: str, name: str) -> str:
        r = self.cli("status", alloc_id)
        m = re.search(rf"^{re.escape(name)}:\s+(.*?)\s*$", r.stdout, re.MULTILINE)
        assert m, f"`lattice status {alloc_id}` has no {name!r} line:\n{_show(r)}"
        return m.group(1)

    def node_state(self, node_id: str) -> str:
        return self.cluster.node(node_id)["state"]

    def wait_pgid(self, job: Job) -> int:
        self.cluster.wait_for(f"{job.id} to record its process group", job.pgid_file.exists)
        text = self.cluster.wait_for(
            f"{job.id}'s process group id", lambda: job.pgid_file.read_text().strip()
        )
        return int(text)


@pytest.fixture
def world(lattice_cluster: ClusterHandle, tmp_path: Path) -> Any:
    w = World(cluster=lattice_cluster, workdir=tmp_path)
    yield w
    _clean_up(w)


def _clean_up(w: World) -> None:
    c = w.cluster
    for job in w.jobs.values():
        job.release_file.touch()
        if job.recorder is not None:
            job.recorder.stop()
        try:
            if c.get(job.id)["state"] not in TERMINAL:
                c.cancel(job.id)
        except ApiError:
            pass
    for job in w.jobs.values():
        c.wait_state(job.id, TERMINAL, timeout=30)
    for node_id in w.drained_nodes:
        c.wait_for(f"{node_id} to leave Draining", lambda n=node_id: w.node_state(n) != "Draining")
        if w.node_state(node_id) == "Drained":
            c.request("POST", f"/api/v1/nodes/{node_id}/undrain", {})
    c.wait_for(
        "every node Ready and idle",
        lambda: all(n["state"] == "Ready" and not n["owner"] for n in c.nodes()),
        timeout=30,
    )


# --------------------------------------------------------------------------- background


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    r = world.cli("nodes", "-o", "json")
    nodes = json.loads(r.stdout)
    assert len(nodes) == count, _show(r)
    assert all(n["state"] == "Ready" and not n.get("owner") for n in nodes), _show(r)


# --------------------------------------------------------------------------- submit and run


@when(parsers.parse('I submit a batch script that prints "{text}"'))
def submit_hello(world: World, text: str) -> None:
    marker = world.workdir / "hello"
    marker.mkdir()
    script = marker / "hello.sh"
    # Sleeps after printing so that "Running" lasts long enough to be seen with the CLI.
    script.write_text(
        f"#!/bin/bash\n#LATTICE --name=hello\n#LATTICE --walltime=5m\necho {shlex.quote(text)}\n"
        "sleep 2\n"
    )
    r = world.cli("submit", "-o", "json", str(script))
    ack = json.loads(r.stdout)
    job = Job(id=ack["id"], marker_dir=marker, ack=ack)
    job.recorder = StateRecorder(world.cluster, job.id)
    job.recorder.start()
    world.jobs[job.id] = world.current = job


@then("the submission is acknowledged as Pending")
def acknowledged_pending(world: World) -> None:
    assert world.current is not None and world.current.ack is not None
    assert world.current.ack["state"] == "Pending", world.current.ack


@then("lattice status shows the job Running")
def status_shows_running(world: World) -> None:
    job = world.current
    assert job is not None
    seen: list[str] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = world.status_field(job.id, "State")
        seen.append(state)
        if state == "Running":
            return
        assert state == "Pending", f"lattice status never showed Running (saw {seen})"
        time.sleep(0.1)
    raise AssertionError(f"lattice status never showed Running within 20 s (saw {seen})")


@then(parsers.parse("the job ends {state} with exit code {code:d}"))
def job_ends_with_exit_code(world: World, state: str, code: int) -> None:
    job = world.current
    assert job is not None
    a = world.cluster.wait_state(job.id, TERMINAL, timeout=30)
    assert a["state"] == state, a
    assert world.status_field(job.id, "State") == state
    assert world.status_field(job.id, "Exit code") == str(code)


@then("the job went through Pending, Running and Completed, in that order")
def went_through_states(world: World) -> None:
    job = world.current
    assert job is not None and job.recorder is not None and job.ack is not None
    job.recorder.join(30)
    assert job.recorder.error is None, job.recorder.error
    seen = [job.ack["state"]]
    for s in job.recorder.states:
        if s != seen[-1]:
            seen.append(s)
    assert seen == ["Pending", "Running", "Completed"], seen


@then(
    parsers.parse(
        "the job ended within {limit:d} seconds of its submission, after running its "
        "{sleep:d} second sleep"
    )
)
def ended_within(world: World, limit: int, sleep: int) -> None:
    job = world.current
    assert job is not None
    a = world.cluster.get(job.id)
    assert a["started_at"] >= a["submitted_at"], a
    assert a["finished_at"] - a["started_at"] >= sleep, f"the {sleep}s sleep did not run: {a}"
    took = a["finished_at"] - a["submitted_at"]
    assert took < limit, f"submission to end took {took:.2f}s on an idle cluster"


@then(parsers.parse('lattice logs of the job show "{text}" and nothing else'))
def logs_exactly(world: World, text: str) -> None:
    job = world.current
    assert job is not None
    r = world.cli("logs", job.id)
    assert log_lines(r) == [text], _show(r)
    assert world.cluster.logs(job.id) == [text]  # the REST endpoint behind it


@then(parsers.parse('lattice logs of the job contain "{text}"'))
def logs_contain(world: World, text: str) -> None:
    job = world.current
    assert job is not None
    r = world.cli("logs", job.id)
    assert any(text in line for line in log_lines(r)), _show(r)


# --------------------------------------------------------------------------- walltime


@when(
    parsers.re(
        r"I submit a batch script with a walltime of (?P<seconds>\d+) seconds that "
        r"(?P<ignores>ignores SIGTERM and )?sleeps for (?P<sleep>\d+) seconds"
    )
)
def submit_overrunning(world: World, seconds: str, ignores: str | None, sleep: str) -> None:
    if ignores:
        # Bash runs the trap after each short sleep, so SIGTERM is caught and the loop goes on.
        body = (
            "trap 'echo \"caught SIGTERM, carrying on\"' TERM\n"
            "echo started\n"
            f"for _ in $(seq {int(sleep) * 10}); do sleep 0.1; done\n"
        )
    else:
        body = f"echo started\nsleep {int(sleep)}\n"
    world.current = world.submit_script(
        "overrun", body, directives=(f"--walltime={int(seconds)}s",)
    )
    world.current.walltime = int(seconds)


@then(parsers.parse('the job ends {state} with reason "{reason}"'))
def job_ends_with_reason(world: World, state: str, reason: str) -> None:
    job = world.current
    assert job is not None
    a = world.cluster.wait_state(job.id, TERMINAL, timeout=STOPPED_WELL_BEFORE + 10)
    assert (a["state"], a["reason"]) == (state, reason), a
    if state == "Failed":
        assert a["exit_code"] not in (None, 0), a


@then(parsers.parse('lattice status shows reason "{reason}"'))
def status_shows_reason(world: World, reason: str) -> None:
    job = world.current
    assert job is not None
    assert world.status_field(job.id, "Reason") == reason


@then("the job ran for at least its walltime but was stopped well before it would have finished")
def ran_walltime(world: World) -> None:
    job = world.current
    assert job is not None and job.walltime > 0
    a = world.cluster.get(job.id)
    ran = a["finished_at"] - a["started_at"]
    walltime = job.walltime
    assert ran >= walltime, f"stopped after {ran:.2f}s, before its {walltime}s walltime"
    assert ran < STOPPED_WELL_BEFORE, f"ran {ran:.2f}s; walltime {walltime}s + grace"


@then("none of the job's processes are left running")
def no_processes_left(world: World) -> None:
    job = world.current
    assert job is not None
    _assert_group_gone(world, job)


@then("the job's node is free again")
def node_free_again(world: World) -> None:
    job = world.current
    assert job is not None
    (node,) = world.cluster.get(job.id)["assigned_nodes"]
    world.cluster.wait_for(f"{node} freed", lambda: not world.cluster.node(node)["owner"])
    assert world.cluster.node(node)["state"] == "Ready"


def _assert_group_gone(world: World, job: Job) -> None:
    pgid = world.wait_pgid(job)
    world.cluster.wait_for(
        f"process group {pgid} of {job.id} to be gone",
        lambda: not process_group_alive(pgid),
        timeout=GRACE_SECONDS + 10,
    )


# --------------------------------------------------------------------------- cancel

LONG_BODY = "echo running\nsleep 600\n"
# Bash runs the trap between the short sleeps, so it outlives SIGTERM until SIGKILL.
TRAPPING_BODY = (
    "trap 'echo \"caught SIGTERM, carrying on\"' TERM\n"
    "echo running\n"
    "for _ in $(seq 6000); do sleep 0.1; done\n"
)


class OverlapMonitor(threading.Thread):
    """Watches, from just before a cancel, whether the next job starts on the node while
    any process of the cancelled job is still alive."""

    def __init__(self, cancelled_pgid: int, next_started: Path) -> None:
        super().__init__(daemon=True, name="overlap")
        self.pgid = cancelled_pgid
        self.next_started = next_started
        self.overlap_at: float | None = None
        self.gone_at: float | None = None
        self.t0 = time.monotonic()

    def run(self) -> None:
        while time.monotonic() - self.t0 < 30:
            started = self.next_started.exists()
            alive = process_group_alive(self.pgid)
            if started and alive and self.overlap_at is None:
                self.overlap_at = time.monotonic() - self.t0
            if not alive:
                self.gone_at = time.monotonic() - self.t0
                return
            time.sleep(0.005)


@given(parsers.re(r"a long job (?P<traps>that traps SIGTERM )?running on every node"))
def long_job_everywhere(world: World, traps: str | None) -> None:
    body = TRAPPING_BODY if traps else LONG_BODY
    for _ in world.cluster.nodes():
        world.long_jobs.append(world.submit_script("long", body))
    placed = set()
    for job in world.long_jobs:
        a = world.cluster.wait_state(job.id, "Running")
        placed.update(a["assigned_nodes"])
        world.wait_pgid(job)  # its processes really run
    assert placed == {n["id"] for n in world.cluster.nodes()}, placed


@given("another job waiting Pending because no node is free")
def waiting_job(world: World) -> None:
    world.waiting = world.submit_script("next", "echo next\nsleep 600\n")
    time.sleep(OBSERVE_SECONDS)
    assert world.status_field(world.waiting.id, "State") == "Pending"


@when("I cancel the first long job with lattice cancel")
def cancel_first(world: World) -> None:
    job = world.current = world.long_jobs[0]
    world.cancelled_node = world.cluster.get(job.id)["assigned_nodes"][0]
    if world.waiting is not None:
        world.monitor = OverlapMonitor(world.wait_pgid(job), world.waiting.pgid_file)
        world.monitor.start()
    world.cli("cancel", job.id)


@then(parsers.parse('lattice cancel confirms "{message}" for it'))
def cancel_confirms(world: World, message: str) -> None:
    assert world.current is not None and world.last is not None
    assert world.last.stdout.strip() == f"{message} {world.current.id}", _show(world.last)


@then("the cancelled job ends Cancelled")
def cancelled(world: World) -> None:
    assert world.current is not None
    a = world.cluster.wait_state(world.current.id, TERMINAL)
    assert a["state"] == "Cancelled", a
    assert world.status_field(world.current.id, "State") == "Cancelled"


@then("none of the cancelled job's processes are left running")
def cancelled_processes_gone(world: World) -> None:
    assert world.current is not None
    _assert_group_gone(world, world.current)


@then("the other long job is still Running")
def other_long_job_running(world: World) -> None:
    (other,) = [j for j in world.long_jobs if j is not world.current]
    assert world.cluster.get(other.id)["state"] == "Running"
    assert process_group_alive(world.wait_pgid(other)), "the other long job was killed too"


@then("the waiting job starts Running on the node the cancelled job used")
def waiting_starts(world: World) -> None:
    assert world.waiting is not None and world.current is not None
    a = world.cluster.wait_state(world.waiting.id, "Running")
    assert a["assigned_nodes"] == [world.cancelled_node], a
    cancelled = world.cluster.get(world.current.id)
    assert a["started_at"] >= cancelled["finished_at"], (a, cancelled)
    assert world.status_field(world.waiting.id, "State") == "Running"


@then("the waiting job did not start while the cancelled job's processes were still running")
def no_overlap(world: World) -> None:
    m = world.monitor
    assert m is not None
    m.join(35)
    assert m.gone_at is not None, "the cancelled job's processes never went away"
    assert m.overlap_at is None, (
        f"the next job was running on {world.cancelled_node} {m.overlap_at:.2f}s after the "
        f"cancel, while the cancelled job's processes lived until {m.gone_at:.2f}s"
    )


@then("cancelling the cancelled job again is refused with a hint")
def cancel_again(world: World) -> None:
    assert world.current is not None
    r = world.cli("cancel", world.current.id, ok=False)
    assert r.returncode != 0, _show(r)
    assert "already ended" in r.stderr and "\nHint: " in r.stderr, _show(r)


# --------------------------------------------------------------------------- drain

RELEASE_BODY = "echo waiting\nwhile [ ! -e {marker}/release ]; do sleep 0.1; done\necho released\n"


@given("a job that runs until I release it")
def releasable_job(world: World) -> None:
    job = world.current = world.submit_script("hold", RELEASE_BODY)
    a = world.cluster.wait_state(job.id, "Running")
    world.wait_pgid(job)
    world.node = a["assigned_nodes"][0]


@when(parsers.parse('the operator drains the node running it with reason "{reason}"'))
def drain(world: World, reason: str) -> None:
    world.drained_nodes.add(world.node)
    world.cli("node", "drain", world.node, "--reason", reason)


@then(parsers.parse("lattice reports the node is now {state}"))
def node_now(world: World, state: str) -> None:
    r = world.last
    assert r is not None
    assert r.stdout.strip() == f"Node {world.node} is now {state}", _show(r)
    listed = json.loads(world.cli("nodes", "-o", "json").stdout)
    assert {n["id"]: n["state"] for n in listed}[world.node] == state, listed


@then("the node stays Draining while the job runs")
def stays_draining(world: World) -> None:
    assert world.current is not None
    deadline = time.monotonic() + OBSERVE_SECONDS
    while time.monotonic() < deadline:
        assert world.node_state(world.node) == "Draining"
        assert world.cluster.get(world.current.id)["state"] == "Running"
        time.sleep(0.1)
    assert world.status_field(world.current.id, "State") == "Running"


@then("a new job is placed on the other node")
def placed_elsewhere(world: World) -> None:
    job = world.submit_script("elsewhere", "echo elsewhere\n")
    a = world.cluster.wait_state(job.id, TERMINAL)
    assert a["state"] == "Completed", a
    assert a["assigned_nodes"] and world.node not in a["assigned_nodes"], a


@then("undraining the node is refused with a hint while it is Draining")
def undrain_refused(world: World) -> None:
    r = world.cli("node", "undrain", world.node, ok=False)
    assert r.returncode != 0, _show(r)
    assert "Draining" in r.stderr and "\nHint: " in r.stderr, _show(r)
    assert world.node_state(world.node) == "Draining"


@when("I release the job")
def release(world: World) -> None:
    assert world.current is not None
    world.current.release_file.touch()


@then("the node becomes Drained")
def becomes_drained(world: World) -> None:
    world.cluster.wait_for(
        f"{world.node} Drained", lambda: world.node_state(world.node) == "Drained", timeout=15
    )
    r = world.cli("nodes", world.node)
    assert re.search(r"^State:\s+Drained\s*$", r.stdout, re.MULTILINE), _show(r)


@when("the operator undrains the node")
def undrain(world: World) -> None:
    world.cli("node", "undrain", world.node)


@then("a job that needs both nodes runs to completion")
def both_nodes(world: World) -> None:
    job = world.submit_script("both", "echo both\n", directives=("--walltime=5m", "--nodes=2"))
    a = world.cluster.wait_state(job.id, TERMINAL)
    assert a["state"] == "Completed", a
    assert sorted(a["assigned_nodes"]) == sorted(n["id"] for n in world.cluster.nodes()), a
