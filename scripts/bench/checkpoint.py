"""Checkpoint broker: one evaluation pass over 10,000 running allocations, and the
latency from a checkpoint request to Suspended for a cooperative application.

(1) ``eval_10k_s``: ``lattice_checkpoint.broker.evaluate`` (the broker's whole decision
pass: cost model, skip rules, ordering, f8 estimates) over a synthetic quorum state of
``--allocations`` (10,000) Running checkpointable allocations on as many nodes (a tenth
with 4 GPUs, some with a checkpoint or a hint already recorded) and 2,000 Pending ones
of mixed classes. Median over ``--runs`` passes (after one warm-up pass), wall time
and the process's CPU time (``eval_10k_cpu_s``: what the pass costs when the machine
is not shared).

(2) ``hint_to_suspended_ms``: a dev cluster (1 server, 1 agent, no broker), the signal
protocol test application (``ckpt_signal.py``, counting every 10 ms) running; the
owner's suspend (``POST /api/v1/allocations/{id}/suspend``, what ``lattice suspend``
sends) moves it to Checkpointing, the agent sends SIGUSR1, the application writes its
counter and the sentinel, the agent reports, the quorum records Suspended. Measured on
the allocation's ``/watch`` stream from the Checkpointing event to the Suspended event;
then ``resume`` and the next sample. Also the application's own share
(``app_write_ms``: the recorded checkpoint duration, request to sentinel as the agent
saw it) and the server-side span (``server_ms``: the checkpoint record's time minus
``checkpoint_hint_at``).

    uv run python scripts/bench/checkpoint.py [--runs N] [--quick]

Goals: < 1 s per evaluation pass of 10,000; hint to Suspended < 500 ms plus the
application's write time.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dev_cluster, emit, latency_summary, log, median, parser, r, runs_of

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "packages/lattice-node-agent/tests/apps/ckpt_signal.py"


# --------------------------------------------------------------------------- (1)


def synthetic_state(n: int, pending: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    from lattice_common.types import (
        Allocation,
        AllocationSpec,
        AllocationState,
        CheckpointHint,
        CheckpointRecord,
        GpuDevice,
        Node,
        NodeCapabilities,
    )

    now = 2_000_000.0
    nodes: dict[str, Node] = {}
    for i in range(n):
        gpus = [GpuDevice(index=k, memory_bytes=80 << 30) for k in range(4)] if i % 10 == 0 else []
        nodes[f"n{i}"] = Node(
            id=f"n{i}", capabilities=NodeCapabilities(gpus=gpus, gpu_count=len(gpus))
        )
    allocs: dict[str, Allocation] = {}
    for i in range(n):
        spec = AllocationSpec(
            entrypoint="train",
            tenant=f"t{i % 8}",
            vcluster=f"v{i % 4}",
            walltime_seconds=86_400,
            preemption_class=i % 8,
            checkpoint="auto",
            checkpoint_protocol=("signal", "shmem", "grpc")[i % 3],
        )
        a = Allocation(
            id=f"a{i}",
            spec=spec,
            state=AllocationState.RUNNING,
            assigned_nodes=[f"n{i}"],
            started_at=now - 60.0 * (i % 600),
        )
        if i % 5 == 0:
            a.last_checkpoint = CheckpointRecord(
                id="ckpt-1-hint-1",
                path="/ck",
                size_bytes=1 << 30,
                duration_seconds=12,
                at=now - 900,
            )
        if i % 7 == 0:
            a.checkpoint_hint = CheckpointHint(id="hint-1", epoch=1, at=now - 30)
            a.checkpoint_hints = 1
        allocs[a.id] = a
    for j in range(pending):
        spec = AllocationSpec(
            entrypoint="job",
            tenant=f"t{j % 8}",
            vcluster=f"v{j % 4}",
            nodes=1 + j % 4,
            walltime_seconds=3600,
            preemption_class=j % 11,
            checkpoint="auto" if j % 2 else "none",
            checkpoint_protocol="signal" if j % 2 else "",
        )
        allocs[f"p{j}"] = Allocation(id=f"p{j}", spec=spec)
    return allocs, nodes, now


def bench_eval(n: int, runs: int) -> dict[str, Any]:
    from lattice_checkpoint import cost
    from lattice_checkpoint.broker import evaluate

    allocs, nodes, now = synthetic_state(n, n // 5)
    storage = cost.StorageView(write_bandwidth_bytes_per_s=5e9)
    evaluate(allocs, nodes, now, storage, interval=30.0)  # warm-up
    times: list[float] = []
    cpu: list[float] = []
    hints = decisions = 0
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        ev = evaluate(allocs, nodes, now, storage, interval=30.0)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        hints, decisions = len(ev.hints), len(ev.decisions)
    log(
        f"evaluation of {n}: wall {[round(t, 3) for t in times]} s, cpu "
        f"{[round(t, 3) for t in cpu]} s ({decisions} decided, {hints} hints)"
    )
    return {
        "eval_s": r(median(times), 4),
        "eval_cpu_s": r(median(cpu), 4),
        "eval_min_s": r(min(times), 4),
        "eval_max_s": r(max(times), 4),
        "running": n,
        "pending": n // 5,
        "decisions": decisions,
        "hints": hints,
    }


# --------------------------------------------------------------------------- (2)


class Watch:
    """(state, time seen, allocation) for every state change on the allocation's
    /watch stream."""

    def __init__(self, cluster: Any, alloc_id: str) -> None:
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        self.cond = threading.Condition()
        url = cluster.rest_url + f"/api/v1/allocations/{alloc_id}/watch"
        req = urllib.request.Request(url, headers={"x-lattice-user": "bench"})
        self._resp = urllib.request.urlopen(req, timeout=600)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for raw in self._resp:
                if raw.strip():
                    a = json.loads(raw)["allocation"]
                    now = time.perf_counter()
                    with self.cond:
                        if not self.events or self.events[-1][0] != a["state"]:
                            self.events.append((a["state"], now, a))
                            self.cond.notify_all()
        except (OSError, ValueError, AttributeError):  # closed under us at the end
            return

    def wait(self, state: str, after: int, timeout: float = 60.0) -> tuple[int, float, dict]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(after, len(self.events)):
                    if self.events[i][0] == state:
                        return i, self.events[i][1], self.events[i][2]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {state} (saw {[e[0] for e in self.events]})")
                self.cond.wait(left)

    def close(self) -> None:
        # Shut the socket down before closing the response: close() takes the buffer's
        # lock, which the reader thread holds while it waits in recv for a line that
        # may never come (after the last state change), and would wait for it for good.
        with contextlib.suppress(OSError, AttributeError):
            self._resp.fp.raw._sock.shutdown(socket.SHUT_RDWR)
        self._resp.close()


def post(cluster: Any, path: str, body: Any = None, method: str = "POST") -> Any:
    req = urllib.request.Request(
        cluster.rest_url + path,
        data=json.dumps(body or {}).encode(),
        method=method,
        headers={"content-type": "application/json", "x-lattice-user": "bench"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def bench_suspend(runs: int, keep: bool) -> dict[str, Any]:
    samples: list[float] = []
    app_ms: list[float] = []
    server_ms: list[float] = []
    with dev_cluster(
        agents=1, keep=keep, cycle_interval=1.0, heartbeat_interval=0.5, checkpoint_broker=False
    ) as cluster:
        body = {
            "entrypoint": f"{sys.executable} {APP} 100000000 0.01",
            "tenant": cluster.tenant,
            "vcluster": cluster.vclusters[0],
            "walltime": "30m",
            "checkpoint": "signal",
            "project": "bench",
        }
        aid = post(cluster, "/api/v1/allocations", body)["id"]
        watch = Watch(cluster, aid)
        seen = 0
        try:
            for i in range(runs + 1):  # the first is a warm-up
                seen, _, _ = watch.wait("Running", seen)
                time.sleep(0.5)  # let it count (and the agent report it running)
                post(cluster, f"/api/v1/allocations/{aid}/suspend")
                seen, t_ck, _ = watch.wait("Checkpointing", seen)
                seen, t_sus, a = watch.wait("Suspended", seen)
                ck = a.get("last_checkpoint") or {}
                if i > 0:
                    samples.append(t_sus - t_ck)
                    app_ms.append(float(ck.get("duration_seconds", 0.0)) * 1000.0)
                    if a.get("checkpoint_hint_at"):
                        server_ms.append((float(ck["at"]) - float(a["checkpoint_hint_at"])) * 1000)
                log(
                    f"sample {i}: {1000 * (t_sus - t_ck):.1f} ms ({'warm-up' if i == 0 else 'kept'})"
                )
                post(cluster, f"/api/v1/allocations/{aid}/resume")
        finally:
            watch.close()
            try:
                post(cluster, f"/api/v1/allocations/{aid}", method="DELETE")
            except OSError:
                pass
    lat = latency_summary(samples)
    return {
        "hint_to_suspended_ms": lat.get("p50_ms"),
        "hint_to_suspended": lat,
        "app_write_ms": r(median(app_ms)),
        "server_ms": r(median(server_ms)),
        "samples": len(samples),
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=5)
    p.add_argument("--allocations", type=int, default=10_000)
    p.add_argument("--no-cluster", action="store_true", help="only the evaluation pass")
    args = p.parse_args()
    runs = runs_of(args, quick_runs=2)
    n = args.allocations
    ev = bench_eval(n, runs)
    key = "eval_10k" if n == 10_000 else f"eval_{n}"
    result: dict[str, Any] = {f"{key}_s": ev["eval_s"], f"{key}_cpu_s": ev["eval_cpu_s"]}
    result["eval"] = ev
    result["load_average"] = r(os.getloadavg()[0])  # a shared machine stretches wall times
    if not args.no_cluster:
        result.update(bench_suspend(runs, args.keep))
    emit(
        {
            "eval_10k_s": result.get("eval_10k_s"),
            "hint_to_suspended_ms": result.get("hint_to_suspended_ms"),
            **result,
        }
    )


if __name__ == "__main__":
    main()
