"""Task launches in the API: the rank layout (examples and properties), how the
launch's end is worked out from each node's end, and LaunchTasks' refusals over
both transports (nothing is sent to an agent when the request is refused)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_api.auth import Role
from lattice_api.layout import MAX_TASKS_PER_NODE, rank_layout
from lattice_api.ops.launches import merge_done
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from served_api import Grpc, bearer, grpc_error

NODES = [f"n{i}" for i in range(8)]


@pytest.mark.parametrize(
    ("nodes", "n", "k", "want"),
    [
        (2, 0, 0, [1, 1]),  # one per node
        (2, 0, 2, [2, 2]),  # K everywhere
        (2, 4, 2, [2, 2]),  # node i: ranks [i*K, (i+1)*K)
        (3, 5, 2, [2, 2, 1]),  # the last node takes the rest
        (4, 3, 2, [2, 1]),  # fewer nodes than the allocation has
        (3, 7, 0, [3, 2, 2]),  # spread: the first nodes one more
        (4, 2, 0, [1, 1]),  # fewer tasks than nodes
    ],
)
def test_layout_examples(nodes: int, n: int, k: int, want: list[int]) -> None:
    assert rank_layout(NODES[:nodes], n, k) == want


@pytest.mark.parametrize(
    ("n", "k", "text"),
    [
        (5, 2, "5 tasks at 2 per node need 3 nodes; the launch has 2"),
        (-1, 0, "must not be negative"),
        (0, MAX_TASKS_PER_NODE + 1, "more than"),
    ],
)
def test_layout_refusals(n: int, k: int, text: str) -> None:
    with pytest.raises(ValidationError, match=text) as e:
        rank_layout(NODES[:2], n, k)
    assert e.value.hint


@given(
    nodes=st.integers(1, 64),
    n=st.integers(0, 2000),
    k=st.integers(0, 64),
)
def test_layout_properties(nodes: int, n: int, k: int) -> None:
    try:
        layout = rank_layout(NODES * 8 + [f"m{i}" for i in range(nodes)], n, k)
    except ValidationError:
        return
    assert layout and all(x >= 1 for x in layout)
    if n:
        assert sum(layout) == n
    if k:
        assert all(x == k for x in layout[:-1]) and layout[-1] <= k
    if n and not k:
        assert max(layout) - min(layout) <= 1


def _done(status: int, codes: dict[int, int], **kw: object) -> v1.LaunchDone:
    return v1.LaunchDone(exit_status=status, rank_exit_codes=codes, failed_rank=-1, **kw)  # type: ignore[arg-type]


def test_end_of_a_clean_launch() -> None:
    done = merge_done(["a", "b"], {"a": _done(0, {0: 0, 1: 0}), "b": _done(0, {2: 0})}, {})
    assert done.exit_status == 0 and not done.aborted and done.rank_exit_codes == {0: 0, 1: 0, 2: 0}


def test_end_names_the_first_failed_rank() -> None:
    done = merge_done(["a", "b"], {"a": _done(0, {0: 0}), "b": _done(3, {1: 3, 2: 4})}, {})
    assert (done.exit_status, done.failed_rank, done.failed_node) == (3, 1, "b")
    assert done.reason == "rank 1 exited with code 3"


def test_end_of_an_abort_is_the_origin_nodes() -> None:
    origin = _done(7, {2: 7, 3: 137}, aborted=True, reason="rank 2: boom", failed_node="b")
    spread = _done(7, {0: 137, 1: 137}, aborted=True, reason="rank 2: boom", failed_node="b")
    done = merge_done(["a", "b"], {"a": spread, "b": origin}, {})
    assert done.aborted and done.exit_status == 7 and done.failed_node == "b"
    assert done.rank_exit_codes == {0: 137, 1: 137, 2: 7, 3: 137}


def test_end_with_a_lost_node() -> None:
    done = merge_done(["a", "b"], {"a": _done(0, {0: 0})}, {"b": "its agent is unreachable"})
    assert done.aborted and done.exit_status == 1 and done.failed_node == "b"
    assert done.reason == "node b lost: its agent is unreachable"


async def test_launch_refusals_over_rest(served) -> None:  # type: ignore[no-untyped-def]
    _, world, rest, _ = served
    path = "/api/v1/allocations/{}/tasks"
    body = {"argv": ["./app"], "num_tasks": 2}
    # somebody else's allocation: not there for alice; an administrator may not either
    status, res = await rest.call("POST", path.format(world.bob_running), bearer("alice"), body)
    assert status == 404 and "not found" in res["error"]["message"]
    root = bearer("root", Role.SYSTEM_ADMIN)
    status, res = await rest.call("POST", path.format(world.bob_running), root, body)
    assert status == 403 and "belongs to bob" in res["error"]["message"]
    # not Running
    status, res = await rest.call("POST", path.format(world.alice_pending), bearer("alice"), body)
    assert status == 409 and "not Running" in res["error"]["message"]
    assert res["error"]["hint"]
    # bad requests of the owner
    bob = bearer("bob")
    for bad, text in [
        ({"argv": []}, "needs a command"),
        ({"argv": ["x"], "mpi": "ssh"}, "unknown PMI mode"),
        ({"argv": ["x"], "num_tasks": 3, "tasks_per_node": 2}, "need 2 nodes"),
        ({"argv": ["x"], "nodes": ["n9"]}, "n9 not among"),
    ]:
        status, res = await rest.call("POST", path.format(world.bob_running), bob, bad)
        assert status == 400 and text in res["error"]["message"], res
    # unknown allocation, read-only role
    status, _ = await rest.call("POST", path.format("nope"), bob, body)
    assert status == 404
    status, _ = await rest.call(
        "POST", path.format(world.bob_running), bearer("ro", Role.READ_ONLY), body
    )
    assert status == 403


async def test_launch_refusals_over_grpc(served) -> None:  # type: ignore[no-untyped-def]
    _, world, _, channel = served
    alice = Grpc(channel, bearer("alice"))
    code, err = await grpc_error(
        alice.alloc.launch_tasks(
            v1.LaunchTasksRequest(allocation_id=world.bob_running, argv=["./app"])
        )
    )
    assert code == "NOT_FOUND" and "not found" in err["message"]
    code, err = await grpc_error(
        alice.alloc.launch_tasks(
            v1.LaunchTasksRequest(allocation_id=world.alice_pending, argv=["./app"])
        )
    )
    assert code == "FAILED_PRECONDITION" and "not Running" in err["message"]
    code, err = await grpc_error(
        Grpc(channel, bearer("bob")).alloc.launch_tasks(
            v1.LaunchTasksRequest(allocation_id=world.bob_running, argv=["./app"])
        )
    )
    # n1 was registered without an agent address: nothing can be started there
    assert code == "UNAVAILABLE" and "n1 has no reachable agent" in err["message"]


def test_end_of_two_aborts_is_the_earlier_ones() -> None:
    # rank 3 called MPI_Abort(7) on b; rank 1 on a lost its connection to rank 3 and
    # failed on its own (15) just before b's abort reached a
    mpi_abort = _done(7, {2: 137, 3: 7}, aborted=True, failed_node="b", aborted_at=100.0)
    knock_on = _done(15, {0: 137, 1: 15}, aborted=True, failed_node="a", aborted_at=100.02)
    done = merge_done(["a", "b"], {"a": knock_on, "b": mpi_abort}, {})
    assert (done.exit_status, done.failed_node) == (7, "b")
