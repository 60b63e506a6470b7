"""``lattice cache status|warm|evict`` against the real API (the ``api`` fixture, in a
thread) and real agents in process (NodeAgentService with a real UenvCache each, one
directory registry, in a thread of their own): the tables and per-node results users
see, the requests sent, errors with a Hint, and a non-admin refused by a secured server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from grpclib.server import Server
from lattice_agent.service import NodeAgentService
from lattice_agent.uenv import UenvCache, UenvRegistry
from lattice_cli.commands.cache import results_text, size_text, status_text
from lattice_cli.main import app, load_commands
from lattice_test_harness.local_api import ThreadedLocalApi
from typer.testing import CliRunner

load_commands()

GOOD, BAD = "prgenv/1.0:v1", "prgenv/1.0:tampered"
DATA = b"x" * 4096
SHA = hashlib.sha256(DATA).hexdigest()


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


class Agents:
    """NodeAgentService for each node on 127.0.0.1, in a thread with its own loop."""

    def __init__(self, tmp: Path, nodes: list[str]) -> None:
        reg = tmp / "registry"
        reg.mkdir()
        (reg / "good.sqfs").write_bytes(DATA)
        index = {
            GOOD: {"file": "good.sqfs", "sha256": SHA, "size": len(DATA)},
            BAD: {"file": "good.sqfs", "sha256": "0" * 64, "size": len(DATA)},
        }
        (reg / "index.json").write_text(json.dumps(index))
        self.caches = {n: UenvCache(UenvRegistry(reg), tmp / n / "uenv", 1 << 30) for n in nodes}
        self.addresses: dict[str, str] = {}
        self.loop = asyncio.new_event_loop()
        self.servers: list[Server] = []
        started = threading.Event()

        async def start() -> None:
            for node, cache in self.caches.items():
                server = Server([NodeAgentService(node, None, tmp, uenv=cache)])  # type: ignore[arg-type]
                await server.start("127.0.0.1", 0)
                port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                self.addresses[node] = f"127.0.0.1:{port}"
                self.servers.append(server)

        def main() -> None:
            self.loop.run_until_complete(start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, name="agents", daemon=True)
        self.thread.start()
        assert started.wait(10)

    def stop(self) -> None:
        async def close() -> None:
            for s in self.servers:
                s.close()
                await s.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def agents(api, tmp_path: Path) -> Iterator[Agents]:  # type: ignore[no-untyped-def]
    a = Agents(tmp_path, ["x1000c0s0b0n0", "x1000c0s0b0n1"])
    api.nodes("x1000c0s0b0n0", agent_address=a.addresses["x1000c0s0b0n0"], group=3)
    api.nodes("x1000c0s0b0n1", agent_address=a.addresses["x1000c0s0b0n1"], group=3)
    yield a
    a.stop()


def test_warm_status_evict(api, agents: Agents) -> None:  # type: ignore[no-untyped-def]
    r = run("cache", "warm", f"--image={GOOD}", "--nodes=x1000c0s0b0n0,x1000c0s0b0n1")
    assert r.exit_code == 0, r.stderr
    assert api.last("POST")["json"] == {
        "image": GOOD,
        "nodes": ["x1000c0s0b0n0", "x1000c0s0b0n1"],
    }
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NODE", "RESULT"]
    assert lines[1].split()[:3] == ["x1000c0s0b0n0", "cached", GOOD]
    assert f"(sha256 {SHA[:12]}, 4.0 KiB)" in lines[1] and len(lines) == 3

    table = run("cache", "status").stdout.splitlines()
    assert table[0].split() == ["NODE", "IMAGE", "SIZE", "LAST", "USED", "IN", "USE"]
    assert [ln.split()[:4] for ln in table[1:]] == [
        ["x1000c0s0b0n0", GOOD, "4.0", "KiB"],
        ["x1000c0s0b0n1", GOOD, "4.0", "KiB"],
    ]
    assert all(ln.split()[-1] == "no" for ln in table[1:])

    agents.caches["x1000c0s0b0n0"].acquire(GOOD, "a1b2c3")
    data = json.loads(run("cache", "status", "--node", "x1000c0s0b0n0", "-o", "json").stdout)
    assert api.last()["query"] == {"node": "x1000c0s0b0n0"}
    assert [(n["node"], [(i["ref"], i["in_use"]) for i in n["images"]]) for n in data] == [
        ("x1000c0s0b0n0", [(GOOD, True)])
    ]
    refused = run("cache", "evict", f"--image={GOOD}", "--node=x1000c0s0b0n0")
    assert refused.exit_code == 1
    assert refused.stderr.startswith(f"Error: image {GOOD} is in use by allocation(s) a1b2c3")
    assert "Hint: " in refused.stderr

    r = run("cache", "evict", f"--image={GOOD}", "--node=x1000c0s0b0n1")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"Evicted {GOOD} (4.0 KiB) from x1000c0s0b0n1"
    assert api.last("POST")["json"] == {"image": GOOD, "node": "x1000c0s0b0n1"}
    again = run("cache", "evict", f"--image={GOOD}", "--node=x1000c0s0b0n1")
    assert again.exit_code == 1 and "is not cached on this node" in again.stderr
    assert "Hint: See what each node caches with `lattice cache status`." in again.stderr


def test_warm_a_group_with_a_failing_node_exits_1(api, agents: Agents) -> None:  # type: ignore[no-untyped-def]
    api.nodes("x1000c0s1b0n0", group=3)  # registered, but no agent answers for it
    r = run("cache", "warm", f"--image={GOOD}", "--group=3")
    assert api.last("POST")["json"] == {"image": GOOD, "group": 3}
    assert r.exit_code == 1
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert "cached" in rows["x1000c0s0b0n0"] and "cached" in rows["x1000c0s0b0n1"]
    assert "FAILED: node x1000c0s1b0n0 has no agent address" in rows["x1000c0s1b0n0"]
    assert r.stderr.startswith(f"Error: {GOOD} was not warmed on 1 of 3 node(s)")
    assert "Hint: Check the node with `lattice nodes`" in r.stderr

    r = run("cache", "warm", f"--image={BAD}", "--nodes=x1000c0s0b0n0", "-o", "json")
    assert r.exit_code == 1
    (result,) = json.loads(r.stdout)["results"]
    assert result["error"]["details"]["cause"] == "hash_mismatch"

    status = run("cache", "status").stdout
    assert "\nnode x1000c0s1b0n0 has no agent address (its agent never registered)" in status
    single = run("cache", "status", "--node=x1000c0s1b0n0")
    assert single.exit_code == 1 and single.stderr.startswith("Error: node x1000c0s1b0n0 has")
    assert "Hint: " in single.stderr


def test_usage_errors_have_a_hint(api) -> None:  # type: ignore[no-untyped-def]
    for args in (
        ("cache", "warm", f"--image={GOOD}"),
        ("cache", "warm", f"--image={GOOD}", "--all", "--group=1"),
    ):
        r = run(*args)
        assert r.exit_code == 2
        assert r.stderr.startswith("Error: name the nodes to warm") and "Hint: " in r.stderr
    assert not api.sent("POST")
    r = run("cache", "warm", "--image=prgenv", "--all")
    assert r.exit_code == 1 and "not of the form name/version" in r.stderr
    assert "Hint: An image is a uenv NAME/VERSION[:TAG]" in r.stderr
    r = run("cache", "warm", f"--image={GOOD}", "--nodes=nope")
    assert r.exit_code == 1 and "Error: unknown node(s): nope" in r.stderr
    assert run("cache", "evict", f"--image={GOOD}").exit_code == 2  # --node is required


def test_help_on_every_command() -> None:
    top = run("cache", "--help")
    assert top.exit_code == 0 and "uenv image caches on the nodes" in top.stdout
    for word in ("status", "warm", "evict"):
        assert word in top.stdout
    assert "Show the uenv images cached" in run("cache", "status", "--help").stdout
    warm = run("cache", "warm", "--help").stdout
    assert "Pre-fetch a uenv image" in warm
    assert all(f in warm for f in ("--image", "--nodes", "--group", "--all"))
    assert "Remove a uenv image from one node" in run("cache", "evict", "--help").stdout


def test_a_user_without_the_admin_role_is_refused(  # type: ignore[no-untyped-def]
    clean_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "cache-cli-test-secret-long-enough!!"
    with ThreadedLocalApi(hmac_secret=secret) as server:
        server.add_node("n1")
        monkeypatch.setenv("LATTICE_ENDPOINT", server.rest_url)
        claims = {"sub": "alice", "exp": int(time.time()) + 600}
        monkeypatch.setenv("LATTICE_TOKEN", jwt.encode(claims, secret, algorithm="HS256"))
        for args in (
            ("cache", "warm", f"--image={GOOD}", "--all"),
            ("cache", "evict", f"--image={GOOD}", "--node=n1"),
        ):
            r = run(*args)
            assert r.exit_code == 1
            assert r.stderr.startswith("Error: alice (user) may not perform cache.admin")
            assert "Hint: " in r.stderr
        r = run("cache", "status", "-o", "json")  # reading is for everyone
        assert r.exit_code == 0 and json.loads(r.stdout)[0]["node"] == "n1"


def test_renderers() -> None:
    now = time.time()
    nodes: list[dict[str, Any]] = [
        {"node": "a", "ok": True, "enabled": False, "images": []},
        {"node": "b", "ok": False, "error": {"message": "did not answer within 5s"}},
        {
            "node": "c",
            "ok": True,
            "enabled": True,
            "used_bytes": 3 << 30,
            "max_bytes": 100 << 30,
            "images": [
                {"ref": GOOD, "sha256": SHA, "size": 3 << 30, "last_access": now, "in_use": True}
            ],
        },
    ]
    text = status_text(nodes, now, wide=True)
    rows = text.splitlines()
    assert rows[0].split()[-2:] == ["SHA256", "CACHE"]
    assert rows[1].split()[:2] == ["a", "(uenv"]
    assert rows[2].split()[:4] == ["c", GOOD, "3.0", "GiB"]
    assert rows[2].split()[-5:] == ["yes", SHA[:12], "3.0", "GiB/100.0", "GiB"]
    assert text.endswith("\n\nnode b: did not answer within 5s")
    assert status_text([], now) == "No nodes."
    assert size_text(512) == "512 B" and size_text(5 << 40) == "5.0 TiB" and size_text(None) == "-"
    out = {"image": GOOD, "results": [{"node": "a", "ok": False, "error": {"message": "boom"}}]}
    assert results_text(out, "cached").splitlines()[1].split() == ["a", "FAILED:", "boom"]
