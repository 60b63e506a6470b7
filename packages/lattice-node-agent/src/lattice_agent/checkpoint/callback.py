"""The gRPC callback protocol (spec: "gRPC callback (agent-aware applications)"), over
Unix sockets only (proto/lattice/v1/checkpoint.proto):

* :class:`Registry`: the agent's CheckpointRegistry socket in the allocation's
  directory ($LATTICE_CHECKPOINT_SOCKET), owned by the job's user (mode 0600); the
  application registers the socket of its CheckpointCallback endpoint there;
* :class:`CallbackProtocol`: calls that endpoint when a checkpoint is needed and reads
  its answer: an estimate, progress, a deferral request, done or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server
from lattice_common.proto.lattice import v1

from lattice_agent.checkpoint.base import Poll
from lattice_agent.mpi_launcher import connectable_path

log = logging.getLogger("lattice.agent.checkpoint")


class _RegistryService(v1.CheckpointRegistryBase):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def register(
        self, message: v1.RegisterCheckpointEndpointRequest
    ) -> v1.RegisterCheckpointEndpointResponse:
        if message.allocation_id and message.allocation_id != self.registry.alloc_id:
            return v1.RegisterCheckpointEndpointResponse(
                accepted=False, message=f"this socket is allocation {self.registry.alloc_id}'s"
            )
        if not os.path.isabs(message.socket_path):
            return v1.RegisterCheckpointEndpointResponse(
                accepted=False, message="socket_path must be an absolute path"
            )
        self.registry.endpoint = message.socket_path
        log.info(
            "allocation %s: checkpoint endpoint %s", self.registry.alloc_id, message.socket_path
        )
        return v1.RegisterCheckpointEndpointResponse(accepted=True)


class Registry:
    """One allocation's CheckpointRegistry socket."""

    def __init__(self, alloc_id: str, path: Path) -> None:
        self.alloc_id = alloc_id
        self.path = path
        self.endpoint = ""  # the application's CheckpointCallback socket, once registered
        self._server: Server | None = None

    async def open(self, uid: int | None = None, gid: int | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # left by an earlier run or agent
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_path, fd = connectable_path(str(self.path))
        try:
            sock.bind(bind_path)
            os.chmod(bind_path, 0o600)  # before listen: only the job's user connects
            if uid is not None and gid is not None:
                os.chown(bind_path, uid, gid)
        except OSError:
            sock.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        self._server = Server([_RegistryService(self)])
        await self._server.start(sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        self.path.unlink(missing_ok=True)


class CallbackProtocol:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._poll = Poll()
        self._task: asyncio.Task[None] | None = None
        self._args: tuple[str, Path, float, bool, float] | None = None

    async def request(
        self,
        checkpoint_id: str,
        directory: Path,
        *,
        timeout: float,
        force: bool,
        deferral_left: float,
    ) -> None:
        await self._cancel()
        self._poll = Poll()
        self._args = (checkpoint_id, directory, timeout, force, deferral_left)
        self._task = asyncio.create_task(
            self._call(), name=f"checkpoint-call-{self.registry.alloc_id}"
        )

    async def _call(self) -> None:
        assert self._args is not None
        checkpoint_id, directory, timeout, force, deferral_left = self._args
        # an application that has not registered yet may still do so: no sign of life
        # until then, so the timeout table treats it as unresponsive
        while not self.registry.endpoint:
            await asyncio.sleep(0.1)
        path, fd = connectable_path(self.registry.endpoint)
        channel = Channel(path=path)
        try:
            stub = v1.CheckpointCallbackStub(channel)
            req = v1.CheckpointCallbackRequest(
                allocation_id=self.registry.alloc_id,
                checkpoint_id=checkpoint_id,
                checkpoint_dir=str(directory),
                timeout_seconds=timeout,
                force=force,
                deferral_left_seconds=deferral_left,
            )
            async for u in stub.checkpoint(req):
                if u.estimate_seconds > 0 or u.progress > 0:
                    self._poll.sign_of_life = True
                if u.defer_seconds > 0:
                    self._poll.defer_seconds = u.defer_seconds
                if u.error:
                    self._poll.error = u.error
                if u.done:
                    self._poll.done = True
        except (GRPCError, StreamTerminatedError, OSError, ConnectionError) as e:
            # the endpoint went away or broke: wait for done/deadline as unresponsive
            log.warning("allocation %s: checkpoint callback failed: %s", self.registry.alloc_id, e)
        finally:
            channel.close()
            if fd is not None:
                os.close(fd)

    def poll(self) -> Poll:
        p = self._poll
        # each sign of life and deferral request is reported once
        self._poll = Poll(done=p.done, error=p.error)
        return p

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def close(self) -> None:
        await self._cancel()
