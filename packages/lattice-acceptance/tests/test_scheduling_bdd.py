"""Steps for features/scheduling.feature: backfill, preemption, sensitive claims, pending
reasons and live cost-function weights.

Each scenario builds its own small real cluster (``World.start_cluster``, from
``lattice_acceptance.world``, shared with the other step modules that need a fresh cluster),
because the scenarios leave different marks behind (claims, weights). User actions go
through the real ``lattice`` CLI; the REST API is read to observe states, nodes and
timestamps precisely. Jobs are batch scripts that record when they start and, when they
run until released, wait for a ``release`` file (see ``lattice_acceptance.world``). The ``world``
fixture releases and cancels whatever still runs before the cluster is stopped.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass, field

import pytest
from lattice_acceptance.steps import *  # noqa: F403 (shared step definitions)
from lattice_acceptance.world import TIMEOUT, Job, assert_hint_line, fresh_world, log_lines
from lattice_acceptance.world import World as ClusterWorld
from lattice_acceptance.world import show as _show
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

FEATURE = "scheduling.feature"

# Longest acceptable time from submission to start for a job that fits at once.
AT_ONCE_SECONDS = 10.0


scenarios(FEATURE)


# --------------------------------------------------------------------------- world


@dataclass
class World(ClusterWorld):
    victims: list[Job] = field(default_factory=list)
    victim_seconds: int = 0  # how long each preemption victim runs on its own


world = fresh_world(World)  # a cluster of its own per scenario


# --------------------------------------------------------------------------- cluster


@given(
    parsers.re(
        r"a Lattice cluster with (?P<count>\d+) nodes?"
        r'(?: and a "(?P<vcluster>[^"]+)" vCluster)?'
    )
)
def lattice_cluster(world: World, count: str, vcluster: str | None) -> None:
    world.start_cluster(int(count), ("default", vcluster) if vcluster else ("default",))


# --------------------------------------------------------------------------- backfill


@given(
    parsers.parse(
        'a job "{name}" of class {cls:d} with a walltime of {walltime} running on one node'
    )
)
def running_on_one_node(world: World, name: str, cls: int, walltime: str) -> None:
    job = world.submit(
        name,
        directives=(f"--walltime={walltime}", f"--preemption-class={cls}"),
        until_released=True,
    )
    a = world.wait_running(job)
    assert len(a["assigned_nodes"]) == 1, a
    world.node = a["assigned_nodes"][0]  # the busy node


@given(
    parsers.parse(
        'a job "{name}" of class {cls:d} that needs {nodes:d} nodes waiting Pending for '
        "the busy node"
    )
)
def wide_job_waiting(world: World, name: str, cls: int, nodes: int) -> None:
    job = world.submit(
        name,
        "sleep 2",
        directives=("--walltime=5m", f"--preemption-class={cls}", f"--nodes={nodes}"),
    )
    a = world.wait_considered(job)
    assert a["state"] == "Pending", a


@when(parsers.parse('I submit a job "{name}" of class {cls:d} with a walltime of {walltime}'))
def submit_with_walltime(world: World, name: str, cls: int, walltime: str) -> None:
    world.submit(
        name, "sleep 2", directives=(f"--walltime={walltime}", f"--preemption-class={cls}")
    )


@then(parsers.parse('"{name}" runs at once on the free node while "{other}" is still Pending'))
def runs_at_once_on_free_node(world: World, name: str, other: str) -> None:
    job = world.jobs[name]
    a = world.wait_running(job)
    free = [n for n in world.node_ids() if n != world.node]
    assert a["assigned_nodes"] == free, (a, world.node)
    waited = a["started_at"] - a["submitted_at"]
    assert waited < AT_ONCE_SECONDS, f"{name} waited {waited:.1f}s before it started"
    assert world.get(other)["state"] == "Pending", world.get(other)


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: World, name: str) -> None:
    world.wait_end(name)
    assert world.status_field(world.jobs[name].id, "State") == "Completed"


@then(parsers.parse('"{name}" stays Pending next to the idle node while "{other}" waits'))
def stays_pending_next_to_idle_node(world: World, name: str, other: str) -> None:
    (free,) = [n for n in world.node_ids() if n != world.node]

    def check() -> None:
        node = world.cluster.node(free)
        assert node["state"] == "Ready" and not node["owner"], node  # the gap is there
        assert world.get(name)["state"] == "Pending", world.get(name)
        assert world.get(other)["state"] == "Pending", world.get(other)

    world.observe(f"{name} Pending", check)
    assert world.status_field(world.jobs[name].id, "State") == "Pending"


@when(parsers.parse('I cancel "{name}" with lattice cancel'))
def cancel_with_cli(world: World, name: str) -> None:
    job = world.jobs[name]
    r = world.cli("cancel", job.id)
    assert r.stdout.strip() == f"Cancelled allocation {job.id}", _show(r)


@then(parsers.parse('"{name}" runs on both nodes and ends Completed'))
def runs_on_both_nodes(world: World, name: str) -> None:
    a = world.wait_end(name)
    assert sorted(a["assigned_nodes"]) == world.node_ids(), a


@then(parsers.parse('"{name}" started only after "{other}" had started, and ends Completed'))
def started_after(world: World, name: str, other: str) -> None:
    a = world.wait_end(name)
    b = world.get(other)
    assert b["started_at"] is not None, b
    assert a["started_at"] >= b["started_at"], (
        f"{name} started at {a['started_at']}, before {other} at {b['started_at']}"
    )
    order = world.started_order()
    assert order.index(other) < order.index(name), order


# --------------------------------------------------------------------------- preemption


@given(
    parsers.parse("a job of class {cls:d} that runs for {seconds:d} seconds running on every node")
)
def low_jobs_everywhere(world: World, cls: int, seconds: int) -> None:
    # walltime 10m: a job within 5 minutes of its walltime is too near completion to be
    # preempted (Preemption Policy, near_completion_threshold)
    for i, _ in enumerate(world.node_ids(), start=1):
        world.victims.append(
            world.submit(
                f"low-{i}",
                f"sleep {seconds}",
                directives=("--walltime=10m", f"--preemption-class={cls}"),
            )
        )
    placed = [n for job in world.victims for n in world.wait_running(job)["assigned_nodes"]]
    assert sorted(placed) == world.node_ids(), placed
    world.victim_seconds = seconds


@when(parsers.parse('I submit a job "{name}" of class {cls:d} that needs {nodes:d} nodes'))
def submit_multi_node(world: World, name: str, cls: int, nodes: int) -> None:
    world.submit(
        name, directives=("--walltime=10m", f"--preemption-class={cls}", f"--nodes={nodes}")
    )


@then(parsers.parse('"{name}" runs on both nodes while the class-2 jobs would still be running'))
def runs_while_victims_would_run(world: World, name: str) -> None:
    a = world.cluster.wait_for(
        f"{name} to start",
        lambda: (a := world.get(name))["started_at"] is not None and a,
        timeout=TIMEOUT,
    )
    assert sorted(a["assigned_nodes"]) == world.node_ids(), a
    seconds = world.victim_seconds
    for v in world.victims:
        would_end = v.first["started_at"] + seconds
        assert a["started_at"] < would_end, (
            f"{name} started at {a['started_at']}, not before {v.name} would have ended "
            f"on its own ({would_end}): nothing was preempted"
        )


@then("every class-2 job was preempted once and kept its original submit time")
def victims_preempted_once(world: World) -> None:
    assert world.victims
    for v in world.victims:
        a = world.cluster.get(v.id)
        assert a["preempted_count"] == 1, a
        assert a["submitted_at"] == v.first["submitted_at"], (a, v.first)
        assert a["resume_from_checkpoint"] is True, a
        assert a["requeue_count"] == 0, a  # a preemption is not a failure requeue


@then(parsers.parse('every class-2 job runs again after "{name}" and ends Completed'))
def victims_run_again(world: World, name: str) -> None:
    urgent = world.wait_end(name)
    for v in world.victims:
        a = world.wait_end(v.name)
        assert a["started_at"] > v.first["started_at"], (a, v.first)
        # on the nodes the urgent job gave back (0.5 s: the two clocks are not one)
        assert a["started_at"] >= urgent["finished_at"] - 0.5, (a, urgent)
        assert a["preempted_count"] == 1, a


@then(parsers.parse('lattice status of every class-2 job shows "{label}:" {value}'))
def victims_status_shows(world: World, label: str, value: str) -> None:
    for v in world.victims:
        assert world.status_field(v.id, label) == value


@then(parsers.parse('lattice logs of "{name}" show that it started once and finished once'))
def logs_once(world: World, name: str) -> None:
    r = world.cli("logs", world.jobs[name].id)
    assert log_lines(r) == [f"started {name}", f"finished {name}"], _show(r)


@then("lattice logs of every class-2 job show that it started twice and finished once")
def victims_logs(world: World) -> None:
    for v in world.victims:
        r = world.cli("logs", v.id)
        lines = log_lines(r)
        assert lines.count(f"started {v.name}") == 2, _show(r)
        assert lines.count(f"finished {v.name}") == 1, _show(r)


@when(parsers.parse('I submit a job "{name}" of class {cls:d}'))
def submit_of_class(world: World, name: str, cls: int) -> None:
    world.submit(name, directives=("--walltime=5m", f"--preemption-class={cls}"))


@then(parsers.parse('"{name}" stays Pending while "{other}" runs'))
def stays_pending_while_other_runs(world: World, name: str, other: str) -> None:
    world.wait_considered(world.jobs[name])

    def check() -> None:
        assert world.get(other)["state"] == "Running", world.get(other)
        assert world.get(name)["state"] == "Pending", world.get(name)

    world.observe(f"{name} Pending", check)


@then(parsers.parse('"{name}" ends Completed and was never preempted'))
def completed_never_preempted(world: World, name: str) -> None:
    a = world.wait_end(name)
    assert a["preempted_count"] == 0 and a["requeue_count"] == 0, a
    assert world.started_order().count(name) == 1, world.started_order()


# --------------------------------------------------------------------------- node range


@then(parsers.parse("the job runs on the {count:d} free nodes and ends Completed"))
def runs_on_free_nodes(world: World, count: int) -> None:
    assert world.current is not None
    busy = {n for j in world.jobs.values() if j.first for n in j.first["assigned_nodes"]}
    a = world.wait_end(world.current.name)
    assert len(a["assigned_nodes"]) == count, a
    assert not busy & set(a["assigned_nodes"]), (a, busy)


# --------------------------------------------------------------------------- sensitive


def _submit_sensitive(world: World, user: str) -> Job:
    n = sum(1 for j in world.jobs.values() if j.user == user) + 1
    return world.submit(
        f"{user}-{n}",
        "echo regulated",
        directives=("--walltime=5m", "--vcluster=sensitive"),
        user=user,
    )


@when("alice submits a job to the sensitive vCluster with lattice submit")
def alice_submits_sensitive(world: World) -> None:
    world.current = _submit_sensitive(world, "alice")


@then("alice's job ends Completed at preemption class 10")
def alice_job_completed(world: World) -> None:
    job = world.current
    assert job is not None
    a = world.wait_end(job.name)
    assert a["spec"]["user"] == "alice", a["spec"]
    assert a["spec"]["vcluster"] == "sensitive", a["spec"]
    # sensitive work is never preempted: it runs at class 10 whatever was asked
    assert a["spec"]["preemption_class"] == 10, a["spec"]
    assert len(a["assigned_nodes"]) == 1, a
    world.node = a["assigned_nodes"][0]


@then('lattice nodes shows alice\'s node "Claimed by" alice although her job has ended')
def node_claimed_by_alice(world: World) -> None:
    assert world.node_field(world.node, "Claimed by") == "alice"
    node = world.cluster.node(world.node)
    assert node["claimed_by"] == "alice" and not node["owner"], node  # idle, yet claimed


@when(parsers.parse('bob submits a job "{name}" that runs until released'))
def bob_submits_long(world: World, name: str) -> None:
    world.submit(name, directives=("--walltime=5m",), user="bob", until_released=True)


@when(parsers.parse('bob submits a job "{name}"'))
def bob_submits(world: World, name: str) -> None:
    world.submit(name, directives=("--walltime=5m",), user="bob")


@then(parsers.parse('"{name}" runs on the node that is not claimed'))
def runs_on_unclaimed(world: World, name: str) -> None:
    a = world.wait_running(world.jobs[name])
    assert a["assigned_nodes"] == [n for n in world.node_ids() if n != world.node], a


@then(parsers.parse('"{name}" stays Pending although alice\'s claimed node is idle'))
def stays_pending_beside_claimed(world: World, name: str) -> None:
    world.wait_considered(world.jobs[name])

    def check() -> None:
        node = world.cluster.node(world.node)
        assert node["state"] == "Ready" and not node["owner"], node
        assert node["claimed_by"] == "alice", node
        assert world.get(name)["state"] == "Pending", world.get(name)

    world.observe(f"{name} Pending", check)
    assert world.status_field(world.jobs[name].id, "State") == "Pending"


@then("alice's next sensitive job runs on her claimed node")
def alice_next_job(world: World) -> None:
    job = _submit_sensitive(world, "alice")
    a = world.wait_end(job.name)
    assert a["assigned_nodes"] == [world.node], a
    assert world.cluster.node(world.node)["claimed_by"] == "alice"


@then(
    parsers.parse(
        "the cluster's log store holds the output of \"{name}\" and nothing of alice's job"
    )
)
def log_store_without_sensitive_output(world: World, name: str) -> None:
    # the node's claim came with alice's job in its desired state: her output stays on
    # the node (no sensitive pool configured here), bob's went to the ordinary store
    assert world.current is not None
    store = world.cluster.cluster.base / "log-store"
    keys = [str(p.relative_to(store)) for p in store.rglob("*") if p.is_file()]
    assert any(world.jobs[name].id in k for k in keys), keys
    assert not any(world.current.id in k for k in keys), keys
    r = world.cli("logs", world.jobs[name].id)
    assert f"finished {name}" in log_lines(r), _show(r)


@when("alice releases her node with lattice node release")
def alice_releases(world: World) -> None:
    world.cli("node", "release", world.node, user="alice")


@then("lattice confirms that the node is released, Ready and unclaimed")
def release_confirmed(world: World) -> None:
    r = world.last
    assert r is not None
    assert r.stdout.strip() == f"Node {world.node} released; it is Ready and unclaimed", _show(r)


@then('lattice nodes shows nobody in "Claimed by" for the node')
def node_unclaimed(world: World) -> None:
    assert world.node_field(world.node, "Claimed by") == "—"
    assert world.cluster.node(world.node)["claimed_by"] == ""


@then(parsers.parse('"{name}" runs on the released node and ends Completed'))
def runs_on_released_node(world: World, name: str) -> None:
    a = world.wait_end(name)
    assert a["assigned_nodes"] == [world.node], a


@when("I release the node with lattice node release")
def release_unclaimed(world: World) -> None:
    world.node = world.node_ids()[0]
    world.cli("node", "release", world.node, ok=False)


@then(parsers.parse('lattice refuses with an error mentioning "{text}"'))
def refused(world: World, text: str) -> None:
    r = world.last
    assert r is not None
    assert r.returncode != 0, _show(r)
    assert text in r.stderr, _show(r)


@then('the error carries a "Hint:" line')
def carries_hint_line(world: World) -> None:
    assert world.last is not None
    assert_hint_line(world.last)


@then("the node is still Ready and unclaimed")
def node_still_ready(world: World) -> None:
    node = world.cluster.node(world.node)
    assert node["state"] == "Ready" and node["claimed_by"] == "", node


@then("the lattice command named in the hint runs without error")
def hint_command_works(world: World) -> None:
    r = world.last
    assert r is not None
    hint = next((ln for ln in r.stderr.splitlines() if ln.startswith("Hint: ")), "")
    # a command in backticks, else "lattice" and its words up to the first plain word
    # after an option ("lattice nodes --verbose shows ...")
    m = re.search(r"`(lattice [^`]+)`", hint)
    if m:
        words = shlex.split(m.group(1))
    else:
        found = re.search(r"\blattice\s+(.*)", hint)
        assert found, f"the hint names no lattice command: {hint!r}"
        words = ["lattice"]
        for w in found.group(1).rstrip(".").split():
            if len(words) > 1 and not w.startswith("-") and words[-1].startswith("-"):
                break
            words.append(w)
    out = world.cli(*words[1:], ok=False)
    assert out.returncode == 0, f"the hint {hint!r} suggests {shlex.join(words)}:\n{_show(out)}"


# --------------------------------------------------------------------------- pending reasons


@when(parsers.re(r"I submit a job with lattice submit(?P<flags>(?: \S+)*)"))
def submit_with_flags(world: World, flags: str) -> None:
    r = world.cli("submit", "--walltime=5m", *shlex.split(flags), "--", "echo", "ran")
    m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
    assert m, _show(r)
    job = Job(name="the-job", id=m.group(1), dir=world.workdir, user="tester")
    world.jobs[job.name] = world.current = job


@then("the job stays Pending although the node is idle")
def stays_pending_node_idle(world: World) -> None:
    job = world.current
    assert job is not None
    world.wait_considered(job)

    def check() -> None:
        for n in world.cluster.nodes():
            assert n["state"] == "Ready" and not n["owner"], n
        assert world.cluster.get(job.id)["state"] == "Pending"

    world.observe(f"{job.id} Pending", check)


@then("the job stays Pending although a node is idle")
def stays_pending_beside_idle_node(world: World) -> None:
    job = world.current
    assert job is not None
    world.wait_considered(job)

    def check() -> None:
        nodes = world.cluster.nodes()
        assert any(n["state"] == "Ready" and not n["owner"] for n in nodes), nodes
        assert world.cluster.get(job.id)["state"] == "Pending"

    world.observe(f"{job.id} Pending", check)


@then(parsers.parse('the job stays Pending while "{name}" runs'))
def stays_pending_while(world: World, name: str) -> None:
    job = world.current
    assert job is not None
    world.wait_considered(job)

    def check() -> None:
        assert world.get(name)["state"] == "Running"
        assert world.cluster.get(job.id)["state"] == "Pending"

    world.observe(f"{job.id} Pending", check)


@then(
    parsers.re(
        r'lattice status of the job(?P<verbose> with --verbose)? shows "(?P<label>[^"]+):" '
        r'"(?P<reason>[^"]+)"'
    )
)
def status_reason(world: World, verbose: str | None, label: str, reason: str) -> None:
    job = world.current
    assert job is not None
    world.wait_considered(job)
    flags = ("--verbose",) if verbose else ()
    assert world.status_field(job.id, label, *flags) == reason
    assert world.status_field(job.id, "State", *flags) == "Pending"


@then(parsers.parse('the REASON column of lattice status --verbose shows "{reason}" for the job'))
def status_table_reason(world: World, reason: str) -> None:
    job = world.current
    assert job is not None
    r = world.cli("status", "--verbose")
    lines = r.stdout.splitlines()
    assert lines and "REASON" in lines[0], _show(r)
    column = lines[0].index("REASON")
    row = next((ln for ln in lines[1:] if ln.split()[:1] == [job.id]), None)
    assert row is not None, _show(r)
    assert row[column:].strip() == reason, _show(r)


@given(parsers.parse('a job "{name}" of class {cls:d} that runs until released'))
def job_until_released(world: World, name: str, cls: int) -> None:
    job = world.submit(
        name, directives=("--walltime=5m", f"--preemption-class={cls}"), until_released=True
    )
    world.wait_running(job)


@when(parsers.parse('I release "{name}"'))
def release_job(world: World, name: str) -> None:
    world.release(name)


@then("the job ends Completed")
def the_job_ends_completed(world: World) -> None:
    assert world.current is not None
    world.wait_end(world.current.name)


# --------------------------------------------------------------------------- weights


@given(
    parsers.re(
        r'(?P<later>a second later )?a job "(?P<name>[^"]+)" of class (?P<cls>\d+) waiting Pending'
    )
)
def job_waiting(world: World, later: str | None, name: str, cls: str) -> None:
    if later:
        time.sleep(1.0)  # it has waited a second less than the one before
    job = world.submit(name, directives=("--walltime=5m", f"--preemption-class={cls}"))
    a = world.wait_considered(job)
    assert a["state"] == "Pending", a


@when(
    parsers.parse(
        'the administrator sets the weights of vCluster "{vcluster}" to priority '
        "{priority:g} and wait time {wait_time:g}, and every other weight to 0"
    )
)
def set_weights(world: World, vcluster: str, priority: float, wait_time: float) -> None:
    world.set_weights(vcluster, {"priority": priority, "wait_time": wait_time})


@then(parsers.parse('lattice admin vcluster list shows those weights for "{vcluster}"'))
def weights_listed(world: World, vcluster: str) -> None:
    assert world.listed_weights(vcluster) == world.weights


@then(parsers.parse("lattice admin vcluster show {vcluster} shows those weights"))
def weights_shown(world: World, vcluster: str) -> None:
    r = world.cli("admin", "vcluster", "show", vcluster)
    for w, v in world.weights.items():
        shown = re.search(rf"^Weight {w}:\s+(\S+)\s*$", r.stdout, re.MULTILINE)
        assert shown and float(shown.group(1)) == v, f"weight {w} is not {v:g}:\n{_show(r)}"


@then(parsers.parse('"{first}" starts before "{second}" and both end Completed'))
def starts_first(world: World, first: str, second: str) -> None:
    a, b = world.wait_end(first), world.wait_end(second)
    order = [n for n in world.started_order() if n in (first, second)]
    assert order == [first, second], f"started in the order {order}"
    assert a["started_at"] < b["started_at"], (a, b)
