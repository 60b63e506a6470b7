"""The audit log (AdminService.QueryAudit, ExportAudit, VerifyAudit): query it with
filters and pages, export it as a file that verifies offline with the public key, and
verify the committed chain here. Recording is lattice_api.audit's.

Who may read it: system admins everything; tenant admins (spec: "Query audit") only
the entries of their own tenant (the tenant of their token). Exporting and verifying
the whole log is for system admins (the permission table). Every read first waits
briefly for what this server recorded to be appended, so an action is in the log
its own server shows next.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
from lattice_common import audit
from lattice_common.audit import AuditEntry
from lattice_common.errors import PermissionDenied, ValidationError
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity, Role

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def parse_time(value: Any, name: str) -> float | None:
    """Epoch seconds, or an ISO 8601 date or date-time (UTC unless it says otherwise);
    None for "" / None / 0."""
    if value in (None, "", 0, 0.0):
        return None
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(
            f"{name}: {text!r} is not a time",
            hint="Give epoch seconds or an ISO 8601 date or time, e.g. 2026-03-01 or "
            "2026-03-01T12:00:00Z.",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def entry_view(e: AuditEntry) -> dict[str, Any]:
    """An entry as REST answers it (every field the chain covers, as stored)."""
    return msgspec.to_builtins(e)


class AuditOps:
    def __init__(self, quorum: Quorum, recorder: AuditRecorder) -> None:
        self.quorum = quorum
        self.recorder = recorder

    def _tenant_scope(self, who: Identity, tenant: str) -> str:
        """The tenant filter the caller gets: tenant admins are held to their own."""
        if who.role != Role.TENANT_ADMIN:
            return tenant
        if not who.tenant:
            raise PermissionDenied(
                f"{who.user} (tenant-admin) has no tenant to query the audit log of",
                hint="Tenant administrators see their own tenant's entries; the token "
                "needs a tenant claim.",
            )
        if tenant and tenant != who.tenant:
            raise PermissionDenied(
                f"{who.user} may query the audit log of tenant {who.tenant} only",
                details={"tenant": tenant},
            )
        return who.tenant

    async def query(self, who: Identity, params: Mapping[str, Any]) -> dict[str, Any]:
        """``{entries: [AuditEntry], next_page_token}``; params: since (or from), until
        (or to), user, action, tenant, allocation_id, target, limit, page_token."""
        p = {k: v for k, v in params.items() if v not in (None, "")}
        since = parse_time(p.get("since", p.get("from")), "since")
        until = parse_time(p.get("until", p.get("to")), "until")
        limit = p.get("limit") or DEFAULT_LIMIT
        try:
            limit = int(limit)
        except (TypeError, ValueError):
            raise ValidationError(f"limit: {limit!r} is not a whole number") from None
        if limit < 1:
            raise ValidationError("limit must be at least 1")
        token = str(p.get("page_token") or "0")
        if not token.isdigit():
            raise ValidationError(
                f"page_token {token!r} is not one this server gave",
                hint="Pass next_page_token from the previous page unchanged.",
            )
        target = str(p.get("target") or "")
        if p.get("allocation_id"):
            target = f"allocation:{p['allocation_id']}"
        tenant = self._tenant_scope(who, str(p.get("tenant") or ""))
        await self.recorder.flush(timeout=1.0)
        entries, after = self.quorum.read(
            queries.audit_entries,
            since=since,
            until=until,
            user=str(p.get("user") or "") or None,
            action=str(p.get("action") or "") or None,
            tenant=tenant or None,
            target=target or None,
            after_seq=int(token),
            limit=min(limit, MAX_LIMIT),
        )
        return {"entries": entries, "next_page_token": str(after) if after else ""}

    async def export(self, who: Identity) -> Iterator[bytes]:
        """The export file's lines (lattice_common.audit.export_lines), signed by this
        server's key, naming every key that signed an entry."""
        await self.recorder.flush(timeout=2.0)
        entries, keys = self.quorum.read(queries.audit_log)
        return iter(audit.export_lines(entries, self.recorder.key, keys, exported_at=time.time()))

    async def verify(self, who: Identity) -> dict[str, Any]:
        """Check the committed chain: links, hashes and each entry's signature with the
        key it names (the public keys the quorum kept)."""
        await self.recorder.flush(timeout=2.0)
        entries, keys = self.quorum.read(queries.audit_log)
        pems = {**keys, self.recorder.key_id: self.recorder.public_key_pem}
        r = audit.verify_chain(entries, audit.trusted_keys(pems.values()))
        return {
            "valid": r.ok,
            "count": r.count,
            "first_bad_sequence": r.first_bad or 0,
            "message": r.message,
            "last_hash": r.last_hash,
            "public_keys": pems,
            "signing_key_id": self.recorder.key_id,
        }


__all__ = ["AuditOps", "entry_view", "parse_time"]
