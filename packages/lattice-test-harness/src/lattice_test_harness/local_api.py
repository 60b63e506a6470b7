"""The real REST and gRPC servers of lattice-server over a LocalQuorum, in process.

No Raft, no agents, no processes: the same ``Operations``, adapters, permission table
and middleware as ``lattice-server``, served on ephemeral loopback ports. Tests seed
state by proposing real commands (``api.propose(c.CreateTenant(...))`` or the small
helpers below) and talk to the servers with the SDK, the CLI or the generated stubs.

Two ways to run it:

* :func:`serve_local_api` -- an async context manager on the running loop (the
  ``local_api`` fixture);
* :class:`ThreadedLocalApi` -- the servers in a background thread with their own loop,
  for code under test that calls ``asyncio.run`` itself (the CLI); its ``propose`` is
  synchronous (the ``local_api_thread`` fixture).

Every REST request is recorded (method, path, query, headers, JSON body) in
``requests``, for tests of a client's side of the wire. Logs come from
:class:`MemoryLogs` (``api.logs.add(alloc_id, "line")``) instead of node agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from grpclib.client import Channel
from lattice_api.auth import Authenticator
from lattice_api.grpc.server import build_grpc_server
from lattice_api.node_monitor import NodeMonitor
from lattice_api.oidc import OidcProvider
from lattice_api.operations import Operations
from lattice_api.rest.app import build_rest_app
from lattice_api.settings import ApiSettings
from lattice_api.tls import ServerTls
from lattice_common import commands as c
from lattice_common.errors import LatticeError
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    NodeCapabilities,
    Tenant,
    VCluster,
)
from lattice_quorum.local import LocalQuorum

# --------------------------------------------------------------------------- logs


class MemoryLogs:
    """A LogSource fed by the test: ``add(alloc_id, line, stream=..., node_id=...)``."""

    def __init__(self) -> None:
        self.lines: dict[str, list[dict[str, Any]]] = {}

    def add(
        self,
        alloc_id: str,
        line: str,
        *,
        stream: str = "stdout",
        node_id: str = "",
        timestamp: float | None = None,
    ) -> None:
        self.lines.setdefault(alloc_id, []).append(
            {
                "allocation_id": alloc_id,
                "node_id": node_id,
                "stream": stream,
                "line": line,
                "timestamp": time.time() if timestamp is None else timestamp,
            }
        )

    def _select(
        self,
        alloc: Allocation,
        tail: int | None,
        stream: str,
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
        offset: int = 0,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        lines = [
            ln
            for ln in self.lines.get(alloc.id, [])
            if (stream in ("both", "") or ln["stream"] == stream)
            and (not node or ln["node_id"] == node)
            and (since is None or ln["timestamp"] >= since)
            and (until is None or ln["timestamp"] <= until)
        ]
        lines = lines[-tail:] if tail else lines
        lines = lines[offset:]
        return lines[:limit] if limit is not None else lines

    async def follow(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both", **filters: Any
    ) -> AsyncIterator[dict[str, Any]]:
        for ln in self._select(alloc, tail, stream, **filters):
            yield dict(ln)

    async def fetch(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both", **filters: Any
    ) -> list[dict[str, Any]]:
        return [dict(ln) for ln in self._select(alloc, tail, stream, **filters)]

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the servers


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _recorder(requests: list[dict[str, Any]]) -> Any:
    @web.middleware
    async def record(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        body = await request.read() if request.can_read_body else b""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "headers": dict(request.headers),
                "json": parsed,
            }
        )
        return await handler(request)

    return record


class LocalApi:
    """Handles of one in-process API: the quorum, the operations, the addresses."""

    def __init__(
        self,
        quorum: LocalQuorum,
        ops: Operations,
        logs: MemoryLogs,
        requests: list[dict[str, Any]],
        rest_port: int,
        grpc_port: int,
    ) -> None:
        self.quorum = quorum
        self.ops = ops
        self.logs = logs
        self.requests = requests
        self.rest_port = rest_port
        self.grpc_port = grpc_port
        self.host = "127.0.0.1"

    @property
    def rest_url(self) -> str:
        return f"http://{self.host}:{self.rest_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def channel(self) -> Channel:
        """A grpclib channel to the gRPC server (close it when done)."""
        return Channel(self.host, self.grpc_port)

    # --- seeding: real commands ---------------------------------------------------

    def propose(self, cmd: c.Command) -> c.CommandResult:
        """Apply ``cmd`` now; a rejected command raises its typed error."""
        res = self.quorum.apply(cmd)
        if res.error is not None:
            raise LatticeError.from_dict(res.error)
        return res

    def add_tenant(self, name: str, **fields: Any) -> Tenant:
        tenant = self.propose(c.CreateTenant(tenant=Tenant(name=name, **fields), now=time.time()))
        assert tenant.tenant is not None
        return tenant.tenant

    def add_vcluster(self, name: str, **fields: Any) -> VCluster:
        res = self.propose(
            c.CreateVCluster(vcluster=VCluster(name=name, **fields), now=time.time())
        )
        assert res.vcluster is not None
        return res.vcluster

    def add_node(self, node_id: str, **kw: Any) -> Any:
        caps = kw.pop("capabilities", None)
        if isinstance(caps, dict):
            caps = NodeCapabilities(**caps)
        cmd = c.RegisterNode(
            node_id=node_id, capabilities=caps or NodeCapabilities(), now=time.time(), **kw
        )
        return self.propose(cmd).node

    def submit(self, spec: AllocationSpec, *, now: float | None = None) -> Allocation:
        res = self.propose(c.SubmitAllocation(spec=spec, now=time.time() if now is None else now))
        assert res.allocation is not None
        return res.allocation

    def start(self, alloc_id: str, node_ids: list[str], *, now: float | None = None) -> Allocation:
        """Assign nodes, as a scheduler would: the allocation is then Running."""
        t = time.time() if now is None else now
        res = self.propose(c.AssignNodes(allocation_id=alloc_id, node_ids=node_ids, now=t))
        assert res.allocation is not None
        return res.allocation

    def set_state(
        self, alloc_id: str, state: AllocationState, *, now: float | None = None, **kw: Any
    ) -> Allocation:
        t = time.time() if now is None else now
        cmd = c.UpdateAllocationState(allocation_id=alloc_id, state=state, now=t, **kw)
        res = self.propose(cmd)
        assert res.allocation is not None
        return res.allocation


@contextlib.asynccontextmanager
async def serve_local_api(
    *,
    hmac_secret: str | None = None,
    agent_token: str | None = None,
    settings: ApiSettings | None = None,
    quorum: LocalQuorum | None = None,
    oidc_min_refresh_interval: float = 0.0,
    tls: ServerTls | None = None,
) -> AsyncIterator[LocalApi]:
    """The real REST and gRPC servers over a LocalQuorum on the running loop.

    Without ``hmac_secret`` or ``settings.oidc_issuer`` the servers run in development
    mode (the caller is the ``x-lattice-user`` header, as a system admin), like
    ``lattice dev up``. With ``settings.oidc_issuer`` tokens are checked against that
    identity provider's keys (a :class:`lattice_test_harness.fake_idp.FakeIdP`), the key
    set refetched on an unknown key id at most every ``oidc_min_refresh_interval`` s.
    With ``tls`` both listeners speak TLS as lattice-server does (mutual on gRPC when
    it is), trusting the internal CA once one is created (certificates name
    ``settings.tls.site``)."""
    quorum = quorum or LocalQuorum()
    logs = MemoryLogs()
    requests: list[dict[str, Any]] = []
    settings = settings or ApiSettings()
    oidc = None
    if settings.oidc_issuer:  # JWKS validation against that IdP (e.g. a FakeIdP)
        oidc = OidcProvider(
            settings.oidc_issuer,
            settings.oidc_client_id,
            min_refresh_interval=oidc_min_refresh_interval,
        )
    auth = Authenticator(
        hmac_secret=hmac_secret, agent_token=agent_token, oidc=oidc, site=settings.tls.site
    )
    await auth.start()
    monitor = NodeMonitor(quorum)
    quorum.on_leadership(monitor.on_leadership)
    ops = Operations(
        quorum, monitor=monitor, logs=logs, settings=settings, oidc=oidc, auth_mode=auth.mode
    )
    if tls is not None:
        tls.trust_quorum_ca(quorum)
        ops.pki.on_change = lambda: tls.trust_quorum_ca(quorum)
    app = build_rest_app(ops, auth)
    app.middlewares.insert(0, _recorder(requests))
    grpc = build_grpc_server(ops, auth)
    gsock, rsock = _bound_socket(), _bound_socket()
    await grpc.start(sock=gsock, ssl=tls.grpc if tls is not None else None)
    # streams a client abandoned (an open watch) must not hold the teardown for a minute
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.SockSite(runner, rsock, ssl_context=tls.rest if tls is not None else None).start()
    try:
        yield LocalApi(quorum, ops, logs, requests, rsock.getsockname()[1], gsock.getsockname()[1])
    finally:
        grpc.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(grpc.wait_closed(), 5)
        await runner.cleanup()
        await ops.recorder.close()  # the audit log's worker
        quorum.close()


class ThreadedLocalApi:
    """:func:`serve_local_api` in a background thread with its own event loop.

    Use as a context manager (or ``start()``/``stop()``); the handles (``rest_url``,
    ``propose``, ``requests``, ...) are those of :class:`LocalApi`."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self.api: LocalApi | None = None

    def start(self) -> LocalApi:
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                async with serve_local_api(**self._kwargs) as api:
                    self.api = api
                    ready.set()
                    await self._stop.wait()
            except BaseException as e:  # surfaced by start()
                failure.append(e)
                ready.set()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="local-api", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the local API did not start within 30 s")
        if failure:
            raise failure[0]
        assert self.api is not None
        return self.api

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)

    def __enter__(self) -> LocalApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def threaded_local_api(**kwargs: Any) -> Iterator[LocalApi]:
    with ThreadedLocalApi(**kwargs) as api:
        yield api


__all__ = [
    "LocalApi",
    "MemoryLogs",
    "ThreadedLocalApi",
    "serve_local_api",
    "threaded_local_api",
]
