"""The API's side of the audit log: the signing key, and :class:`AuditRecorder`, which
signs events into the chain and proposes them (``AppendAudit``) in the background.

**Who signs.** Apply is deterministic and holds no key, so the server signs: each
member loads the key from ``api.audit_signing_key_path`` (an Ed25519 private key in
PEM; give every member the same file). Without it (development), the member uses
``<quorum.data_dir>/audit_signing_key.pem``, generated on first start, with a loud
warning: it survives restarts, so the chain stays verifiable with the same public key.
Entries name the key that signed them (``key_id``) and the quorum keeps every signing
key's public half, so a rotated key, or a dev cluster whose members each made their own,
still verifies.

**Never in the way.** ``record()`` queues the event and returns; one worker per server
takes what is queued, reads the log's tail, signs the events after it and proposes them
as one command. A proposal that lost a race (another member appended first, or this
follower had not applied the last append yet) is rejected as stale and signed again
after the new tail. An event that cannot be appended after retrying for a minute is
dropped and counted in ``lattice_audit_append_failures_total``; the user's operation
never waits for it or fails because of it. On the leader the worker also drains the
quorum's outbox (sensitive claims, releases and ends the state machine queued), which
survives crashes and leader changes because it is replicated.

**Failed authentications** are recorded per source at most ``auth_failures_per_minute``
times a minute; the rest only count in ``lattice_audit_auth_failures_suppressed_total``
(and in the next recorded entry's ``suppressed`` detail), so a flood cannot fill the log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lattice_common import audit
from lattice_common import commands as c
from lattice_common.audit import AuditEvent
from lattice_common.errors import ValidationError
from lattice_common.types import SchedulerType
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter

log = logging.getLogger("lattice.api.audit")

APPEND_FAILURES = Counter(
    "lattice_audit_append_failures_total",
    "Audit events that could not be appended to the log (dropped after retrying)",
)
APPENDED = Counter(
    "lattice_audit_entries_appended_total", "Audit entries this server signed and appended"
)
AUTH_SUPPRESSED = Counter(
    "lattice_audit_auth_failures_suppressed_total",
    "Failed authentications not recorded in the audit log (per-source rate limit)",
)

DEV_KEY_FILE = "audit_signing_key.pem"
MAX_QUEUED = 10_000
BATCH = 256


def load_signing_key(key_path: str = "", data_dir: str = "") -> Any:
    """The audit signing key: ``key_path`` (must exist), else a key kept in
    ``data_dir`` (created on first use), else a key that lives as long as the process.
    The last two only for development, with a loud warning."""
    if key_path:
        try:
            return audit.load_private_key(Path(key_path).read_bytes())
        except OSError as e:
            raise ValidationError(
                f"api.audit_signing_key_path: cannot read {key_path}: {e.strerror or e}",
                hint="Point it at an Ed25519 private key in PEM (openssl genpkey -algorithm "
                "ed25519 -out audit.pem), the same file on every quorum member.",
            ) from None
        except ValueError as e:
            raise ValidationError(
                f"api.audit_signing_key_path: {key_path}: {e}",
                hint="The audit signing key must be an Ed25519 private key in PEM.",
            ) from None
    if data_dir:
        path = Path(data_dir) / DEV_KEY_FILE
        key, created = audit.load_or_create_private_key(path)
        log.warning(
            "AUDIT SIGNING KEY NOT CONFIGURED: %s the development key %s (key id %s). "
            "Set api.audit_signing_key_path to a key shared by every quorum member "
            "outside development.",
            "generated" if created else "using",
            path,
            audit.key_id(key),
        )
        return key
    key = audit.generate_private_key()
    log.warning(
        "AUDIT SIGNING KEY NOT CONFIGURED: using a random key for this process only "
        "(key id %s); entries it signs cannot be verified after a restart unless its "
        "public key was kept.",
        audit.key_id(key),
    )
    return key


def detail_value(value: Any) -> str:
    """Audit details are strings: text as is, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


