"""The audit log in apply(): AppendAudit continues the chain or is rejected as stale,
entries must verify with the key the command names, the outbox of sensitive claims,
releases and ends, queries with pagination, and the log surviving a dump and a load
(msgpack and pickle, as pysyncobj's full dump)."""

from __future__ import annotations

import pickle

import msgspec
from lattice_common import audit
from lattice_common import commands as c
from lattice_common.audit import AuditEvent
from lattice_common.types import AllocationState, SchedulerType
from lattice_quorum import queries
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b
from test_state import assign, ok, rejected, set_state, submit, world

KEY = audit.generate_private_key()
PEM = audit.public_key_pem(KEY)


def ev(i: int, **kw) -> AuditEvent:
    base = {"time": 100.0 + i, "actor": f"admin{i % 2}", "action": audit.NODE_DRAIN}
    return AuditEvent(**{**base, "target": f"node:n{i}", **kw})


def append(s: GlobalState, *events: AuditEvent, key=KEY, outbox_ids=()) -> c.AppendAudit:
    seq, prev = queries.audit_tail(s)
    entries = audit.seal(events, key, seq=seq, prev_hash=prev)
    return c.AppendAudit(
        entries=entries,
        public_key=audit.public_key_pem(key),
        outbox_ids=list(outbox_ids),
        now=200.0,
    )


def test_entries_continue_the_chain_and_verify() -> None:
    s = GlobalState()
    ok(s, append(s, ev(1), ev(2)))
    ok(s, append(s, ev(3)))
    log, keys = queries.audit_log(s)
    assert [e.seq for e in log] == [1, 2, 3]
    assert keys == {audit.key_id(KEY): PEM}
    assert audit.verify_chain(log, [KEY.public_key()]).ok
    assert queries.audit_tail(s) == (3, log[-1].hash)


def test_a_stale_proposal_is_rejected_and_changes_nothing() -> None:
    s = GlobalState()
    first = append(s, ev(1))
    racing = append(s, ev(2))  # signed after the same tail
    ok(s, first)
    err = rejected(s, racing, "stale_revision")
    assert err["details"]["last_seq"] == 1
    ok(s, append(s, ev(2)))  # signed again after the new tail
    assert [e.seq for e in s.audit_log] == [1, 2]


def test_entries_that_do_not_verify_with_the_named_key_are_refused() -> None:
    s = GlobalState()
    cmd = append(s, ev(1))
    other = audit.public_key_pem(audit.generate_private_key())
    err = rejected(s, msgspec.structs.replace(cmd, public_key=other), "invalid_argument")
    assert "signed by an unknown key" in err["message"]
    edited = msgspec.structs.replace(cmd.entries[0], actor="mallory")
    err = rejected(s, msgspec.structs.replace(cmd, entries=[edited]), "invalid_argument")
    assert "entry 1: hash does not match its contents" in err["message"]
    rejected(s, msgspec.structs.replace(cmd, public_key="junk"), "invalid_argument")
    rejected(s, msgspec.structs.replace(cmd, entries=[]), "invalid_argument")


def test_several_keys_sign_one_chain() -> None:
    s = GlobalState()
    other = audit.generate_private_key()
    ok(s, append(s, ev(1)))
    ok(s, append(s, ev(2), key=other))
    log, keys = queries.audit_log(s)
    assert set(keys) == {audit.key_id(KEY), audit.key_id(other)}
    assert audit.verify_chain(log, keys.values()).ok


def sensitive_world() -> GlobalState:
    s = world(nodes=2, vclusters=("v",))
    ok(
        s,
        c.CreateVCluster(
            vcluster=b.vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION),
            now=1.0,
        ),
    )
    return s


