"""Aggregation (spec: Telemetry, Layer 2), pure: readings into windows, windows into
statistical summaries, summaries and raw readings into samples.

Prod mode: windows of ``telemetry.aggregation_window_seconds`` (30 s) aligned to multiples
of the window on the wall clock (every node's windows line up), summarised per metric as
mean, p50, p95, p99, max and count, stamped with the window's end. Debug mode adds one
``agg="raw"`` sample per metric per collection, stamped with the collection time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lattice_agent.telemetry.samples import AGGS, RAW, AllocLabels, Reading, Sample, split_key

__all__ = ["Windows", "percentile", "raw_samples", "summarize", "window_start"]


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``ordered`` (ascending, not empty), by linear
    interpolation between the closest ranks (numpy's default): monotone in ``q``, equal to
    the minimum at 0 and the maximum at 100."""
    if not ordered:
        raise ValueError("percentile of no values")
    if len(ordered) == 1:
        return float(ordered[0])
    pos = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    a, b = float(ordered[lo]), float(ordered[hi])
    # a + (b - a) * frac can leave [a, b] by a rounding step; clamp keeps p50 <= p95 <= ...
    return min(max(a + (b - a) * frac, a), b)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{mean, p50, p95, p99, max, count}`` of ``values`` (not empty)."""
    if not values:
        raise ValueError("summary of no values")
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    mean = math.fsum(ordered) / n
    return {
        "mean": min(max(mean, ordered[0]), ordered[-1]),
        "p50": percentile(ordered, 50),
        "p95": percentile(ordered, 95),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
        "count": float(n),
    }


def window_start(at: float, window: float) -> float:
    """The start of the aligned window holding wall time ``at``."""
    return math.floor(at / window) * window


def _ms(t: float) -> int:
    return round(t * 1000)


def raw_samples(reading: Reading) -> list[Sample]:
    """Debug mode: one ``agg="raw"`` sample per value, at the collection time."""
    ts = _ms(reading.at)
    out = []
    for key, v in sorted(reading.values.items()):
        if math.isfinite(v):
            name, extra = split_key(key)
            out.append(Sample(name, reading.labels.pairs(RAW, extra), float(v), ts))
    return out


@dataclass
class _Window:
    start: float
    end: float
    # per allocation: its labels and the values of each metric, in arrival order
    labels: dict[str, AllocLabels] = field(default_factory=dict)
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)


class Windows:
    """The open prod-mode windows. ``add`` readings as they come; ``close(now, lag)``
    returns the samples of every window whose end is at least ``lag`` seconds before
    ``now`` (a reading a little late still lands in its window) and forgets them."""

    def __init__(self, window_seconds: float) -> None:
        if not window_seconds > 0:
            raise ValueError("the aggregation window must be greater than zero")
        self.window = float(window_seconds)
        self._open: dict[float, _Window] = {}

    def add(self, reading: Reading) -> None:
        start = window_start(reading.at, self.window)
        w = self._open.get(start)
        if w is None:
            w = self._open[start] = _Window(start, start + self.window)
        aid = reading.alloc_id
        w.labels[aid] = reading.labels
        per = w.values.setdefault(aid, {})
        for name, v in reading.values.items():
            if math.isfinite(v):
                per.setdefault(name, []).append(float(v))

    def close(self, now: float, lag: float = 0.0) -> list[Sample]:
        out: list[Sample] = []
        for start in sorted(self._open):
            w = self._open[start]
            if w.end + lag > now:
                break
            del self._open[start]
            out.extend(_window_samples(w))
        return out

    def pending(self) -> int:
        """How many windows are open."""
        return len(self._open)


def _window_samples(w: _Window) -> Iterable[Sample]:
    ts = _ms(w.end)
    for aid in sorted(w.values):
        labels = w.labels[aid]
        for key in sorted(w.values[aid]):
            values = w.values[aid][key]
            if not values:
                continue
            summary = summarize(values)
            name, extra = split_key(key)
            for agg in AGGS:
                yield Sample(name, labels.pairs(agg, extra), summary[agg], ts)
