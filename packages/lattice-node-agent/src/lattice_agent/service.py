"""NodeAgentService as served by each agent: live logs for the API, task launches.

LaunchProcesses, WatchLaunch and Abort go to the agent's ``LaunchManager``
(``pmi.launches``); PmiFence serves the cross-node fences this agent collects
(``pmi.fence``); Attach goes to the agent's ``AttachManager`` (``attach``);
CacheStatus, CacheWarm and CacheEvict to its uenv image cache (``uenv.UenvCache``,
file work in a thread; ``lattice cache``); StreamMetrics and SetTelemetryMode to its
telemetry loop (``telemetry.watch``; ``lattice watch``, ``lattice telemetry``); Diagnose
to ``diagnostics.Diagnoser`` (``lattice diag``). The RPCs of the contract that later work
builds (desired state pushes) answer UNIMPLEMENTED naming the RPC.

When an agent token is configured every call must carry it (``Authorization:
Bearer``): these RPCs start processes inside allocations.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpclib
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.server import Server
from lattice_common import pki
from lattice_common.errors import (
    InvalidTransition,
    LatticeError,
    NotFound,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from lattice_common.proto.lattice import v1
from lattice_common.rpc import grpc_error

from lattice_agent.attach import AttachManager
from lattice_agent.diagnostics import Diagnoser
from lattice_agent.pmi.fence import (
    DuplicateContribution,
    EpochMismatch,
    FenceAborted,
    FenceError,
    FenceRegistry,
    FenceTimeout,
    UnknownNode,
)
from lattice_agent.pmi.launches import LaunchManager
from lattice_agent.pmi.wire import PmiProtocolError, decode_kvs, encode_kvs
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.telemetry import watch as telemetry_watch
from lattice_agent.uenv import (
    CacheEntry,
    UenvCache,
    UenvDisabled,
    UenvError,
    UenvHashMismatch,
    UenvInUse,
    UenvNotFound,
    UenvSignatureError,
    UenvUnreachable,
)

if TYPE_CHECKING:
    from lattice_agent.telemetry.loop import TelemetryLoop


class NodeAgentService(v1.NodeAgentServiceBase):
    def __init__(
        self,
        node_id: str,
        runtime: ProcessRuntime,
        log_dir: Path,
        fences: FenceRegistry | None = None,
        launches: LaunchManager | None = None,
        attaches: AttachManager | None = None,
        uenv: UenvCache | None = None,
        telemetry: TelemetryLoop | None = None,
        allocation: Callable[[str], object | None] | None = None,
        diagnostics: Diagnoser | None = None,
    ) -> None:
        self.node_id = node_id
        #: the node's telemetry loop (None: no StreamMetrics / SetTelemetryMode here) and
        #: the allocations the desired state assigns here (by id; None: none known)
        self.telemetry = telemetry
        self.allocation = allocation or (lambda _: None)
        self.runtime = runtime
        self.log_dir = log_dir
        #: the cross-node PMI fences this agent collects
        self.fences = fences if fences is not None else FenceRegistry()
        self.launches = launches
        self.attaches = attaches
        #: the node's uenv image cache (None: uenv disabled here)
        self.uenv = uenv
        # warms in progress by ref: [lock, callers] (one fetch of a ref at a time)
        self._warming: dict[str, list] = {}  # type: ignore[type-arg]
        self._last_fence: tuple[dict[str, str], bytes] | None = None
        #: `lattice diag`'s node-local facts; by default over the directories the attach
        #: manager (or the launches) put the allocations' work and scratch in
        self.diagnostics = diagnostics or _default_diagnoser(self)

    async def stream_logs(self, message: v1.LogRequest) -> AsyncIterator[v1.LogLine]:
        """``tail`` < 0 (or 0 without follow): all history; N > 0: the last N lines."""
        stream = message.stream or "both"
        if stream not in ("both", "stdout", "stderr"):
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, f"unknown stream {stream!r}")
        n: int | None = message.tail if message.tail > 0 else None
        if message.tail == 0 and message.follow:
            n = 0
        if message.follow:
            records = self.runtime.follow(message.allocation_id, stream, n)
        else:
            records = _aiter(self.runtime.tail(message.allocation_id, n, stream))
        async for r in records:
            yield v1.LogLine(
                allocation_id=r.allocation_id,
                node_id=self.node_id,
                stream=r.stream,
                line=r.line,
                timestamp=r.timestamp,
            )

    async def sync_desired_state(self, message: v1.DesiredState) -> v1.SyncAck:
        raise grpclib.GRPCError(
            Status.UNIMPLEMENTED,
            "NodeAgentService.SyncDesiredState is not implemented yet: agents pull desired "
            "state with NodeService.WatchDesiredState",
        )

    async def attach(
        self, messages: AsyncIterator[v1.AttachInput]
    ) -> AsyncIterator[v1.AttachOutput]:
        """A terminal in an allocation on this node (``attach.AttachManager``)."""
        if self.attaches is None:
            raise grpclib.GRPCError(Status.UNIMPLEMENTED, f"node {self.node_id} serves no attach")
        try:
            async for out in self.attaches.serve(messages):
                yield out
        except LatticeError as e:
            raise grpc_error(e) from None

    def _manager(self) -> LaunchManager:
        if self.launches is None:
            raise grpclib.GRPCError(
                Status.UNIMPLEMENTED, f"node {self.node_id} runs no task launches"
            )
        return self.launches

    async def launch_processes(
        self, message: v1.LaunchProcessesRequest
    ) -> v1.LaunchProcessesResponse:
        try:
            pids = await self._manager().launch(message)
        except LatticeError as e:
            raise grpc_error(e) from None
        return v1.LaunchProcessesResponse(task_id=message.task_id, pids=pids)

    async def watch_launch(self, message: v1.WatchLaunchRequest) -> AsyncIterator[v1.LaunchEvent]:
        manager = self._manager()
        try:
            manager.get(message.allocation_id, message.task_id)
        except LatticeError as e:
            raise grpc_error(e) from None
        async for ev in manager.watch(message.allocation_id, message.task_id):
            yield ev

    async def pmi_fence(self, message: v1.PmiFenceRequest) -> v1.PmiFenceResponse:
        """One node's contribution to a fence this agent heads; answers the merged KVS.

        Only launches registered in ``self.fences`` are served: a fence for any
        other launch is NOT_FOUND, so a caller cannot plant keys in a launch
        that this agent does not head.
        """
        coordinator = self.fences.get(message.allocation_id, message.task_id)
        if coordinator is None:
            raise grpclib.GRPCError(
                Status.NOT_FOUND,
                f"node {self.node_id!r} heads no PMI fence for launch {message.task_id!r} "
                f"of allocation {message.allocation_id!r}",
            )
        try:
            puts = decode_kvs(message.kvs_json)
        except PmiProtocolError as e:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, str(e)) from e
        try:
            kvs = await coordinator.contribute(message.epoch, message.node_id, puts)
        except FenceTimeout as e:
            raise grpclib.GRPCError(Status.DEADLINE_EXCEEDED, str(e)) from e
        except FenceAborted as e:
            raise grpclib.GRPCError(Status.ABORTED, str(e)) from e
        except UnknownNode as e:
            raise grpclib.GRPCError(Status.INVALID_ARGUMENT, str(e)) from e
        except (EpochMismatch, DuplicateContribution) as e:
            raise grpclib.GRPCError(Status.FAILED_PRECONDITION, str(e)) from e
        except FenceError as e:
            raise grpclib.GRPCError(Status.FAILED_PRECONDITION, str(e)) from e
        return v1.PmiFenceResponse(epoch=message.epoch, kvs_json=self._encoded(kvs))

    def _encoded(self, kvs: dict[str, str]) -> bytes:
        """The epoch's keys as sent: encoded once for all the waiters of one fence epoch
        (they resume one after the other with the same mapping)."""
        last = self._last_fence
        if last is not None and last[0] is kvs:
            return last[1]
        raw = encode_kvs(kvs)
        self._last_fence = (kvs, raw)
        return raw

    async def abort(self, message: v1.AbortRequest) -> v1.AbortResponse:
        if not message.task_id:
            raise grpclib.GRPCError(
                Status.UNIMPLEMENTED,
                "NodeAgentService.Abort of a whole allocation is not implemented: cancel it "
                "through the API; name a launch (task_id) to abort one",
            )
        return v1.AbortResponse(killed=self._manager().abort(message))

    # ------------------------------------------------------------------ telemetry

    def _telemetry(self) -> TelemetryLoop:
        if self.telemetry is None:
            raise grpc_error(Unimplemented(f"node {self.node_id} serves no telemetry"))
        return self.telemetry

    async def stream_metrics(
        self, message: v1.StreamMetricsRequest
    ) -> AsyncIterator[v1.MetricsSnapshot]:
        """An allocation's live metrics and alerts on this node (``telemetry.watch``)."""
        stream = telemetry_watch.metrics_stream(
            self._telemetry(), self.node_id, message, assigned=self.allocation
        )
        try:
            async for snap in stream:
                yield snap
        except LatticeError as e:
            raise grpc_error(e) from None

    async def set_telemetry_mode(
        self, message: v1.SetTelemetryModeRequest
    ) -> v1.TelemetryModeResponse:
        try:
            return telemetry_watch.set_mode(
                self._telemetry(), self.node_id, message, assigned=self.allocation
            )
        except LatticeError as e:
            raise grpc_error(e) from None

    # ------------------------------------------------------------------ diagnostics

    async def diagnose(self, message: v1.DiagnoseRequest) -> v1.NodeDiagnosis:
        """Mount health, latest values and the I/O latency histogram of an allocation
        here (``diagnostics.Diagnoser``)."""
        try:
            return await self.diagnostics.diagnose(message)
        except LatticeError as e:
            raise grpc_error(e) from None

    # ------------------------------------------------------------------ uenv cache

    def _cache(self) -> UenvCache:
        if self.uenv is None:
            raise grpc_error(
                InvalidTransition(
                    f"uenv is not enabled on node {self.node_id}",
                    details={"node": self.node_id, "cause": "uenv_disabled"},
                    hint="Configure node_agent.uenv_registry on the node.",
                )
            )
        return self.uenv

    async def cache_status(self, message: v1.CacheStatusRequest) -> v1.NodeCacheStatus:
        if self.uenv is None:
            return v1.NodeCacheStatus(node=self.node_id, ok=True, enabled=False)
        st = await asyncio.to_thread(self.uenv.status)
        images: list[dict[str, object]] = st["images"]  # type: ignore[assignment]
        return v1.NodeCacheStatus(
            node=self.node_id,
            ok=True,
            enabled=bool(st["enabled"]),
            cache_dir=str(st["cache_dir"]),
            max_bytes=int(st["max_bytes"]),  # type: ignore[call-overload]
            used_bytes=int(st["used_bytes"]),  # type: ignore[call-overload]
            images=[v1.CachedImage(**img) for img in images],  # type: ignore[arg-type]
        )

    async def cache_warm(self, message: v1.CacheImageRequest) -> v1.CachedImage:
        """Fetch ``ref`` into the cache (verified), in a thread; its cache entry. Warms of
        one ref on this node wait for each other (one copy at a time)."""
        cache = self._cache()
        ref = message.ref.strip()
        held = self._warming.setdefault(ref, [asyncio.Lock(), 0])
        held[1] += 1
        try:
            async with held[0]:
                entry = await asyncio.to_thread(_warm, cache, ref)
        except (UenvError, OSError) as e:
            raise grpc_error(self._cache_error(ref, e)) from None
        finally:
            held[1] -= 1
            if not held[1]:
                self._warming.pop(ref, None)
        if entry is None:  # another fetch evicted it at once (the cache is over its limit)
            raise grpc_error(
                LatticeError(
                    f"uenv {ref}: evicted from the cache of node {self.node_id} as it was warmed",
                    details={"node": self.node_id, "cause": "evicted"},
                    hint="The cache is full of images in use; see `lattice cache status`.",
                )
            )
        return _cached_image(entry)

    async def cache_evict(self, message: v1.CacheImageRequest) -> v1.CacheEvictResponse:
        """Remove ``ref`` from the cache unless an allocation here uses it."""
        cache = self._cache()
        ref = message.ref.strip()
        try:
            removed = await asyncio.to_thread(cache.remove, ref)
        except (UenvError, OSError) as e:
            raise grpc_error(self._cache_error(ref, e)) from None
        return v1.CacheEvictResponse(removed=[_cached_image(e) for e in removed])

    def _cache_error(self, ref: str, e: UenvError | OSError) -> LatticeError:
        """A cache failure as the typed error the API passes on (``details.cause``)."""
        node = self.node_id
        if isinstance(e, OSError):
            return LatticeError(
                f"uenv {ref}: cache on node {node}: {e.strerror or e}",
                details={"node": node, "cause": "io_error"},
                hint="Check node_agent.uenv_cache_dir on the node (space, permissions).",
            )
        details: dict[str, object] = {"node": node}
        if isinstance(e, UenvInUse):
            details.update(cause="in_use", allocations=", ".join(e.allocations))
            return InvalidTransition(e.message, details=details, hint=e.hint)
        if isinstance(e, UenvNotFound):
            details["cause"] = "not_found"
            if e.available:
                details["available"] = ", ".join(e.available)
            return NotFound(e.message, details=details, hint=e.hint)
        kinds: list[tuple[type[UenvError], str, type[LatticeError]]] = [
            (UenvDisabled, "uenv_disabled", InvalidTransition),
            (UenvHashMismatch, "hash_mismatch", InvalidTransition),
            (UenvSignatureError, "signature", InvalidTransition),
            (UenvUnreachable, "registry_unreachable", Unavailable),
        ]
        for kind, cause, cls in kinds:
            if isinstance(e, kind):
                details["cause"] = cause
                return cls(e.message, details=details, hint=e.hint)
        details["cause"] = "fetch_failed"
        return LatticeError(e.message, details=details, hint=e.hint)


