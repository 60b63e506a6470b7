"""The audit log through the real servers (REST and gRPC over a LocalQuorum, signed
tokens): admin actions recorded with who did them, sensitive claims and submissions,
failed authentications (rate-limited per source), who may read it, pagination, the
export verifying offline with the public key, server-side verification naming an
edited entry, and recording that never fails or blocks the user's operation."""

from __future__ import annotations

import asyncio
import time

import jwt
import msgspec
import pytest
from lattice_api.audit import AuditRecorder
from lattice_api.auth import Role
from lattice_common import audit
from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_common.types import SchedulerType
from lattice_quorum import queries
from lattice_quorum.local import LocalQuorum
from prometheus_client import REGISTRY
from served_api import SECRET, Grpc, bearer, grpc_error

ADMIN = bearer("root", Role.SYSTEM_ADMIN)
USER = bearer("alice")


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def entries(rest, who=ADMIN, **query) -> list[dict]:
    status, body = await rest.call("GET", "/api/v1/admin/audit", who, **query)
    assert status == 200, body
    return body["entries"]


async def test_admin_actions_are_recorded_with_who_did_them(served) -> None:
    _api, _world, rest, channel = served
    status, _ = await rest.call("POST", "/api/v1/nodes/n2/drain", ADMIN, {"reason": "DIMM errors"})
    assert status == 200
    status, _ = await rest.call("PATCH", "/api/v1/tenants/physics", ADMIN, {"max_nodes": 5})
    assert status == 200
    g = Grpc(channel, bearer("ops", Role.SYSTEM_ADMIN))
    await g.nodes.undrain_node(v1.NodeActionRequest(id="n2"))
    await g.admin.create_v_cluster(
        v1.CreateVClusterRequest(vcluster=v1.VCluster(name="gpu", tenant="bio"))
    )

    got = await entries(rest)
    mine = [(e["actor"], e["action"], e["target"]) for e in got]
    assert mine == [
        ("root", "node.drain", "node:n2"),
        ("root", "tenant.update", "tenant:physics"),
        ("ops", "node.undrain", "node:n2"),
        ("ops", "vcluster.create", "vcluster:gpu"),
    ]
    assert got[0]["details"] == {"reason": "DIMM errors", "state": "Drained"}  # idle
    assert got[1]["details"] == {"max_nodes": "5"} and got[1]["tenant"] == "physics"
    assert got[3]["tenant"] == "bio"
    assert [e["seq"] for e in got] == [1, 2, 3, 4]

    # filters, and the same entries over gRPC
    assert [e["seq"] for e in await entries(rest, user="ops")] == [3, 4]
    assert [e["seq"] for e in await entries(rest, action="node.")] == [1, 3]
    assert [e["seq"] for e in await entries(rest, target="n2")] == [1, 3]
    res = await g.admin.query_audit(v1.QueryAuditRequest(user="root"))
    assert [(e.sequence, e.user, e.action, e.node_id) for e in res.entries] == [
        (1, "root", "node.drain", "n2"),
        (2, "root", "tenant.update", ""),
    ]
    assert res.entries[0].hash == got[0]["hash"] and res.entries[0].key_id == got[0]["key_id"]
    # the specification's path and its from= spelling
    status, body = await rest.call("GET", "/api/v1/audit", ADMIN, **{"from": "2000-01-01"})
    assert status == 200 and len(body["entries"]) == 4
    future = time.time() + 3600
    assert await entries(rest, since=future) == []


