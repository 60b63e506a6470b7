from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_api.node_monitor import health_after_silence
from lattice_common.types import NodeState as N


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
