"""TLS of lattice-server (spec: TLS configuration, internal service authentication).

``api.tls_cert``/``tls_key`` turn TLS on for both listeners; ``api.tls_ca`` makes the
gRPC listener mutual: a client without a certificate from a trusted CA fails the
handshake, so plaintext and anonymous connections never reach a handler. The gRPC port
is the components' port (agents, schedulers, the checkpoint broker); people use REST,
where a client certificate is checked when presented and a bearer token is the rule.

Trusted: the CAs in ``api.tls_ca`` (the site's PKI, which signed the members' and
services' certificates) and the cluster's internal CA (lattice_admin ca init), added to
the live contexts as soon as it is created or rotated, on every member
(:meth:`ServerTls.follow_ca`). The same certificate is this member's client certificate
towards the node agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from pathlib import Path

from lattice_common import pki
from lattice_common.config import ApiConfig
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

log = logging.getLogger("lattice.api.tls")


class ServerTls:
    """The contexts of one member: ``grpc`` (HTTP/2), ``rest`` (HTTP/1.1) and ``client``
    (towards the agents); :meth:`trust` adds CA certificates to all three."""

    def __init__(self, cert: bytes, key: bytes, trust: list[bytes], *, mutual: bool) -> None:
        self.mutual = mutual
        grpc_mode = "required" if mutual else "none"
        rest_mode = "optional" if mutual else "none"
        self.grpc = pki.server_context(cert, key, trust, client_certs=grpc_mode)
        self.rest = pki.server_context(cert, key, trust, client_certs=rest_mode, alpn=None)
        # the agents' certificates name nodes, not the addresses they listen on: the
        # chain is checked, the name is not (lattice_common.agents)
        self.client: ssl.SSLContext | None = (
            pki.client_context(trust, cert, key, check_hostname=False) if mutual else None
        )
        self._trusted: set[str] = set()

    @classmethod
    def from_config(cls, api: ApiConfig) -> ServerTls | None:
        if not api.tls_cert:
            return None
        trust = [Path(api.tls_ca).read_bytes()] if api.tls_ca else []
        return cls(
            Path(api.tls_cert).read_bytes(),
            Path(api.tls_key).read_bytes(),
            trust,
            mutual=bool(api.tls_ca),
        )

    def trust(self, pems: list[str]) -> int:
        """Trust these CA certificates from now on (new handshakes); returns how many
        were new."""
        if not self.mutual:
            return 0
        new = [p for p in pems if p and p not in self._trusted]
        for pem in new:
            for ctx in (self.grpc, self.rest, self.client):
                if ctx is not None:
                    ctx.load_verify_locations(cadata=pem)
            self._trusted.add(pem)
        return len(new)

    def trust_quorum_ca(self, quorum: Quorum) -> None:
        cert, _key, previous = quorum.read(queries.certificate_authority)
        added = self.trust([cert, *previous])
        if added:
            log.info("trusting the cluster's internal CA (%d new certificate(s))", added)

    async def follow_ca(self, quorum: Quorum, interval: float = 2.0) -> None:
        """Keep trusting the internal CA as it is created or rotated (any member)."""
        while True:
            with contextlib.suppress(Exception):  # a member still catching up
                self.trust_quorum_ca(quorum)
            await asyncio.sleep(interval)


__all__ = ["ServerTls"]
