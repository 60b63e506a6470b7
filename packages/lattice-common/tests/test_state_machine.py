"""Allocation and node transition tables: table-driven checks and a terminal-state property."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_common.errors import InvalidTransition
from lattice_common.state_machine import (
    ALLOCATION_TRANSITIONS,
    NODE_TRANSITIONS,
    can_transition,
    check_node_transition,
    check_transition,
)
from lattice_common.types import TERMINAL_STATES
from lattice_common.types import AllocationState as A
from lattice_common.types import NodeState as N


def test_every_state_has_a_row() -> None:
    assert set(ALLOCATION_TRANSITIONS) == set(A)
    assert set(NODE_TRANSITIONS) == set(N)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_terminal_states_have_no_exits(state: A) -> None:
    assert ALLOCATION_TRANSITIONS[state] == frozenset()
    assert state.terminal
    for target in A:
        assert not can_transition(state, target)


@pytest.mark.parametrize("state", [s for s in A if s not in TERMINAL_STATES])
def test_every_live_state_can_end(state: A) -> None:
    """Anything not finished can at least be cancelled or fail."""
    assert {A.CANCELLED, A.FAILED} <= ALLOCATION_TRANSITIONS[state]


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (A.PENDING, A.RUNNING),
        (A.PENDING, A.STAGING),
        (A.STAGING, A.RUNNING),
        (A.RUNNING, A.COMPLETED),
        (A.RUNNING, A.PENDING),  # requeue
        (A.RUNNING, A.CHECKPOINTING),
        (A.CHECKPOINTING, A.SUSPENDED),
        (A.SUSPENDED, A.PENDING),  # resume after preemption
        (A.PENDING, A.CANCELLED),
    ],
)
def test_allowed(current: A, target: A) -> None:
    assert can_transition(current, target)
    check_transition("a1", current, target)  # does not raise


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (A.COMPLETED, A.RUNNING),
        (A.FAILED, A.PENDING),
        (A.CANCELLED, A.RUNNING),
        (A.PENDING, A.COMPLETED),
        (A.PENDING, A.SUSPENDED),
        (A.SUSPENDED, A.RUNNING),
        (A.RUNNING, A.RUNNING),
    ],
)
def test_rejected(current: A, target: A) -> None:
    assert not can_transition(current, target)
    with pytest.raises(InvalidTransition):
        check_transition("a1", current, target)


def test_rejection_names_both_states_and_the_allocation() -> None:
    with pytest.raises(InvalidTransition) as info:
        check_transition("a1b2c3d4", A.COMPLETED, A.RUNNING)
    err = info.value
    assert "Completed" in err.message and "Running" in err.message
    assert "a1b2c3d4" in err.message
    assert err.details == {"allocation": "a1b2c3d4", "from": "Completed", "to": "Running"}
    assert "submit a new one" in err.hint
    assert err.code == "invalid_transition"


def test_live_state_rejection_hints_at_status() -> None:
    with pytest.raises(InvalidTransition) as info:
        check_transition("x", A.PENDING, A.COMPLETED)
    assert "lattice status" in info.value.hint


@pytest.mark.parametrize(
    ("current", "target", "ok"),
    [
        (N.READY, N.DRAINING, True),
        (N.DRAINING, N.DRAINED, True),
        (N.DRAINED, N.READY, True),
        (N.READY, N.READY, True),  # re-asserting the same state is a no-op
        (N.DRAINING, N.READY, False),  # undrain only from Drained
        (N.FAILED, N.READY, False),
        (N.BOOTING, N.DRAINED, False),
    ],
)
def test_node_transitions(current: N, target: N, ok: bool) -> None:
    if ok:
        check_node_transition("nid001", current, target)
    else:
        with pytest.raises(InvalidTransition) as info:
            check_node_transition("nid001", current, target)
        assert current.value in info.value.message and target.value in info.value.message


@given(st.lists(st.sampled_from(list(A)), max_size=50))
def test_state_never_leaves_a_terminal_state(targets: list[A]) -> None:
    state = A.PENDING
    reached_terminal: A | None = None
    for target in targets:
        try:
            check_transition("p", state, target)
        except InvalidTransition:
            continue
        assert target in ALLOCATION_TRANSITIONS[state]
        state = target
        if reached_terminal is not None:
            pytest.fail(f"left terminal state {reached_terminal} for {state}")
        if state in TERMINAL_STATES:
            reached_terminal = state
    if reached_terminal is not None:
        assert state == reached_terminal


@given(st.lists(st.sampled_from(list(A)), max_size=50))
def test_rejected_moves_match_the_table(targets: list[A]) -> None:
    state = A.PENDING
    for target in targets:
        allowed = target in ALLOCATION_TRANSITIONS[state]
        try:
            check_transition("p", state, target)
        except InvalidTransition:
            assert not allowed
        else:
            assert allowed
            state = target
