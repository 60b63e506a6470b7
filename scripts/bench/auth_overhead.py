"""Cost of security on the submit path: TLS, mTLS and JWKS-validated OIDC tokens
versus dev mode.

Two 1-member clusters (LocalCluster members=1, agents=0: submissions need no agents;
each vCluster's scheduler runs) are up side by side in the same run:

* ``dev``: no authentication, plaintext (every caller trusted, ``x-lattice-user``);
* ``secure``: a `lattice dev up --secure` cluster (lattice_cli.devsecure): REST over TLS,
  the scheduler on mTLS with its site-CA certificate, Raft encrypted, and every
  request's ``Authorization: Bearer`` token validated against the fake IdP of
  lattice-test-harness (real HTTP discovery + JWKS, RS256 tokens). The tenant and
  vCluster are created with an ``admin`` token. Each submitter has its own user and
  RS256 token, minted up front, and its own TLS connection (handshake in the warm-up).

``--clients`` concurrent REST submitters (asyncio tasks, one aiohttp session and
connection each) POST ``/api/v1/allocations`` back to back until ``--total`` are
acknowledged (201 = committed). Runs alternate dev / secure on the same two clusters
(both see the same growing state); rate = acknowledged / wall time of the run; the
JSON reports medians over runs and the per-run rates.

    uv run python scripts/bench/auth_overhead.py [--runs N] [--quick]

Goal: secure throughput >= 0.8 x dev-mode throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    CpuMeter,
    _dump_logs,
    cluster_procs,
    dev_cluster,
    emit,
    job_body,
    latency_summary,
    log,
    median,
    parser,
    r,
    rest_headers,
    runs_of,
    stop_cluster,
)


def _tls(cluster: Any) -> Any:
    """The secure cluster's client TLS context (its site CA); None for the dev one."""
    return cluster.secure.client_context() if getattr(cluster, "secure", None) else None


def _post(cluster: Any, url: str, body: dict[str, Any], token: str) -> None:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10, context=_tls(cluster)):
            pass
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise RuntimeError(f"POST {url}: {e.code} {e.read()[:300]!r}") from None


