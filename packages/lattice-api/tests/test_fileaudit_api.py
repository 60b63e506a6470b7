"""NodeService.ReportFileAccess on the real servers (signed tokens, the agent token): a
node's file-access events land in the audit log as ``file.access`` under the
allocation's user (not what the agent could claim), readable with the audit query by
action and allocation; the answer names the node's sensitive allocations; events of an
allocation on another node, or of none, are refused and recorded nowhere; people cannot
call it; a report too large is refused whole; events the node lost are recorded as such."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpclib.client import Channel
from lattice_api.auth import Role
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, SchedulerType
from lattice_test_harness.local_api import LocalApi
from served_api import Grpc, Rest, bearer, grpc_error, serve_seeded


class Seeded:
    def __init__(self, api: LocalApi) -> None:
        api.add_tenant("hospital")
        api.add_tenant("physics")
        api.add_vcluster("sensitive", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
        api.add_vcluster("batch")
        api.add_node("n1")
        api.add_node("n2")
        api.add_node("n3")

        def run(user: str, tenant: str, vcluster: str, node: str) -> str:
            spec = AllocationSpec(
                entrypoint="x", tenant=tenant, vcluster=vcluster, user=user, walltime_seconds=60
            )
            a = api.submit(spec)
            api.start(a.id, [node])
            return a.id

        self.sensitive = run("dr-x", "hospital", "sensitive", "n1")
        self.batch = run("bob", "physics", "batch", "n3")
        self.elsewhere = run("carol", "physics", "batch", "n2")


@pytest.fixture
async def served() -> AsyncIterator[tuple[LocalApi, Seeded, Rest, Channel]]:
    async for got in serve_seeded(Seeded):
        yield got


def event(alloc_id: str, path: str = "/data/subject-001.csv", **kw: Any) -> v1.FileAccessEvent:
    fields = {
        "time": time.time(),
        "allocation_id": alloc_id,
        "uid": 1000,
        "pid": 4242,
        "tid": 4242,
        "comm": "python",
        "path": path,
        "flags": "r",
        "result": 3,
        "count": 1,
        "source": "ebpf",
        **kw,
    }
    return v1.FileAccessEvent(**fields)


async def entries(rest: Rest, **query: Any) -> list[dict[str, Any]]:
    status, body = await rest.call(
        "GET", "/api/v1/admin/audit", bearer("auditor", Role.SYSTEM_ADMIN), **query
    )
    assert status == 200, body
    return body["entries"]


async def test_events_are_recorded_under_the_allocations_user(served) -> None:
    _, s, rest, channel = served
    agent = Grpc(channel, bearer("n1", Role.AGENT))
    resp = await agent.nodes.report_file_access(
        v1.ReportFileAccessRequest(
            node_id="n1",
            events=[
                event(s.sensitive),
                event(s.sensitive, "/scratch/out.bin", flags="w,create,trunc", count=5000),
            ],
        )
    )
    assert resp.accepted == 2 and resp.rejected == []
    assert resp.audited_allocations == [s.sensitive]
    # a job its owner put in audit mode is recorded too; the cluster does not audit it
    resp = await agent.nodes.report_file_access(
        v1.ReportFileAccessRequest(node_id="n3", events=[event(s.batch, "/home/bob/x")])
    )
    assert resp.accepted == 1 and resp.audited_allocations == []
    (e,) = await entries(rest, action="file.access", allocation_id=s.sensitive)
    assert (e["actor"], e["target"], e["tenant"]) == (
        "dr-x",
        f"allocation:{s.sensitive}",
        "hospital",
    )
    d = e["details"]
    assert (d["node"], d["events"], d["opens"], d["sensitive"]) == ("n1", "2", "5001", "true")
    records = json.loads(d["records"])
    assert [(r["path"], r["flags"], r["count"], r["uid"]) for r in records] == [
        ("/data/subject-001.csv", "r", 1, 1000),
        ("/scratch/out.bin", "w,create,trunc", 5000, 1000),
    ]
    (b,) = await entries(rest, action="file.access", target=s.batch)
    assert b["actor"] == "bob" and b["details"]["sensitive"] == "false"


async def test_a_node_reports_only_for_its_own_allocations(served) -> None:
    _, s, rest, channel = served
    agent = Grpc(channel, bearer("n1", Role.AGENT))
    resp = await agent.nodes.report_file_access(
        v1.ReportFileAccessRequest(
            node_id="n1", events=[event(s.elsewhere), event(s.elsewhere), event("nope")]
        )
    )
    assert resp.accepted == 0
    assert [(r.allocation_id, r.count, r.reason) for r in resp.rejected] == [
        (s.elsewhere, 2, f"allocation {s.elsewhere} is not on node n1"),
        ("nope", 1, "allocation nope not found"),
    ]
    assert await entries(rest, action="file.access") == []


async def test_people_cannot_report_and_bad_reports_change_nothing(served) -> None:
    _, s, rest, channel = served
    user = Grpc(channel, bearer("dr-x", Role.USER))
    request = v1.ReportFileAccessRequest(node_id="n1", events=[event(s.sensitive)])
    status, _ = await grpc_error(user.nodes.report_file_access(request))
    assert status == "PERMISSION_DENIED"
    agent = Grpc(channel, bearer("n1", Role.AGENT))
    many = v1.ReportFileAccessRequest(node_id="n1", events=[event(s.sensitive)] * 2001)
    status, err = await grpc_error(agent.nodes.report_file_access(many))
    assert status == "INVALID_ARGUMENT" and "at most 2000" in err["message"] and err["hint"]
    status, err = await grpc_error(
        agent.nodes.report_file_access(v1.ReportFileAccessRequest(node_id="n9"))
    )
    assert status == "NOT_FOUND" and err["hint"]
    assert await entries(rest, action="file.access") == []


async def test_lost_events_are_recorded_and_an_empty_report_only_asks(served) -> None:
    _, s, rest, channel = served
    agent = Grpc(channel, bearer("n1", Role.AGENT))
    resp = await agent.nodes.report_file_access(v1.ReportFileAccessRequest(node_id="n1"))
    assert resp.accepted == 0 and resp.audited_allocations == [s.sensitive]
    assert await entries(rest, action="file.access") == []
    await agent.nodes.report_file_access(v1.ReportFileAccessRequest(node_id="n1", dropped=17))
    (e,) = await entries(rest, action="file.access", target="node:n1")
    assert e["details"]["lost"] == "17" and e["actor"] == "node:n1"
