"""A client of the SPIFFE Workload API: the node agent's X.509-SVID, if SPIRE serves one.

Why this module exists: the node agent needs an identity for mTLS to the quorum and the
API. It tries, in order: (1) the SPIFFE Workload API (this module), (2) a certificate
from the quorum CA, (3) bootstrap certificate files, (4) ``LATTICE_AGENT_TOKEN``. Step 1
is :func:`fetch_x509_svid`: when a SPIRE agent (or any SPIFFE Workload API server)
listens on the socket named by :func:`socket_path_from_env`, the agent takes the first
X.509-SVID it serves, as PEM, ready for an ``ssl.SSLContext``.

Wire format (SPIFFE Workload API and Workload Endpoint standards): gRPC without TLS over
a unix socket; the proto file declares no package, so the method is
``/SpiffeWorkloadAPI/FetchX509SVID``, server-streaming: a new ``X509SVIDResponse`` is
sent whenever the SVIDs change (rotation), the stream never ends on its own. Every call
carries the metadata ``workload.spiffe.io: true``; servers answer calls without it with
``InvalidArgument``. SPIRE answers ``PermissionDenied`` ("no identity issued") when no
registration entry matches the caller, ``Unavailable`` while it starts.

The messages are written here by hand as betterproto2 dataclasses (not generated, not
registered in Lattice's message pool; they are never packed into ``Any``)::

    message X509SVIDRequest {}
    message X509SVIDResponse {
        repeated X509SVID svids = 1;
        repeated bytes crl = 2;                    // DER CRLs
        map<string, bytes> federated_bundles = 3;  // trust domain ID -> DER certs
    }
    message X509SVID {
        string spiffe_id = 1;
        bytes x509_svid = 2;      // DER certificates, concatenated, leaf first
        bytes x509_svid_key = 3;  // PKCS#8 DER, unencrypted
        bytes bundle = 4;         // DER CA certificates of the trust domain, concatenated
        string hint = 5;          // operator's label when several SVIDs are served
    }
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import betterproto2
from cryptography import x509
from cryptography.hazmat.primitives import serialization

__all__ = [
    "DEFAULT_SOCKET",
    "FETCH_X509_SVID",
    "SECURITY_HEADER",
    "SOCKET_ENV",
    "SPIFFE_ENDPOINT_ENV",
    "X509SVID",
    "SpiffeError",
    "Svid",
    "X509SVIDRequest",
    "X509SVIDResponse",
    "agent_spiffe_id",
    "fetch_x509_svid",
    "socket_path_from_env",
    "split_der_certificates",
]

#: Lattice's own setting for the Workload API socket (wins over SPIFFE_ENDPOINT_SOCKET)
SOCKET_ENV = "LATTICE_SPIRE_SOCKET"
#: the standard's variable (``unix:///path``): clients fall back to it when not configured
SPIFFE_ENDPOINT_ENV = "SPIFFE_ENDPOINT_SOCKET"
#: Lattice's default when neither variable is set (the standard names no default path;
#: SPIRE's own default is /tmp/spire-agent/public/api.sock)
DEFAULT_SOCKET = "/run/spire/agent.sock"
FETCH_X509_SVID = "/SpiffeWorkloadAPI/FetchX509SVID"
#: (key, value) every Workload API call must carry (anti-SSRF header of the standard)
SECURITY_HEADER = ("workload.spiffe.io", "true")
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, NUL included


class SpiffeError(Exception):
    """No usable SVID from the Workload API; ``message`` says why, ``hint`` what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(f"{message}. Hint: {hint}" if hint else message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Svid:
    """An X.509-SVID as PEM: the certificate chain (leaf first), its key, the CA bundle."""

    spiffe_id: str
    cert_chain_pem: bytes
    key_pem: bytes  # PKCS#8, unencrypted
    bundle_pem: bytes
    not_after: float  # the leaf's notAfter, epoch seconds


# --- messages (hand-written; field numbers from the SPIFFE Workload API proto) ----------


@dataclass(eq=False, repr=False)
class X509SVIDRequest(betterproto2.Message):
    """No parameters."""


@dataclass(eq=False, repr=False)
class X509SVID(betterproto2.Message):
    """One SVID with its key and the bundle of its trust domain."""

    spiffe_id: str = betterproto2.field(1, betterproto2.TYPE_STRING)
    x509_svid: bytes = betterproto2.field(2, betterproto2.TYPE_BYTES)
    x509_svid_key: bytes = betterproto2.field(3, betterproto2.TYPE_BYTES)
    bundle: bytes = betterproto2.field(4, betterproto2.TYPE_BYTES)
    hint: str = betterproto2.field(5, betterproto2.TYPE_STRING)


@dataclass(eq=False, repr=False)
class X509SVIDResponse(betterproto2.Message):
    # betterproto2.field gives each instance its own list/dict (a default_factory)
    svids: list[X509SVID] = betterproto2.field(1, betterproto2.TYPE_MESSAGE, repeated=True)  # noqa: RUF009
    crl: list[bytes] = betterproto2.field(2, betterproto2.TYPE_BYTES, repeated=True)  # noqa: RUF009
    federated_bundles: dict[str, bytes] = betterproto2.field(  # noqa: RUF009
        3,
        betterproto2.TYPE_MAP,
        map_meta=betterproto2.map_meta(betterproto2.TYPE_STRING, betterproto2.TYPE_BYTES),
    )


# --- locating the endpoint ------------------------------------------------------------


def agent_spiffe_id(trust_domain: str, node_id: str) -> str:
    """The SPIFFE ID of a Lattice node agent: ``spiffe://<trust domain>/lattice/agent/<node>``."""
    return f"spiffe://{trust_domain}/lattice/agent/{node_id}"


def _parse_address(value: str, source: str) -> str:
    """A socket path from ``/path``, ``unix:/path`` or ``unix:///path``."""
    value = value.strip()
    if not value.startswith(("unix:", "tcp:")):
        return value
    parts = urlsplit(value)
    if parts.scheme == "tcp":
        raise SpiffeError(
            f"{source}={value!r}: the Workload API over TCP is not supported",
            "serve the Workload API on a unix socket (unix:///run/spire/agent.sock)",
        )
    if parts.netloc or parts.query or parts.fragment or not parts.path.startswith("/"):
        raise SpiffeError(
            f"{source}={value!r} is not a unix socket address",
            "write unix:///absolute/path/to/agent.sock or just the absolute path",
        )
    return parts.path


def socket_path_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The Workload API socket: ``LATTICE_SPIRE_SOCKET``, else ``SPIFFE_ENDPOINT_SOCKET``
    (the standard's variable), else :data:`DEFAULT_SOCKET`.

    Plain paths and the ``unix:/path`` / ``unix:///path`` forms are accepted; ``tcp://``
    and malformed ``unix:`` URIs raise :class:`SpiffeError`.
    """
    env = os.environ if environ is None else environ
    for name in (SOCKET_ENV, SPIFFE_ENDPOINT_ENV):
        value = env.get(name, "").strip()
        if value:
            return _parse_address(value, name)
    return DEFAULT_SOCKET


# --- DER -> PEM -----------------------------------------------------------------------


def split_der_certificates(data: bytes) -> list[bytes]:
    """Concatenated DER certificates, one by one (each is an ASN.1 SEQUENCE, definite length)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        if data[pos] != 0x30 or pos + 2 > len(data):
            raise ValueError(f"no DER SEQUENCE at byte {pos}")
        first = data[pos + 1]
        if first < 0x80:
            header, length = 2, first
        else:
            n = first & 0x7F
            if n == 0 or n > 4 or pos + 2 + n > len(data):
                raise ValueError(f"bad DER length at byte {pos + 1}")
            header, length = 2 + n, int.from_bytes(data[pos + 2 : pos + 2 + n], "big")
        end = pos + header + length
        if end > len(data):
            raise ValueError(f"DER certificate at byte {pos} is cut short")
        out.append(data[pos:end])
        pos = end
    return out


def _certificates(data: bytes, what: str) -> list[x509.Certificate]:
    try:
        certs = [x509.load_der_x509_certificate(d) for d in split_der_certificates(data)]
    except ValueError as e:
        raise SpiffeError(
            f"the Workload API sent an invalid {what} ({e})",
            "the server must send ASN.1 DER certificates, concatenated (not PEM)",
        ) from None
    if not certs:
        raise SpiffeError(f"the Workload API sent an empty {what}", "check the SPIRE agent")
    return certs


def _pem(certs: list[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _to_svid(msg: X509SVID) -> Svid:
    if not msg.spiffe_id.startswith("spiffe://"):
        raise SpiffeError(
            f"the Workload API sent an SVID with SPIFFE ID {msg.spiffe_id!r}",
            "a SPIFFE ID starts with spiffe://",
        )
    chain = _certificates(msg.x509_svid, f"certificate chain for {msg.spiffe_id}")
    bundle = _certificates(msg.bundle, f"trust bundle for {msg.spiffe_id}")
    leaf = chain[0]
    try:
        uris = leaf.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if uris != [msg.spiffe_id]:
        raise SpiffeError(
            f"the SVID for {msg.spiffe_id} has URI SANs {uris} instead of its SPIFFE ID",
            "an X.509-SVID leaf carries exactly one URI SAN, the SPIFFE ID",
        )
    try:
        key = serialization.load_der_private_key(msg.x509_svid_key, password=None)
    except (ValueError, TypeError) as e:
        raise SpiffeError(
            f"the Workload API sent an invalid private key for {msg.spiffe_id} ({e})",
            "the key must be unencrypted PKCS#8 DER",
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise SpiffeError(
            f"the private key for {msg.spiffe_id} does not match its certificate",
            "check the SPIRE agent's SVID cache",
        )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return Svid(
        spiffe_id=msg.spiffe_id,
        cert_chain_pem=_pem(chain),
        key_pem=key_pem,
        bundle_pem=_pem(bundle),
        not_after=leaf.not_valid_after_utc.timestamp(),
    )


# --- the call -------------------------------------------------------------------------

_STATUS_HINTS = {
    "INVALID_ARGUMENT": "the request was malformed (is the workload.spiffe.io header sent?); "
    "retrying will not help",
    "PERMISSION_DENIED": "the SPIRE agent issued no identity to this process: register an "
    "entry whose selectors match the node agent (spire-server entry create), then retry",
    "UNAVAILABLE": "the SPIRE agent is starting or overloaded; retry with a backoff",
    "UNIMPLEMENTED": "the socket does not serve the SPIFFE Workload API",
}


async def fetch_x509_svid(socket_path: str, timeout: float = 5.0) -> Svid:
    """The first X.509-SVID the Workload API at ``socket_path`` serves.

    Reads the first response of the ``FetchX509SVID`` stream, then cancels the stream.
    ``socket_path`` may be a path or a ``unix:`` URI. Raises :class:`SpiffeError` when the
    socket is missing or nothing listens on it, the server refuses (its gRPC status is in
    the message), the stream ends or times out without an SVID, or the SVID is invalid.
    """
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    path = _parse_address(socket_path, "socket")
    hint_env = f"start the SPIRE agent, or set {SOCKET_ENV} to its Workload API socket"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SpiffeError(f"no SPIFFE Workload API socket at {path}", hint_env) from None
    except OSError as e:
        raise SpiffeError(f"cannot reach {path}: {e.strerror}", hint_env) from None
    if not stat.S_ISSOCK(mode):
        raise SpiffeError(f"{path} is not a unix socket", hint_env)
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise SpiffeError(
            f"socket path {path} is longer than {_UNIX_PATH_MAX} bytes",
            "use a shorter path (or a symlink to the socket's directory)",
        )

    channel = Channel(path=path)
    try:
        async with asyncio.timeout(timeout):
            async with channel.request(
                FETCH_X509_SVID,
                Cardinality.UNARY_STREAM,
                X509SVIDRequest,
                X509SVIDResponse,
                metadata=dict([SECURITY_HEADER]),
            ) as stream:
                await stream.send_message(X509SVIDRequest(), end=True)
                response = await stream.recv_message()
                if response is not None:
                    # the stream stays open for rotations: leaving the block normally
                    # would wait for its trailers forever
                    await stream.cancel()
    except GRPCError as e:
        raise SpiffeError(
            f"the Workload API at {path} refused FetchX509SVID: {e.status.name}"
            + (f" ({e.message})" if e.message else ""),
            _STATUS_HINTS.get(e.status.name, "check the SPIRE agent's log"),
        ) from None
    except TimeoutError:
        raise SpiffeError(
            f"no X.509-SVID from the Workload API at {path} within {timeout:g} s",
            "check that the SPIRE agent is attested and healthy (spire-agent healthcheck)",
        ) from None
    except (OSError, StreamTerminatedError) as e:
        raise SpiffeError(f"cannot talk to the Workload API at {path}: {e}", hint_env) from None
    finally:
        channel.close()
    if response is None or not response.svids:
        raise SpiffeError(
            f"the Workload API at {path} sent no X.509-SVID",
            "the server must send at least one SVID or refuse with PermissionDenied; "
            "check the SPIRE agent's registration entries",
        )
    return _to_svid(response.svids[0])
