"""The nodes' uenv caches through the API (lattice_api.ops.cache): the real REST and gRPC
servers over a LocalQuorum, and real agents in process (NodeAgentService with a real
UenvCache each, one directory registry, the agent token required) for n1 (group 3) and
n2; n3's agent accepts connections but never answers. Status and warm answer per node,
an unreachable node included; evict refuses an image in use; warm and evict are for
system administrators."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpclib.server import Server
from lattice_agent.service import NodeAgentService, require_token
from lattice_agent.uenv import UenvCache, UenvRegistry
from lattice_api.auth import Role
from lattice_common.agents import AgentChannels
from lattice_common.proto.lattice import v1
from lattice_sdk import LatticeClient
from lattice_sdk.errors import LatticeError as SdkError
from served_api import AGENT_TOKEN, Grpc, bearer, grpc_error, token

pytestmark = pytest.mark.timeout(60)

ROOT = bearer("root", Role.SYSTEM_ADMIN)
ALICE = bearer("alice")
GOOD, BAD = "prgenv/1.0:v1", "prgenv/1.0:tampered"
DATA = b"squashfs image bytes" * 50
SHA = hashlib.sha256(DATA).hexdigest()


def publish(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "good.sqfs").write_bytes(DATA)
    (root / "bad.sqfs").write_bytes(DATA)
    index = {
        GOOD: {"file": "good.sqfs", "sha256": SHA, "size": len(DATA)},
        BAD: {"file": "bad.sqfs", "sha256": hashlib.sha256(b"other").hexdigest(), "size": 1},
    }
    (root / "index.json").write_text(json.dumps(index))


class Cluster:
    """The API's nodes with their agents: ``caches`` by node id."""

    def __init__(self, api: Any, rest: Any, channel: Any) -> None:
        self.api = api
        self.rest = rest
        self.channel = channel
        self.caches: dict[str, UenvCache] = {}
        self.servers: list[Server] = []
        self.silent: socket.socket | None = None


@pytest.fixture
async def cluster(served: Any, tmp_path: Path) -> AsyncIterator[Cluster]:
    api, _world, rest, channel = served
    publish(tmp_path / "registry")
    c = Cluster(api, rest, channel)
    for node in ("n1", "n2"):
        cache = UenvCache(UenvRegistry(tmp_path / "registry"), tmp_path / node / "uenv", 1 << 30)
        server = Server([NodeAgentService(node, None, tmp_path, uenv=cache)])  # type: ignore[arg-type]
        require_token(server, AGENT_TOKEN)
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        api.add_node(node, agent_address=f"127.0.0.1:{port}", group=3 if node == "n1" else 0)
        c.caches[node] = cache
        c.servers.append(server)
    # n3: an agent that accepts the connection and never answers
    c.silent = socket.socket()
    c.silent.bind(("127.0.0.1", 0))
    c.silent.listen()
    api.add_node("n3", agent_address=f"127.0.0.1:{c.silent.getsockname()[1]}")
    # the server's agent channels carry the agent token, as lattice-server's do
    ops = api.ops.cache
    ops.agents = AgentChannels(AGENT_TOKEN)
    ops.status_timeout = ops.warm_timeout = ops.evict_timeout = 1.0
    yield c
    ops.agents.close()
    for server in c.servers:
        server.close()
        await server.wait_closed()
    c.silent.close()


def by_node(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i["node"]: i for i in items}


async def test_warm_on_nodes_then_status_of_every_node(cluster: Cluster) -> None:
    rest = cluster.rest
    status, out = await rest.call(
        "POST", "/api/v1/cache/warm", ROOT, {"image": GOOD, "nodes": ["n2", "n1"]}
    )
    assert status == 200, out
    assert out["image"] == GOOD
    assert [r["node"] for r in out["results"]] == ["n1", "n2"]
    for r in out["results"]:
        assert r["ok"] and "error" not in r
        assert (r["image"]["ref"], r["image"]["sha256"], r["image"]["size"]) == (
            GOOD,
            SHA,
            len(DATA),
        )
    assert [e.ref for e in cluster.caches["n1"].entries()] == [GOOD]

    status, out = await rest.call("GET", "/api/v1/cache", ALICE)  # any user may look
    assert status == 200, out
    nodes = by_node(out["nodes"])
    assert sorted(nodes) == ["n1", "n2", "n3"]
    for n in ("n1", "n2"):
        assert nodes[n]["ok"] and nodes[n]["enabled"] and nodes[n]["used_bytes"] == len(DATA)
        assert [i["ref"] for i in nodes[n]["images"]] == [GOOD]
        assert nodes[n]["cache_dir"] == str(cluster.caches[n].dir)
    n3 = nodes["n3"]  # reported, not an error for the whole call
    assert not n3["ok"] and n3["error"]["code"] == "unavailable"
    assert "did not answer within 1s" in n3["error"]["message"]
    assert n3["error"]["details"] == {"node": "n3", "cause": "unreachable"}
    assert n3["error"]["hint"]

    status, out = await rest.call("GET", "/api/v1/cache", ALICE, node="n2")
    assert status == 200 and [n["node"] for n in out["nodes"]] == ["n2"]
    status, out = await rest.call("GET", "/api/v1/cache", ALICE, node="n9")
    assert status == 404 and "lattice nodes" in out["error"]["hint"]


