"""Steps for features/admission.feature: refusals at submission (vCluster size, node
properties, tenant quota), --wait-for-capacity, pending reasons with numbers, estimated
start times, submit --test-only and the vCluster queue view.

Each scenario starts its own small real cluster (``World.start_cluster``, from
``lattice_acceptance.world``). Users act through the real ``lattice`` CLI; the REST API
is read (and, for refusals, posted to) to check what was stored. The ``world`` fixture
releases and cancels whatever still runs before the cluster is stopped.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest
from lattice_acceptance.steps import *  # noqa: F403 (shared step definitions)
from lattice_acceptance.world import TIMEOUT, Job, assert_rejected, fresh_world
from lattice_acceptance.world import World as ClusterWorld
from lattice_acceptance.world import show as _show
from lattice_test_harness.cluster import ApiError
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("admission.feature")

# How far an estimate may lie from the time computed here (clocks, rounding, cycles).
ESTIMATE_SLACK = 5.0


@dataclass
class World(ClusterWorld):
    before: list[str] = field(default_factory=list)  # allocation ids before a refusal
    flags: list[str] = field(default_factory=list)  # the refused submission's flags
    api_error: ApiError | None = None


world = fresh_world(World)  # a cluster of its own per scenario


def _listed_ids(world: World) -> list[str]:
    """Every allocation's id, as an administrator sees them with lattice status --all."""
    r = world.cli("status", "--all", "-o", "json", user="admin")
    return sorted(a["id"] for a in json.loads(r.stdout))


def _keep_if_accepted(world: World, stdout: str) -> None:
    """A submission accepted by mistake is cancelled after the scenario."""
    if m := re.search(r"Submitted allocation (\S+)", stdout):
        world.jobs[m.group(1)] = Job(name=m.group(1), id=m.group(1), dir=world.workdir, user="")


def _submit_cli(world: World, name: str, *flags: str, user: str = "tester") -> Job:
    r = world.cli("submit", f"--name={name}", *flags, "--", "echo", "ran", user=user)
    m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
    assert m, _show(r)
    job = Job(name=name, id=m.group(1), dir=world.workdir, user=user)
    world.jobs[name] = world.current = job
    return job


# --------------------------------------------------------------------------- cluster


@given(parsers.re(r"a Lattice cluster with (?P<count>\d+) nodes?"))
def lattice_cluster(world: World, count: str) -> None:
    world.start_cluster(int(count))


# --------------------------------------------------------------------------- refusals


@when(
    parsers.re(
        r"I run lattice submit (?P<flags>.+) and keep a list of every allocation from before"
    )
)
def submit_refused(world: World, flags: str) -> None:
    world.before = _listed_ids(world)
    world.flags = shlex.split(flags)
    r = world.cli("submit", "--walltime=5m", *world.flags, "--", "true", ok=False)
    _keep_if_accepted(world, r.stdout)


@then(parsers.parse("lattice refuses the submission with an error saying '{error}'"))
def refused_with(world: World, error: str) -> None:
    assert world.last is not None
    assert_rejected(world.last, error)


@then(parsers.parse("the refusal explains itself with '{detail}'"))
def refusal_detail(world: World, detail: str) -> None:
    r = world.last
    assert r is not None
    assert detail in r.stderr, _show(r)
    hints = [ln for ln in r.stderr.splitlines() if ln.startswith("Hint: ")]
    assert hints and len(hints[0]) > len("Hint: ") + 5, _show(r)
    if detail == "--wait-for-capacity":
        assert "--wait-for-capacity" in hints[0], _show(r)
    if detail == "Available:":
        # what the nodes do have, so that the user can pick a constraint that matches
        (avail,) = [ln for ln in r.stderr.splitlines() if "Available:" in ln]
        listed = avail.split("Available:", 1)[1].strip()
        nodes = json.loads(world.cli("nodes", "-o", "json").stdout)
        kinds = {(n.get("capabilities") or {}).get("gpu_type") or "" for n in nodes} - {""}
        if kinds:
            assert all(k in listed for k in kinds), (kinds, _show(r))
        else:
            assert listed == "none", _show(r)  # these nodes have no GPUs at all