class AuditRecorder:
    """Signs and appends audit events for one server (see the module's doc)."""

    def __init__(
        self,
        quorum: Quorum,
        key: Any = None,
        *,
        auth_failures_per_minute: int = 10,
        poll_interval: float = 0.2,
        retry_for: float = 60.0,
    ) -> None:
        self.quorum = quorum
        self.key = key if key is not None else load_signing_key()
        self.key_id = audit.key_id(self.key)
        self.public_key_pem = audit.public_key_pem(self.key)
        self.auth_failures_per_minute = auth_failures_per_minute
        self.poll_interval = poll_interval
        self.retry_for = retry_for
        self._queue: collections.deque[AuditEvent] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._busy = False
        self._closed = False
        self._auth: dict[str, list[float]] = {}  # source -> [window start, count, suppressed]

    # --- recording --------------------------------------------------------------------

    def record(
        self,
        actor: str,
        action: str,
        target: str = "",
        *,
        tenant: str = "",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue an event for the log; returns at once and never raises."""
        try:
            if len(self._queue) >= MAX_QUEUED:
                APPEND_FAILURES.inc()
                log.error("audit queue full (%d events): %s %s dropped", MAX_QUEUED, action, target)
                return
            self._queue.append(
                AuditEvent(
                    time=time.time(),
                    actor=actor,
                    action=action,
                    target=target,
                    tenant=tenant,
                    details={str(k): detail_value(v) for k, v in (details or {}).items()},
                )
            )
            self._kick()
        except Exception:  # never the caller's problem
            APPEND_FAILURES.inc()
            log.exception("could not queue audit event %s %s", action, target)

    def _sensitive(self, a: Any, cache: dict[str, bool]) -> bool:
        name = a.spec.vcluster
        if name not in cache:
            v = self.quorum.read(queries.vcluster, name)
            cache[name] = v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION
        return cache[name]

    def record_submission(self, user: str, allocations: list[Any]) -> None:
        """``allocation.submit`` for those of ``allocations`` in sensitive vClusters."""
        try:
            sensitive: dict[str, bool] = {}  # per vCluster: a task group reads it once
            for a in allocations:
                if self._sensitive(a, sensitive):
                    self.record(
                        user,
                        audit.ALLOCATION_SUBMIT,
                        f"allocation:{a.id}",
                        tenant=a.spec.tenant,
                        details={"vcluster": a.spec.vcluster, "nodes": a.spec.nodes},
                    )
        except Exception:
            APPEND_FAILURES.inc()
            log.exception("could not record sensitive submissions")

    def record_access(
        self, user: str, allocation: Any, action: str, details: Mapping[str, Any] | None = None
    ) -> None:
        """Reading a sensitive allocation's logs or attaching to it (spec: every action
        on sensitive work is audit-logged); nothing for other allocations."""
        try:
            if self._sensitive(allocation, {}):
                self.record(
                    user,
                    action,
                    f"allocation:{allocation.id}",
                    tenant=allocation.spec.tenant,
                    details=dict(details or {}),
                )
        except Exception:
            APPEND_FAILURES.inc()
            log.exception("could not record access to %s", getattr(allocation, "id", "?"))

    def auth_failed(self, source: str, headers: Mapping[str, str], reason: str) -> None:
        """A request that failed authentication, from ``source`` (the peer's address),
        rate-limited per source."""
        try:
            now = time.monotonic()
            window = self._auth.get(source)
            if window is None or now - window[0] >= 60.0:
                suppressed = int(window[2]) if window else 0
                if len(self._auth) > 10_000:  # forget sources quiet for a minute
                    self._auth = {s: w for s, w in self._auth.items() if now - w[0] < 60.0}
                window = self._auth[source] = [now, 0, 0]
            else:
                suppressed = 0
            if window[1] >= self.auth_failures_per_minute:
                window[2] += 1
                AUTH_SUPPRESSED.inc()
                return
            window[1] += 1
            details = {"source": source, "reason": reason[:200]}
            claimed = _claimed_user(headers)
            if claimed:
                details["claimed_user"] = claimed
            if suppressed:
                details["suppressed"] = str(suppressed)
            self.record(
                claimed or "unauthenticated", audit.AUTH_FAILED, f"source:{source}", details=details
            )
        except Exception:
            APPEND_FAILURES.inc()
            log.exception("could not record a failed authentication")

    # --- the worker -------------------------------------------------------------------

    def on_leadership(self, is_leader: bool) -> None:
        """Leaders drain the quorum's outbox: make sure the worker runs."""
        if is_leader:
            self._kick()

    def _kick(self) -> None:
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop here: the next call from one starts the worker
            return
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="audit-recorder")
        elif self._wake is not None:
            self._wake.set()

    def _outbox_waiting(self) -> bool:
        return self.quorum.is_leader and self.quorum.read(queries.audit_outbox_size) > 0

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._closed:
            try:
                if self._queue or self._outbox_waiting():
                    self._busy = True
                    try:
                        await self._append_once()
                    finally:
                        self._busy = False
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("audit recorder")
                await asyncio.sleep(self.poll_interval)
            self._wake.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            # that arrives as the event is set (close() right after a flush())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()

    async def _append_once(self) -> None:
        local = list(self._queue)[:BATCH]
        deadline = time.monotonic() + self.retry_for
        attempt = 0
        while True:
            outbox = self.quorum.read(queries.audit_outbox, BATCH) if self.quorum.is_leader else []
            if not local and not outbox:
                return
            seq, prev_hash = self.quorum.read(queries.audit_tail)
            events = sorted(outbox + local, key=lambda ev: ev.time)  # stable: ties keep order
            cmd = c.AppendAudit(
                entries=audit.seal(events, self.key, seq=seq, prev_hash=prev_hash),
                public_key=self.public_key_pem,
                outbox_ids=[ev.id for ev in outbox],
                now=time.time(),
            )
            try:
                res = await self.quorum.propose(cmd)
            except Exception as e:  # no leader, commit timeout, ...: retried
                error, stale, retry = str(e), False, True
            else:
                if res.error is None:
                    APPENDED.inc(len(cmd.entries))
                    for _ in local:
                        self._queue.popleft()
                    return
                error = str(res.error.get("message", res.error))
                stale = retry = res.error.get("code") == "stale_revision"
            attempt += 1
            if not retry or time.monotonic() > deadline:
                break
            if not stale:
                log.warning("audit append failed (will retry): %s", error)
            # a follower's stale tail catches up within milliseconds
            await asyncio.sleep(min(0.005 * attempt, 0.5) if stale else min(0.2 * attempt, 2.0))
        log.error("audit: %d events could not be appended: %s", len(cmd.entries), error)
        if local:
            APPEND_FAILURES.inc(len(local))
            for _ in local:
                self._queue.popleft()
        else:  # outbox events stay in the quorum: try again later, not at once
            await asyncio.sleep(5.0)

    async def flush(self, timeout: float = 2.0) -> bool:
        """Wait (at most ``timeout``) until what was recorded here, and on the leader
        the quorum's outbox, is in the log; False when it was not in time."""
        self._kick()
        deadline = time.monotonic() + timeout
        while self._queue or self._busy or self._outbox_waiting():
            if time.monotonic() > deadline or self._task is None:
                return False
            if self._wake is not None:
                self._wake.set()
            await asyncio.sleep(0.005)
        return True

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)  # never holds a shutdown up


def _claimed_user(headers: Mapping[str, str]) -> str:
    """Who the failed request claimed to be (unverified): the token's subject."""
    auth = headers.get("authorization") or headers.get("Authorization") or ""
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not token:
        return ""
    try:
        import jwt

        sub = jwt.decode(token, options={"verify_signature": False}).get("sub")
    except Exception:
        return ""
    return str(sub)[:128] if sub else ""


__all__ = [
    "APPENDED",
    "APPEND_FAILURES",
    "AUTH_SUPPRESSED",
    "AuditRecorder",
    "detail_value",
    "load_signing_key",
]
