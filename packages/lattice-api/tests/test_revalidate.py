"""Long streams end when their token stops validating (spec: OIDC token refresh for
long-lived streams): a watch opened with a token that expires is cut at the next check,
over gRPC (UNAUTHENTICATED naming the reason) and REST (the connection closes); a
stream with a valid token, or the agent token, keeps going."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import grpclib
import jwt
import pytest
from grpclib.const import Status
from lattice_api.settings import ApiSettings
from lattice_common.proto.lattice import v1
from lattice_test_harness.local_api import serve_local_api
from served_api import AGENT_TOKEN, SECRET, World

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.3


def short_token(user: str, seconds: float) -> str:
    claims = {"sub": user, "exp": int(time.time() + seconds)}
    return jwt.encode(claims, SECRET, algorithm="HS256")


@pytest.fixture
async def api() -> Any:
    settings = ApiSettings(token_revalidation_interval=INTERVAL)
    async with serve_local_api(hmac_secret=SECRET, agent_token=AGENT_TOKEN, settings=settings) as a:
        yield a, World(a)


async def _grpc_watch(api: Any, alloc_id: str, token: str, hold: float) -> Any:
    """Watch until the stream ends (its error) or ``hold`` seconds pass (None)."""
    channel = api.channel()
    stub = v1.AllocationServiceStub(channel, metadata={"authorization": f"Bearer {token}"})
    try:
        async with asyncio.timeout(hold):
            async for _ in stub.watch(v1.WatchAllocationsRequest(id=alloc_id)):
                pass
    except TimeoutError:
        return None
    except grpclib.GRPCError as e:
        return e
    finally:
        channel.close()
    return "ended"


async def test_a_grpc_stream_ends_when_its_token_expires(api: Any) -> None:
    served, world = api
    t0 = time.monotonic()
    err = await _grpc_watch(served, world.bob_running, short_token("bob", 1.5), hold=10)
    assert isinstance(err, grpclib.GRPCError), err
    assert err.status == Status.UNAUTHENTICATED
    assert "no longer valid" in (err.message or "") and "expired" in (err.message or "")
    assert 0.3 < time.monotonic() - t0 < 5  # exp is whole seconds: 0.5..1.5 s away


async def test_streams_with_valid_tokens_or_the_agent_token_keep_going(api: Any) -> None:
    served, world = api
    long = short_token("bob", 600)
    got = await asyncio.gather(
        _grpc_watch(served, world.bob_running, long, hold=2.0),
        _grpc_watch(served, world.bob_running, AGENT_TOKEN, hold=2.0),
    )
    assert got == [None, None]  # both still open when the test let go


async def test_a_rest_stream_is_cut_when_its_token_expires(api: Any) -> None:
    served, world = api
    url = f"{served.rest_url}/api/v1/allocations/{world.bob_running}/watch"

    async def watch(token: str, hold: float) -> str:
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as s:
            try:
                async with asyncio.timeout(hold), s.get(url, headers=headers) as r:
                    assert r.status == 200
                    async for _ in r.content:
                        pass
            except TimeoutError:
                return "open"
            except aiohttp.ClientError:
                return "cut"
        return "cut"

    short, long = await asyncio.gather(
        watch(short_token("bob", 1.5), 8), watch(short_token("bob", 600), 3)
    )
    assert (short, long) == ("cut", "open")
    # reconnecting with the expired token is refused with the reason
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {short_token('bob', -5)}"}
        async with s.get(url, headers=headers) as r:
            assert r.status == 401
