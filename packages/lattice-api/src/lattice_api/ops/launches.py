"""Task launches inside a Running allocation (``lattice launch``, srun's equivalent).

LaunchTasks checks the allocation (Running, the caller's own), lays the ranks out
over its nodes (``layout.rank_layout``), provisions CXI credentials when a fabric
manager is configured, and sends LaunchProcesses to every node's agent at once.
If any node refuses, the others are told to abort and nothing keeps running.

A launch is not quorum state: it lives in the agents for as long as its ranks
(and ``retain_seconds`` after), so any API member can follow it. WatchLaunch
fans the agents' event streams in: the layout first, rank output and exits as
they come, each node's end, then one ``done`` with the launch's exit status
(the abort status if it was aborted, else the first non-zero rank exit in rank
order, else 0). A node whose stream stays broken is reported lost; its peers
abort the launch on their own (``lattice_agent.pmi.launches``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_common.agents import AgentChannels
from lattice_common.errors import (
    InvalidTransition,
    LatticeError,
    NotFound,
    PermissionDenied,
    Unavailable,
    ValidationError,
)
from lattice_common.proto.lattice import v1
from lattice_common.rpc import decode_grpc_error
from lattice_common.types import AllocationState
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.auth import Identity
from lattice_api.fabric import FabricManager
from lattice_api.layout import rank_layout
from lattice_api.ops.base import visible_allocation

log = logging.getLogger("lattice.api.launch")

__all__ = ["PMI_MODES", "LaunchOps", "event_dict"]

PMI_MODES = ("", "pmi1", "pmi2", "pmix", "none")
#: how long the fan-out waits for the agents to start their ranks
FANOUT_TIMEOUT = 30.0
#: a node whose launch stream stays broken this long is reported lost
NODE_LOST_AFTER = 5.0
_TRANSPORT = (GRPCError, StreamTerminatedError, OSError, TimeoutError)


def _done_dict(d: v1.LaunchDone) -> dict[str, Any]:
    return {
        "exit_status": d.exit_status,
        "aborted": d.aborted,
        "reason": d.reason,
        "failed_rank": d.failed_rank,
        "failed_node": d.failed_node,
        "rank_exit_codes": {str(k): v for k, v in sorted(d.rank_exit_codes.items())},
    }


def event_dict(ev: v1.LaunchEvent) -> dict[str, Any]:
    """A launch event as the plain dict both transports send (every field present)."""
    if ev.output is not None:
        o = ev.output
        return {
            "type": "output",
            "node_id": ev.node_id,
            "rank": o.rank,
            "stream": o.stream,
            "line": o.line,
        }
    if ev.rank_exit is not None:
        return {
            "type": "rank_exit",
            "node_id": ev.node_id,
            "rank": ev.rank_exit.rank,
            "exit_code": ev.rank_exit.exit_code,
        }
    if ev.start is not None:
        return {
            "type": "start",
            "node_id": ev.node_id,
            "task_id": ev.start.task_id,
            "nodes": list(ev.start.node_ids),
            "ranks_per_node": list(ev.start.ranks_per_node),
            "world_size": ev.start.world_size,
        }
    if ev.node_done is not None:
        return {"type": "node_done", "node_id": ev.node_id, **_done_dict(ev.node_done)}
    if ev.done is not None:
        return {"type": "done", "node_id": "", **_done_dict(ev.done)}
    return {"type": "unknown", "node_id": ev.node_id}


def merge_done(
    node_ids: list[str], done: dict[str, v1.LaunchDone], lost: dict[str, str]
) -> v1.LaunchDone:
    """The launch's end from each node's end (pure)."""
    codes: dict[int, int] = {}
    for d in done.values():
        codes.update(d.rank_exit_codes)
    aborted = [done[n] for n in node_ids if n in done and done[n].aborted]
    if aborted:
        # the node where the first abort started says best what happened: an MPI_Abort
        # makes its peers' ranks fail too (their connections to it break) and those
        # nodes may abort on their own before the abort reaches them
        origins = [done[n] for n in node_ids if n in done and done[n].failed_node == n]
        origin = min(origins, key=lambda d: d.aborted_at or float("inf"), default=aborted[0])
        return v1.LaunchDone(
            exit_status=origin.exit_status or 1,
            aborted=True,
            reason=origin.reason,
            failed_rank=origin.failed_rank,
            failed_node=origin.failed_node,
            rank_exit_codes=codes,
        )
    if lost:
        node = next(n for n in node_ids if n in lost)
        return v1.LaunchDone(
            exit_status=1,
            aborted=True,
            reason=f"node {node} lost: {lost[node]}",
            failed_rank=-1,
            failed_node=node,
            rank_exit_codes=codes,
        )
    bad = next(((r, c) for r, c in sorted(codes.items()) if c != 0), None)
    if bad is None:
        return v1.LaunchDone(exit_status=0, failed_rank=-1, rank_exit_codes=codes)
    node = next((n for n in node_ids if n in done and bad[0] in done[n].rank_exit_codes), "")
    return v1.LaunchDone(
        exit_status=bad[1],
        reason=f"rank {bad[0]} exited with code {bad[1]}",
        failed_rank=bad[0],
        failed_node=node,
        rank_exit_codes=codes,
    )


class _FanIn:
    """One watch of a launch: a pump per node into one queue."""

    def __init__(
        self,
        agents: AgentChannels,
        allocation_id: str,
        task_id: str,
        addresses: dict[str, str],
        lost_after: float,
    ) -> None:
        self.agents = agents
        self.req = v1.WatchLaunchRequest(allocation_id=allocation_id, task_id=task_id)
        self.addresses = addresses
        self.lost_after = lost_after
        self.queue: asyncio.Queue[tuple[str, v1.LaunchEvent | str | None]] = asyncio.Queue()
        self.pumps: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        for node, addr in self.addresses.items():
            self.pumps[node] = asyncio.create_task(self._pump(node, addr))

    def stop(self, nodes: set[str] | None = None) -> None:
        for node, t in self.pumps.items():
            if nodes is None or node in nodes:
                t.cancel()

    async def _pump(self, node: str, address: str) -> None:
        """Events of ``node``; then None (its end), "" (it has no such launch) or a
        reason (lost). A reconnect skips what was already passed on."""
        received = 0
        last = time.monotonic()
        why = ""
        while True:
            skip = received
            try:
                async for ev in self.agents.stub(address).watch_launch(self.req):
                    last = time.monotonic()
                    if skip:
                        skip -= 1
                        continue
                    received += 1
                    await self.queue.put((node, ev))
                    if ev.node_done is not None:
                        await self.queue.put((node, None))
                        return
                why = "its launch stream ended early"
            except asyncio.CancelledError:
                raise
            except GRPCError as e:
                if e.status == Status.NOT_FOUND and received == 0:
                    await self.queue.put((node, ""))
                    return
                why = decode_grpc_error(e).message
            except (StreamTerminatedError, OSError, ValueError) as e:
                why = f"its agent at {address} is unreachable ({e or type(e).__name__})"
            if time.monotonic() - last > self.lost_after:
                await self.queue.put((node, why or "its agent stopped answering"))
                return
            await asyncio.sleep(0.2)


class LaunchOps:
    """LaunchTasks and WatchLaunch."""

    def __init__(
        self,
        quorum: Quorum,
        agents: AgentChannels,
        *,
        fabric: FabricManager | None = None,
        fanout_timeout: float = FANOUT_TIMEOUT,
        node_lost_after: float = NODE_LOST_AFTER,
    ) -> None:
        self.quorum = quorum
        self.agents = agents
        self.fabric = fabric
        self.fanout_timeout = fanout_timeout
        self.node_lost_after = node_lost_after
        self._supervisors: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ LaunchTasks

    def _addresses(self, nodes: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for node_id in nodes:
            node = self.quorum.read(queries.node, node_id)
            if node is None or not node.agent_address:
                raise Unavailable(
                    f"node {node_id} has no reachable agent",
                    hint="Check the node with `lattice nodes`; its agent may be down.",
                )
            out[node_id] = node.agent_address
        return out

    async def launch_tasks(
        self, who: Identity, alloc_id: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Start ranks on the allocation's nodes; returns task_id, nodes and the layout."""
        a = visible_allocation(self.quorum, who, alloc_id)
        if a.spec.user != who.user:
            raise PermissionDenied(
                f"allocation {a.id} belongs to {a.spec.user}",
                hint="Tasks can be launched only in your own allocations.",
            )
        if a.state != AllocationState.RUNNING:
            raise InvalidTransition(
                f"allocation {a.id} is {a.state.value}, not Running",
                hint="Launch tasks once the allocation runs (`lattice status ID`).",
            )
        argv = [str(x) for x in body.get("argv") or []]
        if not argv or not argv[0]:
            raise ValidationError(
                "a launch needs a command", hint="lattice launch --alloc=ID -n 4 -- ./prog args"
            )
        mpi = str(body.get("mpi") or "")
        if mpi not in PMI_MODES:
            raise ValidationError(
                f"unknown PMI mode {mpi!r}", hint="Use --pmi=pmi1, pmi2, pmix or none."
            )
        env = {str(k): str(v) for k, v in (body.get("env") or {}).items()}
        for k in env:
            if not k or "=" in k or "\0" in k:
                raise ValidationError(f"invalid environment variable name {k!r}")
        nodes = list(a.assigned_nodes)
        wanted = [str(n) for n in body.get("nodes") or []]
        if wanted:
            unknown = [n for n in wanted if n not in nodes]
            if unknown:
                raise ValidationError(
                    f"{', '.join(unknown)} not among allocation {a.id}'s nodes",
                    hint=f"Its nodes are {', '.join(nodes)}.",
                )
            nodes = [n for n in nodes if n in wanted]
        layout = rank_layout(
            nodes, int(body.get("num_tasks") or 0), int(body.get("tasks_per_node") or 0)
        )
        nodes = nodes[: len(layout)]
        addresses = self._addresses(nodes)
        task_id = str(uuid.uuid4())
        cxi = None
        service_id = ""
        if self.fabric is not None:
            creds = await self.fabric.provision(a.id, task_id, nodes)
            service_id = creds.service_id
            cxi = v1.CxiCredentials(vni=creds.vni, auth_key=creds.auth_key, svc_id=creds.svc_id)
        world = sum(layout)
        template = v1.LaunchProcessesRequest(
            allocation_id=a.id,
            task_id=task_id,
            argv=argv,
            world_size=world,
            env=env,
            working_dir=str(body.get("working_dir") or ""),
            mpi=mpi,
            peer_agents=[addresses[n] for n in nodes],
            node_ids=nodes,
            ranks_per_node=layout,
            cxi=cxi,
        )
        try:
            await self._fan_out(template)
        except BaseException:
            if service_id:
                await self._revoke(service_id)
            raise
        if service_id:
            self._supervise(a.id, task_id, addresses, service_id)
        log.info("launch %s in %s by %s: %d ranks on %s", task_id, a.id, who.user, world, nodes)
        return {"task_id": task_id, "nodes": nodes, "world_size": world, "ranks_per_node": layout}

    async def _fan_out(self, template: v1.LaunchProcessesRequest) -> None:
        """LaunchProcesses to every node of ``template`` at once (node i gets the ranks
        after those of the nodes before it); any refusal aborts the others and is raised.

        The launch-wide fields (the node and peer lists grow with the launch) are encoded
        once; each node's request is its own first_rank/local_tasks followed by them, which
        protobuf reads as one message (fields of concatenated encodings merge).
        """
        nodes = list(template.node_ids)
        peers = list(template.peer_agents)
        shared = bytes(template)
        first = 0
        calls = []
        for i, count in enumerate(template.ranks_per_node):
            own = bytes(v1.LaunchProcessesRequest(first_rank=first, local_tasks=count))
            first += count
            calls.append(
                asyncio.create_task(
                    self.agents.stub(peers[i]).launch_processes(
                        _Encoded.of(own + shared), timeout=self.fanout_timeout
                    )
                )
            )
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(nodes[i], r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            return
        node, exc = failed[0]
        err = _as_error(node, exc)
        abort = v1.AbortRequest(
            allocation_id=template.allocation_id,
            task_id=template.task_id,
            reason=f"the launch could not start on node {node}: {err.message}",
            exit_status=1,
            failed_rank=-1,
            failed_node=node,
        )
        await asyncio.gather(
            *(
                self.agents.stub(peers[i]).abort(abort, timeout=10)
                for i in range(len(nodes))
                if nodes[i] != node
            ),
            return_exceptions=True,
        )
        raise err

    async def _revoke(self, service_id: str) -> None:
        assert self.fabric is not None
        try:
            await self.fabric.revoke(service_id)
        except LatticeError as e:
            log.warning("could not revoke CXI service %s: %s", service_id, e)

    def _supervise(
        self, alloc_id: str, task_id: str, addresses: dict[str, str], service_id: str
    ) -> None:
        """Revoke the launch's CXI credentials when it ends."""

        async def run() -> None:
            try:
                async for _ in self._events(alloc_id, task_id, addresses):
                    pass
            except LatticeError as e:
                log.warning("lost track of launch %s: %s", task_id, e)
            finally:
                await self._revoke(service_id)

        task = asyncio.create_task(run(), name=f"launch-supervisor-{task_id}")
        self._supervisors.add(task)
        task.add_done_callback(self._supervisors.discard)

    # ------------------------------------------------------------------ WatchLaunch

    async def watch(
        self, who: Identity, alloc_id: str, task_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The launch's events as dicts (see ``event_dict``), ending with ``done``.

        NotFound is raised before the first event when no node of the allocation
        knows the launch.
        """
        a = visible_allocation(self.quorum, who, alloc_id)
        if not a.assigned_nodes:
            raise NotFound(f"allocation {a.id} has no nodes, so no launch {task_id}")
        addresses = {}
        for node_id in a.assigned_nodes:
            node = self.quorum.read(queries.node, node_id)
            if node is not None and node.agent_address:
                addresses[node_id] = node.agent_address
        events = self._events(a.id, task_id, addresses)
        first = await anext(events)  # raises NotFound before streaming starts
        return _chain(event_dict(first), events)

    async def _events(
        self, alloc_id: str, task_id: str, addresses: dict[str, str]
    ) -> AsyncIterator[v1.LaunchEvent]:
        fan = _FanIn(self.agents, alloc_id, task_id, addresses, self.node_lost_after)
        fan.start()
        try:
            pending = set(addresses)
            node_ids: list[str] | None = None
            done: dict[str, v1.LaunchDone] = {}
            lost: dict[str, str] = {}
            unreachable: dict[str, str] = {}
            while pending:
                node, item = await fan.queue.get()
                if item is None or item == "":
                    pending.discard(node)
                elif isinstance(item, str):
                    pending.discard(node)
                    unreachable[node] = item
                    if node_ids is not None and node in node_ids and node not in done:
                        lost[node] = item
                elif item.start is not None:
                    if node_ids is None:
                        node_ids = list(item.start.node_ids)
                        outside = pending - set(node_ids)
                        fan.stop(outside)
                        pending -= outside
                        lost.update({n: w for n, w in unreachable.items() if n in node_ids})
                        yield v1.LaunchEvent(start=item.start)
                elif item.node_done is not None:
                    done[node] = item.node_done
                    yield item
                else:
                    yield item
                if node_ids is not None and all(n in done or n in lost for n in node_ids):
                    break
            if node_ids is None:
                raise NotFound(
                    f"no node of allocation {alloc_id} knows launch {task_id}",
                    hint="Launches are kept a while after they end; check the id "
                    "that `lattice launch` printed.",
                )
            yield v1.LaunchEvent(done=merge_done(node_ids, done, lost))
        finally:
            fan.stop()

    async def close(self) -> None:
        for t in list(self._supervisors):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._supervisors, return_exceptions=True)


class _Encoded(v1.LaunchProcessesRequest):
    """A LaunchProcessesRequest sent as bytes put together beforehand (see ``_fan_out``)."""

    @classmethod
    def of(cls, wire: bytes) -> _Encoded:
        msg = cls()
        object.__setattr__(msg, "_lattice_wire", wire)
        return msg

    def SerializeToString(self) -> bytes:
        return self._lattice_wire  # type: ignore[attr-defined, no-any-return]

    def __bytes__(self) -> bytes:
        return self._lattice_wire  # type: ignore[attr-defined, no-any-return]


async def _chain(
    first: dict[str, Any], rest: AsyncIterator[v1.LaunchEvent]
) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for ev in rest:
        yield event_dict(ev)


def _as_error(node: str, exc: BaseException) -> LatticeError:
    if isinstance(exc, GRPCError):
        err = decode_grpc_error(exc)
        err.message = f"node {node}: {err.message}"
        return err
    if isinstance(exc, LatticeError):
        return exc
    return Unavailable(
        f"node {node}'s agent could not be reached: {exc or type(exc).__name__}",
        hint="Check the node with `lattice nodes`; its agent may be down.",
    )
