"""The head agent's cross-node PMI fence: the coordinator and ``NodeAgentService.PmiFence``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import grpclib
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.server import Server
from lattice_agent.pmi import FENCE_TIMEOUT_REASON
from lattice_agent.pmi.fence import (
    DuplicateContribution,
    EpochMismatch,
    FenceAborted,
    FenceCoordinator,
    FenceRegistry,
    FenceTimeout,
    UnknownNode,
)
from lattice_agent.pmi.wire import decode_kvs, encode_kvs
from lattice_agent.service import NodeAgentService
from lattice_common.proto.lattice import v1

# --- FenceCoordinator ---------------------------------------------------------------


async def test_merges_three_nodes_and_answers_every_waiter() -> None:
    c = FenceCoordinator(["n0", "n1", "n2"])
    results = await asyncio.gather(
        c.contribute(0, "n0", {"a": "0"}),
        c.contribute(0, "n1", {"b": "1"}),
        c.contribute(0, "n2", {"c": "2"}),
    )
    assert results == [{"a": "0", "b": "1", "c": "2"}] * 3
    assert c.epoch == 1
    # every waiter gets the same mapping (encoded once for all of them); the
    # coordinator's own key space is separate from it
    assert results[0] is results[1] is results[2]
    results[0]["x"] = "mutated"
    assert "x" not in c.kvs


async def test_waits_until_the_last_node_arrives() -> None:
    c = FenceCoordinator(["n0", "n1"])
    first = asyncio.create_task(c.contribute(0, "n0", {"a": "0"}))
    await asyncio.sleep(0.01)
    assert not first.done()
    assert c.kvs == {}  # nothing is published before the fence completes
    assert await c.contribute(0, "n1", {}) == {"a": "0"}
    assert await first == {"a": "0"}


async def test_each_fence_publishes_its_epochs_keys_and_the_space_stays_cumulative() -> None:
    """A fence answers with what was put for that epoch (each agent's Launch keeps the
    launch's whole space); the coordinator's snapshot is the cumulative space."""
    c = FenceCoordinator(["n0", "n1", "n2"])
    await asyncio.gather(*(c.contribute(0, n, {f"e0-{n}": n}) for n in ("n0", "n1", "n2")))
    second = await asyncio.gather(
        c.contribute(1, "n0", {"e1": "x"}),
        c.contribute(1, "n1", {}),
        c.contribute(1, "n2", {"e0-n2": "overwritten"}),
    )
    assert second == [{"e1": "x", "e0-n2": "overwritten"}] * 3
    assert c.kvs == {"e0-n0": "n0", "e0-n1": "n1", "e0-n2": "overwritten", "e1": "x"}
    assert c.epoch == 2


async def test_single_node_completes_at_once() -> None:
    c = FenceCoordinator(["only"])
    assert await c.contribute(0, "only", {"k": "v"}) == {"k": "v"}


async def test_unknown_node() -> None:
    c = FenceCoordinator(["n0", "n1"])
    with pytest.raises(UnknownNode, match="intruder"):
        await c.contribute(0, "intruder", {"k": "v"})


async def test_duplicate_contribution() -> None:
    c = FenceCoordinator(["n0", "n1"])
    first = asyncio.create_task(c.contribute(0, "n0", {"a": "0"}))
    await asyncio.sleep(0)
    with pytest.raises(DuplicateContribution, match="n0"):
        await c.contribute(0, "n0", {"a": "again"})
    assert await c.contribute(0, "n1", {}) == {"a": "0"}
    assert await first == {"a": "0"}


async def test_wrong_epoch() -> None:
    c = FenceCoordinator(["n0"])
    with pytest.raises(EpochMismatch, match="epoch 1, current is 0"):
        await c.contribute(1, "n0", {})
    await c.contribute(0, "n0", {})
    with pytest.raises(EpochMismatch, match="epoch 0, current is 1"):
        await c.contribute(0, "n0", {})  # a stale (replayed) fence


async def test_first_epoch_is_configurable() -> None:
    c = FenceCoordinator(["n0"], first_epoch=5)
    assert await c.contribute(5, "n0", {"k": "v"}) == {"k": "v"}
    assert c.epoch == 6


async def test_timeout_names_the_missing_nodes_and_is_final() -> None:
    c = FenceCoordinator(["n0", "n1", "n2", "n3"], timeout=0.05)
    waiters = [asyncio.create_task(c.contribute(0, n, {})) for n in ("n0", "n2")]
    results = await asyncio.gather(*waiters, return_exceptions=True)
    for r in results:
        assert isinstance(r, FenceTimeout)
        assert str(r).startswith(FENCE_TIMEOUT_REASON)
        assert "n1" in str(r) and "n3" in str(r)
        assert "n0" not in str(r) and "n2" not in str(r)
        assert r.missing == ["n1", "n3"]
    with pytest.raises(FenceTimeout):  # a latecomer gets the same answer
        await c.contribute(0, "n1", {})


async def test_timeout_counts_per_epoch() -> None:
    c = FenceCoordinator(["n0", "n1"], timeout=0.1)
    for epoch in range(3):  # each epoch well within the timeout, total beyond it
        await asyncio.sleep(0.04)
        await asyncio.gather(c.contribute(epoch, "n0", {}), c.contribute(epoch, "n1", {}))
    await asyncio.sleep(0.15)  # no timer left running between fences
    assert c.failed is None


async def test_abort_fails_every_waiter_and_later_contributions() -> None:
    c = FenceCoordinator(["n0", "n1", "n2"])
    waiters = [asyncio.create_task(c.contribute(0, n, {})) for n in ("n0", "n1")]
    await asyncio.sleep(0)
    c.abort("rank 3 called MPI_Abort")
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, FenceAborted) for r in results)
    assert all("rank 3 called MPI_Abort" in str(r) for r in results)
    with pytest.raises(FenceAborted):
        await c.contribute(0, "n2", {})


async def test_abort_without_waiters() -> None:
    c = FenceCoordinator(["n0"])
    c.abort("cancelled")
    with pytest.raises(FenceAborted, match="cancelled"):
        await c.contribute(0, "n0", {})


async def test_a_cancelled_waiter_does_not_break_the_round() -> None:
    c = FenceCoordinator(["n0", "n1"])
    gone = asyncio.create_task(c.contribute(0, "n0", {"a": "0"}))
    await asyncio.sleep(0)
    gone.cancel()
    assert await c.contribute(0, "n1", {"b": "1"}) == {"a": "0", "b": "1"}


def test_coordinator_needs_nodes() -> None:
    with pytest.raises(ValueError):
        FenceCoordinator([])


def test_registry() -> None:
    reg = FenceRegistry()
    c = FenceCoordinator(["n0"])
    reg.register("alloc", "t0", c)
    assert reg.get("alloc", "t0") is c
    assert reg.get("alloc", "t1") is None
    with pytest.raises(ValueError):
        reg.register("alloc", "t0", FenceCoordinator(["n0"]))
    assert reg.remove("alloc", "t0") is c
    assert reg.remove("alloc", "t0") is None
    assert len(reg) == 0


# --- NodeAgentService.PmiFence over real gRPC ---------------------------------------


@pytest.fixture
async def served(tmp_path: Path) -> Any:
    """The real NodeAgentService on 127.0.0.1:<ephemeral>; yields (registry, port)."""
    registry = FenceRegistry()
    # pmi_fence touches neither the runtime nor the logs
    service = NodeAgentService("head", cast(Any, None), tmp_path, fences=registry)
    server = Server([service])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield registry, port
    finally:
        server.close()
        await server.wait_closed()


def _request(node: str, epoch: int, kvs: dict[str, str], task: str = "t0") -> v1.PmiFenceRequest:
    return v1.PmiFenceRequest(
        allocation_id="alloc", task_id=task, epoch=epoch, node_id=node, kvs_json=encode_kvs(kvs)
    )


async def test_grpc_fence_of_four_concurrent_agents(served: Any) -> None:
    registry, port = served
    nodes = [f"n{i}" for i in range(4)]
    registry.register("alloc", "t0", FenceCoordinator(nodes, timeout=10))
    channels = [Channel("127.0.0.1", port) for _ in nodes]
    try:
        stubs = [v1.NodeAgentServiceStub(ch) for ch in channels]
        for epoch in range(2):
            replies = await asyncio.gather(
                *(
                    stub.pmi_fence(_request(n, epoch, {f"{n}-e{epoch}": f"card-{n}"}))
                    for stub, n in zip(stubs, nodes, strict=True)
                )
            )
            expected = {f"{n}-e{epoch}": f"card-{n}" for n in nodes}  # this epoch's keys
            for reply in replies:
                assert reply.epoch == epoch
                assert decode_kvs(reply.kvs_json) == expected
    finally:
        for ch in channels:
            ch.close()


async def test_grpc_unknown_launch_is_not_found(served: Any) -> None:
    registry, port = served
    registry.register("alloc", "t0", FenceCoordinator(["n0"]))
    ch = Channel("127.0.0.1", port)
    try:
        stub = v1.NodeAgentServiceStub(ch)
        with pytest.raises(grpclib.GRPCError) as err:
            await stub.pmi_fence(_request("n0", 0, {"evil": "1"}, task="nope"))
        assert err.value.status == Status.NOT_FOUND
        assert "nope" in (err.value.message or "")
        assert registry.get("alloc", "t0").kvs == {}
    finally:
        ch.close()


async def test_grpc_errors_map_to_status_codes(served: Any) -> None:
    registry, port = served
    registry.register("alloc", "t0", FenceCoordinator(["n0", "n1"], timeout=0.1))
    registry.register("alloc", "t1", FenceCoordinator(["n0", "n1"]))
    ch = Channel("127.0.0.1", port)
    try:
        stub = v1.NodeAgentServiceStub(ch)

        async def status_of(req: v1.PmiFenceRequest) -> Status:
            with pytest.raises(grpclib.GRPCError) as err:
                await stub.pmi_fence(req)
            return err.value.status

        assert await status_of(_request("stranger", 0, {}, task="t1")) == Status.INVALID_ARGUMENT
        assert await status_of(_request("n0", 7, {}, task="t1")) == Status.FAILED_PRECONDITION
        assert await status_of(_request("n0", 0, {})) == Status.DEADLINE_EXCEEDED
        waiter = asyncio.create_task(status_of(_request("n0", 0, {}, task="t1")))
        await asyncio.sleep(0.05)
        assert await status_of(_request("n0", 0, {}, task="t1")) == Status.FAILED_PRECONDITION
        registry.get("alloc", "t1").abort("job cancelled")
        assert await waiter == Status.ABORTED
    finally:
        ch.close()


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"k": 1}', b"\xff\xfe"])
async def test_grpc_malformed_keys_are_refused_and_nothing_is_stored(
    served: Any, raw: bytes
) -> None:
    registry, port = served
    registry.register("alloc", "t0", FenceCoordinator(["n0", "n1"]))
    ch = Channel("127.0.0.1", port)
    try:
        req = v1.PmiFenceRequest(
            allocation_id="alloc", task_id="t0", epoch=0, node_id="n0", kvs_json=raw
        )
        with pytest.raises(grpclib.GRPCError) as err:
            await v1.NodeAgentServiceStub(ch).pmi_fence(req)
        assert err.value.status == Status.INVALID_ARGUMENT
        coordinator = registry.get("alloc", "t0")
        assert coordinator.kvs == {} and coordinator.epoch == 0
    finally:
        ch.close()
