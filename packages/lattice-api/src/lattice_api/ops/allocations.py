"""AllocationService operations: submit (one allocation or a task group), get, list,
cancel, watch, and logs (read from the head node's agent through a LogSource)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import msgspec
from lattice_common import audit
from lattice_common import commands as c
from lattice_common.errors import NotFound, Unavailable, ValidationError
from lattice_common.history import HistoryStore, merge
from lattice_common.taskgroup import parse_task_group
from lattice_common.types import (
    TERMINAL_STATES,
    Allocation,
    AllocationSpec,
    AllocationState,
    StartEstimate,
)
from lattice_common.uenv_registry import (
    CachedIndex,
    UenvError,
    UenvNotFound,
    UenvRegistry,
    UenvSignatureError,
)
from lattice_common.watch import decode_delta
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from lattice_scheduler import admission

from lattice_api import access
from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity
from lattice_api.ops.accounting import AccountingOps
from lattice_api.ops.base import raise_if_error, visible_allocation
from lattice_api.ops.queue import QueueOps
from lattice_api.validation import validate_submission


class LogSource(Protocol):
    """Where allocation output comes from (lattice_api.logs.LogProxy: the agents and the
    log store). Filters (``node``, ``since``, ``until``, ``offset``, ``limit``) are
    passed as keywords only when a caller gives them."""

    def follow(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both", **filters: Any
    ) -> AsyncIterator[dict[str, Any]]: ...

    async def fetch(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both", **filters: Any
    ) -> list[dict[str, Any]]: ...


def _log_filters(**given: Any) -> dict[str, Any]:
    """The log filters a caller gave (None and 0 offsets are not given)."""
    return {k: v for k, v in given.items() if v is not None and not (k == "offset" and v == 0)}


def parse_states(state: str | None) -> set[AllocationState] | None:
    """``"running,pending"`` -> the states (None = any); unknown names list the valid."""
    if not state:
        return None
    try:
        return {AllocationState.parse(s) for s in state.split(",") if s.strip()}
    except ValueError:
        raise ValidationError(
            f"unknown state {state!r}",
            details={"available": ", ".join(s.value for s in AllocationState)},
        ) from None


# seconds to wait for an HTTP registry's index at submit (in a thread, cached for a while)
UENV_INDEX_TIMEOUT = 10.0


def uenv_resolver(registry: str, signing_key: str = "") -> CachedIndex | None:
    """The API's resolver of ``spec.uenv`` against the agents' registry (None: uenv is
    disabled, a spec asking for one is refused). An unreadable signing key stops the
    server: it must never accept images it cannot verify."""
    if not registry:
        return None
    try:
        return CachedIndex(
            UenvRegistry(registry, signing_key=signing_key or None, timeout=UENV_INDEX_TIMEOUT)
        )
    except UenvError as e:
        raise ValidationError(e.message, hint=e.hint) from None


class AllocationOps:
    def __init__(
        self,
        quorum: Quorum,
        logs: LogSource,
        queue: QueueOps,
        *,
        uenv: CachedIndex | None = None,
        audit: AuditRecorder | None = None,
    ) -> None:
        self.quorum = quorum
        self.log_source = logs
        self.queue = queue
        self.uenv = uenv
        self.audit = audit  # sensitive submissions are recorded (lattice_api.audit)
        # the reservation gate (lattice_api.ops.accounting): a no-op unless accounting
        # is enabled, when Operations gives it the accounting client
        self.gate = AccountingOps(quorum)
        # the history store (lattice_common.history): allocations that left the
        # quorum's state after their retention; set by lattice-server (None: none)
        self.history: HistoryStore | None = None

    # --- submit ---------------------------------------------------------------------

    def validate(self, who: Identity, body: Mapping[str, Any]) -> AllocationSpec:
        """The spec, or the error that refuses it: malformed input, unknown names, or a
        request that can never run here (lattice_scheduler.admission). Every way in
        goes through it: a single submission, a task group's template, a test-only
        submission, and each member of a DAG (lattice_api.ops.dags)."""
        spec = self._parse(who, body)
        if spec.uenv and self.uenv is None:
            raise ValidationError(
                "uenv is not enabled on this cluster",
                details={"uenv": spec.uenv},
                hint="This cluster has no uenv registry (node_agent.uenv_registry is empty): "
                "submit without --uenv, or ask the operators to configure one.",
            )
        self.quorum.read(queries.admit, admission.check, spec)
        return spec

    async def resolve_uenv(self, spec: AllocationSpec) -> tuple[AllocationSpec, str]:
        """``spec.uenv`` looked up in the registry (index cached briefly, read off the
        event loop): the spec naming the entry it matched, and the image's sha256 the
        agents must then run. Unknown refs and unsigned images are refused (400), an
        unreachable registry is Unavailable (503)."""
        if not spec.uenv:
            return spec, ""
        if self.uenv is None:  # validate() refused it already; kept for direct callers
            raise ValidationError("uenv is not enabled on this cluster")
        try:
            image = await self.uenv.resolve(spec.uenv)
        except (UenvNotFound, UenvSignatureError) as e:
            raise ValidationError(e.message, details={"uenv": spec.uenv}, hint=e.hint) from None
        except UenvError as e:
            raise Unavailable(e.message, details={"uenv": spec.uenv}, hint=e.hint) from None
        if image.ref != spec.uenv:
            spec = msgspec.structs.replace(spec, uenv=image.ref)
        return spec, image.sha256

    def _parse(self, who: Identity, body: Mapping[str, Any]) -> AllocationSpec:
        tenants, vclusters = self.quorum.read(queries.tenant_and_vcluster_names)
        return validate_submission(
            body,
            user=who.user,
            tenants=tenants,
            vclusters=vclusters,
            default_tenant=who.tenant,
            # a follower may not have applied a just-created tenant yet: the state
            # machine checks names again at commit, with the same error
            check_names=self.quorum.is_leader,
        )

    async def submit(self, who: Identity, body: dict[str, Any]) -> Allocation:
        spec, sha = await self.resolve_uenv(self.validate(who, body))
        async with self.gate.hold([spec]) as held:  # accounting: reserved before proposing
            res = raise_if_error(
                await self.quorum.propose(
                    c.SubmitAllocation(spec=held.specs[0], uenv_sha256=sha, now=time.time())
                )
            )
        assert res.allocation is not None
        if self.audit is not None:
            self.audit.record_submission(who.user, [res.allocation])
        return res.allocation

    def test_submit(self, who: Identity, body: dict[str, Any]) -> StartEstimate:
        """``sbatch --test-only``: validate and refuse as a submission would, then say
        when and where it would start; nothing is stored."""
        body = {k: v for k, v in body.items() if k not in ("task_group", "test_only")}
        return self.queue.test_only(self.validate(who, body))

    async def submit_task_group(self, who: Identity, body: dict[str, Any]) -> c.CommandResult:
        """One allocation per index of ``body["task_group"]`` (``"0-99%20"`` or an object
        with start/end/step/concurrency); returns the group id and its tasks."""
        tg = body.get("task_group")
        if isinstance(tg, dict):
            try:
                start, end = int(tg.get("start", 0)), int(tg["end"])
                step, conc = int(tg.get("step") or 1), int(tg.get("concurrency") or 0)
            except (KeyError, TypeError, ValueError):
                raise ValidationError(
                    "task_group needs whole numbers start, end, step and concurrency",
                    hint='e.g. {"start": 0, "end": 99, "concurrency": 20}',
                ) from None
            parse_task_group(f"{start}-{end}:{step}" + (f"%{conc}" if conc else ""))
        else:
            start, end, step, conc = parse_task_group(str(tg))
        spec = self.validate(who, {k: v for k, v in body.items() if k != "task_group"})
        spec, sha = await self.resolve_uenv(spec)
        count = len(range(start, end + 1, step or 1))
        async with self.gate.hold([spec], counts=[max(count, 1)]) as held:
            cmd = c.SubmitTaskGroup(
                spec=held.specs[0],
                start=start,
                end=end,
                step=step,
                concurrency=conc,
                uenv_sha256=sha,
                now=time.time(),
            )
            res = raise_if_error(await self.quorum.propose(cmd))
        if self.audit is not None:
            self.audit.record_submission(who.user, res.allocations or [])
        return res

    # --- reads ----------------------------------------------------------------------

    def get(self, who: Identity, alloc_id: str) -> Allocation:
        return visible_allocation(self.quorum, who, alloc_id)

    def list(
        self,
        who: Identity,
        *,
        state: str | None = None,
        tenant: str | None = None,
        vcluster: str | None = None,
        user: str | None = None,
        all_users: bool = False,
        limit: int | None = None,
        task_group: str | None = None,
    ) -> list[Allocation]:
        """Oldest first; the caller's own unless ``all_users`` or a ``user`` is given
        (lattice_api.access.listing_user)."""
        self.quorum.require_caught_up()
        states = parse_states(state)
        return self.quorum.read(
            queries.allocations_matching,
            states=states,
            tenant=access.listing_tenant(who, tenant),
            vcluster=vcluster,
            user=access.listing_user(who, user, all_users),
            task_group=task_group,
            limit=limit,
        )

    # --- reads with the history store (what the gRPC and REST adapters call) --------

    async def find(self, who: Identity, alloc_id: str) -> Allocation:
        """:meth:`get`, or the allocation's final record from the history store once it
        left the quorum's state (same visibility rule, same NotFound)."""
        try:
            return self.get(who, alloc_id)
        except NotFound:
            if self.history is None:
                raise
            a = await self.history.get(alloc_id)
            if a is None or not access.can_read(who, a):
                raise NotFound(
                    f"allocation {alloc_id} not found",
                    hint="List your allocations with `lattice status`, ended ones with "
                    "`lattice history`.",
                ) from None
            return a

    async def list_with_history(
        self,
        who: Identity,
        *,
        state: str | None = None,
        tenant: str | None = None,
        vcluster: str | None = None,
        user: str | None = None,
        all_users: bool = False,
        limit: int | None = None,
        task_group: str | None = None,
        ended_since: float | None = None,
        ended_until: float | None = None,
    ) -> list[Allocation]:
        """:meth:`list` plus, when terminal states are asked for by name (``lattice
        history``), the history store's matches, merged without duplicates (the quorum
        is read first: an allocation moved meanwhile was stored before it left). Without
        a state filter the listing stays the quorum's (``lattice status``: live work and
        what ended within the retention), so its cost never grows with the history.

        ``ended_since`` / ``ended_until``: only allocations that ended in
        ``[ended_since, ended_until)``, and ``limit`` keeps the latest to end; the store
        filters and cuts in SQL, so ``lattice history --since`` reads what it shows."""
        window = ended_since is not None or ended_until is not None
        live = self.list(
            who,
            state=state,
            tenant=tenant,
            vcluster=vcluster,
            user=user,
            all_users=all_users,
            limit=None if window else limit,  # the window cuts by end time, below
            task_group=task_group,
        )
        if window:
            live = [a for a in live if _ended_in(a, ended_since, ended_until)]
        states = parse_states(state)
        ended = set() if states is None else set(states) & TERMINAL_STATES
        if self.history is not None and ended:
            stored = await self.history.matching(
                states=ended,
                tenant=access.listing_tenant(who, tenant),
                vcluster=vcluster,
                user=access.listing_user(who, user, all_users),
                task_group=task_group,
                limit=limit,
                ended_since=ended_since,
                ended_until=ended_until,
            )
            out = merge(live, stored)
        else:
            out = live
        if window and limit and len(out) > limit:
            latest = sorted(out, key=lambda a: (a.finished_at or 0.0, a.id))[-limit:]
            keep = {a.id for a in latest}
            return [a for a in out if a.id in keep]
        return out[-limit:] if limit else out

    # --- cancel ---------------------------------------------------------------------

    async def cancel(self, who: Identity, alloc_id: str) -> Allocation:
        access.check_cancel(who, self.get(who, alloc_id))
        res = raise_if_error(
            await self.quorum.propose(
                c.CancelAllocation(allocation_id=alloc_id, requested_by=who.user, now=time.time())
            )
        )
        assert res.allocation is not None
        return res.allocation

    # --- streams --------------------------------------------------------------------

    def watch(self, who: Identity, alloc_id: str) -> AsyncIterator[tuple[int, Allocation]]:
        """(revision, allocation): the current state first, then every change, until
        the allocation is terminal. NotFound is raised here, before the stream starts."""
        self.get(who, alloc_id)
        return self._watch(who, alloc_id)

    async def _watch(self, who: Identity, alloc_id: str) -> AsyncIterator[tuple[int, Allocation]]:
        q = self.quorum.subscribe()
        try:
            last = -1
            while True:
                raw = await q.get()
                if raw is None:  # state replaced: re-read
                    a = self.get(who, alloc_id)
                    rev = a.revision
                else:
                    d = decode_delta(raw)
                    found = [x for x in d.allocations if x.id == alloc_id]
                    if d.snapshot and not found:
                        raise NotFound(f"allocation {alloc_id} not found")
                    if not found:
                        continue
                    a, rev = found[0], d.revision
                if a.revision != last:
                    last = a.revision
                    yield rev, a
                if a.terminal:
                    return
        finally:
            self.quorum.unsubscribe(q)

    async def logs(
        self,
        who: Identity,
        alloc_id: str,
        *,
        tail: int | None = None,
        stream: str = "both",
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
        offset: int | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Output lines in time order: live from the agent, history from the log store
        (lattice_api.logs); ``tail`` applies after the node and time filters, ``offset``
        and ``limit`` page through what is left."""
        _check_log_request(stream, since, until)
        a = self.get(who, alloc_id)
        if self.audit is not None:
            self.audit.record_access(who.user, a, audit.ALLOCATION_LOGS, {"stream": stream})
        filters = _log_filters(node=node, since=since, until=until, offset=offset, limit=limit)
        return await self.log_source.fetch(a, tail=tail, stream=stream, **filters)

    def follow_logs(
        self,
        who: Identity,
        alloc_id: str,
        *,
        tail: int | None = None,
        stream: str = "both",
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Live log lines; NotFound is raised here, before the stream starts."""
        _check_log_request(stream, since, until)
        a = self.get(who, alloc_id)
        if self.audit is not None:
            details = {"stream": stream, "follow": "true"}
            self.audit.record_access(who.user, a, audit.ALLOCATION_LOGS, details)
        filters = _log_filters(node=node, since=since, until=until)
        return self.log_source.follow(a, tail=tail, stream=stream, **filters)


def _check_log_request(stream: str, since: float | None, until: float | None) -> None:
    if stream not in ("both", "stdout", "stderr"):
        raise ValidationError(
            f"unknown stream {stream!r}",
            details={"stream": stream},
            hint="Give stdout, stderr or both.",
        )
    if since is not None and until is not None and until < since:
        raise ValidationError(
            "until is before since",
            details={"since": since, "until": until},
            hint="Give --since earlier than --until.",
        )


__all__ = ["AllocationOps", "LogSource", "parse_states"]


def _ended_in(a: Allocation, since: float | None, until: float | None) -> bool:
    """Whether ``a`` ended in ``[since, until)``; one that has not ended never is."""
    if a.finished_at is None:
        return False
    if since is not None and a.finished_at < since:
        return False
    return until is None or a.finished_at < until