@then("lattice status --all shows the same allocations as before")
def same_allocations(world: World) -> None:
    assert _listed_ids(world) == world.before


def _rest_body(flags: list[str]) -> dict[str, Any]:
    """The REST request that the refused CLI flags stand for."""
    body: dict[str, Any] = {}
    words = [w for f in flags for w in (f.split("=", 1) if f.startswith("--") else [f])]
    it = iter(words)
    for flag in it:
        value = next(it)
        if flag == "--nodes":
            body["nodes"] = int(value)
        elif flag == "--constraint":
            k, v = value.split("=", 1)
            body["constraints"] = {k: v}
        elif flag == "--tenant":
            body["tenant"] = value
        else:
            raise AssertionError(f"no REST field for {flag}")
    return body


@when("I POST the same request to the REST API")
def post_same(world: World) -> None:
    try:
        a = world.cluster.submit("true", **_rest_body(world.flags))
    except ApiError as e:
        world.api_error = e
    else:
        world.jobs[a["id"]] = Job(name=a["id"], id=a["id"], dir=world.workdir, user="")
        raise AssertionError(f"the API accepted {world.flags}: {a}")


@then(parsers.parse("the API answers {status:d} {code} and again nothing is stored"))
def api_refused(world: World, status: int, code: str) -> None:
    e = world.api_error
    assert e is not None
    assert (e.status, e.error.get("code")) == (status, code), (e.status, e.error)
    assert len(e.error.get("hint") or "") > 5, e.error
    assert sorted(a["id"] for a in world.cluster.allocations()) == world.before


# --------------------------------------------------------------------------- wait for capacity


@when(
    parsers.parse(
        'I submit a job "{name}" that needs {nodes:d} nodes with lattice submit --wait-for-capacity'
    )
)
def submit_waiting_for_capacity(world: World, name: str, nodes: int) -> None:
    _submit_cli(world, name, "--walltime=5m", f"--nodes={nodes}", "--wait-for-capacity")


@then(parsers.parse('lattice accepts "{name}" and it stays Pending'))
def accepted_pending(world: World, name: str) -> None:
    job = world.jobs[name]
    world.wait_considered(job)

    def check() -> None:
        assert world.get(name)["state"] == "Pending", world.get(name)

    world.observe(f"{name} Pending", check)
    assert world.status_field(job.id, "State") == "Pending"


@then(parsers.parse('lattice status of "{name}" says it is {reason}'))
def status_says_waiting(world: World, name: str, reason: str) -> None:
    shown = world.status_field(world.jobs[name].id, "Pending reason")
    assert shown.startswith(reason), shown


@when("a third node joins the cluster")
def third_node_joins(world: World) -> None:
    world.cluster.cluster.add_agent()
    world.cluster.wait_for(
        "3 Ready nodes",
        lambda: sum(n["state"] == "Ready" for n in world.cluster.nodes()) == 3,
        timeout=TIMEOUT,
    )
    assert len(json.loads(world.cli("nodes", "-o", "json").stdout)) == 3


@then(parsers.parse('"{name}" runs on all {count:d} nodes and ends Completed'))
def runs_on_all_nodes(world: World, name: str, count: int) -> None:
    a = world.wait_end(name)
    assert sorted(a["assigned_nodes"]) == world.node_ids() and len(world.node_ids()) == count, a
    assert world.status_field(world.jobs[name].id, "State") == "Completed"


# --------------------------------------------------------------------------- quota reason


@when(parsers.parse('I submit a job "{name}" of tenant "{tenant}"'))
def submit_tenant_job(world: World, name: str, tenant: str) -> None:
    world.current = world.submit(name, directives=("--walltime=5m", f"--tenant={tenant}"))


@then(parsers.parse('lattice status of "{name}" shows the pending reason "{reason}"'))
def status_pending_reason(world: World, name: str, reason: str) -> None:
    job = world.jobs[name]
    world.wait_considered(job)
    assert world.status_field(job.id, "Pending reason") == reason
    assert world.status_field(job.id, "State") == "Pending"
    # a node is idle all the while: the quota, not the cluster, holds the job back
    assert any(n["state"] == "Ready" and not n["owner"] for n in world.cluster.nodes())


