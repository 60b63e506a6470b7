"""Keystroke -> echo round trip of ``lattice attach`` on loopback, through the real API
(WebSocket) and agent (PTY): ``attach_echo_p50(cluster)`` in milliseconds.

One allocation (``sleep 300``) on a dev cluster with at least one agent; one attach
running ``cat`` on a PTY; each sample sends one byte and waits for the PTY's echo of
it (the agent's line discipline echoes; ``cat`` sees whole lines). 200 samples after
10 warm-up ones; the median is returned. Without a cluster one is started (1 agent).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from typing import Any

from _common import USER, dev_cluster, job_body, log, rest_headers

__all__ = ["attach_echo_p50"]


def _call(cluster: Any, method: str, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(
        cluster.leader().rest_url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers=rest_headers(cluster.tenant),
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def _running_allocation(cluster: Any, timeout: float = 60.0) -> str:
    a = _call(cluster, "POST", "/api/v1/allocations", job_body(cluster, "sleep 300"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _call(cluster, "GET", f"/api/v1/allocations/{a['id']}")["state"] == "Running":
            return str(a["id"])
        time.sleep(0.1)
    raise TimeoutError(f"allocation {a['id']} did not start within {timeout:g}s")


async def _samples(url: str, tenant: str, alloc_id: str, samples: int, warmup: int) -> list[float]:
    from lattice_sdk import LatticeClient

    client = LatticeClient.from_url(url, user=USER, headers={"x-lattice-tenant": tenant})
    async with client:
        term = await client.attach(alloc_id, command=["cat"], tty=True, rows=24, cols=80)
        async with term:
            out = aiter(term)
            times: list[float] = []
            for i in range(warmup + samples):
                key = bytes([ord("a") + i % 26])
                t0 = time.perf_counter()
                await term.send(key)
                seen = b""
                while key not in seen:
                    seen += await asyncio.wait_for(anext(out), 10)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1000.0)
                if i % 50 == 49:  # keep cat's line short
                    await term.send(b"\n")
                    seen = b""
                    while b"\n" not in seen:
                        seen += await asyncio.wait_for(anext(out), 10)
            await term.send(b"\x04")
            return times


def attach_echo_p50(cluster: Any = None, *, samples: int = 200, warmup: int = 10) -> float:
    """Median keystroke->echo round trip in ms (a fresh 1-agent cluster when none given)."""
    if cluster is None:
        with dev_cluster(agents=1) as c:
            return attach_echo_p50(c, samples=samples, warmup=warmup)
    alloc_id = _running_allocation(cluster)
    try:
        times = asyncio.run(
            _samples(cluster.leader().rest_url, cluster.tenant, alloc_id, samples, warmup)
        )
    finally:
        try:
            _call(cluster, "DELETE", f"/api/v1/allocations/{alloc_id}")
        except Exception as e:
            log(f"cancelling {alloc_id}: {e}")
    p50 = statistics.median(times)
    log(f"attach echo: p50 {p50:.2f} ms, p90 {statistics.quantiles(times, n=10)[-1]:.2f} ms")
    return p50


if __name__ == "__main__":
    print(f"{attach_echo_p50():.2f}")
