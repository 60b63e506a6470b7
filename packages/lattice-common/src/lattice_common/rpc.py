"""gRPC plumbing shared by the processes that talk to lattice-server (schedulers,
agents, the checkpoint broker): endpoint failover, auth metadata, typed errors, and
the remote QuorumClient (propose + watch-state)."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from lattice_common import commands as c
from lattice_common.config import TlsConfig
from lattice_common.errors import (
    ERROR_CLASSES,
    LatticeError,
    NotLeader,
    Unavailable,
    encode_error,
)
from lattice_common.net import split_host_port
from lattice_common.proto.lattice import v1
from lattice_common.watch import StateDelta, decode_delta

TRANSPORT_ERRORS = (OSError, StreamTerminatedError, ConnectionError, TimeoutError)


def grpc_error(err: LatticeError) -> GRPCError:
    """A gRPC status whose message is the error as JSON (code, message, details, hint),
    so that clients can rebuild the typed error (``decode_grpc_error``)."""
    return GRPCError(Status(err.grpc_status), encode_error(err).decode())


def decode_grpc_error(e: GRPCError) -> LatticeError:
    """Rebuild the server's typed error from the JSON it put in the status message."""
    try:
        d = json.loads(e.message or "")
        if isinstance(d, dict) and "code" in d:
            return LatticeError.from_dict(d)
    except ValueError:
        pass
    if e.status == Status.UNAVAILABLE:
        return Unavailable(e.message or "unavailable")
    cls = next((k for k in ERROR_CLASSES.values() if k.grpc_status == e.status.value), LatticeError)
    return cls(e.message or e.status.name)


class Endpoints:
    """A list of ``host:port`` API endpoints; ``rotate`` moves to the next one.

    ``ssl``: a client context (lattice_common.pki.client_context) for TLS/mTLS to
    lattice-server; None = plaintext. After the context's certificate is renewed,
    :meth:`renewed` makes the next calls open a new connection that presents it, while
    streams already open carry on over the old one: a long stream takes its channel
    with :meth:`hold` and gives it back with :meth:`release`, and a channel retired by
    a renewal is closed once nothing holds it."""

    def __init__(self, spec: str | list[str], ssl: ssl.SSLContext | None = None) -> None:
        items = spec.split(",") if isinstance(spec, str) else spec
        self.items = [
            i.strip().removeprefix("https://").removeprefix("http://").removeprefix("grpc://")
            for i in items
            if i.strip()
        ]
        if not self.items:
            raise ValueError("no quorum endpoint given")
        self.index = 0
        self.ssl = ssl
        self._channel: Channel | None = None
        self._retired: list[Channel] = []
        self._held: dict[int, int] = {}  # id(channel) -> streams holding it

    @property
    def current(self) -> str:
        return self.items[self.index]

    def channel(self) -> Channel:
        if self._channel is None:
            host, port = split_host_port(self.current, default_host="127.0.0.1")
            self._channel = Channel(host, port, ssl=self.ssl)
        return self._channel

    def hold(self) -> Channel:
        """The current channel, for a long stream: kept open across renewals until
        :meth:`release`."""
        ch = self.channel()
        self._held[id(ch)] = self._held.get(id(ch), 0) + 1
        return ch

    def release(self, ch: Channel) -> None:
        n = self._held.get(id(ch), 0) - 1
        if n > 0:
            self._held[id(ch)] = n
            return
        self._held.pop(id(ch), None)
        if ch in self._retired:  # retired by a renewal while the stream ran
            self._retired.remove(ch)
            ch.close()

    def renewed(self) -> None:
        """The client certificate changed: new calls use a new connection. The one it
        replaces stays open until the next renewal (calls in flight finish on it) or,
        when a stream holds it, until that stream releases it."""
        for ch in [r for r in self._retired if id(r) not in self._held]:
            self._retired.remove(ch)
            ch.close()
        if self._channel is not None:
            self._retired.append(self._channel)
            self._channel = None

    def rotate(self, prefer: str = "") -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if prefer and prefer in self.items:
            self.index = self.items.index(prefer)
        elif prefer:
            self.items.append(prefer)
            self.index = len(self.items) - 1
        else:
            self.index = (self.index + 1) % len(self.items)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for ch in self._retired:
            ch.close()
        self._retired.clear()


def service_tls(tls: TlsConfig, kind: str | None = None) -> ssl.SSLContext | None:
    """The client TLS context of a service (scheduler, checkpoint broker, accounting)
    from its ``tls`` config: None without ``tls.ca`` (plaintext); with
    ``tls.cert``/``tls.key`` it presents them (mTLS, required by lattice-server when
    ``api.tls_ca`` is set). Files that cannot be read or used are a LatticeError whose
    hint names the certificate ``kind`` to issue."""
    if not tls.ca:
        return None
    from pathlib import Path

    from lattice_common import pki

    try:
        cert = Path(tls.cert).read_bytes() if tls.cert else None
        key = Path(tls.key).read_bytes() if tls.key else None
        return pki.client_context([Path(tls.ca).read_bytes()], cert, key)
    except (OSError, ValueError) as e:
        issue = f"lattice admin ca issue --kind {kind}" if kind else "lattice admin ca issue"
        raise LatticeError(
            f"cannot load the TLS files: {e}",
            hint=f"Check tls.ca, tls.cert and tls.key (a {kind or 'service'} certificate "
            f"from `{issue}`).",
        ) from None


def auth_metadata(token: str | None = None) -> dict[str, str] | None:
    token = token or os.environ.get("LATTICE_AGENT_TOKEN") or ""
    return {"authorization": f"Bearer {token}"} if token else None


class RemoteQuorum:
    """QuorumClient over gRPC: what a scheduler or broker uses to read and change state."""

    def __init__(
        self, endpoints: Endpoints, token: str | None = None, timeout: float = 10.0
    ) -> None:
        self.endpoints = endpoints
        self.metadata = auth_metadata(token)
        self.timeout = timeout

    def _stub(self) -> v1.QuorumServiceStub:
        return v1.QuorumServiceStub(self.endpoints.channel(), metadata=self.metadata)

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        try:
            resp = await self._stub().propose(
                v1.ProposeRequest(command=c.encode_command(cmd)), timeout=self.timeout
            )
        except GRPCError as e:
            err = decode_grpc_error(e)
            if isinstance(err, Unavailable):
                self.endpoints.rotate()
            raise err from None
        except TRANSPORT_ERRORS as e:
            self.endpoints.rotate()
            raise Unavailable(f"quorum endpoint unreachable: {e}") from None
        return c.decode_result(resp.result)

    async def watch(self) -> AsyncIterator[StateDelta]:
        """Snapshot then deltas. Raises Unavailable when the stream breaks (caller
        reconnects; the next snapshot replaces the mirror)."""
        try:
            async for ev in self._stub().watch_state(v1.WatchStateRequest()):
                yield decode_delta(ev.payload)
        except GRPCError as e:
            self.endpoints.rotate()
            raise decode_grpc_error(e) from None
        except TRANSPORT_ERRORS as e:
            self.endpoints.rotate()
            raise Unavailable(f"watch stream broke: {e}") from None


__all__ = [
    "Endpoints",
    "NotLeader",
    "RemoteQuorum",
    "auth_metadata",
    "decode_grpc_error",
    "service_tls",
]
