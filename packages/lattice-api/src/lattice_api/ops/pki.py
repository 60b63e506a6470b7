"""The internal CA (AdminService.InitCertificateAuthority, GetCertificateAuthority,
IssueCertificate; NodeService.SignNodeCertificate) and the node identity check every
agent call goes through.

The CA lives in the replicated state (lattice_quorum.handlers.pki), so every API member
can sign. Keys are made where they are used: callers send a certificate request and get
back the certificate and the CA bundle to trust. A node agent asks with its bootstrap
certificate (first contact) or its current one (renewal) and gets a certificate for its
own node only; the certificate's name is checked against the node id of every
registration, heartbeat and desired-state stream (:func:`require_node_identity`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from lattice_common import audit, pki
from lattice_common import commands as c
from lattice_common.config import TlsConfig
from lattice_common.errors import (
    FailedPrecondition,
    PermissionDenied,
    Unauthenticated,
    ValidationError,
)
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity
from lattice_api.ops.base import raise_if_error

log = logging.getLogger("lattice.api.pki")

IDENTITY_MISMATCH = Counter(
    "lattice_node_identity_mismatch_total",
    "Agent calls refused because the client certificate names another node (alert on any)",
    ["node"],
)

_NO_CA_HINT = "Create it with `lattice admin ca init` (system admin)."


def require_node_identity(
    who: Identity, node_id: str, recorder: AuditRecorder | None = None
) -> None:
    """A caller with a node certificate may act only for that node (spec: certificate CN
    vs node id, checked on every heartbeat). Token callers are not bound to a node."""
    cert = who.cert
    if cert is None or not cert.node_id or cert.node_id == node_id:
        return
    IDENTITY_MISMATCH.labels(cert.node_id).inc()
    log.warning(
        "refused: certificate of node %s (serial %s) used for node %s",
        cert.node_id,
        cert.serial,
        node_id,
    )
    if recorder is not None:
        recorder.record(
            who.user,
            audit.NODE_IDENTITY_MISMATCH,
            f"node:{node_id}",
            details={"certificate_node": cert.node_id, "serial": cert.serial},
        )
    raise Unauthenticated(
        f"the client certificate names node {cert.node_id}, not {node_id}",
        hint="An agent may only act for the node its certificate names.",
    )


def _kind(value: str) -> pki.Kind:
    try:
        return pki.Kind(value)
    except ValueError:
        raise ValidationError(
            f"unknown certificate kind {value!r}",
            details={"available": ", ".join(k.value for k in pki.Kind)},
        ) from None


class CertificateOps:
    def __init__(
        self, quorum: Quorum, tls: TlsConfig | None = None, audit: AuditRecorder | None = None
    ) -> None:
        self.quorum = quorum
        self.tls = tls or TlsConfig()
        self.audit = audit
        #: called after this member committed a new CA (its listeners trust it at once;
        #: the other members within lattice_api.tls.ServerTls.follow_ca's interval)
        self.on_change: Callable[[], None] | None = None

    @property
    def site(self) -> str:
        return self.tls.site

    def _ca(self) -> tuple[str, str, list[str]]:
        cert, key, previous = self.quorum.read(queries.certificate_authority)
        if not cert:
            raise FailedPrecondition("the cluster has no internal CA", hint=_NO_CA_HINT)
        return cert, key, previous

    def view(self) -> dict[str, Any]:
        cert, _key, previous = self.quorum.read(queries.certificate_authority)
        out: dict[str, Any] = {"cert_pem": cert, "previous_pem": previous, "site": self.site}
        if cert:
            out["serial"] = pki.serial_of(cert.encode())
            out["not_after"] = pki.validity(cert.encode())[1]
        return out

    async def init_ca(self, who: Identity, *, rotate: bool = False) -> dict[str, Any]:
        cert, key = await asyncio.to_thread(pki.create_ca, self.site, now=time.time())
        cmd = c.InitCertificateAuthority(
            cert_pem=cert.decode(), key_pem=key.decode(), rotate=rotate, now=time.time()
        )
        raise_if_error(await self.quorum.propose(cmd))
        if self.on_change is not None:
            self.on_change()
        view = self.view()
        if self.audit is not None:
            details = {"serial": view["serial"], "rotate": str(rotate).lower()}
            self.audit.record(who.user, audit.CA_INIT, f"ca:{self.site}", details=details)
        return view

    def bundle(self) -> str:
        """The CA certificates to trust: the current one, then those rotated out."""
        cert, _key, previous = self._ca()
        return "".join([cert, *previous])

    async def issue(
        self,
        who: Identity,
        *,
        kind: str,
        name: str,
        csr_pem: str,
        lifetime: float = 0.0,
        hosts: list[str] | None = None,
    ) -> dict[str, Any]:
        """A certificate of any kind for a request (system admins: bootstrap certificates
        for new nodes, certificates of internal services)."""
        k = _kind(kind)
        default = {
            pki.Kind.BOOTSTRAP: self.tls.bootstrap_cert_lifetime_seconds,
            pki.Kind.AGENT: self.tls.agent_cert_lifetime_seconds,
        }.get(k, self.tls.service_cert_lifetime_seconds)
        if lifetime < 0:
            raise ValidationError("lifetime_seconds must not be negative")
        return await self._sign(who, k, name, csr_pem, lifetime or default, hosts or [])

    async def sign_node(self, who: Identity, node_id: str, csr_pem: str) -> dict[str, Any]:
        """A node agent's certificate, for its own node only."""
        if not node_id:
            raise ValidationError("node_id is required")
        if who.cert is None and who.method not in ("agent", "none"):
            raise PermissionDenied(
                "node certificates are issued to node agents only",
                hint="Agents call with their bootstrap certificate or the agent token.",
            )
        require_node_identity(who, node_id, self.audit)
        lifetime = self.tls.agent_cert_lifetime_seconds
        return await self._sign(who, pki.Kind.AGENT, node_id, csr_pem, lifetime, [])

    async def _sign(
        self,
        who: Identity,
        kind: pki.Kind,
        name: str,
        csr_pem: str,
        lifetime: float,
        hosts: list[str],
    ) -> dict[str, Any]:
        cert_pem, key_pem, _previous = self._ca()
        try:
            signed = await asyncio.to_thread(
                pki.sign_csr,
                cert_pem.encode(),
                key_pem.encode(),
                csr_pem.encode(),
                kind=kind,
                name=name,
                site=self.site,
                now=time.time(),
                lifetime=lifetime,
                hosts=hosts,
            )
        except pki.CertError as e:
            raise ValidationError(
                f"cannot sign: {e}",
                hint=f"The request's subject must be O=Lattice, OU={kind.value}, "
                f"CN={name}.{self.site}.lattice.internal.",
            ) from None
        serial = pki.serial_of(signed)
        not_after = pki.validity(signed)[1]
        if self.audit is not None:
            self.audit.record(
                who.user,
                audit.CERT_ISSUE,
                f"{kind.value}:{name}",
                details={"serial": serial, "not_after": f"{not_after:.0f}"},
            )
        return {
            "cert_pem": signed.decode(),
            "ca_pem": self.bundle(),
            "serial": serial,
            "not_after": not_after,
        }


__all__ = ["IDENTITY_MISMATCH", "CertificateOps", "require_node_identity"]