async def test_warm_a_group_or_every_node_with_per_node_results(cluster: Cluster) -> None:
    rest = cluster.rest
    status, out = await rest.call("POST", "/api/v1/cache/warm", ROOT, {"image": GOOD, "group": 3})
    assert status == 200 and [(r["node"], r["ok"]) for r in out["results"]] == [("n1", True)]
    assert cluster.caches["n2"].entries() == []

    status, out = await rest.call("POST", "/api/v1/cache/warm", ROOT, {"image": GOOD, "all": True})
    assert status == 200, out
    results = by_node(out["results"])
    assert results["n1"]["ok"] and results["n2"]["ok"]
    assert not results["n3"]["ok"] and results["n3"]["error"]["code"] == "unavailable"

    status, out = await rest.call(
        "POST", "/api/v1/cache/warm", ROOT, {"image": BAD, "nodes": "n1,n2"}
    )
    assert status == 200
    for r in out["results"]:
        assert not r["ok"] and r["error"]["code"] == "invalid_transition"
        assert r["error"]["details"]["cause"] == "hash_mismatch", r
        assert "image hash mismatch" in r["error"]["message"] and r["error"]["hint"]
    status, out = await rest.call(
        "POST", "/api/v1/cache/warm", ROOT, {"image": "prgenv/2.0:v1", "nodes": ["n1"]}
    )
    (r,) = out["results"]
    assert r["error"]["code"] == "not_found" and GOOD in r["error"]["message"]


async def test_warm_needs_an_image_and_one_choice_of_nodes(cluster: Cluster) -> None:
    rest = cluster.rest
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"image": GOOD}, 400, "name the nodes to warm"),
        ({"image": GOOD, "group": 3, "all": True}, 400, "only one of them"),
        ({"image": "", "all": True}, 400, "an image is required"),
        ({"image": "prgenv", "all": True}, 400, "not of the form name/version"),
        ({"image": GOOD, "nodes": ["n1", "n7", "n8"]}, 404, "unknown node(s): n7, n8"),
        ({"image": GOOD, "group": 5}, 404, "no node is in group 5"),
        ({"image": GOOD, "group": "x"}, 400, "group must be a whole number"),
    ]
    for body, code, message in cases:
        status, out = await rest.call("POST", "/api/v1/cache/warm", ROOT, body)
        assert status == code and message in out["error"]["message"], (body, out)
        assert out["error"]["hint"], out
    assert all(c.entries() == [] for c in cluster.caches.values())


async def test_evict_one_node_refused_while_in_use(cluster: Cluster) -> None:
    rest = cluster.rest
    for cache in cluster.caches.values():
        cache.acquire(GOOD, "alloc-1")
    status, out = await rest.call(
        "POST", "/api/v1/cache/evict", ROOT, {"image": GOOD, "node": "n1"}
    )
    assert status == 409, out
    assert out["error"]["message"] == f"image {GOOD} is in use by allocation(s) alloc-1"
    assert out["error"]["details"]["node"] == "n1" and out["error"]["hint"]

    cluster.caches["n1"].release("alloc-1")
    status, out = await rest.call(
        "POST", "/api/v1/cache/evict", ROOT, {"image": GOOD, "node": "n1"}
    )
    assert status == 200, out
    assert out["results"] == [
        {"node": "n1", "ok": True, "image": {**out["results"][0]["image"], "sha256": SHA}}
    ]
    assert cluster.caches["n1"].entries() == [] and len(cluster.caches["n2"].entries()) == 1

    status, out = await rest.call(
        "POST", "/api/v1/cache/evict", ROOT, {"image": GOOD, "node": "n1"}
    )
    assert status == 404 and "not cached on this node" in out["error"]["message"]
    status, out = await rest.call(
        "POST", "/api/v1/cache/evict", ROOT, {"image": GOOD, "node": "n3"}
    )
    assert status == 503 and out["error"]["details"]["cause"] == "unreachable"
    status, out = await rest.call("POST", "/api/v1/cache/evict", ROOT, {"image": GOOD})
    assert status == 400 and "name the node" in out["error"]["message"]


