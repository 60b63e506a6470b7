"""Simulated node agents at scale: thousands of nodes in a few OS processes.

Each simulated node speaks the real agent protocol to real ``lattice-server`` members
(grpclib ``NodeService`` stubs from ``lattice_common.proto``): ``RegisterNode`` with
plausible capabilities, a ``Heartbeat`` every ``heartbeat_interval`` with a sequence
number that only grows, one ``WatchDesiredState`` stream (the protocol has no
multiplexed form), and fake process execution: the decisions come from the real
agent's pure ``reconcile``; an allocation it starts is reported ``running`` in the
next heartbeat and ``exited`` (exit 0) after ``run_seconds``, at once, as the real agent
reports an exit. Heartbeats are spread evenly over the interval across the whole fleet
(``--index``/``--total``), never in lockstep.

Nodes share a few HTTP/2 connections per process (one per ``nodes_per_channel``
nodes: a server allows 100 concurrent streams per connection and every node keeps a
stream open). Heartbeats follow the leader hint for the whole process.

Heartbeats are coalesced (spec: "node agents batch heartbeats"): the heartbeats a
process's nodes send within ``coalesce_window`` seconds go to the leader as one
``BatchHeartbeat`` call, each answered on its own; ``--coalesce-window 0`` sends one
``Heartbeat`` call per node and heartbeat, as the real agent does.

Desired-state streams are spread over the quorum members by node (any member in sync
serves one; ``--streams-on-leader`` sends them all to the leader) and a lost stream
comes back after a jittered, growing delay (0.5 s doubling to 8 s), so that the
thousands of streams a failed member held do not reconnect in one burst. An agent
reconnecting tells the generation it has (``known_generation``); a member sends its
set again only once it changed.

As a process::

    python -m lattice_test_harness.simagents --nodes 2500 --offset 0 \\
        --quorum-endpoint 127.0.0.1:50051,127.0.0.1:50052 --heartbeat-interval 10

prints one JSON line ``{"ready": true, ...}`` on stdout once every node registered and
received its first desired state, then keeps ``--status-file`` (JSON counters) fresh
every second. SIGUSR1 pauses the heartbeats, SIGUSR2 resumes them, SIGTERM/SIGINT stop
it cleanly. ``SimFleet`` starts and stops such processes from a test or benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lattice_agent.reconcile import Forget, Start, Stop, reconcile
from lattice_common.net import split_host_port
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, auth_metadata
from lattice_common.types import Allocation, AllocationReport, Node, NodeCapabilities
from lattice_common.wire import from_message, to_message

log = logging.getLogger("lattice.simagents")

# capabilities by node index: mostly GPU nodes, some CPU-only, as a mixed partition
_KINDS = (
    NodeCapabilities(cpu_cores=72, memory_gb=480, gpu_type="GH200", gpu_count=4),
    NodeCapabilities(cpu_cores=72, memory_gb=480, gpu_type="GH200", gpu_count=4),
    NodeCapabilities(cpu_cores=64, memory_gb=512, gpu_type="A100", gpu_count=4),
    NodeCapabilities(cpu_cores=128, memory_gb=256),
)


@dataclass
class SimOptions:
    endpoints: list[str]
    nodes: int
    offset: int = 0
    total: int = 0  # the whole fleet's size (spreads heartbeats); 0 = nodes
    prefix: str = "sim"
    heartbeat_interval: float = 10.0
    run_seconds: float = 1.0  # a started allocation exits (0) after this; <0: never
    group_size: int = 78  # nodes per dragonfly group
    nodes_per_channel: int = 50
    register_concurrency: int = 64
    coalesce_window: float = 0.1  # seconds; 0 = one Heartbeat call per heartbeat
    max_batch: int = 2000  # heartbeats per BatchHeartbeat call
    spread_streams: bool = True  # desired-state streams over all members, by node
    token: str | None = None
    home_vcluster: str = ""


@dataclass
class Counters:
    registered: int = 0
    streams_ready: int = 0
    heartbeats: int = 0
    heartbeat_batches: int = 0  # BatchHeartbeat calls (0 when not coalesced)
    heartbeat_errors: int = 0
    rate_limited: int = 0
    reregistered: int = 0
    desired_updates: int = 0
    started: int = 0
    exited: int = 0
    stream_errors: int = 0
    heartbeat_latency_s: list[float] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        lat = sorted(self.heartbeat_latency_s)
        self.heartbeat_latency_s = lat[-2000:]  # keep it bounded, newest-ish
        d = {k: v for k, v in self.__dict__.items() if k != "heartbeat_latency_s"}
        if lat:
            d["heartbeat_p50_ms"] = round(1000 * lat[len(lat) // 2], 2)
            d["heartbeat_p99_ms"] = round(1000 * lat[int(len(lat) * 0.99)], 2)
        return d


class FakeRuntime:
    """What a node 'runs': reports as the real ProcessRuntime gives them, no processes."""

    def __init__(self, run_seconds: float, on_exit: Any, counters: Counters) -> None:
        self.run_seconds = run_seconds
        self.on_exit = on_exit
        self.counters = counters
        self.records: dict[str, AllocationReport] = {}
        self.timers: dict[str, asyncio.TimerHandle] = {}

    def reports(self) -> list[AllocationReport]:
        return list(self.records.values())

    def start(self, a: Allocation) -> None:
        self.records[a.id] = AllocationReport(
            allocation_id=a.id, phase="running", pid=1, started_at=time.time()
        )
        self.counters.started += 1
        if self.run_seconds >= 0:
            loop = asyncio.get_running_loop()
            self.timers[a.id] = loop.call_later(self.run_seconds, self._exit, a.id, 0, "")

    def _exit(self, alloc_id: str, code: int, reason: str) -> None:
        self.timers.pop(alloc_id, None)
        r = self.records.get(alloc_id)
        if r is None or r.phase != "running":
            return
        r.phase, r.exit_code, r.reason, r.finished_at = "exited", code, reason, time.time()
        self.counters.exited += 1
        self.on_exit()

    def stop(self, alloc_id: str, reason: str, keep: bool) -> None:
        t = self.timers.pop(alloc_id, None)
        if t is not None:
            t.cancel()
        if keep:
            self._exit(alloc_id, -15, reason)
        else:
            self.records.pop(alloc_id, None)

    def forget(self, alloc_id: str) -> None:
        self.stop(alloc_id, "", keep=False)


class Transport:
    """The process's connections: ``nodes_per_channel`` nodes per channel, per endpoint;
    ``leader`` is the endpoint heartbeats go to (moved by hints and failures)."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.endpoints = list(opts.endpoints)
        self.leader = 0
        self.channels: dict[tuple[int, int], Channel] = {}
        self.metadata = auth_metadata(opts.token)

    def stub(self, node_index: int, endpoint: int | None = None) -> v1.NodeServiceStub:
        ep = self.leader if endpoint is None else endpoint
        key = (ep, node_index // max(1, self.opts.nodes_per_channel))
        ch = self.channels.get(key)
        if ch is None:
            host, port = split_host_port(self.endpoints[ep], default_host="127.0.0.1")
            ch = self.channels[key] = Channel(host, port)
        return v1.NodeServiceStub(ch, metadata=self.metadata)

    def follow(self, hint: str) -> None:
        if hint in self.endpoints:
            self.leader = self.endpoints.index(hint)

    def failed(self, endpoint: int) -> None:
        # only the first failure seen on the current endpoint moves everyone on
        if endpoint == self.leader:
            self.leader = (self.leader + 1) % len(self.endpoints)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()


class BeatRefused(Exception):
    """The leader refused one node's heartbeat in a batch (its error code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Coalescer:
    """Collects the process's heartbeats for ``window`` seconds and sends them as one
    BatchHeartbeat; every node gets its own answer (or refusal) back."""

    def __init__(self, fleet: SimProcess, window: float, max_batch: int) -> None:
        self.fleet = fleet
        self.window = window
        self.max_batch = max(1, max_batch)
        self.queue: list[tuple[v1.HeartbeatRequest, asyncio.Future[v1.HeartbeatResponse]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def send(self, req: v1.HeartbeatRequest) -> v1.HeartbeatResponse:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[v1.HeartbeatResponse] = loop.create_future()
        self.queue.append((req, fut))
        if len(self.queue) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self.queue = self.queue, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(
        self, batch: list[tuple[v1.HeartbeatRequest, asyncio.Future[v1.HeartbeatResponse]]]
    ) -> None:
        f = self.fleet
        t = f.transport
        ep = t.leader
        try:
            # a channel of its own (index -1), apart from the nodes' streams
            resp = await t.stub(-1, ep).batch_heartbeat(
                v1.BatchHeartbeatRequest(heartbeats=[req for req, _ in batch]), timeout=30
            )
        except Exception as e:  # every node of the batch sees the call's failure
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        f.counters.heartbeat_batches += 1
        if resp.leader_hint is not None and not resp.results:
            answers = [v1.HeartbeatResponse(leader_hint=resp.leader_hint)] * len(batch)
            for (_, fut), answer in zip(batch, answers, strict=True):
                if not fut.done():
                    fut.set_result(answer)
            return
        for (_, fut), res in zip(batch, resp.results, strict=False):
            if fut.done():
                continue
            if res.error is not None:
                fut.set_exception(BeatRefused(res.error.code, res.error.message))
            else:
                fut.set_result(
                    v1.HeartbeatResponse(generation=res.generation, reregister=res.reregister)
                )
        for _, fut in batch[len(resp.results) :]:
            if not fut.done():
                fut.set_exception(BeatRefused("internal", "no answer in the batch"))

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)


class SimNode:
    def __init__(self, index: int, fleet: SimProcess) -> None:
        o = fleet.opts
        self.index = index  # within this process
        self.global_index = o.offset + index
        self.node_id = f"{o.prefix}-{self.global_index:05d}"
        self.fleet = fleet
        self.sequence = 0
        self.generation = 0
        self.attempts: dict[str, int] = {}
        self.beat_now = asyncio.Event()
        self.first_desired = asyncio.Event()
        self.runtime = FakeRuntime(o.run_seconds, self.beat_now.set, fleet.counters)

    def record(self) -> Node:
        o = self.fleet.opts
        g = self.global_index
        return Node(
            id=self.node_id,
            hostname=f"{self.node_id}.sim",
            capabilities=_KINDS[g % len(_KINDS)],
            group=g // max(1, o.group_size),
            conformance_group=f"fp-{g % len(_KINDS)}",
            agent_address=f"127.0.0.1:{20000 + g % 40000}",
            home_vcluster=o.home_vcluster,
        )

    async def register(self) -> None:
        t = self.fleet.transport
        delay = 0.2
        while True:
            ep = t.leader
            try:
                await t.stub(self.index, ep).register_node(
                    v1.RegisterNodeRequest(node=to_message(self.record(), v1.Node)), timeout=30
                )
                return
            except (GRPCError, *TRANSPORT_ERRORS) as e:
                if not isinstance(e, GRPCError):
                    t.failed(ep)
                log.debug("register %s failed: %s", self.node_id, e)
                await asyncio.sleep(delay + random.random() * delay)
                delay = min(delay * 2, 5.0)

    async def heartbeat(self) -> None:
        f = self.fleet
        t = f.transport
        self.sequence += 1
        ep = t.leader
        t0 = time.perf_counter()
        req = v1.HeartbeatRequest(
            node_id=self.node_id,
            sequence=self.sequence,
            allocations=[to_message(r, v1.AllocationReport) for r in self.runtime.reports()],
            generation=self.generation,
            timestamp=time.time(),
            health=v1.HealthSummary(
                conformance_fingerprint=f"fp-{self.global_index % len(_KINDS)}",
                telemetry_sources=["proc"],
            ),
        )
        if f.coalescer is not None:
            resp = await f.coalescer.send(req)
        else:
            resp = await t.stub(self.index, ep).heartbeat(req, timeout=30)
        f.counters.heartbeat_latency_s.append(time.perf_counter() - t0)
        f.counters.heartbeats += 1
        if resp.leader_hint:
            t.follow(resp.leader_hint)
            self.beat_now.set()
        elif resp.reregister:
            f.counters.reregistered += 1
            await self.register()

    async def heartbeat_loop(self) -> None:
        f = self.fleet
        o = f.opts
        total = o.total or o.nodes
        # evenly spread over the interval across the whole fleet
        await asyncio.sleep(o.heartbeat_interval * (self.global_index % total) / total)
        while True:
            next_at = time.monotonic() + o.heartbeat_interval
            if not f.running.is_set():  # paused: skip this slot, keep the spread
                await asyncio.sleep(o.heartbeat_interval)
                continue
            ep = f.transport.leader
            try:
                await self.heartbeat()
            except GRPCError as e:
                f.counters.heartbeat_errors += 1
                if e.status == Status.RESOURCE_EXHAUSTED:
                    f.counters.rate_limited += 1
            except BeatRefused as e:
                f.counters.heartbeat_errors += 1
                if e.code == "rate_limited":
                    f.counters.rate_limited += 1
            except TRANSPORT_ERRORS:
                f.counters.heartbeat_errors += 1
                f.transport.failed(ep)
                await asyncio.sleep(0.5 + random.random())
                continue
            wait = next_at - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.beat_now.wait(), wait)
            self.beat_now.clear()

    async def desired_loop(self) -> None:
        f = self.fleet
        t = f.transport
        # any member in sync serves a desired-state stream (not only the leader): the
        # streams are spread over the members by node, so neither the leader's steady
        # load nor a failed member's reconnecting streams fall on one member
        ep = self.global_index % len(t.endpoints) if f.opts.spread_streams else -1
        delay = 0.5
        while True:
            here = t.leader if ep < 0 else ep
            try:
                async for ds in t.stub(self.index, here).watch_desired_state(
                    v1.WatchDesiredStateRequest(
                        node_id=self.node_id, known_generation=self.generation
                    )
                ):
                    delay = 0.5
                    self.apply_desired(
                        ds.generation, [from_message(a, Allocation) for a in ds.allocations]
                    )
            except asyncio.CancelledError:
                raise
            except (GRPCError, *TRANSPORT_ERRORS) as e:
                f.counters.stream_errors += 1
                log.debug("desired-state stream of %s lost: %s", self.node_id, e)
                gone = not isinstance(e, GRPCError) or e.status == Status.UNAVAILABLE
                if gone and ep < 0:
                    t.failed(here)
                elif gone:
                    ep = (ep + 1) % len(t.endpoints)
            # jittered and growing: thousands of streams lost at once (a member gone)
            # come back spread over seconds, not in one burst
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 8.0)

    def apply_desired(self, generation: int, desired: list[Allocation]) -> None:
        self.fleet.counters.desired_updates += 1
        if not self.first_desired.is_set():
            self.first_desired.set()
            self.fleet.counters.streams_ready += 1
        if generation < self.generation:
            return
        self.generation = generation
        rt = self.runtime
        for act in reconcile(self.node_id, desired, rt.reports(), self.attempts):
            if isinstance(act, Stop):
                rt.stop(act.allocation_id, act.reason, act.keep)
                if not act.keep:
                    self.attempts.pop(act.allocation_id, None)
            elif isinstance(act, Forget):
                rt.forget(act.allocation_id)
                self.attempts.pop(act.allocation_id, None)
            elif isinstance(act, Start):
                self.attempts[act.allocation.id] = act.allocation.requeue_count
                rt.start(act.allocation)


class SimProcess:
    """``opts.nodes`` simulated nodes on this process's event loop."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.counters = Counters()
        self.transport = Transport(opts)
        self.coalescer = (
            Coalescer(self, opts.coalesce_window, opts.max_batch)
            if opts.coalesce_window > 0
            else None
        )
        self.running = asyncio.Event()  # cleared: heartbeats paused
        self.running.set()
        self.nodes = [SimNode(i, self) for i in range(opts.nodes)]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, ready_timeout: float = 600.0) -> None:
        """Register every node, open the streams and start the heartbeats; returns once
        every node got its first desired state."""
        sem = asyncio.Semaphore(self.opts.register_concurrency)

        async def reg(n: SimNode) -> None:
            async with sem:
                await n.register()
                self.counters.registered += 1
                self._tasks.append(asyncio.create_task(n.desired_loop()))
                self._tasks.append(asyncio.create_task(n.heartbeat_loop()))

        await asyncio.gather(*(reg(n) for n in self.nodes))
        await asyncio.wait_for(
            asyncio.gather(*(n.first_desired.wait() for n in self.nodes)), ready_timeout
        )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.coalescer is not None:
            await self.coalescer.close()
        self.transport.close()


