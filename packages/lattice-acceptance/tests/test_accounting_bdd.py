"""Steps for features/accounting.feature: the reservation gate, charging and top-ups
through the real ``lattice`` CLI, on a real local cluster with lattice-accounting.

The scenarios share one module-scoped cluster with accounting on (SQLite ledger, charge
passes every second); each works in its own project, so they do not depend on order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.world import World, show
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("accounting.feature")

ADMIN = "ops"
RATE = "36.00"  # per node-hour: 0.01 per node-second
CENT = Decimal("0.01")


@pytest.fixture(scope="module")
def accounting_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(
        tmp_path_factory.mktemp("accounting"),
        members=1,
        agents=2,
        accounting=True,
        accounting_options={"charge_interval_seconds": 1.0},
    )
    h.request("POST", "/api/v1/admin/prices", {"vcluster": "default", "rate": RATE})
    yield h
    h.cluster.stop()


@pytest.fixture
def world(accounting_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World.on(accounting_cluster, tmp_path)
    w.workdir.mkdir(exist_ok=True)
    yield w
    w.clean_up()


@pytest.fixture
def ctx() -> dict[str, Any]:
    return {}


def balance(world: World, *args: str) -> dict[str, Any]:
    r = world.cli("account", "balance", *args, "-o", "json", user=ADMIN)
    return json.loads(r.stdout)


# --------------------------------------------------------------------------- given


@given("a Lattice cluster with accounting")
def with_accounting(world: World) -> None:
    world.check_nodes(2)


@given(
    parsers.parse(
        'a Lattice cluster with accounting and {amount} in project "{project}" of tenant "{tenant}"'
    )
)
def funded_project(world: World, amount: str, project: str, tenant: str) -> None:
    world.check_nodes(2)
    world.cli("account", "topup", "--tenant", tenant, amount, user=ADMIN)
    world.cli("account", "transfer", "--tenant", tenant, "--project", project, amount, user=ADMIN)
    assert balance(world, "--tenant", tenant, "--project", project)["available"] == amount


# --------------------------------------------------------------------------- when


@when(
    parsers.parse(
        'the user submits a 2-second job to project "{project}" with a 10-minute walltime'
    )
)
def submit_funded(world: World, ctx: dict[str, Any], project: str) -> None:
    ctx["job"] = world.submit(
        "charged", "sleep 2", directives=("--walltime=10m", f"--project={project}")
    )


@when(parsers.parse('the user submits a 2-node job with a 2-hour walltime to project "{project}"'))
def submit_underfunded(world: World, ctx: dict[str, Any], project: str) -> None:
    ctx["before"] = len(world.cluster.allocations())
    r = world.cli(
        "submit", "--nodes=2", "--walltime=2h", f"--project={project}", "--", "sleep", "1",
        ok=False,
    )  # fmt: skip
    ctx["refused"] = r


@when(parsers.parse("the administrator runs lattice account topup --tenant {tenant} {amount}"))
def topup(world: World, ctx: dict[str, Any], tenant: str, amount: str) -> None:
    world.cli("account", "topup", "--tenant", tenant, "1", user=ADMIN)  # the account exists
    ctx["before"] = Decimal(balance(world, "--tenant", tenant)["available"])
    r = world.cli("account", "topup", "--tenant", tenant, amount, user=ADMIN)
    assert f"tenant {tenant}: available" in r.stdout, show(r)


# --------------------------------------------------------------------------- then


@then(
    parsers.parse(
        'lattice account balance shows {amount} reserved for project "{project}" while the '
        "job has not ended"
    )
)
def reserved_while_running(world: World, ctx: dict[str, Any], amount: str, project: str) -> None:
    assert world.cluster.get(ctx["job"].id)["state"] not in ("Completed", "Failed", "Cancelled")
    r = world.cli("account", "balance", "--project", project, user=ADMIN)
    assert re.search(rf"Reserved:\s+{re.escape(amount)}$", r.stdout, re.M), show(r)


@then("after the job ends lattice history shows its cost, its runtime at 0.01 per second")
def history_cost(world: World, ctx: dict[str, Any]) -> None:
    job = ctx["job"]
    world.wait_end("charged")

    def settled() -> Any:
        rows = json.loads(world.cli("history", "-o", "json").stdout)
        row = next((a for a in rows if a["id"] == job.id), None)
        costs = world.cluster.request("GET", f"/api/v1/accounts/allocations?ids={job.id}")
        return row if costs["costs"].get(job.id, {}).get("state") == "finalized" else None

    row = world.cluster.wait_for("the job settled", settled, timeout=30)
    runtime = Decimal(repr(row["finished_at"])) - Decimal(repr(row["started_at"]))
    exact = runtime * Decimal(RATE) / 3600
    assert abs(Decimal(row["cost"]) - exact) < Decimal("0.0001"), (row["cost"], exact)
    ctx["cost"] = Decimal(row["cost"])
    table = world.cli("history").stdout
    line = next(x for x in table.splitlines() if x.startswith(job.id))
    assert line.rstrip().endswith(str(ctx["cost"].quantize(CENT))), table


@then(
    parsers.parse(
        "lattice account balance shows 0.00 reserved and {amount} less that cost available in "
        'project "{project}"'
    )
)
def balance_after(world: World, ctx: dict[str, Any], amount: str, project: str) -> None:
    b = balance(world, "--project", project)
    assert b["reserved"] == "0.00", b
    assert Decimal(b["available"]) == (Decimal(amount) - ctx["cost"]).quantize(CENT), b


@then(parsers.parse("the submission is refused with '{message}'"))
def refused_with(ctx: dict[str, Any], message: str) -> None:
    r = ctx["refused"]
    assert r.returncode != 0, show(r)
    assert f"Error: {message}" in r.stderr, show(r)


@then("the refusal has a hint to top up or transfer funds")
def refusal_hint(ctx: dict[str, Any]) -> None:
    r = ctx["refused"]
    assert re.search(r"Hint: Top up the tenant .*transfer funds to the project", r.stderr), show(r)


@then(
    parsers.parse('no allocation was stored and project "{project}" still has {amount} available')
)
def nothing_stored(world: World, ctx: dict[str, Any], project: str, amount: str) -> None:
    assert len(world.cluster.allocations()) == ctx["before"]
    b = balance(world, "--project", project)
    assert b["available"] == amount and b["reserved"] == "0.00", b


@then(
    parsers.parse(
        "lattice account balance --tenant {tenant} shows {amount} more available than before"
    )
)
def more_available(world: World, ctx: dict[str, Any], tenant: str, amount: str) -> None:
    r = world.cli("account", "balance", "--tenant", tenant, user=ADMIN)
    m = re.search(r"^Available:\s+(\S+)$", r.stdout, re.M)
    assert m, show(r)
    assert Decimal(m.group(1)) - ctx["before"] == Decimal(amount), show(r)


@then(parsers.parse("lattice account transactions --kind topup lists the top-up of {amount}"))
def topup_listed(world: World, amount: str) -> None:
    r = world.cli("account", "transactions", "--kind", "topup", user=ADMIN)
    assert re.search(rf"\btopup\s+{re.escape(amount)}\b", r.stdout), show(r)