def test_sensitive_claims_releases_and_ends_wait_in_the_outbox_until_recorded() -> None:
    s = sensitive_world()
    batch = submit(s, vcluster="v", user="bob")
    assign(s, batch, ["n0001"])
    set_state(s, batch, AllocationState.COMPLETED, exit_code=0)
    assert s.audit_outbox == []  # nothing sensitive happened
    aid = submit(s, vcluster="sens", user="alice")
    assign(s, aid, ["n0000"], now=50.0)
    ok(s, c.CancelAllocation(allocation_id=aid, requested_by="alice", now=60.0))
    ok(s, c.ReleaseNodeClaim(node_id="n0000", user="root", admin=True, now=70.0))
    box = queries.audit_outbox(s)
    assert [(e.action, e.actor, e.target, e.time) for e in box] == [
        (audit.NODE_CLAIM, "alice", "node:n0000", 50.0),
        (audit.ALLOCATION_END, "alice", f"allocation:{aid}", 60.0),
        (audit.NODE_RELEASE, "root", "node:n0000", 70.0),
    ]
    assert box[0].details == {"allocation_id": aid} and box[0].tenant == "t"
    assert box[1].details["state"] == "Cancelled"
    assert box[2].details == {"claimed_by": "alice", "as_admin": "true"}
    assert [e.id for e in box] == [1, 2, 3]

    # recorded (two of them) in one command that empties those from the outbox
    ok(s, append(s, *box[:2], outbox_ids=[1, 2]))
    assert [e.id for e in queries.audit_outbox(s)] == [3]
    # another member recording the same events again is stale
    seq, prev = queries.audit_tail(s)
    again = c.AppendAudit(
        entries=audit.seal(box[:1], KEY, seq=seq, prev_hash=prev), public_key=PEM, outbox_ids=[1]
    )
    rejected(s, again, "stale_revision")
    ok(s, append(s, box[2], outbox_ids=[3]))
    assert queries.audit_outbox_size(s) == 0
    assert [e.action for e in s.audit_log] == [
        audit.NODE_CLAIM,
        audit.ALLOCATION_END,
        audit.NODE_RELEASE,
    ]


def test_queries_filter_and_page() -> None:
    s = GlobalState()
    ok(s, append(s, *(ev(i) for i in range(1, 8))))
    ok(s, append(s, ev(8, action=audit.TENANT_UPDATE, target="tenant:t", tenant="t")))
    page, nxt = queries.audit_entries(s, limit=3)
    assert [e.seq for e in page] == [1, 2, 3] and nxt == 3
    page, nxt = queries.audit_entries(s, after_seq=nxt, limit=3)
    assert [e.seq for e in page] == [4, 5, 6] and nxt == 6
    page, nxt = queries.audit_entries(s, after_seq=nxt, limit=3)
    assert [e.seq for e in page] == [7, 8] and nxt == 0
    by_user, _ = queries.audit_entries(s, user="admin1")
    assert [e.seq for e in by_user] == [1, 3, 5, 7]
    assert [e.seq for e in queries.audit_entries(s, action="tenant.update")[0]] == [8]
    assert [e.seq for e in queries.audit_entries(s, action="node.")[0]] == list(range(1, 8))
    assert [e.seq for e in queries.audit_entries(s, tenant="t")[0]] == [8]
    assert [e.seq for e in queries.audit_entries(s, target="n3")[0]] == [3]
    window = queries.audit_entries(s, since=103.0, until=105.0)[0]
    assert [e.seq for e in window] == [3, 4, 5]
    # a page that ends exactly at the last match says there is no more
    page, nxt = queries.audit_entries(s, user="admin1", limit=4)
    assert [e.seq for e in page] == [1, 3, 5, 7] and nxt == 0


def test_the_log_and_outbox_survive_a_dump_and_a_load() -> None:
    s = sensitive_world()
    ok(s, append(s, ev(1), ev(2)))
    aid = submit(s, vcluster="sens", user="alice")
    assign(s, aid, ["n0000"])
    for loaded in (
        pickle.loads(pickle.dumps(s)),  # pysyncobj's full dump
        msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=GlobalState),
    ):
        assert loaded.audit_log == s.audit_log
        assert loaded.audit_keys == s.audit_keys
        assert loaded.audit_outbox == s.audit_outbox
        assert loaded.audit_outbox_seq == 1
        ok(loaded, append(loaded, *queries.audit_outbox(loaded), outbox_ids=[1]))
        log, keys = queries.audit_log(loaded)
        assert audit.verify_chain(log, keys.values()).ok and len(log) == 3