# --- the process ------------------------------------------------------------------------


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="simulated nodes in this process")
    p.add_argument("--offset", type=int, default=0, help="index of this process's first node")
    p.add_argument("--total", type=int, default=0, help="nodes in the whole fleet")
    p.add_argument("--prefix", default="sim", help="node ids are PREFIX-NNNNN")
    p.add_argument("--quorum-endpoint", required=True, help="comma-separated gRPC addresses")
    p.add_argument("--heartbeat-interval", type=float, default=10.0)
    p.add_argument("--run-seconds", type=float, default=1.0, help="<0: never exit")
    p.add_argument("--group-size", type=int, default=78)
    p.add_argument("--nodes-per-channel", type=int, default=50)
    p.add_argument("--home-vcluster", default="")
    p.add_argument(
        "--coalesce-window",
        type=float,
        default=0.1,
        help="seconds of heartbeats sent as one BatchHeartbeat; 0 = one Heartbeat each",
    )
    p.add_argument(
        "--streams-on-leader",
        action="store_true",
        help="every desired-state stream to the leader (default: spread over the members)",
    )
    p.add_argument("--status-file", default="", help="JSON counters, rewritten every second")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--profile", default="", help="write a cProfile of the run to this file")
    return p.parse_args(argv)


async def _amain(a: argparse.Namespace) -> None:
    opts = SimOptions(
        endpoints=[e.strip() for e in a.quorum_endpoint.split(",") if e.strip()],
        nodes=a.nodes,
        offset=a.offset,
        total=a.total or a.nodes,
        prefix=a.prefix,
        heartbeat_interval=a.heartbeat_interval,
        run_seconds=a.run_seconds,
        group_size=a.group_size,
        nodes_per_channel=a.nodes_per_channel,
        token=os.environ.get("LATTICE_AGENT_TOKEN") or None,
        home_vcluster=a.home_vcluster,
        coalesce_window=a.coalesce_window,
        spread_streams=not a.streams_on_leader,
    )
    proc = SimProcess(opts)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_signal_handler(signal.SIGINT, done.set)
    loop.add_signal_handler(signal.SIGUSR1, proc.running.clear)
    loop.add_signal_handler(signal.SIGUSR2, proc.running.set)
    status = Path(a.status_file) if a.status_file else None

    async def write_status() -> None:
        while True:
            if status is not None:
                tmp = status.with_suffix(".tmp")
                snap = {**proc.counters.snapshot(), "paused": not proc.running.is_set()}
                tmp.write_text(json.dumps(snap))
                os.replace(tmp, status)
            await asyncio.sleep(1.0)

    writer = asyncio.create_task(write_status())
    starting = asyncio.create_task(proc.start(a.ready_timeout))
    stop_wait = asyncio.create_task(done.wait())
    t0 = time.perf_counter()
    first, _ = await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if starting in first:
        starting.result()
        print(
            json.dumps(
                {
                    "ready": True,
                    "nodes": opts.nodes,
                    "offset": opts.offset,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            ),
            flush=True,
        )
        await stop_wait
    else:
        starting.cancel()
    writer.cancel()
    await proc.stop()


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            asyncio.run(_amain(a))
        finally:
            prof.disable()
            prof.dump_stats(a.profile)
    else:
        asyncio.run(_amain(a))


# --- the launcher ------------------------------------------------------------------------


class SimFleet:
    """``nodes`` simulated nodes over ``processes`` OS processes (``python -m
    lattice_test_harness.simagents``), started together; ``wait_ready`` blocks until
    every process reported ready. Use as a context manager: leaving it stops them."""

    def __init__(
        self,
        endpoints: str,
        nodes: int,
        processes: int,
        work_dir: str | os.PathLike[str],
        *,
        heartbeat_interval: float = 10.0,
        run_seconds: float = 1.0,
        prefix: str = "sim",
        coalesce_window: float = 0.1,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.nodes = nodes
        self.processes = max(1, processes)
        self.dir = Path(work_dir)
        self.heartbeat_interval = heartbeat_interval
        self.run_seconds = run_seconds
        self.prefix = prefix
        self.coalesce_window = coalesce_window
        self.extra_args = tuple(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.procs: list[subprocess.Popen[str]] = []

    def node_ids(self) -> list[str]:
        return [f"{self.prefix}-{i:05d}" for i in range(self.nodes)]

    def start(self) -> SimFleet:
        self.dir.mkdir(parents=True, exist_ok=True)
        per, extra = divmod(self.nodes, self.processes)
        offset = 0
        for k in range(self.processes):
            n = per + (1 if k < extra else 0)
            logf = open(self.dir / f"sim-{k}.log", "ab")  # noqa: SIM115 (kept by the child)
            try:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "lattice_test_harness.simagents",
                            "--nodes",
                            str(n),
                            "--offset",
                            str(offset),
                            "--total",
                            str(self.nodes),
                            "--prefix",
                            self.prefix,
                            "--quorum-endpoint",
                            self.endpoints,
                            "--heartbeat-interval",
                            str(self.heartbeat_interval),
                            "--run-seconds",
                            str(self.run_seconds),
                            "--status-file",
                            str(self.status_path(k)),
                            "--coalesce-window",
                            str(self.coalesce_window),
                            *self.extra_args,
                        ],
                        stdout=subprocess.PIPE,
                        stderr=logf,
                        text=True,
                        env=self.env,
                        start_new_session=True,
                    )
                )
            finally:
                logf.close()
            offset += n
        return self

    def status_path(self, k: int) -> Path:
        return self.dir / f"sim-{k}.status.json"

    def wait_ready(self, timeout: float = 600.0) -> list[dict[str, Any]]:
        """The ready line of every process (raises if one exits or the time runs out)."""
        import selectors

        deadline = time.monotonic() + timeout
        ready: dict[int, dict[str, Any]] = {}
        sel = selectors.DefaultSelector()
        for k, p in enumerate(self.procs):
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, k)
        try:
            while len(ready) < len(self.procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"simulated agents not ready after {timeout:.0f}s: {self.status()}"
                    )
                for key, _ in sel.select(min(left, 1.0)):
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    if line.strip().startswith("{"):
                        ready[key.data] = json.loads(line)
                    elif not line:
                        sel.unregister(key.fileobj)
                for k, p in enumerate(self.procs):
                    if p.poll() is not None and k not in ready:
                        tail = (self.dir / f"sim-{k}.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"simulated agents {k} exited ({p.returncode}):\n{tail}")
        finally:
            sel.close()
        return [ready[k] for k in sorted(ready)]

    def status(self) -> dict[str, Any]:
        """The processes' counters summed (``paused`` true if any is paused)."""
        out: dict[str, Any] = {}
        for k in range(len(self.procs)):
            with contextlib.suppress(OSError, ValueError):
                d = json.loads(self.status_path(k).read_text())
                for key, v in d.items():
                    if key == "paused":
                        out["paused"] = out.get("paused", False) or v
                    elif key.endswith("_ms"):
                        out[key] = max(out.get(key, 0.0), v)
                    else:
                        out[key] = out.get(key, 0) + v
        return out

    def pids(self) -> dict[str, int]:
        return {f"sim-{k}": p.pid for k, p in enumerate(self.procs)}

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def pause(self) -> None:
        """Heartbeats stop (streams stay open)."""
        self.signal(signal.SIGUSR1)

    def resume(self) -> None:
        self.signal(signal.SIGUSR2)

    def stop(self, timeout: float = 20.0) -> None:
        self.signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    main()
