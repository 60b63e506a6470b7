from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_api.node_monitor import NodeMonitor, health_after_silence
from lattice_common import commands as c
from lattice_common.types import NodeState as N
from lattice_quorum.local import LocalQuorum


@pytest.mark.parametrize(
    ("state", "silent", "expected"),
    [
        (N.READY, 10, None),
        (N.READY, 31, N.DEGRADED),
        (N.DEGRADED, 60, None),
        (N.DEGRADED, 91, N.DOWN),
        (N.DRAINED, 91, N.DOWN),
        (N.DOWN, 1000, None),
    ],
)
def test_heartbeat_timeline(state: N, silent: float, expected: N | None) -> None:
    assert health_after_silence(state, silent, timeout=30, grace=60) == expected


@given(st.sampled_from(list(N)), st.floats(0, 1e6), st.floats(0.1, 100), st.floats(0, 100))
def test_never_jumps_from_ready_straight_to_down(
    state: N, silent: float, timeout: float, grace: float
) -> None:
    target = health_after_silence(state, silent, timeout=timeout, grace=grace)
    if state == N.READY:
        assert target in (None, N.DEGRADED)
    if target == N.DOWN:
        assert silent > timeout + grace


def test_grace_period_kind_follows_the_node_lifecycle_table() -> None:
    from lattice_api.node_monitor import grace_kind
    from lattice_test_harness import builders as b

    assert grace_kind(b.node("n1")) == "standard"
    home = b.node("n2", home_vcluster="hpc", owner="a1", owner_vcluster="hpc")
    assert grace_kind(home) == "standard"
    borrowed = b.node("n3", home_vcluster="hpc", owner="a2", owner_vcluster="ml")
    assert grace_kind(borrowed) == "borrowed"
    claimed = b.node("n4", claimed_by="alice", home_vcluster="hpc", owner_vcluster="ml")
    assert grace_kind(claimed) == "sensitive"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _monitor_with(nodes: list[str]) -> tuple[NodeMonitor, LocalQuorum, _Clock]:
    q = LocalQuorum()
    for n in nodes:
        q.apply(c.RegisterNode(node_id=n))
    clock = _Clock()
    m = NodeMonitor(q, heartbeat_timeout=30, grace_period=60, clock=clock, seed_interval=10)
    m.on_leadership(True)  # every node's clock starts now
    return m, q, clock


def _state(q: LocalQuorum, node: str) -> N:
    return q.read(lambda s: s.nodes[node].state)


async def test_silent_nodes_go_degraded_then_down_while_heartbeating_ones_stay() -> None:
    m, q, clock = _monitor_with(["n1", "n2"])
    for t in range(0, 100, 5):
        clock.now = 1000.0 + t
        m.last_seen["n2"] = clock.now  # n2 keeps heartbeating
        await m.check()
        if t == 30:
            assert _state(q, "n1") == N.READY  # not yet past the timeout
        if t == 35:
            assert _state(q, "n1") == N.DEGRADED
    assert _state(q, "n1") == N.DOWN
    assert _state(q, "n2") == N.READY


async def test_a_node_registered_at_another_member_is_watched_from_the_next_seed() -> None:
    m, q, clock = _monitor_with(["n1"])
    await m.check()
    q.apply(c.RegisterNode(node_id="late"))  # not through this monitor: no registered()
    clock.now += 11  # the next seed reads it; its silence counts from there
    await m.check()
    assert "late" in m.last_seen
    clock.now += 31
    await m.check()
    assert _state(q, "late") == N.DEGRADED
