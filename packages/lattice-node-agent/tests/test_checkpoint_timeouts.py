"""The checkpoint timeout table (lattice_agent.checkpoint.timeouts), pure: the
specification's rows on examples, and properties over random event sequences."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.checkpoint import timeouts as t


def run(c: t.Clock, until: float, step: float = 0.5) -> tuple[t.Clock, t.Action, float]:
    now = 0.0
    while now <= until:
        c, action = t.decide(c, now)
        if action != t.Action.WAIT:
            return c, action, now
        now += step
    return c, t.Action.WAIT, now


def test_unresponsive_fails_at_the_deadline_without_extension() -> None:
    c, action, at = run(t.start(0.0, 10.0, 300.0), 100.0)
    assert action == t.Action.FAIL and at == 10.0 and not c.extended


def test_responsive_gets_one_extension_of_half_the_timeout() -> None:
    c = t.sign_of_life(t.start(0.0, 10.0, 300.0))
    c, action, at = run(c, 100.0)
    assert action == t.Action.FAIL and at == 15.0 and c.extended


def test_deferral_is_granted_up_to_max_then_forced() -> None:
    c = t.start(0.0, 10.0, 300.0)
    c, granted = t.defer(c, 1.0, 200.0)
    assert granted == 200.0 and not c.forced
    c, action = t.decide(c, 201.0)
    assert action == t.Action.ASK_AGAIN
    c = t.asked_again(c, 201.0)
    c, granted = t.defer(c, 202.0, 200.0)
    assert granted == 100.0 and c.forced  # 300 s in all, then no more
    c = t.asked_again(c, 302.0)
    c, granted = t.defer(c, 303.0, 10.0)
    assert granted == 0.0 and c.forced
    # it answered (a deferral request is a sign of life): one extension, then it fails
    c, action = t.decide(c, 302.0 + 10.0)
    assert action == t.Action.WAIT and c.extended
    c, action = t.decide(c, 302.0 + 15.0)
    assert action == t.Action.FAIL


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["life", "defer", "tick"]),
        st.floats(0.0, 50.0, allow_nan=False),
    ),
    max_size=60,
)


@given(
    timeout=st.floats(0.5, 60.0),
    max_deferral=st.floats(0.0, 120.0),
    events=_EVENTS,
)
def test_deferral_never_exceeds_max_and_extension_is_once(
    timeout: float, max_deferral: float, events: list[tuple[str, float]]
) -> None:
    c = t.start(0.0, timeout, max_deferral)
    now = 0.0
    extensions = 0
    for kind, x in events:
        now += 0.25
        if kind == "life":
            c = t.sign_of_life(c)
        elif kind == "defer":
            c, granted = t.defer(c, now, x)
            assert 0.0 <= granted <= x
        was = c.extended
        c, action = t.decide(c, now)
        extensions += int(c.extended and not was)
        if action == t.Action.ASK_AGAIN:
            c = t.asked_again(c, now)
            extensions = 0  # a fresh request gets its own extension
        assert c.deferred <= max_deferral + 1e-9
        assert extensions <= 1
        if action == t.Action.FAIL:
            # only past a deadline, and a responsive request only after its extension
            assert now >= c.deadline and (c.extended or not c.responsive)
            break
