"""Interactive sessions (``lattice session``): an allocation its user works in through a
terminal. Create submits the allocation and the session in one quorum command (the
allocation validated exactly as a submission: ``AllocationOps.validate``; its entrypoint
defaults to one that holds the nodes until the walltime, the work happens in attached
terminals); get shows the session with its allocation's state and nodes; delete
cancels the allocation. Only the session's user (or a system or tenant admin) may read
or end it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from lattice_common import commands as c
from lattice_common.errors import NotFound, PermissionDenied
from lattice_common.types import Allocation, Session
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api import access
from lattice_api.auth import Identity
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.base import raise_if_error

__all__ = ["HOLD_ENTRYPOINT", "SessionOps", "SessionView"]

#: what a session's allocation runs when no entrypoint is given: it only holds the
#: nodes (the walltime ends it); the user's shells are attached terminals
HOLD_ENTRYPOINT = "sleep infinity"
DEFAULT_WALLTIME = "4h"


class SessionView(msgspec.Struct, kw_only=True):
    """The wire form (proto ``Session``): the record plus its allocation's state/nodes."""

    id: str
    allocation_id: str
    tenant: str = ""
    user: str = ""
    state: str = ""
    created_at: float = 0.0
    nodes: list[str] = msgspec.field(default_factory=list)


def session_view(s: Session, a: Allocation | None) -> SessionView:
    return SessionView(
        id=s.id,
        allocation_id=s.allocation_id,
        tenant=s.tenant,
        user=s.user,
        state=a.state.value if a is not None else "",
        created_at=s.created_at,
        nodes=list(a.assigned_nodes) if a is not None else [],
    )


class SessionOps:
    def __init__(self, quorum: Quorum, allocations: AllocationOps) -> None:
        self.quorum = quorum
        self.allocations = allocations

    async def create(self, who: Identity, body: Mapping[str, Any]) -> SessionView:
        merged = dict(body)
        merged.setdefault("entrypoint", HOLD_ENTRYPOINT)
        if not merged.get("entrypoint"):
            merged["entrypoint"] = HOLD_ENTRYPOINT
        if merged.get("walltime") in (None, "") and not merged.get("walltime_seconds"):
            merged["walltime"] = DEFAULT_WALLTIME
        merged.setdefault("name", "session")
        spec, sha = await self.allocations.resolve_uenv(self.allocations.validate(who, merged))
        async with self.allocations.gate.hold([spec]) as held:  # accounting: reserved first
            res = raise_if_error(
                await self.quorum.propose(
                    c.CreateSession(spec=held.specs[0], uenv_sha256=sha, now=time.time())
                )
            )
        assert res.session is not None
        if self.allocations.audit is not None and res.allocation is not None:
            self.allocations.audit.record_submission(who.user, [res.allocation])
        return session_view(res.session, res.allocation)

    def _find(self, who: Identity, session_id: str) -> tuple[Session, Allocation | None]:
        self.quorum.require_caught_up()
        found = self.quorum.read(queries.session_view, session_id)
        if found is None:
            raise NotFound(
                f"session {session_id} not found",
                hint="Sessions are listed by `lattice session list`.",
            )
        s, _ = found
        if s.user != who.user and not access.sees_others_sessions(who):
            raise PermissionDenied(
                f"session {s.id} belongs to {s.user}", hint="You can only use your own sessions."
            )
        return found

    def get(self, who: Identity, session_id: str) -> SessionView:
        return session_view(*self._find(who, session_id))

    def list(
        self, who: Identity, *, user: str | None = None, all_users: bool = False
    ) -> list[SessionView]:
        self.quorum.require_caught_up()
        rows = self.quorum.read(queries.user_sessions, access.listing_user(who, user, all_users))
        return [session_view(s, a) for s, a in rows]

    async def delete(self, who: Identity, session_id: str) -> SessionView:
        self._find(who, session_id)
        cmd = c.DeleteSession(session_id=session_id, now=time.time())
        res = raise_if_error(await self.quorum.propose(cmd))
        assert res.session is not None
        return session_view(res.session, res.allocation)
