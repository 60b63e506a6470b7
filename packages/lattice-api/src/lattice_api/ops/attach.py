"""Interactive attach (``lattice attach``): a terminal in a Running allocation, proxied
to the agent of one of its nodes (NodeAgentService.Attach, a bidirectional stream).

``open`` makes every check before anything streams: the allocation exists and is the
caller's (for a sensitive allocation: the user holding the node's claim), it is
Running (Checkpointing has the specification's own message), the node is one of its
nodes (default: the first), the caller has fewer than ``max_per_user`` (5) attaches
open on this API member (a sensitive allocation: one at a time). It then opens the
agent's stream, sends the AttachStart and waits for the agent's first message (an
empty stdout once the command runs), so an agent's refusal is also an error of
``open`` and both transports can answer it as a status.

The :class:`AttachCall` it returns moves AttachInput/AttachOutput messages; closing it
cancels the agent's stream (the agent hangs the session up) and frees the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from grpclib.client import Stream
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_common import audit
from lattice_common.agents import AgentChannels
from lattice_common.assignment import is_sensitive
from lattice_common.errors import (
    InvalidTransition,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
    ValidationError,
)
from lattice_common.proto.lattice import v1
from lattice_common.rpc import decode_grpc_error
from lattice_common.types import Allocation, AllocationState
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity
from lattice_api.ops.base import visible_allocation

log = logging.getLogger("lattice.api.attach")

__all__ = ["MAX_PER_USER", "SIGNALS", "AttachCall", "AttachOps", "limit_message"]

MAX_PER_USER = 5
#: signal names a client may send (INT/TSTP/QUIT: foreground group; HUP: session)
SIGNALS = ("INT", "TSTP", "QUIT", "HUP")
#: the agent drops a stream silent for 90 s; the API sends one every 30 s for WebSocket
#: clients (whose own liveness is the WebSocket heartbeat)
KEEPALIVE_INTERVAL = 30.0
OPEN_TIMEOUT = 30.0
_PATH = "/lattice.v1.NodeAgentService/Attach"
_TRANSPORT = (GRPCError, StreamTerminatedError, OSError, TimeoutError)


def limit_message(n: int) -> str:
    return (
        f"maximum concurrent sessions reached ({n}/{n}). "
        "Close an existing session to open a new one."
    )


class AttachCall:
    """One open attach: ``send`` input, ``recv`` output (None at the end), ``close``."""

    def __init__(self, stream: Stream, node_id: str, release: Any) -> None:
        self.stream = stream
        self.node_id = node_id
        self._release = release
        self._closed = False
        self._send_lock = asyncio.Lock()
        self.ended = False

    async def send(self, msg: v1.AttachInput) -> None:
        if self._closed or self.ended:
            return
        async with self._send_lock:
            try:
                await self.stream.send_message(msg)
            except _TRANSPORT as e:
                log.debug("attach input to %s dropped: %s", self.node_id, e)

    async def end_input(self) -> None:
        if self._closed or self.ended:
            return
        async with self._send_lock:
            with contextlib.suppress(*_TRANSPORT):
                await self.stream.end()

    async def recv(self) -> v1.AttachOutput | None:
        """The next output message; None when the agent ended the stream. A broken
        stream is Unavailable ("connection to node lost — attach session ended")."""
        if self.ended:
            return None
        try:
            msg = await self.stream.recv_message()
            if msg is None:
                self.ended = True
                await self.stream.recv_trailing_metadata()
            return msg  # type: ignore[no-any-return]
        except GRPCError as e:
            self.ended = True
            raise decode_grpc_error(e) from None
        except (StreamTerminatedError, OSError) as e:
            self.ended = True
            raise Unavailable(
                "connection to node lost — attach session ended",
                details={"node": self.node_id, "cause": str(e) or type(e).__name__},
            ) from None

    async def close(self) -> None:
        """Cancel the agent's stream (a disconnect there) and free the slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.ended:
                with contextlib.suppress(Exception):
                    await self.stream.__aexit__(None, None, None)
            else:
                with contextlib.suppress(Exception):
                    await self.stream.cancel()
                gone = asyncio.CancelledError()
                with contextlib.suppress(BaseException):
                    await self.stream.__aexit__(type(gone), gone, None)
        finally:
            self._release()


