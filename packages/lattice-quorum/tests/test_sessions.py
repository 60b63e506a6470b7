"""Interactive sessions in the quorum: created with their allocation in one command,
ended by cancelling it, and at most one live sensitive session per user."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import AllocationState, SchedulerType
from lattice_test_harness import builders as b
from test_state import ok, rejected, world


def create(s, user: str = "alice", vcluster: str = "v"):  # type: ignore[no-untyped-def]
    spec = b.spec("sleep infinity", tenant="t", vcluster=vcluster, user=user)
    return ok(s, c.CreateSession(spec=spec, now=10.0))


def test_create_and_delete() -> None:
    s = world()
    res = create(s)
    sess, alloc = res.session, res.allocation
    assert sess is not None and alloc is not None
    assert sess.allocation_id == alloc.id and sess.user == "alice"
    assert s.allocations[alloc.id].state == AllocationState.PENDING
    res = ok(s, c.DeleteSession(session_id=sess.id, now=20.0))
    assert s.allocations[alloc.id].state == AllocationState.CANCELLED
    assert s.sessions[sess.id].ended_at == 20.0
    rejected(s, c.DeleteSession(session_id=sess.id, now=21.0), "invalid_transition")
    rejected(s, c.DeleteSession(session_id="nope", now=21.0), "not_found")


def test_one_live_sensitive_session_per_user() -> None:
    s = world(vclusters=("v", "secure"))
    s.vclusters["secure"].scheduler_type = SchedulerType.SENSITIVE_RESERVATION
    first = create(s, vcluster="secure").session
    assert first is not None
    err = rejected(
        s,
        c.CreateSession(spec=b.spec("sh", tenant="t", vcluster="secure", user="alice"), now=11.0),
        "quota_exceeded",
    )
    assert first.id in err["message"] and "one session at a time" in err["hint"]
    create(s, user="bob", vcluster="secure")  # another user may
    create(s, vcluster="v")  # and non-sensitive sessions are not limited
    ok(s, c.DeleteSession(session_id=first.id, now=30.0))
    create(s, vcluster="secure")  # once it ended, a new one is allowed