@when(parsers.parse('I release "{name}"'))
def release_job(world: World, name: str) -> None:
    world.release(name)


@then(parsers.parse('"{name}" ends Completed'))
def ends_completed(world: World, name: str) -> None:
    world.wait_end(name)


# --------------------------------------------------------------------------- test-only


@when(parsers.parse("I ask lattice submit --test-only when a {nodes:d}-node job would start"))
def ask_test_only(world: World, nodes: int) -> None:
    world.stored_before = len(world.cluster.allocations())
    world.cli("submit", "--test-only", "--walltime=5m", f"--nodes={nodes}", "--", "true")


@then(parsers.parse('lattice answers "{first}" and "{last}"'))
def answers(world: World, first: str, last: str) -> None:
    r = world.last
    assert r is not None
    lines = r.stdout.splitlines()
    assert lines and lines[0].startswith(first), _show(r)
    assert lines[-1] == last, _show(r)
    assert "Submitted" not in r.stdout, _show(r)


@then("no allocation was stored")
def nothing_stored(world: World) -> None:
    assert len(world.cluster.allocations()) == world.stored_before


# --------------------------------------------------------------------------- estimates


@given(
    parsers.re(
        r'jobs? (?P<names>"[^"]+"(?: and "[^"]+")*) with a walltime of (?P<walltime>\S+) '
        r"holds? (?:both nodes|the node) until released"
    )
)
def holders(world: World, names: str, walltime: str) -> None:
    jobs = [
        world.submit(n, directives=(f"--walltime={walltime}",), until_released=True)
        for n in re.findall(r'"([^"]+)"', names)
    ]
    for job in jobs:
        world.wait_running(job)
    assert all(n["owner"] for n in world.cluster.nodes()), world.cluster.nodes()


@when(parsers.parse('I submit a job "{name}" that needs {nodes:d} nodes with a walltime of {wt}'))
def submit_wide(world: World, name: str, nodes: int, wt: str) -> None:
    _submit_cli(world, name, f"--walltime={wt}", f"--nodes={nodes}")


def _estimated(world: World, name: str) -> dict[str, Any]:
    return world.cluster.wait_for(
        f"an estimated start for {name}",
        lambda: (a := world.get(name)).get("estimated_start") and a,
        timeout=TIMEOUT,
    )


@then(parsers.parse('lattice status shows an estimated START_TIME "~HH:MM" for "{name}"'))
def status_table_start(world: World, name: str) -> None:
    _estimated(world, name)
    job = world.jobs[name]
    r = world.cli("status")
    lines = r.stdout.splitlines()
    assert lines and "START_TIME" in lines[0], _show(r)
    row = next((ln for ln in lines[1:] if ln.split()[:1] == [job.id]), None)
    assert row is not None, _show(r)
    cell = row[lines[0].index("START_TIME") :].split()[0]
    assert re.fullmatch(r"~\d\d:\d\d", cell), f"START_TIME {cell!r}:\n{_show(r)}"


@then(
    parsers.parse('the estimated start of "{name}" is when the later holder reaches its walltime')
)
def estimate_matches_walltime(world: World, name: str) -> None:
    _estimated(world, name)
    r = world.cli("status", world.jobs[name].id, "-o", "json")
    a = json.loads(r.stdout)
    assert a["state"] == "Pending", _show(r)
    holders = [j for j in world.jobs.values() if j.first]
    assert holders
    expected = max(
        world.cluster.get(j.id)["started_at"] + world.cluster.get(j.id)["spec"]["walltime_seconds"]
        for j in holders
    )
    assert abs(float(a["estimated_start"]) - expected) <= ESTIMATE_SLACK, (
        f"estimated_start {a['estimated_start']} is not near {expected}:\n{_show(r)}"
    )
    assert a["estimate_basis"] in ("simulation", "reservation"), _show(r)


@then(parsers.parse('lattice status of "{name}" shows an "Estimated start:" line'))
def status_estimated_line(world: World, name: str) -> None:
    shown = world.status_field(world.jobs[name].id, "Estimated start")
    assert re.search(r"\d\d:\d\d", shown) and "estimate:" in shown, shown


