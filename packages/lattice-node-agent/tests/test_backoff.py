"""The agent's reconnect delay: jittered, growing while failures go on, reset by a
success (after a failover thousands of agents must not come back in one burst)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.backoff import FIRST_DELAY, MAX_DELAY, Backoff


def test_the_delay_doubles_up_to_the_limit_and_a_success_starts_it_over() -> None:
    bo = Backoff(rand=lambda: 0.5)  # no jitter: the middle of the range
    assert [round(bo.next(), 3) for _ in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 8.0, 8.0]
    bo.reset()
    assert bo.next() == pytest.approx(FIRST_DELAY)


@given(st.lists(st.floats(0.0, 0.999999), min_size=1, max_size=30))
def test_each_delay_is_within_half_and_one_and_a_half_of_its_step(rolls) -> None:
    it = iter(rolls)
    bo = Backoff(rand=lambda: next(it))
    base = FIRST_DELAY
    for _ in rolls:
        assert 0.5 * base <= bo.next() < 1.5 * base
        base = min(base * 2, MAX_DELAY)


def test_agents_failing_together_retry_spread_out() -> None:
    firsts = sorted(Backoff().next() for _ in range(10_000))
    assert firsts[0] >= 0.1 and firsts[-1] < 0.3
    # no instant takes more than a small share of them (a fixed delay took all)
    buckets = [0] * 20
    for f in firsts:
        buckets[min(19, int((f - 0.1) / 0.01))] += 1
    assert max(buckets) < 1_000


def test_a_limit_below_the_first_step_holds_every_delay_under_one_and_a_half_times_it() -> None:
    # the agent's heartbeat: at a 0.5 s interval no retry waits longer than a heartbeat
    bo = Backoff(limit=0.5 / 1.5)
    assert all(bo.next() <= 0.5 for _ in range(50))
    bo = Backoff(limit=0.1, rand=lambda: 0.5)
    assert [bo.next() for _ in range(3)] == pytest.approx([0.1, 0.1, 0.1])


def test_a_delay_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Backoff(limit=0.0)