async def test_pages_follow_each_other(served) -> None:
    _api, _world, rest, _channel = served
    for node in ("n1", "n2", "n3"):
        await rest.call("POST", f"/api/v1/nodes/{node}/disable", ADMIN, {"reason": "x"})
        await rest.call("POST", f"/api/v1/nodes/{node}/enable", ADMIN)
    status, page = await rest.call("GET", "/api/v1/admin/audit", ADMIN, limit=4)
    assert [e["seq"] for e in page["entries"]] == [1, 2, 3, 4]
    status, page = await rest.call(
        "GET", "/api/v1/admin/audit", ADMIN, limit=4, page_token=page["next_page_token"]
    )
    assert [e["seq"] for e in page["entries"]] == [5, 6] and page["next_page_token"] == ""
    status, body = await rest.call("GET", "/api/v1/admin/audit", ADMIN, page_token="x")
    assert status == 400
    status, body = await rest.call("GET", "/api/v1/admin/audit", ADMIN, since="yesterday-ish")
    assert status == 400 and "is not a time" in body["error"]["message"]


async def test_failed_authentications_are_recorded_at_most_ten_a_minute_per_source(
    served,
) -> None:
    api, _world, rest, channel = served
    forged = jwt.encode(
        {"sub": "mallory", "scope": "admin"},
        "not-the-secret-but-long-enough-for-hs256",
        algorithm="HS256",
    )
    suppressed = metric("lattice_audit_auth_failures_suppressed_total")
    for _ in range(12):
        status, _ = await rest.call("GET", "/api/v1/nodes", {"authorization": f"Bearer {forged}"})
        assert status == 401
    got = await entries(rest, action="auth.failed")
    assert len(got) == 10
    e = got[0]
    assert e["actor"] == "mallory" and e["target"] == "source:127.0.0.1"
    assert e["details"]["claimed_user"] == "mallory"
    assert "Signature verification failed" in e["details"]["reason"]
    assert metric("lattice_audit_auth_failures_suppressed_total") == suppressed + 2

    # gRPC too (the recorder's window is per source: start a fresh one)
    api.ops.recorder._auth.clear()
    bad = Grpc(channel, {"authorization": "Bearer nonsense"})
    status, _ = await grpc_error(bad.nodes.list_nodes(v1.ListNodesRequest()))
    assert status == "UNAUTHENTICATED"
    got = await entries(rest, action="auth.failed")
    assert got[-1]["actor"] == "unauthenticated" and got[-1]["target"] == "source:127.0.0.1"


async def test_who_may_read_export_and_verify_it(served) -> None:
    _api, _world, rest, channel = served
    await rest.call("PATCH", "/api/v1/tenants/physics", ADMIN, {"max_nodes": 6})
    await rest.call("PATCH", "/api/v1/tenants/bio", ADMIN, {"max_nodes": 7})
    for method, path in (
        ("GET", "/api/v1/admin/audit"),
        ("GET", "/api/v1/admin/audit/export"),
        ("POST", "/api/v1/admin/audit/verify"),
    ):
        for who in (USER, bearer("ro", Role.READ_ONLY), bearer("op", Role.OPERATOR)):
            status, body = await rest.call(method, path, who)
            assert status == 403, (method, path, body)
    status, _ = await rest.call(
        "GET", "/api/v1/admin/audit/export", bearer("ta", Role.TENANT_ADMIN)
    )
    assert status == 403
    g = Grpc(channel, USER)
    status, _ = await grpc_error(g.admin.query_audit(v1.QueryAuditRequest()))
    assert status == "PERMISSION_DENIED"

    # a tenant admin sees their own tenant's entries only
    claims = {"sub": "pat", "scope": "tenant:admin", "tenant": "bio", "exp": time.time() + 60}
    pat = {"authorization": f"Bearer {jwt.encode(claims, SECRET, algorithm='HS256')}"}
    got = await entries(rest, pat)
    assert [(e["target"], e["details"]) for e in got] == [("tenant:bio", {"max_nodes": "7"})]
    status, body = await rest.call("GET", "/api/v1/admin/audit", pat, tenant="physics")
    assert status == 403
    status, _ = await rest.call("GET", "/api/v1/admin/audit", bearer("nobody", Role.TENANT_ADMIN))
    assert status == 403


