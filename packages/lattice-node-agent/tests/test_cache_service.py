"""``lattice cache`` on the agent: NodeAgentService.CacheStatus/CacheWarm/CacheEvict over
real gRPC (with the agent token) on a real UenvCache in front of a directory registry,
and ``UenvCache.remove`` (evict by ref, untagged ref or sha256; never a pinned image)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpclib
import pytest
from grpclib.client import Channel
from grpclib.server import Server
from lattice_agent.service import NodeAgentService, require_token
from lattice_agent.uenv import UenvCache, UenvInUse, UenvNotFound
from lattice_common.proto.lattice import v1
from lattice_common.rpc import auth_metadata
from test_uenv import make_cache

pytestmark = pytest.mark.timeout(30)

TOKEN = "cache-agent-token-0123456789"
IMAGES = {"prgenv/1.0:v1": b"A" * 1000, "prgenv/1.0:bad": b"B" * 10, "tools/2:v1": b"T" * 50}


class Agent:
    """A NodeAgentService for node n1 with a cache, on 127.0.0.1:<ephemeral>."""

    def __init__(self, cache: UenvCache | None, tmp: Path) -> None:
        self.cache = cache
        self.server = Server([NodeAgentService("n1", cast(Any, None), tmp, uenv=cache)])
        require_token(self.server, TOKEN)
        self.channel: Channel | None = None

    async def start(self) -> v1.NodeAgentServiceStub:
        await self.server.start("127.0.0.1", 0)
        port = self.server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.channel = Channel("127.0.0.1", port)
        return self.stub()

    def stub(self, token: str | None = TOKEN) -> v1.NodeAgentServiceStub:
        assert self.channel is not None
        return v1.NodeAgentServiceStub(self.channel, timeout=10, metadata=auth_metadata(token))

    async def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    cache = make_cache(tmp_path, IMAGES, bad_hash={"prgenv/1.0:bad"})
    a = Agent(cache, tmp_path)
    await a.start()
    yield a
    await a.stop()


async def refused(call: Any) -> tuple[str, dict[str, Any]]:
    with pytest.raises(grpclib.GRPCError) as e:
        await call
    return e.value.status.name, json.loads(e.value.message or "{}")


async def test_warm_then_status_then_evict(agent: Agent) -> None:
    stub = agent.stub()
    st = await stub.cache_status(v1.CacheStatusRequest())
    assert (st.node, st.ok, st.enabled, st.used_bytes, st.images) == ("n1", True, True, 0, [])
    assert st.cache_dir == str(agent.cache.dir) and st.max_bytes == 1 << 30  # type: ignore[union-attr]

    img = await stub.cache_warm(v1.CacheImageRequest(ref="prgenv/1.0:v1"))
    assert img.ref == "prgenv/1.0:v1" and img.size == 1000 and not img.in_use
    assert img.sha256 == hashlib.sha256(IMAGES["prgenv/1.0:v1"]).hexdigest()
    again = await stub.cache_warm(v1.CacheImageRequest(ref="prgenv/1.0:v1"))  # a hit
    assert again.sha256 == img.sha256 and again.last_access > img.last_access
    tools = await stub.cache_warm(v1.CacheImageRequest(ref="tools/2"))  # its only tag
    assert tools.ref == "tools/2:v1"

    st = await stub.cache_status(v1.CacheStatusRequest())
    assert [i.ref for i in st.images] == ["tools/2:v1", "prgenv/1.0:v1"]  # most recent first
    assert st.used_bytes == 1050

    out = await stub.cache_evict(v1.CacheImageRequest(ref="prgenv/1.0:v1"))
    assert [(i.ref, i.sha256) for i in out.removed] == [("prgenv/1.0:v1", img.sha256)]
    st = await stub.cache_status(v1.CacheStatusRequest())
    assert [i.ref for i in st.images] == ["tools/2:v1"] and st.used_bytes == 50


async def test_warm_refusals_are_typed_with_their_cause(agent: Agent) -> None:
    stub = agent.stub()
    status, err = await refused(stub.cache_warm(v1.CacheImageRequest(ref="prgenv/9:v1")))
    assert status == "NOT_FOUND" and err["code"] == "not_found"
    assert err["details"]["cause"] == "not_found" and err["details"]["node"] == "n1"
    assert "prgenv/1.0:v1" in err["message"]  # the available versions are named

    status, err = await refused(stub.cache_warm(v1.CacheImageRequest(ref="prgenv/1.0:bad")))
    assert status == "FAILED_PRECONDITION" and err["details"]["cause"] == "hash_mismatch"
    assert "image hash mismatch" in err["message"] and err["hint"]
    assert agent.cache.entries() == []  # type: ignore[union-attr]  # nothing unverified kept

    status, err = await refused(stub.cache_warm(v1.CacheImageRequest(ref="no-version")))
    assert status == "NOT_FOUND" and "name/version" in err["message"]


async def test_evict_refuses_an_image_in_use_and_one_not_cached(agent: Agent) -> None:
    stub = agent.stub()
    cache = agent.cache
    assert cache is not None
    cache.acquire("prgenv/1.0:v1", "alloc-7")
    status, err = await refused(stub.cache_evict(v1.CacheImageRequest(ref="prgenv/1.0:v1")))
    assert status == "FAILED_PRECONDITION"
    assert err["message"] == "image prgenv/1.0:v1 is in use by allocation(s) alloc-7"
    assert err["details"]["cause"] == "in_use" and err["hint"]
    st = await stub.cache_status(v1.CacheStatusRequest())
    assert [(i.ref, i.in_use) for i in st.images] == [("prgenv/1.0:v1", True)]

    cache.release("alloc-7")
    out = await stub.cache_evict(v1.CacheImageRequest(ref="prgenv/1.0:v1"))
    assert len(out.removed) == 1
    status, err = await refused(stub.cache_evict(v1.CacheImageRequest(ref="prgenv/1.0:v1")))
    assert status == "NOT_FOUND" and "not cached on this node" in err["message"]
    assert "lattice cache status" in err["hint"]


async def test_calls_without_the_agent_token_are_refused(agent: Agent) -> None:
    for call in (
        agent.stub(None).cache_status(v1.CacheStatusRequest()),
        agent.stub("wrong").cache_warm(v1.CacheImageRequest(ref="prgenv/1.0:v1")),
        agent.stub(None).cache_evict(v1.CacheImageRequest(ref="prgenv/1.0:v1")),
    ):
        status, _ = await refused(call)
        assert status == "UNAUTHENTICATED"
    assert agent.cache.entries() == []  # type: ignore[union-attr]


async def test_a_node_without_uenv(tmp_path: Path) -> None:
    for cache in (None, UenvCache(None, tmp_path / "cache", 100)):
        a = Agent(cache, tmp_path)
        stub = await a.start()
        try:
            st = await stub.cache_status(v1.CacheStatusRequest())
            assert st.ok and not st.enabled and st.images == []
            status, err = await refused(stub.cache_warm(v1.CacheImageRequest(ref="a/1:v1")))
            assert status == "FAILED_PRECONDITION" and err["details"]["cause"] == "uenv_disabled"
            assert "uenv_registry" in err["hint"] or "uenv_registry" in err["message"]
        finally:
            await a.stop()


# ---------------------------------------------------------------------- UenvCache.remove


def test_remove_by_ref_untagged_ref_or_sha256(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"a/1:v1": b"one", "a/1:v2": b"two", "b/2:x": b"bee"})
    for ref in ("a/1:v1", "a/1:v2", "b/2:x"):
        cache.fetch(ref)
    with pytest.raises(UenvNotFound, match=r"several tags are cached \(a/1:v1, a/1:v2\)"):
        cache.remove("a/1")
    assert [e.ref for e in cache.remove(hashlib.sha256(b"two").hexdigest())] == ["a/1:v2"]
    assert [e.ref for e in cache.remove("a/1")] == ["a/1:v1"]  # now the only tag
    assert [e.ref for e in cache.entries()] == ["b/2:x"]
    assert [p.read_text().strip() for p in cache.dir.glob("*.ref")] == ["b/2:x"]
    with pytest.raises(UenvNotFound, match=r"not cached on this node \(cached: b/2:x\)"):
        cache.remove("a/1:v1")


def test_remove_never_removes_a_pinned_image(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"a/1:v1": b"one"})
    path = cache.acquire("a/1:v1", "job-2")
    cache.acquire("a/1:v1", "job-1")
    with pytest.raises(UenvInUse) as e:
        cache.remove("a/1:v1")
    assert e.value.allocations == ("job-1", "job-2") and path.is_file()
    cache.release("job-1")
    cache.release("job-2")
    assert [x.path for x in cache.remove("a/1:v1")] == [path] and not path.exists()
