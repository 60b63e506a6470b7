"""Per-user limits on the served API (REST middleware and gRPC interceptor share one
limiter), heartbeat replay and rate refusals, and secret rotation into the
Authenticator."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpclib
import jwt
import pytest
from grpclib.const import Cardinality
from lattice_api.auth import Authenticator, Role
from lattice_api.node_monitor import HEARTBEATS_REJECTED
from lattice_api.ratelimit import HeartbeatLimiter
from lattice_api.rotation import watch_api_secrets
from lattice_api.settings import ApiSettings
from lattice_common.config import RateLimitConfig, load_config
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation
from lattice_test_harness.local_api import LocalApi, serve_local_api
from served_api import AGENT_TOKEN, SECRET, World, bearer

SPEC_MESSAGE = (
    "maximum concurrent sessions reached (5/5). Close an existing session to open a new one."
)
STREAM_LOGS = "/lattice.v1.AllocationService/StreamLogs"


class EndlessLogs:
    """A log source whose live streams never end (a line every 20 ms)."""

    async def follow(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both"
    ) -> AsyncIterator[dict[str, Any]]:
        n = 0
        while True:
            n += 1
            yield {"allocation_id": alloc.id, "node_id": "n1", "stream": "stdout",
                   "line": f"line {n}", "timestamp": float(n)}  # fmt: skip
            await asyncio.sleep(0.02)

    async def fetch(self, alloc: Allocation, **_: Any) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
async def limited() -> AsyncIterator[tuple[LocalApi, World, aiohttp.ClientSession]]:
    """A secured API whose log streams never end, at most 5 per user."""
    settings = ApiSettings(rate_limit=RateLimitConfig(stream_logs_max_concurrent=5))
    async with serve_local_api(
        hmac_secret=SECRET, agent_token=AGENT_TOKEN, settings=settings
    ) as api:
        world = World(api)
        api.ops.allocations.log_source = EndlessLogs()
        async with aiohttp.ClientSession() as session:
            yield api, world, session


async def open_rest_stream(
    api: LocalApi, session: aiohttp.ClientSession, alloc_id: str, user: str
) -> aiohttp.ClientResponse:
    resp = await session.get(
        f"{api.rest_url}/api/v1/allocations/{alloc_id}/logs/stream",
        headers=bearer(user, Role.SYSTEM_ADMIN if user == "root" else Role.USER),
    )
    if resp.status == 200:
        assert json.loads(await resp.content.readline())["line"] == "line 1"
    return resp


async def test_sixth_log_stream_of_a_user_gets_429_another_user_unaffected(
    limited: Any,
) -> None:
    api, world, session = limited
    # bob's running allocation for bob; alice reads her own finished one
    alice_streams = [
        await open_rest_stream(api, session, world.alice_done, "alice") for _ in range(5)
    ]
    assert [r.status for r in alice_streams] == [200] * 5
    sixth = await open_rest_stream(api, session, world.alice_done, "alice")
    assert sixth.status == 429
    assert sixth.headers["Retry-After"] == "1"
    body = await sixth.json()
    assert body["error"]["message"] == SPEC_MESSAGE
    assert body["error"]["code"] == "rate_limited" and body["error"]["hint"]
    sixth.close()
    # another user is unaffected
    bob = await open_rest_stream(api, session, world.bob_running, "bob")
    assert bob.status == 200
    # a closed stream frees its slot
    alice_streams.pop().close()
    for _ in range(100):
        again = await open_rest_stream(api, session, world.alice_done, "alice")
        if again.status == 200:
            break
        again.close()
        await asyncio.sleep(0.05)
    assert again.status == 200
    for r in [*alice_streams, bob, again]:
        r.close()


async def test_grpc_resource_exhausted_with_retry_after_shares_the_rest_count(
    limited: Any,
) -> None:
    api, world, session = limited
    rest = [await open_rest_stream(api, session, world.alice_done, "alice") for _ in range(3)]
    channel = api.channel()
    try:
        calls = []
        for _ in range(2):  # 3 REST + 2 gRPC = 5 streams of alice
            cm = channel.request(
                STREAM_LOGS,
                Cardinality.UNARY_STREAM,
                v1.StreamLogsRequest,
                v1.LogLine,
                metadata=bearer("alice"),
            )
            stream = await cm.__aenter__()
            await stream.send_message(
                v1.StreamLogsRequest(allocation_id=world.alice_done), end=True
            )
            assert (await stream.recv_message()).line == "line 1"
            calls.append((cm, stream))
        async with channel.request(
            STREAM_LOGS,
            Cardinality.UNARY_STREAM,
            v1.StreamLogsRequest,
            v1.LogLine,
            metadata=bearer("alice"),
        ) as stream:
            await stream.send_message(
                v1.StreamLogsRequest(allocation_id=world.alice_done), end=True
            )
            with pytest.raises(grpclib.GRPCError) as e:
                await stream.recv_message()
            trailers = dict(stream.trailing_metadata or {})
        assert e.value.status.name == "RESOURCE_EXHAUSTED"
        err = json.loads(e.value.message or "{}")
        assert err["message"] == SPEC_MESSAGE and err["details"]["retry_after_seconds"] == 1
        assert trailers.get("retry-after") == "1"
        # bob is not affected on gRPC either
        stub = v1.AllocationServiceStub(channel, timeout=10, metadata=bearer("bob"))
        got = stub.stream_logs(v1.StreamLogsRequest(allocation_id=world.bob_running))
        first = await got.__anext__()
        assert first.line == "line 1"
        await got.aclose()
        for cm, stream in calls:
            await stream.cancel()
            await cm.__aexit__(None, None, None)
    finally:
        for r in rest:
            r.close()
        channel.close()


async def test_default_limit_is_the_spec_ten() -> None:
    async with serve_local_api(hmac_secret=SECRET, agent_token=AGENT_TOKEN) as api:
        world = World(api)
        api.ops.allocations.log_source = EndlessLogs()
        async with aiohttp.ClientSession() as session:
            held = [
                await open_rest_stream(api, session, world.alice_done, "alice") for _ in range(10)
            ]
            assert all(r.status == 200 for r in held)
            eleventh = await open_rest_stream(api, session, world.alice_done, "alice")
            assert eleventh.status == 429
            assert (await eleventh.json())["error"]["message"].startswith(
                "maximum concurrent sessions reached (10/10)."
            )
            for r in [*held, eleventh]:
                r.close()


async def test_request_rate_limit_rest_and_grpc() -> None:
    settings = ApiSettings(rate_limit=RateLimitConfig(requests_per_minute=2))
    async with serve_local_api(
        hmac_secret=SECRET, agent_token=AGENT_TOKEN, settings=settings
    ) as api:
        World(api)
        async with aiohttp.ClientSession() as session:
            url = f"{api.rest_url}/api/v1/allocations"
            for _ in range(2):
                async with session.get(url, headers=bearer("carol")) as r:
                    assert r.status == 200
            async with session.get(url, headers=bearer("carol")) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) == 30
                assert "allows 2 requests per minute" in (await r.json())["error"]["message"]
            # agents (and schedulers) are not limited
            async with session.get(f"{api.rest_url}/api/v1/nodes", headers=_agent()) as r:
                assert r.status == 200
        channel = api.channel()
        try:
            stub = v1.AllocationServiceStub(channel, timeout=10, metadata=bearer("carol"))
            with pytest.raises(grpclib.GRPCError) as e:
                await stub.list(v1.ListAllocationsRequest())
            assert e.value.status.name == "RESOURCE_EXHAUSTED"
            dave = v1.AllocationServiceStub(channel, timeout=10, metadata=bearer("dave"))
            await dave.list(v1.ListAllocationsRequest())
        finally:
            channel.close()


def _agent() -> dict[str, str]:
    return {"authorization": f"Bearer {AGENT_TOKEN}"}


# --- heartbeats ------------------------------------------------------------------------


async def test_heartbeat_replay_rejected_and_counted(served: Any) -> None:
    _api, _w, rest, channel = served
    status, _ = await rest.call("POST", "/api/v1/nodes/register", _agent(), {"node_id": "h1"})
    assert status == 200
    before = HEARTBEATS_REJECTED.labels("replay")._value.get()
    status, out = await rest.call("POST", "/api/v1/nodes/h1/heartbeat", _agent(), {"sequence": 7})
    assert status == 200 and out["accepted"]
    # the same sequence again, and an older one: replays
    for seq in (7, 3):
        status, err = await rest.call(
            "POST", "/api/v1/nodes/h1/heartbeat", _agent(), {"sequence": seq}
        )
        assert status == 409 and err["error"]["code"] == "stale_revision"
        assert f"heartbeat sequence {seq} of node h1 is a replay" in err["error"]["message"]
    stub = v1.NodeServiceStub(channel, timeout=10, metadata=_agent())
    with pytest.raises(grpclib.GRPCError) as e:
        await stub.heartbeat(v1.HeartbeatRequest(node_id="h1", sequence=7))
    assert e.value.status.name == "ABORTED"
    assert HEARTBEATS_REJECTED.labels("replay")._value.get() == before + 3
    # the next number is fine; a re-registered (restarted) agent counts from 1 again
    await stub.heartbeat(v1.HeartbeatRequest(node_id="h1", sequence=8))
    await rest.call("POST", "/api/v1/nodes/register", _agent(), {"node_id": "h1"})
    await stub.heartbeat(v1.HeartbeatRequest(node_id="h1", sequence=1))


async def test_heartbeat_rate_limited_per_node(served: Any) -> None:
    api, _w, rest, _channel = served
    api.ops.nodes.monitor.heartbeat_limit = HeartbeatLimiter(10.0, 2)
    for node in ("h2", "h3"):
        await rest.call("POST", "/api/v1/nodes/register", _agent(), {"node_id": node})
    for seq in (1, 2):
        status, _ = await rest.call(
            "POST", "/api/v1/nodes/h2/heartbeat", _agent(), {"sequence": seq}
        )
        assert status == 200
    status, err = await rest.call("POST", "/api/v1/nodes/h2/heartbeat", _agent(), {"sequence": 3})
    assert status == 429 and "heartbeat rate limit of node h2" in err["error"]["message"]
    status, _ = await rest.call("POST", "/api/v1/nodes/h3/heartbeat", _agent(), {"sequence": 1})
    assert status == 200  # another node is unaffected


async def test_agent_increments_sequence_on_every_heartbeat() -> None:
    """The agent's heartbeat() numbers every heartbeat, failed ones included."""
    import inspect

    from lattice_agent.agent import Agent

    src = inspect.getsource(Agent.heartbeat)
    assert src.index("self.sequence += 1") < src.index("await self._stub().heartbeat(")