class AttachOps:
    """Attach: the checks, the per-user limit on this member, the agent stream."""

    def __init__(
        self,
        quorum: Quorum,
        agents: AgentChannels,
        *,
        max_per_user: int = MAX_PER_USER,
        user_limit: Callable[[str], int] | None = None,
        audit: AuditRecorder | None = None,
    ) -> None:
        self.quorum = quorum
        self.agents = agents
        self.audit = audit  # attaches to sensitive allocations are recorded
        self.max_per_user = max_per_user
        # the user's limit from rate_limit (admin overrides included), as the limiter
        # of the transports sees it; else max_per_user
        self.user_limit = user_limit
        self._per_user: Counter[str] = Counter()
        self._per_alloc: Counter[str] = Counter()

    def active(self, user: str) -> int:
        return self._per_user[user]

    def check(
        self, who: Identity, alloc_id: str, node_id: str = ""
    ) -> tuple[Allocation, str, bool]:
        """(allocation, node, sensitive) when ``who`` may attach now; raises otherwise."""
        a = visible_allocation(self.quorum, who, alloc_id)
        vclusters = {v.name: v for v in self.quorum.read(queries.vclusters)}
        sensitive = is_sensitive(a, vclusters)
        if a.spec.user != who.user:
            raise PermissionDenied(
                f"allocation {a.id} belongs to {a.spec.user}; only its owner may attach",
                hint="Attach to your own allocations (`lattice status` lists them).",
            )
        if a.state == AllocationState.CHECKPOINTING:
            raise InvalidTransition(
                "allocation is being checkpointed — attach unavailable until rescheduled",
                hint=f"Wait for allocation {a.id} to run again (`lattice status {a.id}`).",
            )
        if a.state != AllocationState.RUNNING:
            raise InvalidTransition(
                f"allocation {a.id} is {a.state.value}, not Running",
                hint="Attach once the allocation runs (`lattice status ID`).",
            )
        nodes = list(a.assigned_nodes)
        if not nodes:
            raise Unavailable(f"allocation {a.id} has no nodes")
        node_id = node_id or nodes[0]
        if node_id not in nodes:
            raise ValidationError(
                f"{node_id} is not one of allocation {a.id}'s nodes",
                hint=f"Its nodes are {', '.join(nodes)}.",
            )
        node = self.quorum.read(queries.node, node_id)
        if sensitive and node is not None and node.claimed_by and node.claimed_by != who.user:
            raise PermissionDenied(
                f"node {node_id} is claimed by {node.claimed_by}; only the claiming user "
                "may attach to a sensitive allocation",
                hint="Sensitive allocations accept terminals from their claiming user only.",
            )
        return a, node_id, sensitive

    def _reserve(self, who: Identity, a: Allocation, sensitive: bool) -> Any:
        n = self.user_limit(who.user) if self.user_limit is not None else self.max_per_user
        if self._per_user[who.user] >= n:
            raise QuotaExceeded(
                limit_message(n),
                details={"limit": n, "open": self._per_user[who.user]},
                hint="Exit one of your other `lattice attach` terminals, or use tmux/screen "
                "inside one.",
            )
        if sensitive and self._per_alloc[a.id] >= 1:
            raise QuotaExceeded(
                limit_message(1),
                details={"limit": 1, "allocation": a.id},
                hint="A sensitive allocation takes one attach session at a time.",
            )
        self._per_user[who.user] += 1
        self._per_alloc[a.id] += 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            self._per_user[who.user] -= 1
            self._per_alloc[a.id] -= 1
            if self._per_user[who.user] <= 0:
                del self._per_user[who.user]
            if self._per_alloc[a.id] <= 0:
                del self._per_alloc[a.id]

        return release

    async def open(
        self,
        who: Identity,
        alloc_id: str,
        *,
        node_id: str = "",
        command: list[str] | None = None,
        tty: bool = True,
        rows: int = 0,
        cols: int = 0,
        timeout: float = OPEN_TIMEOUT,
    ) -> AttachCall:
        """Check, reserve a slot, open the agent's stream; the call once the command runs."""
        a, node_id, sensitive = self.check(who, alloc_id, node_id)
        argv = [str(x) for x in command or []]
        if argv and not argv[0]:
            raise ValidationError("the command's program is empty")
        if (rows < 0 or cols < 0) or rows > 10000 or cols > 10000:
            raise ValidationError(f"bad terminal size {rows}x{cols}")
        release = self._reserve(who, a, sensitive)
        if sensitive and self.audit is not None:
            details = {"node": node_id, "command": " ".join(argv) or "(shell)", "tty": str(tty)}
            self.audit.record_access(who.user, a, audit.ALLOCATION_ATTACH, details)
        try:
            node = self.quorum.read(queries.node, node_id)
            if node is None or not node.agent_address:
                raise Unavailable(
                    f"node {node_id} has no reachable agent",
                    hint="Check the node with `lattice nodes`; its agent may be down.",
                )
            try:
                stub = self.agents.stub(node.agent_address)
            except ValueError as e:
                raise Unavailable(f"node {node_id} has a bad agent address: {e}") from None
            stream = stub.channel.request(
                _PATH,
                Cardinality.STREAM_STREAM,
                v1.AttachInput,
                v1.AttachOutput,
                metadata=self.agents.metadata,
            )
            call = AttachCall(stream, node_id, release)
        except BaseException:
            release()
            raise
        start = v1.AttachStart(
            allocation_id=a.id,
            node_id=node_id,
            command=argv,
            tty=tty,
            size=v1.TerminalSize(rows=rows, cols=cols) if rows and cols else None,
        )
        try:
            async with asyncio.timeout(timeout):
                await stream.__aenter__()
                await stream.send_request()
                await stream.send_message(v1.AttachInput(start=start))
                first = await call.recv()
        except BaseException as e:
            await call.close()
            if isinstance(e, TimeoutError):
                raise Unavailable(
                    f"node {node_id}'s agent did not start the attach within {timeout:g}s",
                    hint="Check the node with `lattice nodes`; its agent may be down.",
                ) from None
            if isinstance(e, StreamTerminatedError | OSError):
                raise Unavailable(
                    f"node {node_id}'s agent could not be reached: {e or type(e).__name__}",
                    hint="Check the node with `lattice nodes`; its agent may be down.",
                ) from None
            raise
        if first is None:
            await call.close()
            raise Unavailable(f"node {node_id} ended the attach before it started")
        log.info("attach to %s on %s by %s", a.id, node_id, who.user)
        return call
