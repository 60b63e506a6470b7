"""The accounting service in a running cluster: the reservation gate's cost at submit
and the charge pass of a dev cluster.

1. Reservation latency at submit: lattice-server's call to lattice-accounting
   (``POST /v1/reservations`` over loopback HTTP with the service token, estimate +
   reserve in one SQL transaction), one at a time, p50/p99, with the ledger in SQLite
   (the dev default) and in a throwaway PostgreSQL (when installed).
2. Submit throughput with the gate ON vs OFF in the same run: two dev clusters
   (members=1, agents=0: allocations stay Pending), ``--clients`` concurrent REST
   clients submitting ``--total`` allocations to each; with accounting on, every
   submission is reserved first (SQLite ledger).
3. The charge pass of the accounting cluster afterwards: one pass over every open
   reservation (the Pending submissions of step 2) as ``lattice admin accounting
   status`` reports it.

    uv run python scripts/bench/accounting_gate.py [--quick] [--total N] [--clients N]

Last line: ``{"reserve_sqlite_p50_ms", "reserve_sqlite_p99_ms", "reserve_pg_p50_ms",
"reserve_pg_p99_ms", "submits_per_s_gate_on", "submits_per_s_gate_off",
"submits_per_s_gate_on_pg", "charge_pass_s", "open_reservations"}``.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dev_cluster, emit, latency_summary, log, parser, r, wait_until

PRICE = {"vcluster": "default", "rate": "0.01"}


async def _reserve_latency(url: str, token: str, n: int) -> dict[str, Any]:
    from lattice_api.accounting_client import AccountingClient

    client = AccountingClient(url, token, timeout=30)
    samples = []
    try:
        for i in range(n + 20):
            body = {
                "request_id": f"bench-{uuid.uuid4().hex}",
                "tenant": "default",
                "project": "default",
                "lines": [{"vcluster": "default", "nodes": 1, "walltime_seconds": 60}],
            }
            t0 = time.perf_counter()
            got = await client.call("POST", "/v1/reservations", body=body)
            if i >= 20:  # warm-up excluded
                samples.append(time.perf_counter() - t0)
            assert got.get("gated"), got
    finally:
        await client.close()
    return latency_summary(samples)


async def _submit_burst(base: str, total: int, clients: int) -> float:
    import aiohttp

    body = {
        "entrypoint": "true",
        "tenant": "default",
        "vcluster": "default",
        "walltime": "1m",
        "nodes": 1,
    }
    left = [total]
    errors: list[str] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            async with session.post(base + "/api/v1/allocations", json=body) as resp:
                if resp.status not in (200, 201):
                    errors.append(f"{resp.status} {await resp.text()}")

    async with aiohttp.ClientSession(headers={"x-lattice-user": "bench"}) as session:
        async with session.post(base + "/api/v1/allocations", json=body) as resp:
            await resp.read()  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} submissions failed, e.g. {errors[0]}")
    return total / elapsed


def _fund(c: Any) -> None:
    c._post(c.rest_url + "/api/v1/admin/prices", PRICE)
    c._post(c.rest_url + "/api/v1/accounts/topup", {"tenant": "default", "amount": "1000000"})
    c._post(
        c.rest_url + "/api/v1/accounts/transfer",
        {"tenant": "default", "project": "default", "amount": "900000"},
    )


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=1)
    p.add_argument("--total", type=int, default=None, help="submissions per cluster")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--reservations", type=int, default=None, help="latency samples")
    args = p.parse_args()
    total = args.total or (200 if args.quick else 2000)
    n_res = args.reservations or (100 if args.quick else 1000)
    out: dict[str, Any] = {"clients": args.clients, "total": total}
    fast = {"charge_interval_seconds": 3600.0}  # passes only when asked (step 3)

    with dev_cluster(agents=0, accounting=True, accounting_options=fast) as on:
        _fund(on)
        lat = asyncio.run(_reserve_latency(on.accounting_url, on.accounting_token, n_res))
        out["reserve_sqlite_p50_ms"], out["reserve_sqlite_p99_ms"] = lat["p50_ms"], lat["p99_ms"]
        log(f"reserve (SQLite): {lat}")
        with dev_cluster(agents=0) as off:
            rate_off = asyncio.run(_submit_burst(off.rest_url, total, args.clients))
        rate_on = asyncio.run(_submit_burst(on.rest_url, total, args.clients))
        out["submits_per_s_gate_on"], out["submits_per_s_gate_off"] = r(rate_on, 1), r(rate_off, 1)
        log(f"submits/s: gate on {rate_on:.1f}, off {rate_off:.1f}")
        # one charge pass over every open reservation: restart the service with a short
        # interval and read the pass it reports
        on.stop_accounting()
        on.accounting_options["charge_interval_seconds"] = 0.5
        on.start_accounting()
        status = wait_until(
            "a charge pass",
            lambda: (
                (s := on._get(on.rest_url + "/api/v1/admin/accounting/status", quiet=True))
                and s.get("last_pass", {}).get("seconds") is not None
                and s
            ),
            timeout=120,
        )
        out["charge_pass_s"] = r(status["last_pass"]["seconds"], 4)
        out["open_reservations"] = total + n_res + 21
        log(f"charge pass: {status['last_pass']}")

    from lattice_test_harness.postgres import PostgresServer, available

    if available():
        with PostgresServer() as pg:
            url = pg.create_database(f"bench_{uuid.uuid4().hex[:8]}")
            with dev_cluster(agents=0, accounting=url, accounting_options=fast) as on:
                _fund(on)
                lat = asyncio.run(_reserve_latency(on.accounting_url, on.accounting_token, n_res))
                out["reserve_pg_p50_ms"], out["reserve_pg_p99_ms"] = lat["p50_ms"], lat["p99_ms"]
                log(f"reserve (PostgreSQL): {lat}")
                rate_pg = asyncio.run(_submit_burst(on.rest_url, total, args.clients))
                out["submits_per_s_gate_on_pg"] = r(rate_pg, 1)
                log(f"submits/s: gate on (PostgreSQL) {rate_pg:.1f}")
    else:
        out["reserve_pg_p50_ms"] = out["reserve_pg_p99_ms"] = None
        out["submits_per_s_gate_on_pg"] = None
        log("PostgreSQL not installed: no PostgreSQL figures")
    emit(out)


if __name__ == "__main__":
    main()