@given(
    parsers.re(
        r'jobs (?P<names>"[^"]+"(?:, "[^"]+")* and "[^"]+") with walltimes of '
        r"(?P<walltimes>\S+(?:, \S+)* and \S+) run until their walltime stops them"
    )
)
def walltime_holders(world: World, names: str, walltimes: str) -> None:
    """Jobs that would run forever: the agent ends each at its walltime, on time."""
    ws = re.split(r", | and ", walltimes)
    jobs = [
        world.submit(n, directives=(f"--walltime={w}",), until_released=True)
        for n, w in zip(re.findall(r'"([^"]+)"', names), ws, strict=True)
    ]
    for job in jobs:
        world.wait_running(job)


@then(
    parsers.parse(
        'the estimated start of "{name}" is when "{holder}" reaches its walltime, held as a '
        "reservation"
    )
)
def estimate_is_reservation(world: World, name: str, holder: str) -> None:
    h = world.get(holder)
    expected = h["started_at"] + h["spec"]["walltime_seconds"]
    a = world.cluster.wait_for(
        f"a reservation estimate for {name}",
        lambda: (x := world.get(name)).get("estimate_basis") == "reservation" and x,
        timeout=TIMEOUT,
    )
    assert abs(float(a["estimated_start"]) - expected) <= ESTIMATE_SLACK, (a, expected)
    world.current = world.jobs[name]


@then(
    parsers.parse(
        "lattice submit --test-only says a {nodes:d}-node job with a walltime of {wt} would "
        "start now"
    )
)
def says_it_would_start_now(world: World, nodes: int, wt: str) -> None:
    before = _listed_ids(world)
    r = world.cli("submit", "--test-only", f"--nodes={nodes}", f"--walltime={wt}", "--", "true")
    assert r.stdout.startswith(f"Would start now on {nodes} node"), _show(r)
    assert _listed_ids(world) == before


@when(parsers.parse('I submit the {nodes:d}-node job "{name}" with a walltime of {wt}'))
def submit_short(world: World, nodes: int, name: str, wt: str) -> None:
    _submit_cli(world, name, f"--walltime={wt}", f"--nodes={nodes}")


def _started(world: World, name: str, timeout: float) -> dict[str, Any]:
    """The record once it has started (it may already have ended: these jobs are short)."""
    return world.cluster.wait_for(
        f"{name} started", lambda: (x := world.get(name)).get("started_at") and x, timeout=timeout
    )


@then(parsers.parse('"{name}" starts at once on the free node'))
def starts_at_once(world: World, name: str) -> None:
    a = _started(world, name, TIMEOUT)
    assert a["started_at"] - a["submitted_at"] < 10.0, a
    held = {n for j in ("hold-1", "hold-2", "hold-3") for n in world.get(j)["assigned_nodes"]}
    assert not set(a["assigned_nodes"]) & held, (a, held)


@then(
    parsers.parse(
        '"{name}" starts on all {count:d} nodes within a few seconds of its estimated start'
    )
)
def starts_as_estimated(world: World, name: str, count: int) -> None:
    estimated = float(world.get(name)["estimated_start"])
    a = _started(world, name, TIMEOUT + 40)
    assert len(a["assigned_nodes"]) == count, a
    assert abs(a["started_at"] - estimated) <= ESTIMATE_SLACK, (a["started_at"], estimated)


@given(
    parsers.parse('a job "{name}" with a walltime of {wt} holds one of the nodes until released')
)
def one_holder(world: World, name: str, wt: str) -> None:
    world.wait_running(world.submit(name, directives=(f"--walltime={wt}",), until_released=True))


@given(parsers.parse('I have a job "{name}" that needs {nodes:d} nodes waiting Pending'))
def wide_waiting(world: World, name: str, nodes: int) -> None:
    job = _submit_cli(world, name, "--walltime=1m", f"--nodes={nodes}")
    assert world.wait_considered(job)["state"] == "Pending"


@when("the operator disables the idle node")
def disable_idle_node(world: World) -> None:
    (idle,) = [n["id"] for n in world.cluster.nodes() if not n["owner"]]
    world.node = idle
    world.cli("node", "disable", idle, "--yes", "--reason", "maintenance", user="admin")


