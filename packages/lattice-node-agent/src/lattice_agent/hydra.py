"""Per-allocation agent sockets for ``lattice-mpi-launcher`` (spec: Direct mpirun).

Inside an allocation, ``mpirun`` (Hydra) starts its remote proxies with
``lattice-mpi-launcher HOST <proxy command>`` instead of ssh. The launcher must not
hold the agents' bearer token, so it talks only to its own node's agent, over a Unix
socket that exists for exactly one allocation: ``<work_dir>/<alloc>/agent.sock``
(mode 0600, the allocation's files). Each socket serves a restricted
NodeAgentService: LaunchProcesses and WatchLaunch of that allocation, nothing else
(another allocation's id or any other RPC: PERMISSION_DENIED).

A launch is one process (``/bin/sh -c <command>``, ``mpi="none"``) on one node of the
allocation: this node's runs in the ``LaunchManager``; another node's is forwarded to
that node's agent (its address from the quorum, NodeService.GetNode, called with the
token), and so is its WatchLaunch. The request is rebuilt from the fields a launcher
may choose, so a job cannot name peer agents (which would receive the token) or
nodes outside its allocation. A WatchLaunch that goes away before the command ended
(the launcher was killed, like an ssh connection dropping) kills the command.

``HydraSockets.sync`` (from the agent's desired-state loop) opens a socket and writes
Hydra's host file (the allocation's nodes, one per line) for every allocation
assigned to this node and closes the sockets of allocations that left.

Most jobs never call ``mpirun``, so the socket is opened cheaply: it is bound and
listening (the path exists, mode 0600, before the job starts, so a launcher can
connect at once), but its gRPC server is started only when the first connection
arrives; that connection waits in the listen backlog meanwhile. A job that never
connects costs a bind and a close, not a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpclib
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server
from lattice_common.agents import AgentChannels
from lattice_common.errors import LatticeError
from lattice_common.proto.lattice import v1
from lattice_common.rpc import grpc_error
from lattice_common.types import Allocation

from lattice_agent.identity import IdentityError, IdentityPolicy
from lattice_agent.mpi_launcher import connectable_path
from lattice_agent.pmi.launches import LaunchManager
from lattice_agent.spawn import AGENT_SOCKET, HYDRA_HOST_FILE

log = logging.getLogger("lattice.agent.hydra")

__all__ = ["AllocationAgentService", "HydraSockets", "write_host_file"]

#: LocalLaunch sets these for a launch of one rank; wrong for the MPI ranks that
#: Hydra starts under the proxy (Hydra passes mpirun's environment on, not these)
_LAUNCH_ONLY_VARS = (
    "LATTICE_RANK",
    "LATTICE_LAUNCH_ID",
    "LATTICE_LOCAL_RANK",
    "LATTICE_LOCAL_SIZE",
    "LATTICE_NPROCS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NPROCS",
    "SLURM_NTASKS",
    "SLURM_NODELIST",
    "SLURM_STEP_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
)
_UNSET_THEN_EXEC = f'unset {" ".join(_LAUNCH_ONLY_VARS)}; exec "$0" "$@"'

#: NodeService.GetNode(node_id).agent_address
AddressOf = Callable[[str], Awaitable[str]]

#: seconds a launch started through an allocation socket waits for its launcher to watch
#: it; a launcher opens the watch right after the start, so one that has not by then went
#: away in between (killed, interrupted) and its command must not outlive it
WATCH_GRACE = 10.0


def _denied(what: str) -> GRPCError:
    return grpclib.GRPCError(Status.PERMISSION_DENIED, what)


class AllocationAgentService(v1.NodeAgentServiceBase):
    """NodeAgentService for one allocation's launcher: LaunchProcesses and WatchLaunch only."""

    def __init__(
        self,
        alloc_id: str,
        node_id: str,
        *,
        launches: LaunchManager,
        channels: AgentChannels,
        address_of: AddressOf,
        allocation: Callable[[str], Allocation | None],
        watch_grace: float = WATCH_GRACE,
    ) -> None:
        self.alloc_id = alloc_id
        self.watch_grace = watch_grace
        #: launches a launcher is watching now
        self._watched: set[str] = set()
        self.node_id = node_id
        self.launches = launches
        self.channels = channels
        self.address_of = address_of
        self.allocation = allocation
        #: launch id -> (node, agent address; "" = this node)
        self._where: dict[str, tuple[str, str]] = {}

    def _check(self, alloc_id: str) -> None:
        if alloc_id != self.alloc_id:
            raise _denied(
                f"this socket serves allocation {self.alloc_id} only, not {alloc_id or '(none)'}"
            )

    async def launch_processes(
        self, message: v1.LaunchProcessesRequest
    ) -> v1.LaunchProcessesResponse:
        self._check(message.allocation_id)
        nodes = list(message.node_ids)
        if len(nodes) != 1 or message.peer_agents or message.world_size > 1:
            raise _denied("the allocation socket starts one process on one node per launch")
        node = nodes[0]
        alloc = self.allocation(self.alloc_id)
        if alloc is None:
            raise grpclib.GRPCError(
                Status.NOT_FOUND, f"allocation {self.alloc_id} is not running on {self.node_id}"
            )
        if node not in alloc.assigned_nodes:
            raise _denied(f"node {node!r} is not one of allocation {self.alloc_id}'s nodes")
        if message.task_id in self._where:
            raise grpclib.GRPCError(Status.ALREADY_EXISTS, f"launch {message.task_id} exists")
        req = v1.LaunchProcessesRequest(
            allocation_id=self.alloc_id,
            task_id=message.task_id,
            argv=["/bin/sh", "-c", _UNSET_THEN_EXEC, *message.argv],
            first_rank=0,
            local_tasks=1,
            world_size=1,
            env=dict(message.env),
            working_dir=message.working_dir,
            mpi="none",
            node_ids=[node],
            ranks_per_node=[1],
        )
        if node == self.node_id:
            try:
                pids = await self.launches.launch(req)
            except LatticeError as e:
                raise grpc_error(e) from None
            self._where[req.task_id] = (node, "")
            self._expect_watch(req.task_id)
            return v1.LaunchProcessesResponse(task_id=req.task_id, pids=pids)
        address = await self._address(node)
        try:
            resp = await self.channels.stub(address).launch_processes(req, timeout=60)
        except (StreamTerminatedError, OSError, TimeoutError) as e:
            raise grpclib.GRPCError(
                Status.UNAVAILABLE, f"node {node}'s agent at {address} is unreachable: {e}"
            ) from None
        self._where[req.task_id] = (node, address)
        self._expect_watch(req.task_id)
        return resp

    def _expect_watch(self, task_id: str) -> None:
        asyncio.get_running_loop().call_later(self.watch_grace, self._end_unwatched, task_id)

    def _end_unwatched(self, task_id: str) -> None:
        """The grace is over: a launch no launcher watches is ended. (A watch that ended
        took its launch out of ``_where`` and ended it itself if it had to.)"""
        if task_id in self._watched or task_id not in self._where:
            return
        node, address = self._where.pop(task_id)
        log.warning(
            "launch %s of allocation %s: no lattice-mpi-launcher watched it within %.0fs; "
            "ending it",
            task_id,
            self.alloc_id,
            self.watch_grace,
        )
        self._abort(task_id, node, address, "lattice-mpi-launcher went away before watching it")

    async def _address(self, node: str) -> str:
        try:
            address = await self.address_of(node)
        except GRPCError as e:
            raise grpclib.GRPCError(
                Status.UNAVAILABLE, f"cannot look up node {node}: {e.message or e.status.name}"
            ) from None
        except (StreamTerminatedError, OSError, TimeoutError) as e:
            raise grpclib.GRPCError(
                Status.UNAVAILABLE, f"cannot look up node {node}: {e}"
            ) from None
        if not address:
            raise grpclib.GRPCError(Status.UNAVAILABLE, f"node {node} has no agent address")
        return address

    async def watch_launch(self, message: v1.WatchLaunchRequest) -> AsyncIterator[v1.LaunchEvent]:
        self._check(message.allocation_id)
        where = self._where.get(message.task_id)
        if where is None:
            raise grpclib.GRPCError(
                Status.NOT_FOUND, f"no launch {message.task_id} was started through this socket"
            )
        node, address = where
        done = False
        self._watched.add(message.task_id)
        try:
            if not address:
                try:
                    self.launches.get(self.alloc_id, message.task_id)
                except LatticeError as e:
                    raise grpc_error(e) from None
                events = self.launches.watch(self.alloc_id, message.task_id)
            else:
                events = self.channels.stub(address).watch_launch(message)
            async for ev in events:
                done = done or ev.node_done is not None
                yield ev
        except (StreamTerminatedError, OSError) as e:
            raise grpclib.GRPCError(
                Status.UNAVAILABLE, f"node {node}'s agent at {address} went away: {e}"
            ) from None
        finally:
            self._watched.discard(message.task_id)
            self._where.pop(message.task_id, None)
            if not done:  # the launcher left before its command ended: end the command
                self._abort(message.task_id, node, address)

    def _abort(
        self, task_id: str, node: str, address: str, reason: str = "lattice-mpi-launcher went away"
    ) -> None:
        req = v1.AbortRequest(
            allocation_id=self.alloc_id,
            task_id=task_id,
            reason=reason,
            exit_status=255,
            failed_rank=-1,
            failed_node=node,
        )
        if not address:
            self.launches.abort(req)
            return

        async def send() -> None:
            with contextlib.suppress(GRPCError, StreamTerminatedError, OSError, TimeoutError):
                await self.channels.stub(address).abort(req, timeout=10)

        asyncio.get_running_loop().create_task(send())

    # everything else is refused on an allocation socket

    async def stream_logs(self, message: v1.LogRequest) -> AsyncIterator[v1.LogLine]:
        raise _denied("StreamLogs is not served on an allocation socket")
        yield  # pragma: no cover

    async def sync_desired_state(self, message: v1.DesiredState) -> v1.SyncAck:
        raise _denied("SyncDesiredState is not served on an allocation socket")

    async def attach(self, stream) -> None:  # type: ignore[no-untyped-def,override]
        raise _denied("Attach is not served on an allocation socket")

    async def pmi_fence(self, message: v1.PmiFenceRequest) -> v1.PmiFenceResponse:
        raise _denied("PmiFence is not served on an allocation socket")

    async def abort(self, message: v1.AbortRequest) -> v1.AbortResponse:
        raise _denied("Abort is not served on an allocation socket")

    async def cache_status(self, message: v1.CacheStatusRequest) -> v1.NodeCacheStatus:
        raise _denied("CacheStatus is not served on an allocation socket")

    async def cache_warm(self, message: v1.CacheImageRequest) -> v1.CachedImage:
        raise _denied("CacheWarm is not served on an allocation socket")

    async def cache_evict(self, message: v1.CacheImageRequest) -> v1.CacheEvictResponse:
        raise _denied("CacheEvict is not served on an allocation socket")


