"""Accounting ledger: reservations per second and one charging pass, on PostgreSQL.

A throwaway PostgreSQL cluster (lattice_test_harness.postgres: initdb + pg_ctl on a free
port in a temp dir), a fresh database per run, migrated with the ledger's Alembic
migrations.

(1) Reservations: ``--projects`` projects (in 8 tenants), each funded for about 80 % of
the reservations aimed at it, so the gate refuses some. ``--submitters`` concurrent
submitters (asyncio tasks, one pooled connection each, spread over ``--procs`` worker
processes) call ``Ledger.reserve`` back to back with fresh allocation ids until
``--reservations`` calls are done; rate = calls (accepted or refused) / (last finish -
first start). Then ``overspent`` counts projects whose reservations exceed what was
transferred to them (must be 0), and ``Ledger.verify()`` must find no discrepancy.

(2) Charging pass: ``--allocations`` running allocations (open reservations, seeded in
bulk with the matching reservation journal rows so the books balance), charged in one
``Ledger.charge_many`` pass (some beyond their reservation, drawing on the project);
``charge_pass_s`` is its wall time. ``price_calc_s`` is computing the 100,000 interval
costs with ``prices.charge_for`` (pure Python, before the pass).

    uv run python scripts/bench/accounting.py [--runs N] [--quick]

Goals: >= 1,000 reservations/s with 32 submitters and overspent = 0; a charge pass over
100,000 running allocations < 5 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CpuMeter, emit, latency_summary, log, median, parser, r, runs_of

TENANTS = 8
UNIT = Decimal("2.50")


def _project(i: int) -> tuple[str, str]:
    return f"t{i % TENANTS}", f"p{i}"


async def _fund(url: str, projects: int, per_project: int) -> dict[str, Decimal]:
    from lattice_accounting.ledger import Ledger

    led = await Ledger.open(url)
    funds: dict[str, Decimal] = {}
    try:
        for i in range(projects):
            t, p = _project(i)
            await led.open_project(t, p)
        # ~80 % of what will be asked of each project: the gate must refuse the rest
        for t in range(TENANTS):
            await led.topup(f"t{t}", UNIT * per_project * projects)
        for i in range(projects):
            t, p = _project(i)
            amount = (UNIT * per_project * 4 / 5).quantize(Decimal("0.01"))
            await led.transfer(t, p, amount)
            funds[f"{t}/{p}"] = amount
    finally:
        await led.close()
    return funds


async def _submitters(
    url: str, n: int, quota: list[int], projects: int, seed: int, start: Any
) -> dict[str, Any]:
    from lattice_accounting.db import make_engine
    from lattice_accounting.errors import InsufficientFunds
    from lattice_accounting.ledger import Ledger

    led = Ledger(make_engine(url, pool_size=n))
    rng = random.Random(seed)
    lat: list[float] = []
    refused = 0
    errors: list[str] = []

    # open the pool's connections before the clock starts
    async def warm() -> None:
        async with led.engine.connect() as c:
            await asyncio.sleep(0.2)
            await c.rollback()

    await asyncio.gather(*(warm() for _ in range(n)))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, start.wait)
    c0 = time.process_time()
    t0 = time.monotonic()

    async def one(k: int) -> None:
        nonlocal refused
        for _ in range(quota[k]):
            t, p = _project(rng.randrange(projects))
            s = time.monotonic()
            try:
                await led.reserve(uuid.uuid4().hex, f"{t}/{p}", UNIT, user="bench")
            except InsufficientFunds:
                refused += 1
            except Exception as e:  # counted and shown, never hidden
                errors.append(repr(e)[:200])
            lat.append(time.monotonic() - s)

    await asyncio.gather(*(one(k) for k in range(n)))
    t1 = time.monotonic()
    await led.close()
    return {
        "t0": t0,
        "t1": t1,
        "calls": sum(quota),
        "refused": refused,
        "errors": errors,
        "lat": lat,
        "cpu_s": time.process_time() - c0,
    }


def _worker(args: tuple[Any, ...]) -> dict[str, Any]:
    return asyncio.run(_submitters(*args))


async def _overspent(url: str, funds: dict[str, Decimal]) -> tuple[int, int, list[Any]]:
    from lattice_accounting.db import make_engine
    from lattice_accounting.ledger import Ledger
    from lattice_accounting.schema import reservations
    from sqlalchemy import func, select

    led = Ledger(make_engine(url))
    try:
        async with led.engine.connect() as c:
            rows = (
                await c.execute(
                    select(
                        reservations.c.tenant,
                        reservations.c.project,
                        func.sum(reservations.c.amount),
                        func.count(),
                    ).group_by(reservations.c.tenant, reservations.c.project)
                )
            ).all()
        over = sum(1 for t, p, s, _n in rows if s > funds[f"{t}/{p}"])
        accepted = sum(n for *_x, n in rows)
        return over, accepted, await led.verify()
    finally:
        await led.close()


def reservations_run(
    url: str, *, total: int, submitters: int, procs: int, projects: int
) -> dict[str, Any]:
    per_project = max(1, total // projects)
    funds = asyncio.run(_fund(url, projects, per_project))
    per = [total // submitters + (1 if i < total % submitters else 0) for i in range(submitters)]
    groups = [per[i::procs] for i in range(procs)]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        start = mgr.Event()
        with ctx.Pool(procs) as pool:
            pending = pool.map_async(
                _worker,
                [(url, len(g), g, projects, 1000 + i, start) for i, g in enumerate(groups)],
            )
            time.sleep(3.0)  # workers spawn, import and open their connections
            meter = CpuMeter({}).start()
            start.set()
            results = pending.get(timeout=1800)
            meter.stop()
    t0 = min(x["t0"] for x in results)
    t1 = max(x["t1"] for x in results)
    calls = sum(x["calls"] for x in results)
    refused = sum(x["refused"] for x in results)
    errors = [e for x in results for e in x["errors"]]
    over, accepted, disc = asyncio.run(_overspent(url, funds))
    lat = [v for x in results for v in x["lat"]]
    return {
        "reservations_per_s": r(calls / (t1 - t0), 1),
        "calls": calls,
        "accepted": accepted,
        "refused": refused,
        "errors": len(errors),
        "error_samples": errors[:3],
        "overspent": over,
        "verify_discrepancies": len(disc),
        **{f"reserve_{k}": v for k, v in latency_summary(lat).items() if k in ("p50_ms", "p99_ms")},
        "client_cpu_s": r(sum(x["cpu_s"] for x in results)),
        "machine": meter.result.get("machine"),
    }


async def _seed_running(url: str, n: int, projects: int) -> list[Any]:
    """``n`` open reservations, written in bulk with one reserve journal per project."""
    from lattice_accounting import accounts as acc
    from lattice_accounting.ledger import Ledger
    from lattice_accounting.money import to_micros
    from lattice_accounting.schema import accounts, journal, ledger
    from sqlalchemy import insert, update

    led = await Ledger.open(url)
    now = datetime.now(UTC)
    held = Decimal("10.00")
    try:
        for i in range(projects):
            t, p = _project(i)
            await led.open_project(t, p)
        for t in range(TENANTS):
            await led.topup(f"t{t}", Decimal(50) * n)
        per: dict[int, int] = {}
        rows = []
        for k in range(n):
            i = k % projects
            per[i] = per.get(i, 0) + 1
            t, p = _project(i)
            rows.append(
                {
                    "allocation_id": f"alloc-{k:07d}",
                    "tenant": t,
                    "project": p,
                    "user": f"u{k % 50}",
                    "vcluster": "gpu" if k % 3 else "cpu",
                    "amount": held,
                    "held": held,
                    "charged": Decimal(0),
                    "state": "reserved",
                    "created_at": now,
                    "started_at": now - timedelta(hours=1),
                }
            )
        for i, count in sorted(per.items()):
            t, p = _project(i)
            # funds for the project: its reservations plus a little for overflow charges
            await led.transfer(t, p, held * count + Decimal(count))
        async with led.engine.begin() as c:
            jids = await led._journal_ids(c, len(per))
            jrows, legs = [], []
            for jid, (i, count) in zip(jids, sorted(per.items()), strict=True):
                t, p = _project(i)
                amt = held * count
                jrows.append(
                    {"id": jid, "at": now, "kind": "reserve", "tenant": t, "project": p,
                     "amount": amt, "properties": {"reason": "benchmark seed"}}
                )  # fmt: skip
                legs += [
                    {"journal_id": jid, "account": acc.project_account(t, p), "amount": -amt},
                    {"journal_id": jid, "account": acc.reservation_account(t, p), "amount": amt},
                ]
                for name, d in (
                    (acc.project_account(t, p), -amt),
                    (acc.reservation_account(t, p), amt),
                ):
                    await c.execute(
                        update(accounts)
                        .where(accounts.c.name == name)
                        .values(balance=accounts.c.balance + d)
                    )
            await c.execute(insert(journal), jrows)
            await c.execute(insert(ledger), legs)
            cols = ("allocation_id", "tenant", "project", "user", "vcluster", "amount", "held",
                    "charged", "state", "created_at", "started_at")  # fmt: skip
            records = [
                tuple(to_micros(v) if isinstance(v, Decimal) else v for v in (row[c] for c in cols))
                for row in rows
            ]
            await led._bulk_insert(c, "reservations", cols, records)
    finally:
        await led.close()
    return rows


async def _charge_pass(url: str, rows: list[Any]) -> dict[str, Any]:
    from lattice_accounting.db import make_engine
    from lattice_accounting.ledger import ChargeItem, Ledger
    from lattice_accounting.prices import GPU_HOUR, NODE_HOUR, Price, charge_for

    t_start = datetime(2026, 1, 1, tzinfo=UTC)
    prices = [
        Price("gpu", NODE_HOUR, Decimal("5.00"), t_start, id=1),
        Price("gpu", GPU_HOUR, Decimal("2.00"), t_start, gpu_type="a100", id=2),
        Price("cpu", NODE_HOUR, Decimal("1.20"), t_start, id=3),
    ]
    now = datetime.now(UTC)
    rng = random.Random(7)
    c0 = time.perf_counter()
    items = []
    for row in rows:
        minutes = rng.choice((5, 5, 5, 10, 30, 150))  # a few run past their reservation
        vc = row["vcluster"]
        amount = charge_for(
            (now - timedelta(minutes=minutes), now),
            1,
            4 if vc == "gpu" else 0,
            prices,
            vcluster=vc,
            gpu_type="a100",
        )
        items.append(ChargeItem(row["allocation_id"], amount, now))
    price_calc = time.perf_counter() - c0
    led = Ledger(make_engine(url))
    try:
        t0 = time.perf_counter()
        res = await led.charge_many(items, cursor_at=("charger", 1))
        elapsed = time.perf_counter() - t0
        disc = await led.verify()
    finally:
        await led.close()
    return {
        "charge_pass_s": r(elapsed, 3),
        "price_calc_s": r(price_calc, 3),
        "charged": sum(1 for x in res if x.charged > 0),
        "from_project": sum(1 for x in res if x.from_project > 0),
        "exhausted": sum(1 for x in res if x.exhausted),
        "charge_verify_discrepancies": len(disc),
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=3)
    p.add_argument("--submitters", type=int, default=32)
    p.add_argument("--procs", type=int, default=2, help="submitter worker processes")
    p.add_argument("--reservations", type=int, default=None, help="per run (5000; quick 500)")
    p.add_argument("--projects", type=int, default=64)
    p.add_argument("--allocations", type=int, default=None, help="per pass (100000; quick 5000)")
    args = p.parse_args()
    from lattice_test_harness.postgres import PostgresServer, available

    if not available():
        reason = "PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install postgresql"
        log(reason)
        emit(
            {
                "reservations_per_s": None,
                "overspent": None,
                "charge_pass_s": None,
                "skipped": reason,
            }
        )
        return
    n_runs = runs_of(args)
    total = args.reservations or (500 if args.quick else 5000)
    allocations = args.allocations or (5000 if args.quick else 100_000)
    procs = max(1, min(args.procs, args.submitters))
    runs = []
    with PostgresServer() as pg:
        log(f"PostgreSQL on port {pg.port} ({pg.base})")
        for i in range(n_runs):
            url = pg.create_database(f"bench_res_{i}")
            res = reservations_run(
                url, total=total, submitters=args.submitters, procs=procs, projects=args.projects
            )
            log(
                f"run {i + 1}/{n_runs}: {res['reservations_per_s']} reservations/s, accepted "
                f"{res['accepted']}, refused {res['refused']}, overspent {res['overspent']}, "
                f"errors {res['errors']}"
            )
            url = pg.create_database(f"bench_charge_{i}")
            t0 = time.perf_counter()
            rows = asyncio.run(_seed_running(url, allocations, 1000))
            log(f"seeded {allocations} running allocations in {time.perf_counter() - t0:.1f}s")
            res |= asyncio.run(_charge_pass(url, rows))
            log(f"charge pass over {allocations}: {res['charge_pass_s']} s")
            runs.append(res)
    emit(
        {
            "reservations_per_s": r(median(x["reservations_per_s"] for x in runs), 1),
            "overspent": sum(x["overspent"] for x in runs),
            "charge_pass_s": r(median(x["charge_pass_s"] for x in runs), 3),
            "submitters": args.submitters,
            "procs": procs,
            "reservations": total,
            "allocations": allocations,
            "runs": n_runs,
            "errors": sum(x["errors"] for x in runs),
            "verify_discrepancies": sum(
                x["verify_discrepancies"] + x["charge_verify_discrepancies"] for x in runs
            ),
            "goal": {"reservations_per_s": 1000, "overspent": 0, "charge_pass_s": 5.0},
            "by_run": runs,
        }
    )


if __name__ == "__main__":
    main()