@contextlib.contextmanager
def secure_cluster(idp: Any, *, keep: bool = False) -> Iterator[Any]:
    """A 1-member secure LocalCluster (TLS, mTLS, encrypted Raft) whose API validates
    OIDC tokens against ``idp`` (in this process, so tokens can be minted per user):
    member, tenant + vCluster with an admin token, scheduler (its certificate)."""
    import yaml
    from lattice_cli.devcluster import DEV_SCHEDULER_TYPES, LocalCluster
    from lattice_test_harness.fake_idp import SERVICE_CLIENT, SERVICE_SECRET

    base = Path(tempfile.mkdtemp(prefix="lattice-bench-"))
    cluster = LocalCluster(base / "cluster", members=1, agents=0, secure=True)
    cluster.secure.issuer = idp.issuer  # this process's IdP instead of its own
    cluster.secure.service_client = (SERVICE_CLIENT, SERVICE_SECRET)
    for m in cluster.members:
        (m.dir / "config.yaml").write_text(yaml.safe_dump(cluster.member_config(m)))
    log(f"starting secure cluster (TLS, mTLS, OIDC issuer {idp.issuer}) in {base}")
    t0 = time.perf_counter()
    try:
        for m in cluster.members:
            cluster.start_member(m)
        leader = cluster.leader(60)
        admin = idp.token("bench-admin", scope="admin", lifetime=3600)
        _post(cluster, leader.rest_url + "/api/v1/tenants", {"name": cluster.tenant}, admin)
        for vc in cluster.vclusters:
            _post(
                cluster,
                leader.rest_url + "/api/v1/vclusters",
                {
                    "name": vc,
                    "scheduler_type": DEV_SCHEDULER_TYPES.get(vc, "hpc-backfill"),
                    "cycle_interval_seconds": cluster.cycle_interval,
                },
                admin,
            )
            cluster.start_scheduler(vc)
        cluster.admin_token = admin
        log(f"secure cluster up in {time.perf_counter() - t0:.1f}s; REST {cluster.rest_url}")
        yield cluster
    except BaseException:
        _dump_logs(cluster)
        raise
    finally:
        stop_cluster(cluster)
        if keep:
            log(f"cluster files kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def _grpc_refuses_plaintext(cluster: Any) -> bool:
    """The secure cluster's gRPC port (the components' port) is mutual TLS: a plaintext
    client never gets an answer."""
    from grpclib.client import Channel
    from lattice_common.proto.lattice import v1

    async def go() -> bool:
        ch = Channel("127.0.0.1", cluster.members[0].grpc_port)
        try:
            await v1.NodeServiceStub(ch, timeout=5).list_nodes(v1.ListNodesRequest())
        except Exception:  # connection lost at the handshake
            return True
        finally:
            ch.close()
        return False

    return asyncio.run(go())


def count(cluster: Any, headers: dict[str, str]) -> int:
    req = urllib.request.Request(
        cluster.leader().rest_url + "/api/v1/allocations?all=true", headers=headers
    )
    with urllib.request.urlopen(req, timeout=60, context=_tls(cluster)) as resp:
        return len(json.loads(resp.read())["allocations"])


async def _load(
    url: str, body: dict[str, Any], headers: list[dict[str, str]], total: int, tls: Any
):
    import aiohttp

    sessions = [
        aiohttp.ClientSession(
            headers=h, connector=aiohttp.TCPConnector(limit=1, ssl=tls if tls else True)
        )
        for h in headers
    ]
    lat: list[float] = []
    errors: list[str] = []
    left = total
    try:

        async def post(s: Any) -> bool:
            t = time.perf_counter()
            async with s.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status != 201:
                    errors.append(f"{resp.status} {text[:200]}")
                    return False
            lat.append(time.perf_counter() - t)
            return True

        # warm-up: every session connects and submits once (not measured)
        warm = sum(await asyncio.gather(*(post(s) for s in sessions)))
        lat.clear()

        async def submitter(s: Any) -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await post(s)

        t0 = time.perf_counter()
        await asyncio.gather(*(submitter(s) for s in sessions))
        elapsed = time.perf_counter() - t0
    finally:
        for s in sessions:
            await s.close()
    return {"elapsed": elapsed, "lat": lat, "errors": errors, "warm": warm}


def one_run(
    cluster: Any,
    mode: str,
    headers: list[dict[str, str]],
    count_headers: dict[str, str],
    total: int,
) -> dict[str, Any]:
    before = count(cluster, count_headers)
    pids = {n: p.pid for n, p in cluster_procs(cluster).items()}
    url = cluster.leader().rest_url + "/api/v1/allocations"
    meter = CpuMeter(pids).start()
    body = job_body(cluster, "true", name=f"bench-{mode}")
    res = asyncio.run(_load(url, body, headers, total, _tls(cluster)))
    meter.stop()
    acked = len(res["lat"])
    after = count(cluster, count_headers)
    return {
        "submits_per_s": r(acked / res["elapsed"], 1),
        "acked": acked,
        "errors": len(res["errors"]),
        "error_samples": res["errors"][:3],
        "durable_count_ok": after - before == acked + res["warm"],
        **latency_summary(res["lat"]),
        "cpu": {
            n: v.get("cores") if n != "machine" else v.get("busy_cores")
            for n, v in meter.result.items()
        },
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent REST submitters")
    p.add_argument("--total", type=int, default=None, help="submissions per run (2000)")
    args = p.parse_args()
    n_runs = runs_of(args)
    total = args.total or (300 if args.quick else 2000)

    from lattice_test_harness.fake_idp import FakeIdP

    by_mode: dict[str, list[dict[str, Any]]] = {"dev": [], "secure": []}
    with (
        FakeIdP(token_lifetime=3600) as idp,
        dev_cluster(members=1, agents=0, keep=args.keep) as dev,
        secure_cluster(idp, keep=args.keep) as sec,
    ):
        tenant = sec.tenant
        dev_headers = [
            {**rest_headers(dev.tenant), "x-lattice-user": f"bench-{i}"}
            for i in range(args.clients)
        ]
        # one RS256 token per submitter (own subject), minted before the measurement
        sec_headers = [
            {
                "Authorization": "Bearer " + idp.token(f"bench-{i}", tenant=tenant),
                "x-lattice-tenant": tenant,
            }
            for i in range(args.clients)
        ]
        sec_count = {"Authorization": f"Bearer {sec.admin_token}"}
        for i in range(n_runs):
            for mode, cl, hs, ch in (
                ("dev", dev, dev_headers, rest_headers(dev.tenant)),
                ("secure", sec, sec_headers, sec_count),
            ):
                res = one_run(cl, mode, hs, ch, total)
                log(
                    f"run {i + 1}/{n_runs} {mode}: {res['submits_per_s']}/s, "
                    f"p99 {res.get('p99_ms')} ms, errors {res['errors']}"
                )
                by_mode[mode].append(res)
        jwks_fetches = idp.hits.get("/jwks", 0)
        try:  # the secure side really refuses a request without a token
            count(sec, rest_headers(tenant))
            enforced = False
        except urllib.error.HTTPError as e:
            enforced = e.code == 401
        mtls = _grpc_refuses_plaintext(sec)

    def med(mode: str, key: str, nd: int = 2) -> float | None:
        return r(median(x.get(key) for x in by_mode[mode]), nd)

    sec_rate, dev_rate = med("secure", "submits_per_s", 1), med("dev", "submits_per_s", 1)
    out: dict[str, Any] = {
        "secure_mode": "tls+mtls+oidc-jwks-rs256+raft-encrypted",
        "mtls": mtls,
        "clients": args.clients,
        "total": total,
        "runs": n_runs,
        "cpu_count": os.cpu_count(),
        "secure_submits_per_s": sec_rate,
        "dev_submits_per_s": dev_rate,
        "ratio": r(sec_rate / dev_rate, 3) if sec_rate and dev_rate else None,
        "secure_p99_ms": med("secure", "p99_ms"),
        "dev_p99_ms": med("dev", "p99_ms"),
        "secure_p50_ms": med("secure", "p50_ms"),
        "dev_p50_ms": med("dev", "p50_ms"),
        "secure_run_rates": [x["submits_per_s"] for x in by_mode["secure"]],
        "dev_run_rates": [x["submits_per_s"] for x in by_mode["dev"]],
        "errors": sum(x["errors"] for m in by_mode.values() for x in m),
        "durable_count_ok": all(x["durable_count_ok"] for m in by_mode.values() for x in m),
        "jwks_fetches": jwks_fetches,
        "secure_refuses_no_token": enforced,
        "cpu_cores_last_run": {m: v[-1]["cpu"] for m, v in by_mode.items()},
        "goal_ratio": 0.8,
        "note": f"{args.clients} aiohttp REST submitters (one connection each) in the "
        "benchmark process, same machine as both clusters; runs alternate dev/secure; "
        "secure REST is TLS (HTTP/1.1 keep-alive), the scheduler talks mTLS gRPC",
    }
    samples = [e for m in by_mode.values() for x in m for e in x["error_samples"]]
    if samples:
        out["error_samples"] = samples[:5]
    emit(out)


if __name__ == "__main__":
    main()
