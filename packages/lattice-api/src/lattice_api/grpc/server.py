"""The grpclib server of lattice-server: the four services, one interceptor, and
UNIMPLEMENTED answers naming the RPC for the contract's RPCs not built yet.

The interceptor (a RecvRequest listener wrapping every method handler) resolves the
caller's Identity once, checks the RPC's entry in the permission table, times the call
into the shared request metrics, and maps LatticeError to a gRPC status whose message
is the error as JSON (code, message, details, hint).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpclib
import h2.exceptions
from grpclib.const import Cardinality, Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import ProtocolError
from grpclib.server import Server
from lattice_common.errors import LatticeError, RateLimited, Unauthenticated

from lattice_api.auth import Authenticator
from lattice_api.grpc.accounting_service import AccountingService
from lattice_api.grpc.admin_service import AdminService
from lattice_api.grpc.allocation_service import AllocationService
from lattice_api.grpc.context import grpc_error, set_identity, who
from lattice_api.grpc.node_service import NodeService
from lattice_api.grpc.quorum_service import QuorumService
from lattice_api.http import LATENCY, REQUESTS
from lattice_api.operations import Operations
from lattice_api.permissions import NOT_BUILT, PUBLIC, RPC_BY_PATH, authorize
from lattice_api.ratelimit import RateLimiter
from lattice_api.revalidate import run_rechecked

log = logging.getLogger("lattice.api.grpc")

_UNCHECKED = (NOT_BUILT, PUBLIC)


def install_interceptor(
    server: Server,
    auth: Authenticator,
    limiter: RateLimiter | None = None,
    *,
    streaming: frozenset[str] = frozenset(),
    revalidation_interval: float = 0.0,
) -> None:
    """``streaming``: paths of the streaming RPCs, whose bearer token is checked again
    every ``revalidation_interval`` seconds while they run (lattice_api.revalidate)."""

    async def on_request(event: RecvRequest) -> None:
        headers = dict(event.metadata)
        try:
            peercert = event.peer.cert() if event.peer is not None else None
            set_identity(await auth.authenticate_async(headers, peercert))
        except LatticeError as e:
            set_identity(e)  # raised when the RPC needs the caller
            if isinstance(e, Unauthenticated) and auth.on_failure is not None:  # audit log
                peer = event.peer.addr() if event.peer is not None else None
                auth.on_failure(peer[0] if peer else "", dict(event.metadata), e.message)
        inner = event.method_func
        name = event.method_name
        permission = RPC_BY_PATH.get(name)

        async def wrapped(stream: Any) -> None:
            t0 = time.perf_counter()
            status = "OK"
            release = None
            try:
                if permission not in _UNCHECKED:
                    # an RPC missing from the table needs a system admin
                    authorize(who(), permission or name)
                    if limiter is not None:  # held while the call (or stream) runs
                        release = limiter.check(who(), name)
                if name in streaming:
                    await run_rechecked(
                        inner(stream),
                        who(),
                        lambda: auth.authenticate_async(headers),
                        revalidation_interval,
                    )
                else:
                    await inner(stream)
            except LatticeError as e:
                status = Status(e.grpc_status).name
                if isinstance(e, RateLimited) and await _send_retry_after(stream, e):
                    return
                raise grpc_error(e) from None
            except grpclib.GRPCError as e:
                status = e.status.name
                raise
            except h2.exceptions.StreamClosedError:
                # the caller reset the stream (gave up, timed out) between our await and
                # the answer: nobody to answer, nothing wrong on our side
                status = "CANCELLED"
                log.info("%s: the caller closed the stream before the answer", name)
                raise grpclib.GRPCError(Status.CANCELLED, "the caller closed the stream") from None
            except Exception:
                status = "INTERNAL"
                log.exception("unhandled error in %s", name)
                raise
            finally:
                if release is not None:
                    release()
                REQUESTS.labels(name, status).inc()
                LATENCY.labels(name).observe(time.perf_counter() - t0)

        event.method_func = wrapped

    listen(server, RecvRequest, on_request)


async def _send_retry_after(stream: Any, e: RateLimited) -> bool:
    """End the call with RESOURCE_EXHAUSTED and ``retry-after`` (seconds) in the
    trailing metadata; False when the trailers were already sent."""
    try:
        await stream.send_trailing_metadata(
            status=Status.RESOURCE_EXHAUSTED,
            status_message=grpc_error(e).message,
            metadata={"retry-after": str(e.retry_after)},
        )
    except ProtocolError:
        return False
    return True


def _not_built(service: str, rpc: str) -> Any:
    async def handler(self: Any, message: Any) -> Any:
        raise grpclib.GRPCError(Status.UNIMPLEMENTED, f"{service}.{rpc} is not implemented yet")

    handler.not_built = True  # type: ignore[attr-defined]  # read by the table test
    return handler


def fill_unimplemented(adapter: type, base: type) -> None:
    """Give ``adapter`` a handler naming the RPC for every method of the generated
    ``base`` it does not override (the generated ones answer a bare UNIMPLEMENTED)."""
    service = base.__name__.removesuffix("Base")
    for attr, fn in vars(base).items():
        if attr.startswith("_") or not callable(fn) or attr in vars(adapter):
            continue
        setattr(adapter, attr, _not_built(service, attr))


ADAPTERS = (AllocationService, NodeService, AdminService, QuorumService, AccountingService)
for _adapter in ADAPTERS:
    fill_unimplemented(_adapter, _adapter.__bases__[0])


def build_grpc_server(ops: Operations, auth: Authenticator) -> Server:
    services = [
        AllocationService(
            ops.allocations,
            ops.launches,
            ops.dags,
            ops.attach,
            ops.sessions,
            ops.metrics,
            telemetry=ops.telemetry,
        ),
        NodeService(ops.nodes, ops.cache, ops.pki),
        AdminService(ops.admin, ops.usage, ops.queue, ops.services, ops.audit, ops.pki, ops.backup),
        QuorumService(ops.quorum),
        AccountingService(ops.accounting),
    ]
    server = Server(services)
    auth.on_failure = ops.recorder.auth_failed  # failed authentications: the audit log
    streaming = frozenset(
        path
        for service in services
        for path, handler in service.__mapping__().items()
        if handler.cardinality in (Cardinality.UNARY_STREAM, Cardinality.STREAM_STREAM)
    )
    install_interceptor(
        server,
        auth,
        ops.limiter,
        streaming=streaming,
        revalidation_interval=ops.settings.token_revalidation_interval,
    )
    return server


__all__ = ["ADAPTERS", "build_grpc_server", "fill_unimplemented", "install_interceptor"]