def _default_diagnoser(service: NodeAgentService) -> Diagnoser:
    where = service.attaches or service.launches
    runtime = service.runtime
    return Diagnoser(
        service.node_id,
        allocation=lambda alloc_id: service.allocation(alloc_id),
        running=lambda alloc_id: runtime is not None and alloc_id in runtime.running_ids(),
        work_dir=getattr(where, "work_dir", None),
        scratch=getattr(where, "scratch", None),
        telemetry=service.telemetry,
    )


def _warm(cache: UenvCache, ref: str) -> CacheEntry | None:
    path = cache.fetch(ref)
    return next((e for e in cache.entries() if e.path == path), None)


def _cached_image(e: CacheEntry) -> v1.CachedImage:
    return v1.CachedImage(
        ref=e.ref, sha256=e.sha256, size=e.size, last_access=e.last_access, in_use=e.in_use
    )


#: who may call a node agent over mTLS: the API members and the other agents (PMI
#: fences, launch trees); schedulers, brokers and bootstrap identities may not
AGENT_CALLERS = frozenset({pki.Kind.API, pki.Kind.AGENT})


def require_token(server: Server, token: str | None, site: str = "") -> None:
    """Refuse every call that is not from an API member or an agent. A verified client
    certificate (mTLS: the server context requires one) must name one of them, for
    ``site``; without TLS, calls need ``Authorization: Bearer <token>`` (no token:
    allow all, dev clusters)."""
    expected = f"Bearer {token}" if token else ""

    async def check(event: RecvRequest) -> None:
        peercert = event.peer.cert() if event.peer is not None else None
        if peercert:
            caller = pki.peer_identity(peercert)
            if caller is None or caller.kind not in AGENT_CALLERS or caller.site != site:
                named = "nothing" if caller is None else f"{caller.kind.value} {caller.name}"
                raise grpc_error(
                    Unauthenticated(
                        f"{event.method_name}: the client certificate names {named}",
                        hint="Node agents take calls from API members and other agents only.",
                    )
                )
            return
        if not expected:
            return
        got = event.metadata.get("authorization", "")
        if not isinstance(got, str) or not hmac.compare_digest(got, expected):
            raise grpc_error(
                Unauthenticated(
                    f"{event.method_name} needs the agent token",
                    hint="Callers of a node agent send api.agent_token (LATTICE_AGENT_TOKEN).",
                )
            )

    listen(server, RecvRequest, check)


async def _aiter(items: list) -> AsyncIterator:  # type: ignore[type-arg]
    for i in items:
        yield i
