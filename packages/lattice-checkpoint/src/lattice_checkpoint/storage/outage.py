"""Checkpoint storage outages (spec: Checkpoint Broker, "Storage Outage Behavior").

Write probes feed :func:`observe`: after ``failures_to_unavailable`` consecutive failed
probes the destination is unavailable, its write bandwidth is 0 (so write_time is
infinite and the cost model checkpoints nothing), pending hints are paused and forced
preemptions go without a checkpoint. One good probe ends the outage; the broker then
re-evaluates running allocations in :func:`recovery_order`, highest recompute value
first. The pure core is :class:`OutageState` + :func:`observe`; :class:`StorageOutageTracker`
holds the state and publishes ``lattice_checkpoint_storage_unavailable``.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable, Mapping

import msgspec
from prometheus_client import Gauge

from lattice_checkpoint.storage.base import ProbeResult

__all__ = [
    "DEFAULT_FAILURES_TO_UNAVAILABLE",
    "STORAGE_UNAVAILABLE",
    "OutageState",
    "StorageOutageTracker",
    "Transition",
    "observe",
    "recovery_order",
]

#: one failed probe may be a blip (a retried connection, a slow metadata server); two in
#: a row, one evaluation interval apart, is an outage
DEFAULT_FAILURES_TO_UNAVAILABLE = 2


STORAGE_UNAVAILABLE = Gauge(
    "lattice_checkpoint_storage_unavailable",
    "1 while the checkpoint destination fails its write probes (checkpoints paused), else 0",
)


class Transition(enum.StrEnum):
    NONE = "none"
    BECAME_UNAVAILABLE = "became_unavailable"
    RECOVERED = "recovered"


class OutageState(msgspec.Struct, frozen=True):
    """What the probes so far say. ``since``: when the current state began (the probe
    that made it unavailable, or that ended the outage); ``bandwidth_bytes_per_s``: the
    last good probe's (0.0 before any)."""

    unavailable: bool = False
    consecutive_failures: int = 0
    since: float | None = None
    last_error: str | None = None
    bandwidth_bytes_per_s: float = 0.0

    @property
    def write_bandwidth_bytes_per_s(self) -> float:
        """What the cost model should use: 0.0 during an outage."""
        return 0.0 if self.unavailable else self.bandwidth_bytes_per_s


def observe(
    state: OutageState,
    result: ProbeResult,
    now: float,
    *,
    failures_to_unavailable: int = DEFAULT_FAILURES_TO_UNAVAILABLE,
) -> tuple[OutageState, Transition]:
    """The state after one probe, and whether it started or ended an outage."""
    if result.ok:
        recovered = state.unavailable
        return (
            OutageState(
                unavailable=False,
                consecutive_failures=0,
                since=now if recovered else state.since,
                last_error=None,
                bandwidth_bytes_per_s=result.write_bandwidth_bytes_per_s,
            ),
            Transition.RECOVERED if recovered else Transition.NONE,
        )
    failures = state.consecutive_failures + 1
    down = state.unavailable or failures >= max(1, failures_to_unavailable)
    started = down and not state.unavailable
    return (
        OutageState(
            unavailable=down,
            consecutive_failures=failures,
            since=now if started else state.since,
            last_error=result.error or "write probe failed",
            bandwidth_bytes_per_s=state.bandwidth_bytes_per_s,
        ),
        Transition.BECAME_UNAVAILABLE if started else Transition.NONE,
    )


def recovery_order(recompute_value: Mapping[str, float] | Iterable[tuple[str, float]]) -> list[str]:
    """Allocation ids to re-evaluate after an outage, highest recompute value first
    (ties by id, so the order is stable; a NaN value counts as lowest)."""
    items = recompute_value.items() if isinstance(recompute_value, Mapping) else recompute_value

    def rank(item: tuple[str, float]) -> tuple[float, str]:
        value = item[1]
        return (-value if not math.isnan(value) else math.inf, item[0])

    return [alloc for alloc, _v in sorted(items, key=rank)]


class StorageOutageTracker:
    """The shell around :func:`observe`: keeps the state, sets the gauge."""

    def __init__(
        self,
        *,
        failures_to_unavailable: int = DEFAULT_FAILURES_TO_UNAVAILABLE,
        gauge: Gauge = STORAGE_UNAVAILABLE,
    ) -> None:
        self.failures_to_unavailable = failures_to_unavailable
        self.state = OutageState()
        self._gauge = gauge
        gauge.set(0)

    @property
    def unavailable(self) -> bool:
        return self.state.unavailable

    @property
    def write_bandwidth_bytes_per_s(self) -> float:
        return self.state.write_bandwidth_bytes_per_s

    def observe(self, result: ProbeResult, now: float | None = None) -> Transition:
        self.state, change = observe(
            self.state,
            result,
            time.time() if now is None else now,
            failures_to_unavailable=self.failures_to_unavailable,
        )
        self._gauge.set(1 if self.state.unavailable else 0)
        return change