async def test_export_verifies_offline_and_server_verify_names_an_edited_entry(served) -> None:
    api, _world, rest, channel = served
    for node in ("n1", "n2", "n3"):
        await rest.call("POST", f"/api/v1/nodes/{node}/drain", ADMIN, {"reason": "r"})
    status, verdict = await rest.call("POST", "/api/v1/admin/audit/verify", ADMIN)
    assert status == 200 and verdict["valid"] and verdict["count"] == 3
    assert verdict["message"].startswith("3 entries verified")
    pem = verdict["public_keys"][verdict["signing_key_id"]]

    async with rest.session.get(rest.url + "/api/v1/admin/audit/export", headers=ADMIN) as r:
        assert r.status == 200 and "attachment" in r.headers["Content-Disposition"]
        data = await r.read()
    assert audit.verify_export(data, [pem]).ok
    # the same file over gRPC
    g = Grpc(channel, ADMIN)
    chunks = [ch.data async for ch in g.admin.export_audit(v1.ExportAuditRequest())]
    header, got = audit.read_export(b"".join(chunks))
    assert [e.seq for e in got] == [1, 2, 3] and audit.key_id(
        audit.load_public_key(pem)
    ) in header.public_keys

    # someone edits entry 2 in the committed state: verification names it
    log = api.quorum.state.audit_log
    log[1] = msgspec.structs.replace(log[1], details={"reason": "nothing happened"})
    status, verdict = await rest.call("POST", "/api/v1/admin/audit/verify", ADMIN)
    assert not verdict["valid"] and verdict["first_bad_sequence"] == 2
    assert verdict["message"] == "entry 2: hash does not match its contents (edited?)"
    res = await g.admin.verify_audit(v1.VerifyAuditRequest())
    assert not res.valid and res.first_bad_sequence == 2


async def test_sensitive_claims_submissions_and_ends_are_recorded(served) -> None:
    api, _world, rest, _channel = served
    api.add_vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    status, a = await rest.call(
        "POST",
        "/api/v1/allocations",
        bearer("carol", Role.CLAIMING_USER),
        {"entrypoint": "analyse", "tenant": "bio", "vcluster": "sens", "walltime": "1h"},
    )
    assert status == 201, a
    # the scheduler assigns it: the claim is queued by the state machine, signed by the leader
    api.propose(c.AssignNodes(allocation_id=a["id"], node_ids=["n3"], now=time.time()))
    status, _ = await rest.call("DELETE", f"/api/v1/allocations/{a['id']}", bearer("carol"))
    assert status == 200
    got = await entries(rest)
    assert [(e["actor"], e["action"], e["target"]) for e in got] == [
        ("carol", "allocation.submit", f"allocation:{a['id']}"),
        ("carol", "node.claim", "node:n3"),
        ("carol", "allocation.end", f"allocation:{a['id']}"),
    ]
    assert got[2]["details"]["state"] == "Cancelled"
    # an ordinary submission is not recorded
    status, _ = await rest.call(
        "POST",
        "/api/v1/allocations",
        USER,
        {"entrypoint": "x", "tenant": "bio", "vcluster": "batch", "walltime": "1h"},
    )
    assert status == 201 and len(await entries(rest)) == 3
    assert api.quorum.read(queries.audit_outbox_size) == 0


async def test_reading_a_sensitive_allocations_logs_is_recorded(served) -> None:
    api, world, rest, _channel = served
    api.add_vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    carol = bearer("carol", Role.CLAIMING_USER)
    status, a = await rest.call(
        "POST",
        "/api/v1/allocations",
        carol,
        {"entrypoint": "analyse", "tenant": "bio", "vcluster": "sens", "walltime": "1h"},
    )
    assert status == 201, a
    status, _ = await rest.call("GET", f"/api/v1/allocations/{a['id']}/logs", carol)
    assert status == 200
    got = [e for e in await entries(rest) if e["action"] == "allocation.logs"]
    assert [(e["actor"], e["target"], e["tenant"]) for e in got] == [
        ("carol", f"allocation:{a['id']}", "bio")
    ]
    # logs of ordinary allocations are not recorded
    status, _ = await rest.call(
        "GET", f"/api/v1/allocations/{world.bob_running}/logs", bearer("bob")
    )
    assert status == 200
    assert len([e for e in await entries(rest) if e["action"] == "allocation.logs"]) == 1