@then(parsers.parse('lattice status of "{name}" eventually shows the pending reason "{reason}"'))
def eventually_reason(world: World, name: str, reason: str) -> None:
    job = world.jobs[name]
    world.cluster.wait_for(
        f"the pending reason of {name}: {reason}",
        lambda: world.get(name).get("pending_reason") == reason,
        timeout=TIMEOUT,
    )
    assert world.status_field(job.id, "Pending reason") == reason


@when(parsers.parse('the operator enables the node again and I release "{name}"'))
def enable_and_release(world: World, name: str) -> None:
    world.cli("node", "enable", world.node, user="admin")
    world.release(name)


# --------------------------------------------------------------------------- queue


@given(parsers.re(r'(?P<who>I|bob) (?:have|has) a job "(?P<name>[^"]+)" waiting Pending'))
def job_waiting(world: World, who: str, name: str) -> None:
    user = "bob" if who == "bob" else "tester"
    job = _submit_cli(world, name, "--walltime=1m", user=user)
    a = world.wait_considered(job)
    assert a["state"] == "Pending", a


@when("I look at the queue with lattice queue")
def look_at_queue(world: World) -> None:
    world.cli("queue")


@then(
    parsers.parse(
        'it says the vCluster default has {total:d} pending and lists "{name}" with its '
        "position, score, start time, basis and reason"
    )
)
def queue_table(world: World, total: int, name: str) -> None:
    r = world.last
    assert r is not None
    lines = r.stdout.splitlines()
    assert lines and lines[0].startswith(f"vCluster default: {total} pending, 1 shown"), _show(r)
    header = lines[1].split()
    assert header == ["POS", "ID", "USER", "NODES", "SCORE", "START_TIME", "BASIS", "REASON"], (
        _show(r)
    )
    job = world.jobs[name]
    rows = [ln for ln in lines[2:] if job.id in ln.split()]
    assert len(rows) == 1, _show(r)
    cells = rows[0].split()
    assert cells[0] in ("1", "2") and cells[2] == "tester" and cells[3] == "1", _show(r)
    assert re.fullmatch(r"-?\d+\.\d{3}", cells[4]), _show(r)
    reason = rows[0][lines[1].index("REASON") :].strip()
    assert reason, _show(r)


@then(
    "lattice queue -o json gives each entry a position, score, factor breakdown, pending "
    "reason and estimated start"
)
def queue_json(world: World) -> None:
    r = world.cli("queue", "-o", "json")
    q = json.loads(r.stdout)
    assert q["entries"], _show(r)
    for e in q["entries"]:
        assert isinstance(e["position"], int) and e["position"] >= 1, e
        assert isinstance(e["score"], (int, float)), e
        assert "c1_priority" in e["breakdown"], e
        assert e["pending_reason"], e
        assert "estimated_start" in e, e
    assert [e["allocation"]["id"] for e in q["entries"]] == [world.jobs["mine"].id], q


@then(parsers.parse("the REST queue of vCluster default counts the same {total:d} pending"))
def rest_queue(world: World, total: int) -> None:
    q = world.cluster.request("GET", "/api/v1/vclusters/default/queue")
    assert q["total"] == total, q
    cli = json.loads(world.cli("queue", "-o", "json").stdout)
    assert cli["total"] == q["total"], (cli, q)


@then(parsers.parse('bob sees only "{name}" in lattice queue, with the same {total:d} pending'))
def bob_queue(world: World, name: str, total: int) -> None:
    r = world.cli("queue", "-o", "json", user="bob")
    q = json.loads(r.stdout)
    assert q["total"] == total, _show(r)
    assert [e["allocation"]["id"] for e in q["entries"]] == [world.jobs[name].id], _show(r)
    assert all(e["allocation"]["spec"]["user"] == "bob" for e in q["entries"]), _show(r)
    table = world.cli("queue", user="bob")
    assert table.stdout.startswith(f"vCluster default: {total} pending, 1 shown"), _show(table)
    assert world.jobs["mine"].id not in table.stdout, _show(table)