# --- rotation --------------------------------------------------------------------------


def _hs256(secret: str, sub: str = "alice") -> dict[str, str]:
    import time

    tok = jwt.encode({"sub": sub, "exp": int(time.time()) + 60}, secret, algorithm="HS256")
    return {"authorization": f"Bearer {tok}"}


async def test_rotated_secrets_reach_the_authenticator(tmp_path: Path) -> None:
    hmac_file = tmp_path / "hmac"
    hmac_file.write_text("first-hmac-secret-0123456789abcdef")
    hmac_file.chmod(0o600)
    token_file = tmp_path / "agent"
    token_file.write_text("first-agent-token")
    token_file.chmod(0o600)
    cfg = load_config(
        None,
        env={
            "LATTICE_OIDC_HMAC_SECRET": f"file://{hmac_file}",
            "LATTICE_AGENT_TOKEN": f"file://{token_file}",
            "LATTICE_SECRETS__REFRESH_INTERVAL_SECONDS": "0.05",
        },
    )
    auth = Authenticator(
        hmac_secret=cfg.api.oidc_hmac_secret.get_secret_value(),
        agent_token=cfg.api.agent_token.get_secret_value(),
    )
    assert auth.authenticate(_hs256("first-hmac-secret-0123456789abcdef")).user == "alice"
    resolver = watch_api_secrets(cfg, auth)
    assert resolver is not None
    try:
        hmac_file.write_text("second-hmac-secret-0123456789abcdef")
        token_file.write_text("second-agent-token")
        for _ in range(200):
            try:
                auth.authenticate(_hs256("second-hmac-secret-0123456789abcdef"))
                break
            except Exception:
                await asyncio.sleep(0.02)
        assert auth.authenticate(_hs256("second-hmac-secret-0123456789abcdef")).user == "alice"
        with pytest.raises(Exception, match="invalid token"):
            auth.authenticate(_hs256("first-hmac-secret-0123456789abcdef"))
        for _ in range(200):
            if auth._agent_token == "second-agent-token":
                break
            await asyncio.sleep(0.02)
        new = auth.authenticate({"authorization": "Bearer second-agent-token"})
        old = auth.authenticate({"authorization": "Bearer first-agent-token"})
        assert new.role == old.role == Role.AGENT  # the previous one until the next rotation
    finally:
        await resolver.stop()
    # nothing to watch: no resolver
    assert watch_api_secrets(load_config(None, env={}), auth) is None


async def test_heartbeats_carrying_completions_are_never_rate_limited() -> None:
    from lattice_api.node_monitor import NodeMonitor
    from lattice_common import commands as c
    from lattice_common.errors import RateLimited
    from lattice_common.types import AllocationReport, NodeCapabilities
    from lattice_quorum.local import LocalQuorum

    q = LocalQuorum()
    await q.propose(c.RegisterNode(node_id="n1", capabilities=NodeCapabilities(), now=1.0))
    mon = NodeMonitor(q, heartbeat_interval=10.0, heartbeat_burst=2)
    seq = 0

    async def beat(reports: list[AllocationReport]) -> None:
        nonlocal seq
        seq += 1
        await mon.heartbeat("n1", seq, reports)

    await beat([])
    await beat([])
    with pytest.raises(RateLimited):
        await beat([])  # liveness only: at most the burst per interval
    done = [AllocationReport(allocation_id="gone", phase="exited", exit_code=0)]
    for _ in range(20):  # each exit is reported at once, however many there are
        await beat(done)