async def test_only_system_admins_warm_and_evict(cluster: Cluster) -> None:
    rest = cluster.rest
    for role in (Role.USER, Role.OPERATOR, Role.TENANT_ADMIN, Role.READ_ONLY):
        for path, body in (
            ("/api/v1/cache/warm", {"image": GOOD, "all": True}),
            ("/api/v1/cache/evict", {"image": GOOD, "node": "n1"}),
        ):
            status, out = await rest.call("POST", path, bearer("eve", role), body)
            assert status == 403 and "cache.admin" in out["error"]["message"], (role, out)
            assert out["error"]["hint"]
        status, _ = await rest.call("GET", "/api/v1/cache", bearer("eve", role), node="n1")
        assert status == 200
    status, _ = await rest.call("GET", "/api/v1/cache", bearer("a", Role.AGENT))
    assert status == 403
    assert all(c.entries() == [] for c in cluster.caches.values())


async def test_grpc_gives_what_rest_gives(cluster: Cluster) -> None:
    g = Grpc(cluster.channel, ROOT)
    warmed = await g.nodes.warm_cache(v1.WarmCacheRequest(image=GOOD, group=3))
    assert [(r.node, r.ok, r.image.ref) for r in warmed.results] == [("n1", True, GOOD)]  # type: ignore[union-attr]
    warmed = await g.nodes.warm_cache(v1.WarmCacheRequest(image=BAD, nodes=["n2"]))
    (r,) = warmed.results
    assert not r.ok and r.error is not None and r.error.details["cause"] == "hash_mismatch"

    got = await g.nodes.cache_status(v1.GetCacheStatusRequest())
    status, data = await cluster.rest.call("GET", "/api/v1/cache", ROOT)
    assert status == 200
    assert [n.node for n in got.nodes] == [n["node"] for n in data["nodes"]] == ["n1", "n2", "n3"]
    for m, d in zip(got.nodes, data["nodes"], strict=True):
        assert m.ok == d["ok"] and [i.ref for i in m.images] == [
            i["ref"] for i in d.get("images", [])
        ]
        if not m.ok:
            assert m.error is not None and m.error.code == d["error"]["code"] == "unavailable"

    evicted = await g.nodes.evict_cache(v1.EvictCacheRequest(image=GOOD, node="n1"))
    assert [(r.node, r.ok, r.image.sha256) for r in evicted.results] == [("n1", True, SHA)]  # type: ignore[union-attr]
    code, err = await grpc_error(g.nodes.evict_cache(v1.EvictCacheRequest(image=GOOD, node="n1")))
    assert code == "NOT_FOUND" and "not cached" in err["message"]
    code, err = await grpc_error(
        Grpc(cluster.channel, ALICE).nodes.warm_cache(v1.WarmCacheRequest(image=GOOD, all=True))
    )
    assert code == "PERMISSION_DENIED" and err["hint"]


async def test_sdk_methods(cluster: Cluster) -> None:
    async with LatticeClient.from_url(
        cluster.api.rest_url, token=token("root", Role.SYSTEM_ADMIN)
    ) as c:
        out = await c.warm_cache(GOOD, nodes=["n1", "n2"])
        assert [r["ok"] for r in out["results"]] == [True, True]
        nodes = await c.cache_status("n2")
        assert [i["ref"] for i in nodes[0]["images"]] == [GOOD]
        out = await c.evict_cache(GOOD, "n2")
        assert out["results"][0]["image"]["ref"] == GOOD
        with pytest.raises(SdkError) as e:
            await c.evict_cache(GOOD, "n2")
        assert e.value.status_code == 404 and e.value.hint
    async with LatticeClient.from_url(cluster.api.rest_url, token=token("alice")) as c:
        with pytest.raises(SdkError) as e:
            await c.warm_cache(GOOD, all=True)
        assert e.value.status_code == 403 and "cache.admin" in str(e.value)