#: connections that may wait for an allocation's server to start
_BACKLOG = 64


@dataclass(eq=False)
class _AllocSocket:
    """One allocation's listening socket; its server once a launcher has connected."""

    alloc_id: str
    path: Path
    sock: socket.socket
    server: Server | None = None
    starting: asyncio.Task[None] | None = None


def _started(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("agent socket server did not start", exc_info=task.exception())


def write_host_file(path: Path, nodes: list[str]) -> None:
    """Hydra's host file: one node per line (replaced atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{n}\n" for n in nodes))
    os.replace(tmp, path)


class HydraSockets:
    """One allocation socket (and Hydra host file) per allocation assigned to this node."""

    def __init__(
        self,
        node_id: str,
        *,
        work_dir: Path,
        launches: LaunchManager,
        channels: AgentChannels,
        address_of: AddressOf,
        allocation: Callable[[str], Allocation | None],
        identities: IdentityPolicy | None = None,
        watch_grace: float = WATCH_GRACE,
    ) -> None:
        self.node_id = node_id
        self.watch_grace = watch_grace
        self.work_dir = Path(work_dir).absolute()
        self.identities = identities
        self.launches = launches
        self.channels = channels
        self.address_of = address_of
        self.allocation = allocation
        self._sockets: dict[str, _AllocSocket] = {}
        #: the node list last written to each allocation's host file
        self._nodes: dict[str, list[str]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def path(self, alloc_id: str) -> Path:
        return self.work_dir / alloc_id / AGENT_SOCKET

    async def sync(self, assigned: Mapping[str, Allocation]) -> None:
        """Open sockets for newly assigned allocations, close those of departed ones."""
        for alloc_id in [a for a in self._sockets if a not in assigned]:
            self._close(alloc_id)
        for alloc_id, alloc in assigned.items():
            if alloc_id in self._sockets:
                if self._nodes.get(alloc_id) != alloc.assigned_nodes:  # e.g. requeued
                    with contextlib.suppress(OSError):
                        self._host_file(alloc)
                continue
            try:
                await self._open(alloc)
            except (OSError, ValueError) as e:
                log.warning("no agent socket for allocation %s: %s", alloc_id, e)

    def _give_to_job(self, alloc: Allocation, path: str) -> None:
        """The socket belongs to the user the job runs as (only that user connects)."""
        if self.identities is None:
            return
        try:
            who = self.identities.run_as(alloc)
        except IdentityError:
            return  # the job cannot start either; its start says why
        if who.switches:
            os.chown(path, who.uid, who.gid)

    async def _open(self, alloc: Allocation) -> None:
        from lattice_agent.spawn import check_alloc_id

        check_alloc_id(alloc.id)
        path = self.path(alloc.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._host_file(alloc)
        path.unlink(missing_ok=True)  # left by an earlier agent
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_path, fd = connectable_path(str(path))
        try:
            sock.bind(bind_path)
            os.chmod(bind_path, 0o600)  # before listen: nobody else can ever connect
            self._give_to_job(alloc, bind_path)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        entry = _AllocSocket(alloc.id, path, sock)
        self._sockets[alloc.id] = entry
        # the server comes with the first connection (see the module docstring)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._first_connection, entry)
        log.debug("agent socket for allocation %s at %s", alloc.id, path)

    def _first_connection(self, entry: _AllocSocket) -> None:
        """A launcher connected: start the allocation's server on the listening socket
        (it accepts the waiting connection)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(entry.sock.fileno())
        if entry.server is not None or self._sockets.get(entry.alloc_id) is not entry:
            return
        entry.server = Server(
            [
                AllocationAgentService(
                    entry.alloc_id,
                    self.node_id,
                    launches=self.launches,
                    channels=self.channels,
                    address_of=self.address_of,
                    allocation=self.allocation,
                    watch_grace=self.watch_grace,
                )
            ]
        )
        entry.starting = loop.create_task(
            entry.server.start(sock=entry.sock), name=f"agent-socket-{entry.alloc_id}"
        )
        entry.starting.add_done_callback(_started)
        log.info("agent socket of allocation %s in use: serving it", entry.alloc_id)

    def serving(self, alloc_id: str) -> bool:
        """Whether the allocation's socket has a server (a launcher has connected)."""
        entry = self._sockets.get(alloc_id)
        return entry is not None and entry.server is not None

    def _host_file(self, alloc: Allocation) -> None:
        write_host_file(self.work_dir / alloc.id / HYDRA_HOST_FILE, list(alloc.assigned_nodes))
        self._nodes[alloc.id] = list(alloc.assigned_nodes)

    def _close(self, alloc_id: str) -> None:
        entry = self._sockets.pop(alloc_id)
        self._nodes.pop(alloc_id, None)
        entry.path.unlink(missing_ok=True)
        loop = asyncio.get_running_loop()
        if entry.server is None:  # never used: no server to stop
            loop.remove_reader(entry.sock.fileno())
            entry.sock.close()
            return
        server = entry.server
        starting = entry.starting

        async def closed() -> None:
            if starting is not None and not starting.done():
                with contextlib.suppress(Exception):
                    await starting
            server.close()  # cancels its calls: their launches are killed
            await server.wait_closed()

        task = loop.create_task(closed())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every socket (agent shutdown)."""
        for alloc_id in list(self._sockets):
            self._close(alloc_id)
        if self._closing:
            await asyncio.wait(self._closing, timeout=5)
