"""Steps for features/node_agents.feature: what an agent reports about its node, and what
happens to a node and its work when the agent restarts, dies or hangs.

The scenarios share the module's real local cluster (``lattice_cluster``: 2 agents,
heartbeat 0.5 s, heartbeat timeout 3 s, grace period 3 s). Failures are caused the way
they happen: an agent killed with SIGKILL (a crash), an agent and its job killed (the
node dies), an agent stopped with SIGSTOP (it hangs, like a partition). The ``world``
fixture undoes all of it after each scenario: it continues stopped agents, restarts
dead ones with their own arguments, cancels what still runs and waits until both nodes
are Ready and idle.

Jobs are batch scripts submitted with `lattice submit`; each appends "start <node>" and
"done <node>" to a ``trace`` file (how many times it ran, and where) and writes its
process group id to ``pgid``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.world import TIMEOUT, Job, StateRecorder, show
from lattice_acceptance.world import World as ClusterWorld
from lattice_test_harness.cluster import TERMINAL, ClusterHandle, process_group_alive
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("node_agents.feature")

# The module cluster's heartbeat timeout and grace period (lattice_test_harness FAST).
HEARTBEAT_TIMEOUT = 3.0
GRACE_PERIOD = 3.0
# How late the node monitor (checking once a second) may see a silence start.
MONITOR_SLACK = 0.5
# Restarting agents and requeued work after a scenario can take a while on a busy machine.
RECOVERY_TIMEOUT = 60.0


@dataclass
class World(ClusterWorld):
    agent: Any = None  # the agent of the node the scenario is about (AgentProc)
    other: str = ""  # the node the scenario is not about
    baseline: str = ""  # the node's conformance fingerprint before the scenario
    original_args: list[str] | None = None  # the agent's own arguments, when changed
    stopped: Any = None  # an agent stopped with SIGSTOP
    pgid: int = 0
    running: dict[str, Any] = field(default_factory=dict)  # the job when it first ran
    recorder: StateRecorder | None = None
    died_at: float = 0.0
    node_states: list[str] = field(default_factory=list)
    job_while_degraded: list[str] = field(default_factory=list)
    follow: subprocess.Popen[str] | None = None  # lattice logs --follow, running
    followed: bytes = b""  # what it printed so far (read from its pipe, unbuffered)

    @property
    def job(self) -> Job:
        assert self.current is not None, "no job submitted"
        return self.current

    def trace(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return (self.job.dir / "trace").read_text().splitlines()
        return []

    def agent_of(self, node_id: str) -> Any:
        return next(a for a in self.cluster.cluster.agents if a.node_id == node_id)


@pytest.fixture
def world(lattice_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World.on(lattice_cluster, tmp_path)
    yield w
    _restore(w)


def _restore(w: World) -> None:
    """Agents running with their own arguments, no job left, both nodes Ready and idle."""
    local = w.cluster.cluster
    if w.recorder is not None:
        w.recorder.stop()
    if w.follow is not None and w.follow.poll() is None:
        w.follow.kill()
        w.follow.communicate()
    if w.stopped is not None:
        w.stopped.proc.send_signal(signal.SIGCONT)
    if w.original_args is not None:
        local.stop_agent(w.agent)
        w.agent.args = w.original_args
        local.start_agent(w.agent)
        w.cluster.wait_for(
            f"{w.node} back on its own fingerprint",
            lambda: not w.cluster.node(w.node)["conformance_drift"],
            timeout=RECOVERY_TIMEOUT,
        )
    for a in local.agents:
        if a.proc is None or a.proc.poll() is not None:
            local.start_agent(a)
    w.clean_up()
    w.wait_idle(timeout=RECOVERY_TIMEOUT)


@given(parsers.parse("a running Lattice cluster with {count:d} nodes"))
def running_cluster(world: World, count: int) -> None:
    world.check_nodes(count)


# --------------------------------------------------------------------------- topology


@when("I look at a node with lattice nodes")
def look_at_node(world: World) -> None:
    world.node = world.node_ids()[0]
    world.cli("nodes", world.node, "--output", "json")


def _shown(world: World) -> dict[str, Any]:
    assert world.last is not None
    return json.loads(world.last.stdout)


@then(
    "its conformance group is a fingerprint its agent computed, which is also the baseline "
    "it is expected to keep"
)
def fingerprint(world: World) -> None:
    node = _shown(world)
    fp = node["conformance_group"]
    # computed (a SHA-256 digest): the harness gives the agents no --conformance-group
    assert re.fullmatch(r"[0-9a-f]{64}", fp), node
    assert node["expected_conformance"] == fp and not node["conformance_drift"], node


@then("its capabilities list its GPUs, GPU links, memory domains and memory interconnects")
def capabilities(world: World) -> None:
    caps = _shown(world)["capabilities"]
    for name in ("gpus", "gpu_links", "memory_domains", "memory_interconnects"):
        assert isinstance(caps[name], list), caps


@then("its memory domains come from this machine's NUMA nodes, with at least one CPU")
def memory_domains(world: World) -> None:
    domains = _shown(world)["capabilities"]["memory_domains"]
    # the CI machines are Linux: the NUMA domains come from /sys/devices/system/node
    assert domains, domains
    assert sum(d["cpu_count"] for d in domains) >= 1, domains


@then("the REST API holds the same fingerprint and memory domains for the node")
def same_in_rest(world: World) -> None:
    shown, node = _shown(world), world.cluster.node(world.node)
    assert node["conformance_group"] == shown["conformance_group"], (node, shown)
    assert node["capabilities"]["memory_domains"] == shown["capabilities"]["memory_domains"]


# --------------------------------------------------------------------------- jobs


def _submit(world: World, name: str, body: str) -> None:
    d = world.workdir / name
    script = (
        f'read -r -a _st < /proc/$$/stat; echo "${{_st[4]}}" > {d}/pgid\n'
        f'echo "start $LATTICE_NODE_ID" >> {d}/trace\n'
        f"{body}\n"
        f'echo "done $LATTICE_NODE_ID" >> {d}/trace'
    )
    world.current = job = world.submit(name, script, directives=("--walltime=1m",))
    world.recorder = StateRecorder(world.cluster, job.id)
    world.recorder.start()
    world.running = world.wait_running(job)
    world.node = world.running["assigned_nodes"][0]
    world.other = next(n for n in world.node_ids() if n != world.node)
    world.agent = world.agent_of(world.node)
    world.cluster.wait_for("the job to start", world.trace, timeout=TIMEOUT)
    world.pgid = int((d / "pgid").read_text())


@given("a job that runs until I release it")
def job_until_released(world: World) -> None:
    # not World.submit's until_released: that waits before the job records anything
    _submit(world, "held", f"while [ ! -e {world.workdir}/held/release ]; do sleep 0.1; done")


@given(parsers.parse("a job that runs for {seconds:d} seconds"))
def job_for(world: World, seconds: int) -> None:
    _submit(world, "timed", f"sleep {seconds}")


@then(parsers.re(r"the job ends Completed with exit code 0 on the (?P<which>same|other) node, .*"))
def ends_completed(world: World, which: str) -> None:
    a = world.cluster.wait_state(world.job.id, TERMINAL, timeout=TIMEOUT)
    node = world.node if which == "same" else world.other
    assert (a["state"], a["exit_code"], a["assigned_nodes"]) == ("Completed", 0, [node]), a
    assert a["requeue_count"] == (0 if which == "same" else 1), a
    assert a["submitted_at"] == world.running["submitted_at"], (a, world.running)


@given("a job that prints a line every half second until I release it")
def job_printing_until_released(world: World) -> None:
    d = world.workdir / "ticker"
    _submit(
        world,
        "ticker",
        f"i=0; while [ ! -e {d}/release ]; do i=$((i+1)); echo tick $i; sleep 0.5; done",
    )


@given("the other node is busy with a job that runs until I release it")
def other_node_busy(world: World) -> None:
    blocker = world.submit("blocker", until_released=True, directives=("--walltime=1m",))
    a = world.cluster.wait_state(blocker.id, "Running", timeout=TIMEOUT)
    assert a["assigned_nodes"] == [world.other], a


@when("I follow the job's output with lattice logs --follow")
def follow_output(world: World) -> None:
    world.follow = subprocess.Popen(
        [sys.executable, "-m", "lattice_cli.main", "logs", world.job.id, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=world.cluster.cli_env(),
        cwd=world.workdir,
    )
    # the live stream is open once the job's ticks come through it
    world.cluster.wait_for(
        "the job's ticks through the follow",
        lambda: _read_ticks(world),
        timeout=TIMEOUT,
    )


def _ticks(lines: list[str]) -> list[str]:
    return [ln for ln in lines if re.search(r"\btick \d+$", ln)]


def _read_ticks(world: World) -> bool:
    """Read what the follow printed so far, straight from the pipe: the file object's
    buffer would keep lines read ahead that ``communicate()`` (which reads the pipe
    itself) never sees."""
    proc = world.follow
    assert proc is not None and proc.stdout is not None
    fd = proc.stdout.fileno()
    if select.select([fd], [], [], 0.2)[0]:
        world.followed += os.read(fd, 1 << 16)
    return bool(_ticks(world.followed.decode(errors="replace").splitlines()))


@then(
    "the follow shows the job's lines, then ends saying the job went back to the queue, with "
    "a hint to follow it again once it runs"
)
def follow_ends_requeued(world: World) -> None:
    proc = world.follow
    assert proc is not None
    try:
        # Down after the heartbeat timeout and the grace period, then requeued
        rest, err = proc.communicate(timeout=RECOVERY_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            "lattice logs --follow did not end once the job was requeued"
        ) from None
    ticks = _ticks((world.followed.decode(errors="replace") + rest).splitlines())
    # every line the job printed before its node died, in order, none twice
    assert [t.rsplit(" ", 1)[1] for t in ticks] == [str(i) for i in range(1, len(ticks) + 1)]
    assert proc.returncode == 0, err
    assert f"lattice: allocation {world.job.id} went back to the queue" in err, err
    assert f"Hint: `lattice logs {world.job.id} --follow` again once it runs" in err, err


@then("the job is Pending, waiting for a node")
def pending_again(world: World) -> None:
    a = world.cluster.get(world.job.id)
    assert a["state"] == "Pending" and a["requeue_count"] == 1, a


@then("the job ran once")
def ran_once(world: World) -> None:
    assert world.trace() == [f"start {world.node}", f"done {world.node}"]


@then("the job is still Running on the node")
def still_running_on_node(world: World) -> None:
    assert world.cluster.get(world.job.id)["state"] == "Running"
    assert world.cluster.node(world.node)["owner"] == world.job.id
    assert process_group_alive(world.pgid)


# --------------------------------------------------------------------------- drift


@when(parsers.parse('the agent of the job\'s node restarts with the conformance group "{group}"'))
def restart_with_group(world: World, group: str) -> None:
    world.baseline = world.cluster.node(world.node)["conformance_group"]
    local = world.cluster.cluster
    local.stop_agent(world.agent)
    world.original_args = list(world.agent.args)
    world.agent.args = [*world.agent.args, "--conformance-group", group]
    local.start_agent(world.agent)


@then(
    parsers.parse(
        'lattice nodes shows the node in conformance group "{group}", drifted from its baseline'
    )
)
def drifted(world: World, group: str) -> None:
    world.cluster.wait_for(
        "the new fingerprint reported",
        lambda: world.cluster.node(world.node)["conformance_group"] == group,
        timeout=TIMEOUT,
    )
    r = world.cli("nodes", world.node, "--output", "json")
    node = json.loads(r.stdout)
    assert node["conformance_group"] == group and node["conformance_drift"], show(r)
    assert node["expected_conformance"] == world.baseline, show(r)


@then(parsers.parse('the node\'s state reason is "{reason}"'))
def state_reason(world: World, reason: str) -> None:
    expected = reason.replace("<baseline>", world.baseline)
    assert world.cluster.node(world.node)["state_reason"] == expected
    assert world.node_field(world.node, "Reason") == expected


# --------------------------------------------------------------------------- restart


@when("the agent of the job's node is killed with SIGKILL")
def kill_agent(world: World) -> None:
    world.cluster.cluster.stop_agent(world.agent, signal.SIGKILL)


@then("the job's processes live on and the job is still Running")
def processes_live_on(world: World) -> None:
    time.sleep(0.5)
    assert process_group_alive(world.pgid), "the job must outlive its agent"
    assert world.cluster.get(world.job.id)["state"] == "Running"


@when("the agent is started again")
def start_agent(world: World) -> None:
    world.cluster.cluster.start_agent(world.agent)


@then("the job went through Running and Completed only")
def went_through(world: World) -> None:
    done = world.cluster.get(world.job.id)
    time.sleep(0.5)  # would catch a second run or a late state change
    assert world.cluster.get(world.job.id) == done
    r = world.recorder
    assert r is not None
    r.join(TIMEOUT)
    assert r.error is None, r.error
    seen = r.states[1:] if r.states[:1] == ["Pending"] else r.states
    assert seen == ["Running", "Completed"], r.states
    assert not process_group_alive(world.pgid)


# --------------------------------------------------------------------------- silence


@when("the job's node dies: its agent and the job's processes are killed")
def node_dies(world: World) -> None:
    world.cluster.cluster.stop_agent(world.agent, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(world.pgid, signal.SIGKILL)
    world.died_at = time.monotonic()


@then(
    "the node goes Ready, Degraded, then Down, and Down no sooner than the heartbeat timeout "
    "and the grace period after"
)
def goes_down(world: World) -> None:
    c = world.cluster

    def down() -> bool:
        job = c.get(world.job.id)["state"]  # first: a requeue comes after Down
        state = c.node(world.node)["state"]
        if not world.node_states or world.node_states[-1] != state:
            world.node_states.append(state)
        if state == "Degraded":
            world.job_while_degraded.append(job)
        return state == "Down"

    c.wait_for(f"{world.node} Down", down, timeout=TIMEOUT, interval=0.05)
    after = time.monotonic() - world.died_at
    assert world.node_states == ["Ready", "Degraded", "Down"], world.node_states
    assert after >= HEARTBEAT_TIMEOUT + GRACE_PERIOD - MONITOR_SLACK, f"Down after {after:.1f}s"


@then("the job kept Running while the node was Degraded")
def kept_running(world: World) -> None:
    assert world.job_while_degraded, "the node was never seen Degraded"
    assert set(world.job_while_degraded) == {"Running"}, world.job_while_degraded


@then("the job started on both nodes and finished on the other one")
def started_on_both(world: World) -> None:
    assert world.trace() == [f"start {world.node}", f"start {world.other}", f"done {world.other}"]


@then(parsers.re(r"the node is Ready again(?P<empty> and holds nothing)?"))
def ready_again(world: World, empty: str | None) -> None:
    c = world.cluster
    c.wait_for(f"{world.node} Ready", lambda: c.node(world.node)["state"] == "Ready", TIMEOUT)
    if empty:
        assert not c.node(world.node)["owner"], c.node(world.node)


@when("the agent of the job's node stops answering")
def agent_hangs(world: World) -> None:
    world.agent.proc.send_signal(signal.SIGSTOP)
    world.stopped = world.agent


@then("the node goes Degraded, still holding the job, which keeps Running")
def goes_degraded(world: World) -> None:
    c = world.cluster
    c.wait_for(f"{world.node} Degraded", lambda: c.node(world.node)["state"] == "Degraded", 15)
    assert c.node(world.node)["owner"] == world.job.id
    assert c.get(world.job.id)["state"] == "Running"


@when("the agent answers again")
def agent_answers(world: World) -> None:
    world.agent.proc.send_signal(signal.SIGCONT)
    world.stopped = None
