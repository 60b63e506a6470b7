"""Attach in the API: refusals before anything streams (not the owner, not Running,
the per-user limit) over REST (the WebSocket route answers them as HTTP errors) and
gRPC, and the proxy to a real agent's AttachManager over both transports."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpclib
import pytest
from grpclib.server import Server
from lattice_agent.attach import AttachManager
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.service import NodeAgentService
from lattice_api.auth import Role
from lattice_api.ops.attach import limit_message
from lattice_common.proto.lattice import v1
from lattice_quorum import queries
from lattice_sdk import LatticeClient
from lattice_sdk.errors import LatticeError as SdkError
from served_api import SECRET, bearer, token

pytestmark = pytest.mark.timeout(60)
PATH = "/api/v1/allocations/{}/attach"


async def test_rest_refusals_are_http_errors(served) -> None:  # type: ignore[no-untyped-def]
    _, world, rest, _ = served
    # another user's allocation is not even there for alice (ids cannot be probed) ...
    status, res = await rest.call("GET", PATH.format(world.bob_running), bearer("alice"))
    assert status == 404 and "not found" in res["error"]["message"]
    # ... and an administrator, who can read it, still may not attach to it
    root = bearer("root", Role.SYSTEM_ADMIN)
    status, res = await rest.call("GET", PATH.format(world.bob_running), root)
    assert status == 403 and "only its owner may attach" in res["error"]["message"]
    assert res["error"]["hint"]
    status, res = await rest.call("GET", PATH.format(world.alice_pending), bearer("alice"))
    assert status == 409 and "is Pending, not Running" in res["error"]["message"]
    status, res = await rest.call("GET", PATH.format(world.alice_done), bearer("alice"))
    assert status == 409 and "Completed, not Running" in res["error"]["message"]
    status, res = await rest.call("GET", PATH.format("nope"), bearer("alice"))
    assert status == 404
    status, res = await rest.call("GET", PATH.format(world.bob_running), bearer("bob"), node="n9")
    assert status == 400 and "not one of allocation" in res["error"]["message"]
    status, _ = await rest.call("GET", PATH.format(world.bob_running), bearer("r", Role.READ_ONLY))
    assert status == 403


async def test_sdk_gets_typed_refusals_from_the_websocket(served) -> None:  # type: ignore[no-untyped-def]
    api, world, _, _ = served
    client = LatticeClient.from_url(api.rest_url, token=token("alice"))
    async with client:
        with pytest.raises(SdkError) as e:
            await client.attach(world.bob_running)
        assert e.value.status_code == 404 and "not found" in str(e.value)
        with pytest.raises(SdkError) as e:
            await client.attach(world.alice_pending)
        assert e.value.status_code == 409 and "not Running" in str(e.value)


async def test_grpc_refusal(served) -> None:  # type: ignore[no-untyped-def]
    _, world, _, channel = served
    stub = v1.AllocationServiceStub(channel, timeout=10, metadata=bearer("alice"))
    with pytest.raises(grpclib.GRPCError) as e:
        async for _ in stub.attach(
            [v1.AttachInput(start=v1.AttachStart(allocation_id=world.bob_running, tty=True))]
        ):
            pass
    assert e.value.status.name == "NOT_FOUND"  # another user's: as if it did not exist
    assert "not found" in json.loads(e.value.message or "{}")["message"]


async def test_per_user_limit_message(served) -> None:  # type: ignore[no-untyped-def]
    api, world, rest, _ = served
    api.ops.attach._per_user["bob"] = 5
    try:
        status, res = await rest.call("GET", PATH.format(world.bob_running), bearer("bob"))
    finally:
        del api.ops.attach._per_user["bob"]
    assert status == 429
    assert res["error"]["message"] == limit_message(5)
    assert res["error"]["message"] == (
        "maximum concurrent sessions reached (5/5). Close an existing session to open a new one."
    )


@pytest.fixture
async def agent(served, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real agent service for node n1 with an AttachManager; n1 re-registered at it."""
    api, world, _, _ = served
    alloc = api.quorum.read(queries.allocation, world.bob_running)
    mgr = AttachManager(
        "n1", allocation={alloc.id: alloc}.get, work_dir=tmp_path, log_dir=tmp_path, hup_grace=0.3
    )
    runtime = ProcessRuntime(
        node_id="n1", work_dir=tmp_path, log_dir=tmp_path, state_file=tmp_path / "state.json"
    )
    server = Server([NodeAgentService("n1", runtime, tmp_path, attaches=mgr)])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    api.add_node("n1", agent_address=f"127.0.0.1:{port}", group=3)
    yield mgr
    await mgr.close()
    server.close()
    await server.wait_closed()


async def test_sdk_attach_through_the_api(served, agent) -> None:  # type: ignore[no-untyped-def]
    api, world, _, _ = served
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as client:
        term = await client.attach(world.bob_running, command=["/bin/sh"], rows=30, cols=90)
        async with term:
            assert term.node_id == "n1"
            assert api.ops.attach.active("bob") == 1
            await term.send(b"stty size; echo M$((1+1)); exit 4\n")
            out = b"".join([c async for c in term])
        assert b"30 90" in out and b"M2" in out and term.exit_code == 4
    await asyncio.sleep(0.2)
    assert api.ops.attach.active("bob") == 0
    await agent.idle()
    assert not agent.sessions


async def test_grpc_attach_through_the_api(served, agent) -> None:  # type: ignore[no-untyped-def]
    _, world, _, channel = served
    stub = v1.AllocationServiceStub(channel, timeout=20, metadata=bearer("bob"))
    start = v1.AttachStart(
        allocation_id=world.bob_running, command=["sh", "-c", "cat; exit 6"], tty=False
    )
    msgs = [
        v1.AttachInput(start=start),
        v1.AttachInput(stdin=b"piped\n"),
        v1.AttachInput(close_stdin=True),
    ]
    outs = [o async for o in stub.attach(msgs)]
    assert outs[0].stdout == b""
    assert b"".join(o.stdout or b"" for o in outs) == b"piped\n"
    assert outs[-1].exit_code == 6


async def test_closing_the_websocket_hangs_up(served, agent) -> None:  # type: ignore[no-untyped-def]
    api, world, _, _ = served
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as client:
        term = await client.attach(world.bob_running, command=["sleep", "300"])
        assert len(agent.sessions) == 1
        (s,) = agent.sessions
        await term.close()
    await agent.idle()
    assert not agent.sessions
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(s.pid, 0)
    assert SECRET
