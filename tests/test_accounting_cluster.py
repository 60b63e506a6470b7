"""Accounting end to end on a real dev cluster: lattice-server, a scheduler, agents and
lattice-accounting as processes, the ledger in SQLite (the dev default) or in a
throwaway PostgreSQL.

* a funded project runs a job: the reservation is held while it waits and runs, and the
  final charge is nodes x runtime x price to the cent, the rest released;
* an underfunded submission is refused with the numbers, and nothing is stored;
* kill -9 of lattice-accounting while a job runs, then a restart: the job is charged
  exactly once (the ledger against the runtimes); while it is down, running work and
  scheduling go on and submissions are refused with 503 and a hint;
* an unbounded job that outlives its funds is cancelled with reason funds_exhausted,
  the project drained to zero and never below;
* the watchdog releases an orphan reservation (reserved, no allocation ever proposed);
* many parallel submissions through the API against PostgreSQL never together reserve
  more than the balance.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lattice_test_harness.cluster import ApiError, ClusterHandle

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

RATE = Decimal("36.00")  # per node-hour: 0.01 per node-second
PER_SECOND = RATE / 3600
OPTIONS = {
    "charge_interval_seconds": 1.0,
    "funds_exhausted_grace_seconds": 1.0,
    "reservation_orphan_grace_seconds": 2.0,
    "reserve_ahead_seconds": 3.0,
}


def money(text: Any) -> Decimal:
    return Decimal(str(text))


def cents(d: Decimal) -> Decimal:
    return d.quantize(Decimal("0.01"))


def setup_money(h: ClusterHandle, *, topup: str, transfer: str, project: str = "default") -> None:
    t = h.cluster.tenant
    if not h.request("GET", "/api/v1/admin/prices")["prices"]:
        h.request("POST", "/api/v1/admin/prices", {"vcluster": "default", "rate": str(RATE)})
    h.request("POST", "/api/v1/accounts/topup", {"tenant": t, "amount": topup})
    h.request(
        "POST", "/api/v1/accounts/transfer", {"tenant": t, "project": project, "amount": transfer}
    )


def balance(h: ClusterHandle, project: str = "default") -> dict[str, Any]:
    return h.request("GET", f"/api/v1/accounts/balance?tenant={h.cluster.tenant}&project={project}")


def cost(h: ClusterHandle, alloc_id: str) -> dict[str, Any]:
    got = h.request("GET", f"/api/v1/accounts/allocations?ids={alloc_id}")["costs"]
    return got.get(alloc_id) or {}


def finalized(h: ClusterHandle, alloc_id: str, timeout: float = 30.0) -> dict[str, Any]:
    return h.wait_for(
        f"{alloc_id} settled", lambda: (c := cost(h, alloc_id)).get("state") == "finalized" and c,
        timeout,
    )  # fmt: skip


def runtime_cost(a: dict[str, Any], nodes: int = 1) -> Decimal:
    seconds = Decimal(repr(a["finished_at"])) - Decimal(repr(a["started_at"]))
    return seconds * nodes * PER_SECOND


def internal(h: ClusterHandle, method: str, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(
        h.cluster.accounting_url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={
            "Authorization": f"Bearer {h.cluster.accounting_token}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def bad_input_changes_nothing(h: ClusterHandle) -> None:
    """Refusals keep their message and hint through REST, gRPC and the CLI; nothing is
    written."""
    before = (balance(h), h.request("GET", "/api/v1/admin/prices"))
    refusals = [
        ("/api/v1/accounts/topup", {"tenant": "default", "amount": "-5"}, 400, "positive"),
        ("/api/v1/accounts/topup", {"tenant": "default", "amount": "abc"}, 400, "not a number"),
        ("/api/v1/accounts/topup", {"tenant": "nope", "amount": "5"}, 404, "tenant nope"),
        ("/api/v1/accounts/transfer", {"tenant": "default", "project": "default", "amount": "1000"},
         412,
         "insufficient funds"),
        ("/api/v1/admin/prices", {"vcluster": "default", "rate": str(RATE)}, 409, "overlaps"),
        ("/api/v1/admin/prices", {"vcluster": "default", "rate": "x"}, 400, "rate"),
    ]  # fmt: skip
    for path, body, status, text in refusals:
        with pytest.raises(ApiError) as e:
            h.request("POST", path, body)
        assert e.value.status == status and text in e.value.error["message"], (path, e.value)
        assert e.value.error.get("hint"), (path, e.value.error)

    async def over_grpc() -> Any:
        from grpclib.client import Channel
        from lattice_common.proto.lattice import v1

        host, port = h.cluster.members[0].grpc_address.rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            stub = v1.AccountingServiceStub(channel, timeout=10)
            with pytest.raises(GRPCError) as e:
                await stub.top_up(v1.TopUpRequest(tenant="default", amount="-5"))
            return e.value
        finally:
            channel.close()

    err = asyncio.run(over_grpc())
    assert err.status == Status.INVALID_ARGUMENT, err
    detail = json.loads(err.message or "{}")
    assert "positive" in detail["message"] and detail["hint"], detail
    r = h.cli("account", "topup", "--tenant", "default", "12.x")
    assert r.returncode == 1 and "Error: amount is not a number" in r.stderr, r.stderr
    assert "Hint:" in r.stderr
    assert (balance(h), h.request("GET", "/api/v1/admin/prices")) == before


def test_accounting_on_a_dev_cluster(cluster_factory: Any) -> None:
    h: ClusterHandle = cluster_factory(
        members=1, agents=2, accounting=True, accounting_options=OPTIONS
    )
    setup_money(h, topup="100", transfer="20")
    bad_input_changes_nothing(h)

    # an underfunded submission: refused with the numbers, nothing stored
    before = len(h.allocations())
    with pytest.raises(ApiError) as e:
        h.submit("sleep 1", nodes=2, walltime="1h")
    assert e.value.status == 412
    assert e.value.error["message"] == (
        'allocation rejected: project "default/default" has 20.00 available, the estimate '
        "is 72.00 (2 nodes x 1h x 36.00/node-hour)"
    )
    assert "Top up" in e.value.error["hint"]
    assert len(h.allocations()) == before
    assert balance(h) | {"account": ""} == {
        "account": "", "tenant": "default", "project": "default", "available": "20.00",
        "reserved": "0.00", "spent": "0.00", "allocated": "0.00",
    }  # fmt: skip

    # a funded job: 10 minutes reserved (6.00) while it waits and runs, then exactly
    # its runtime charged and the rest released
    a = h.submit("sleep 2", walltime="10m")
    assert money(balance(h)["reserved"]) == Decimal("6.00")
    done = h.wait_state(a["id"], "Completed", timeout=60)
    c = finalized(h, a["id"])
    assert abs(money(c["cost"]) - runtime_cost(done)) < Decimal("0.0001"), (
        c, done["started_at"], done["finished_at"],
        h.request("GET", f"/api/v1/accounts/transactions?allocation={a['id']}")
    )  # fmt: skip
    b = balance(h)
    assert money(b["reserved"]) == 0
    assert money(b["available"]) == cents(Decimal("20") - money(c["cost"]))
    assert money(b["spent"]) == cents(money(c["cost"]))

    # kill -9 the accounting service while a job runs; it keeps running, scheduling
    # goes on (an accepted job starts meanwhile), submissions are refused with a hint
    long = h.submit("sleep 6", walltime="10m")
    queued = h.submit("sleep 1", walltime="5m")
    h.wait_state(long["id"], "Running", timeout=30)
    h.wait_for("a first charge", lambda: money(cost(h, long["id"]).get("cost", 0)) > 0, 20)
    h.cluster.accounting_proc.send_signal(signal.SIGKILL)
    h.cluster.accounting_proc.wait(10)
    with pytest.raises(ApiError) as e:
        h.submit("true", walltime="1m")
    assert e.value.status == 503 and "accounting service" in e.value.error["message"]
    assert "lattice-accounting" in e.value.error["hint"]
    ran = h.wait_state(queued["id"], "Completed", timeout=60)
    assert ran["exit_code"] == 0
    time.sleep(2)
    h.cluster.start_accounting()
    for job in (long, queued):
        a = h.wait_state(job["id"], "Completed", timeout=60)
        c = finalized(h, job["id"])
        assert abs(money(c["cost"]) - runtime_cost(a)) < Decimal("0.0001"), (job, c, a)
    charges = h.request(
        "GET", f"/api/v1/accounts/transactions?allocation={long['id']}&kind=charge&limit=1000"
    )["transactions"]
    periods = sorted(
        ((t["properties"]["charge_period_end"], t["properties"].get("charge_period_start"))
         for t in charges),
    )  # fmt: skip
    assert len(periods) >= 2 and periods[0][1] is None, periods
    for (end, _), (_, start) in itertools.pairwise(periods):
        assert start == end, periods  # consecutive, never overlapping: charged once

    # an unbounded job outliving its funds: cancelled with funds_exhausted, drained to 0
    setup_money(h, topup="1", transfer="0.06", project="poor")
    svc = h.request(
        "POST",
        "/api/v1/allocations",
        {"entrypoint": "sleep 600", "tenant": "default", "vcluster": "default",
         "lifecycle": "unbounded", "project": "poor"},
    )  # fmt: skip
    gone = h.wait_state(svc["id"], "Cancelled", timeout=60)
    assert gone["reason"] == "funds_exhausted"
    finalized(h, svc["id"])
    poor = balance(h, "poor")
    assert money(poor["available"]) == 0 and money(poor["reserved"]) == 0
    assert money(poor["spent"]) == Decimal("0.06")

    # an orphan reservation (the API died between reserve and propose): released
    before = money(balance(h)["available"])
    got = internal(
        h, "POST", "/v1/reservations",
        {"request_id": f"orphan-{uuid.uuid4().hex[:8]}", "tenant": "default",
         "vcluster": "default", "nodes": 1, "walltime_seconds": 60},
    )  # fmt: skip
    assert got["gated"] and money(balance(h)["available"]) == before - Decimal("0.60")
    h.wait_for("the orphan released", lambda: money(balance(h)["available"]) == before, 30)

    # the books balance; history shows the cost
    assert (
        h.request(
            "POST",
            "/api/v1/admin/accounting/reconcile",
            {"since": "2020-01-01", "until": "2100-01-01"},
        )["discrepancies"]
        == []
    )
    out = h.cli("history")
    assert "Cost" in out.stdout and str(money(c["cost"]).quantize(Decimal("0.01"))) in out.stdout
    out = h.cli("account", "costs", "--by", "project", "--tenant", "default")
    assert out.returncode == 0 and "poor" in out.stdout and "0.06" in out.stdout, out
    out = h.cli("admin", "accounting", "status")
    assert out.returncode == 0 and "connected, revision" in out.stdout, out


def test_accounting_on_postgres(cluster_factory: Any, postgres_server: Any) -> None:
    url = postgres_server.create_database(f"ledger_{uuid.uuid4().hex[:8]}")
    h: ClusterHandle = cluster_factory(
        members=1, agents=2, accounting=url, accounting_options=OPTIONS
    )
    setup_money(h, topup="100", transfer="10")

    # 24 parallel submissions of 1.00 each (100 s on one node) against 10.00
    def one(i: int) -> str:
        try:
            return h.submit("sleep 30", walltime="00:01:40", name=f"p{i}")["id"]
        except ApiError as e:
            assert e.status == 412 and "allocation rejected" in e.error["message"], e.error
            return ""

    with ThreadPoolExecutor(12) as pool:
        ids = [i for i in pool.map(one, range(24)) if i]
    assert len(ids) == 10, ids
    b = balance(h)
    assert money(b["available"]) + money(b["reserved"]) + money(b["spent"]) == Decimal("10")
    assert money(b["available"]) >= 0
    for i in ids:
        h.cancel(i)
    for i in ids:
        a = h.wait_state(i, "Cancelled", timeout=30)
        c = finalized(h, i)
        if a.get("started_at"):
            assert abs(money(c["cost"]) - runtime_cost(a)) < Decimal("0.0001"), (c, a)
        else:
            assert money(c["cost"]) == 0
    b = balance(h)
    assert money(b["reserved"]) == 0
    assert money(b["available"]) + money(b["spent"]) == Decimal("10")
    assert (
        h.request(
            "POST",
            "/api/v1/admin/accounting/reconcile",
            {"since": "2020-01-01", "until": "2100-01-01"},
        )["discrepancies"]
        == []
    )
