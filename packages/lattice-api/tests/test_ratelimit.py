"""The limiter's pure core (lattice_api.ratelimit): token buckets, concurrent counters,
the spec's defaults and messages, admin overrides, who is exempt; hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_api.auth import Identity, Role
from lattice_api.ratelimit import (
    Concurrency,
    HeartbeatLimiter,
    RateLimiter,
    TokenBucket,
    concurrent_message,
    kind_of,
)
from lattice_common.config import RateLimitConfig, RateLimitOverride
from lattice_common.errors import RateLimited

SPEC_MESSAGE = (
    "maximum concurrent sessions reached (5/5). Close an existing session to open a new one."
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def alice(role: Role = Role.USER) -> Identity:
    return Identity("alice", role)


def test_spec_defaults_and_message() -> None:
    lim = RateLimiter()
    assert lim.config.enabled
    assert [lim.limit("u", k) for k in ("attach", "stream_logs", "stream_metrics")] == [5, 10, 5]
    assert [lim.limit("u", k) for k in ("query_metrics", "diagnostics", "compare")] == [60, 30, 10]
    assert lim.limit("u", "request") == 0  # no general limit unless configured
    assert concurrent_message(5) == SPEC_MESSAGE


def test_kinds_of_calls() -> None:
    assert kind_of("/lattice.v1.AllocationService/StreamLogs") == "stream_logs"
    assert kind_of("GET /api/v1/allocations/{id}/logs/stream") == "stream_logs"
    assert kind_of("AllocationService.Attach") == "attach"
    assert kind_of("GET /api/v1/allocations/{id}/attach") == "attach"
    assert kind_of("AllocationService.QueryMetrics") == "query_metrics"
    assert kind_of("/lattice.v1.AllocationService/Submit") == "request"


def test_concurrent_streams_counted_per_user() -> None:
    lim = RateLimiter()
    held = [lim.check(alice(), "AllocationService.StreamLogs") for _ in range(10)]
    with pytest.raises(RateLimited) as e:
        lim.check(alice(), "AllocationService.StreamLogs")
    assert e.value.message == (
        "maximum concurrent sessions reached (10/10). Close an existing session to open a new one."
    )
    assert e.value.http_status == 429 and e.value.grpc_status == 8 and e.value.retry_after == 1
    # another user, another kind: unaffected
    assert lim.check(Identity("bob", Role.USER), "AllocationService.StreamLogs") is not None
    assert lim.check(alice(), "AllocationService.Attach") is not None
    held[0]()  # a stream closes: one more may open
    held[0]()  # release is idempotent
    assert lim.check(alice(), "AllocationService.StreamLogs") is not None
    with pytest.raises(RateLimited):
        lim.check(alice(), "AllocationService.StreamLogs")


def test_request_rate_with_retry_after() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimitConfig(compare_per_minute=10), clock=clock)
    for _ in range(10):
        assert lim.check(alice(), "AllocationService.CompareMetrics") is None
    with pytest.raises(RateLimited) as e:
        lim.check(alice(), "AllocationService.CompareMetrics")
    assert e.value.retry_after == 6  # one token per 6 s
    assert "Compare allows 10 requests per minute" in e.value.message
    clock.t += 6
    lim.check(alice(), "AllocationService.CompareMetrics")
    # other users have their own bucket
    lim.check(Identity("bob", Role.USER), "AllocationService.CompareMetrics")


def test_admin_overrides_and_exemptions() -> None:
    cfg = RateLimitConfig(
        stream_logs_max_concurrent=2,
        overrides={"alice": RateLimitOverride(stream_logs_max_concurrent=3)},
    )
    lim = RateLimiter(cfg)
    for _ in range(3):
        lim.check(alice(), "AllocationService.StreamLogs")
    with pytest.raises(RateLimited, match=r"\(3/3\)"):
        lim.check(alice(), "AllocationService.StreamLogs")
    # system admins share the limits (spec) unless overridden
    admin = Identity("root", Role.SYSTEM_ADMIN)
    for _ in range(2):
        lim.check(admin, "AllocationService.StreamLogs")
    with pytest.raises(RateLimited):
        lim.check(admin, "AllocationService.StreamLogs")
    # agents and schedulers are not users
    for _ in range(10):
        assert (
            lim.check(Identity("lattice-agent", Role.AGENT), "AllocationService.StreamLogs") is None
        )
    off = RateLimiter(RateLimitConfig(enabled=False, stream_logs_max_concurrent=1))
    for _ in range(5):
        assert off.check(alice(), "AllocationService.StreamLogs") is None


def test_general_request_limit_when_configured() -> None:
    clock = Clock()
    lim = RateLimiter(RateLimitConfig(requests_per_minute=3), clock=clock)
    for _ in range(3):
        lim.check(alice(), "POST /api/v1/allocations")
    with pytest.raises(RateLimited) as e:
        lim.check(alice(), "AllocationService.Get")
    assert e.value.retry_after == 20


def test_heartbeat_limiter() -> None:
    clock = Clock()
    hb = HeartbeatLimiter(10.0, 2, clock=clock)
    hb.check("n1")
    hb.check("n1")
    with pytest.raises(RateLimited, match="heartbeat rate limit of node n1"):
        hb.check("n1")
    hb.check("n2")
    clock.t += 10
    hb.check("n1")
    HeartbeatLimiter(10.0, 0).check("n1")  # 0 = off


# --- properties -----------------------------------------------------------------------

times = st.lists(st.floats(min_value=0, max_value=600, allow_nan=False), max_size=300)


@settings(max_examples=200, deadline=None)
@given(
    per_minute=st.integers(min_value=1, max_value=120),
    arrivals=times,
    window=st.floats(min_value=0.1, max_value=300),
)
def test_bucket_never_admits_more_than_burst_plus_refill(
    per_minute: int, arrivals: list[float], window: float
) -> None:
    rate = per_minute / 60.0
    bucket = TokenBucket.full(per_minute, rate, 0.0)
    admitted = [t for t in sorted(arrivals) if bucket.take(t) == 0.0]
    # any window of `window` seconds admits at most capacity + rate * window
    for i, start in enumerate(admitted):
        inside = sum(1 for t in admitted[i:] if t - start <= window)
        assert inside <= per_minute + rate * window + 1e-6


@settings(max_examples=200, deadline=None)
@given(
    per_minute=st.integers(min_value=1, max_value=120),
    gaps=st.lists(st.floats(0, 30), max_size=100),
)
def test_bucket_refill_rate_respected(per_minute: int, gaps: list[float]) -> None:
    rate = per_minute / 60.0
    bucket = TokenBucket.full(per_minute, rate, 0.0)
    while bucket.take(0.0) == 0.0:  # drain the burst
        pass
    t = 0.0
    admitted = 0
    for gap in gaps:
        t += gap
        wait = bucket.take(t)
        if wait == 0.0:
            admitted += 1
        else:  # the retry hint is exact: one token is there after `wait` seconds
            assert 0 < wait <= 1 / rate + 1e-9
    assert admitted <= rate * t + 1 + 1e-6


@settings(max_examples=100, deadline=None)
@given(limit=st.integers(1, 8), ops=st.lists(st.booleans(), max_size=100))
def test_concurrency_never_exceeds_limit(limit: int, ops: list[bool]) -> None:
    c = Concurrency()
    held = []
    for acquire in ops:
        if acquire:
            r = c.acquire(("u", "k"), limit)
            if len(held) < limit:
                assert r is not None
                held.append(r)
            else:
                assert r is None
        elif held:
            held.pop()()
        assert c.count(("u", "k")) == len(held) <= limit