# --------------------------------------------------------------------------- the recorder


class FailingQuorum(LocalQuorum):
    """A quorum whose audit appends never commit."""

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        if isinstance(cmd, c.AppendAudit):
            raise ConnectionError("no leader")
        return await super().propose(cmd)


async def test_audit_failures_never_fail_the_operation_and_are_counted() -> None:
    from lattice_api.auth import Identity
    from lattice_api.node_monitor import NodeMonitor
    from lattice_api.operations import Operations
    from lattice_test_harness.local_api import MemoryLogs

    q = FailingQuorum()
    q.apply(c.RegisterNode(node_id="n1", now=1.0))
    ops = Operations(q, monitor=NodeMonitor(q), logs=MemoryLogs())
    ops.recorder.retry_for = 0.05
    before = metric("lattice_audit_append_failures_total")
    t0 = time.monotonic()
    node = await ops.nodes.drain(Identity("root", Role.SYSTEM_ADMIN), "n1", "x")
    assert node.state.value == "Drained" and time.monotonic() - t0 < 0.5
    assert not await ops.recorder.flush(timeout=0.01)  # still trying, the drain is done
    await ops.recorder.flush(timeout=2.0)
    assert metric("lattice_audit_append_failures_total") == before + 1
    assert q.state.audit_log == []
    await ops.recorder.close()


async def test_two_members_recording_at_once_keep_one_chain() -> None:
    """Two servers (two keys) racing to append: the stale one signs again after the
    new tail, and the chain verifies with both public keys."""
    q = LocalQuorum()
    a, b = (
        AuditRecorder(q, audit.generate_private_key()),
        AuditRecorder(q, audit.generate_private_key()),
    )
    for i in range(20):
        a.record("root", audit.NODE_DRAIN, f"node:a{i}")
        b.record("ops", audit.NODE_DRAIN, f"node:b{i}")
    assert await a.flush(5) and await b.flush(5)
    log, keys = q.read(queries.audit_log)
    assert len(log) == 40 and set(keys) == {a.key_id, b.key_id}
    assert audit.verify_chain(log, keys.values()).ok
    await a.close()
    await b.close()


@pytest.mark.parametrize("created", [True, False])
def test_the_development_key_is_kept_in_the_data_dir(tmp_path, created, caplog) -> None:
    from lattice_api.audit import load_signing_key

    if not created:
        first = load_signing_key("", str(tmp_path))
    key = load_signing_key("", str(tmp_path))
    assert (tmp_path / "audit_signing_key.pem").exists()
    if not created:
        assert audit.key_id(key) == audit.key_id(first)
    assert "AUDIT SIGNING KEY NOT CONFIGURED" in caplog.text


def test_a_configured_key_must_be_an_ed25519_pem(tmp_path) -> None:
    from lattice_api.audit import load_signing_key
    from lattice_common.errors import ValidationError

    path = tmp_path / "k.pem"
    path.write_bytes(audit.private_key_pem(audit.generate_private_key()))
    assert audit.key_id(load_signing_key(str(path))) == audit.key_id(
        audit.load_private_key(path.read_bytes())
    )
    with pytest.raises(ValidationError, match="cannot read"):
        load_signing_key(str(tmp_path / "missing.pem"))
    path.write_text("junk")
    with pytest.raises(ValidationError, match="not a PEM private key"):
        load_signing_key(str(path))


async def test_record_outside_a_loop_waits_for_one() -> None:
    q = LocalQuorum()
    rec = AuditRecorder(q, audit.generate_private_key())
    await asyncio.to_thread(rec.record, "root", audit.NODE_DRAIN, "node:n1")  # no loop there
    assert await rec.flush(2)
    assert [e.target for e in q.state.audit_log] == ["node:n1"]
    await rec.close()
