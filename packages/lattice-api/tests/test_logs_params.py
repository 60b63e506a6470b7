"""GetLogs' filters and paging over gRPC (node_id, since, until, offset, limit and
``truncated``) give exactly what the REST route's query parameters give, and StreamLogs
takes its node_id; the served API over a LocalQuorum with logs from the harness's
MemoryLogs (the real log proxy and store are tested in test_logs_store.py)."""

from __future__ import annotations

from typing import Any

import grpclib
import pytest
from lattice_common.proto.lattice import v1
from served_api import Grpc, bearer

pytestmark = pytest.mark.timeout(60)

BOB = bearer("bob")
ALICE = bearer("alice")


def seed(api: Any, aid: str) -> None:
    """20 lines on n1 and n2 alternately, at t = 100..119, every third on stderr."""
    for i in range(20):
        api.logs.add(
            aid,
            f"line {i}",
            node_id=f"n{1 + i % 2}",
            stream="stderr" if i % 3 == 0 else "stdout",
            timestamp=100.0 + i,
        )


def texts(lines: Any) -> list[str]:
    return [ln.line if hasattr(ln, "line") else ln["line"] for ln in lines]


async def test_get_logs_filters_and_pages_like_rest(served: Any) -> None:
    api, w, rest, channel = served
    aid = w.bob_running
    seed(api, aid)
    g = Grpc(channel, BOB)
    cases: list[dict[str, Any]] = [
        {"node": "n2"},
        {"since": 105.0, "until": 110.0},
        {"node": "n1", "since": 104.0, "stream": "stdout"},
        {"offset": 3, "limit": 4},
        {"since": 110.0, "limit": 20},
        {"node": "n1", "tail": 4, "offset": 1, "limit": 2},
        {"until": 99.0},
    ]
    for case in cases:
        status, body = await rest.call("GET", f"/api/v1/allocations/{aid}/logs", BOB, **case)
        assert status == 200, (case, body)
        req = v1.GetLogsRequest(
            allocation_id=aid,
            node_id=case.get("node", ""),
            stream=case.get("stream", ""),
            tail=case.get("tail", 0),
            since=case.get("since"),
            until=case.get("until"),
            offset=case.get("offset", 0),
            limit=case.get("limit", 0),
        )
        got = await g.alloc.get_logs(req)
        assert [ln.to_dict() for ln in got.lines] == [
            v1.LogLine(**ln).to_dict() for ln in body["lines"]
        ], case
        assert got.truncated == body["truncated"], case
    # the numbers themselves
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, node_id="n2"))
    assert texts(got.lines) == [f"line {i}" for i in range(1, 20, 2)]
    assert {ln.node_id for ln in got.lines} == {"n2"}
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, since=105, until=107))
    assert texts(got.lines) == ["line 5", "line 6", "line 7"]
    # (the world's two lines of bob's, at t = 1 and 2, come first)
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, offset=5, limit=4))
    assert texts(got.lines) == ["line 3", "line 4", "line 5", "line 6"] and got.truncated
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, offset=18, limit=4))
    assert texts(got.lines) == ["line 16", "line 17", "line 18", "line 19"]
    assert not got.truncated
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid, until=0.0))
    assert got.lines == []  # until=0 is a bound (the epoch), not "unset"
    got = await g.alloc.get_logs(v1.GetLogsRequest(allocation_id=aid))
    assert len(got.lines) == 22 and not got.truncated


async def test_get_logs_refusals(served: Any) -> None:
    _api, w, _rest, channel = served
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.GetLogsRequest(allocation_id=w.bob_running, since=120, until=110)
        await Grpc(channel, BOB).alloc.get_logs(req)
    assert e.value.status == grpclib.Status.INVALID_ARGUMENT
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.GetLogsRequest(allocation_id=w.bob_running, node_id="n1")
        await Grpc(channel, ALICE).alloc.get_logs(req)
    assert e.value.status == grpclib.Status.NOT_FOUND


async def test_stream_logs_takes_the_node(served: Any) -> None:
    api, w, _rest, channel = served
    aid = w.bob_running
    seed(api, aid)
    g = Grpc(channel, BOB)
    lines = [
        ln
        async for ln in g.alloc.stream_logs(v1.StreamLogsRequest(allocation_id=aid, node_id="n1"))
    ]
    assert {ln.node_id for ln in lines} == {"n1"}
    assert texts(lines)[-3:] == ["line 14", "line 16", "line 18"]
