"""AllocationService.CompareMetrics (``lattice compare``, ``GET /api/v1/compare``): the
same metrics of several allocations side by side, each indexed from its own start.

Relative-to-start alignment (spec: Cross-Allocation Comparison): allocations run hours or
days apart, so each one's series is read from the TSDB over ``[started_at, started_at +
duration]`` with one range query per way of combining (avg, sum, max), and every point is
shifted in Python to ``t = timestamp - started_at``. The same offset then means the same
moment of every run, and summaries (mean, max, final) and the difference and ratio of each
allocation's mean to the first allocation's compare like with like.

What is read is what ``lattice top`` reads (lattice_api.ops.metrics, the data contract):
the agents' prod-mode ``agg="mean"`` windows (pushed in every mode, so the series have the
same resolution whatever the telemetry mode), combined across nodes and GPUs as the
summary view combines them (the catalog's ``combine``: mean of utilization, sum of bytes
and watts, max of the I/O p99 latency). A point at offset ``t`` is the metric over the
step ending at ``t`` (``avg_over_time``, ``max_over_time`` for max), so the step must be at
least the agents' window and the first point is at ``t = step``.

Who may compare: every allocation must be visible to the caller (``visible_allocation``;
another user's id is NotFound, exactly as an unknown one), and every query is confined by
the TSDB itself to one allocation (``extra_label=alloc_id=ID``, plus ``tenant=T`` for a
tenant admin) with the id again in escaped PromQL. Allocations that have not started have
no t=0: FailedPrecondition naming each of them. Sensitive allocations are compared only
with sensitive allocations of the same claiming user (spec: "no cross-allocation
comparison for sensitive"), and reading them is audited like ``lattice top``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lattice_common.assignment import is_sensitive
from lattice_common.errors import FailedPrecondition, PermissionDenied, ValidationError
from lattice_common.types import Allocation, claimant
from lattice_quorum import queries

from lattice_api.auth import Identity
from lattice_api.ops.base import visible_allocation
from lattice_api.ops.metrics import (
    ALLOCATION_METRICS,
    CATALOG,
    MAX_DURATION,
    PROD_AGG,
    SUMMARY,
    MetricsOps,
    Planned,
    parse_duration,
    scope_of,
    select_metrics,
)
from lattice_api.tsdb import (
    RangeSeries,
    TsdbClient,
    aggregate,
    not_configured,
    parse_seconds,
    rollup,
    selector,
)

RELATIVE = "relative"
#: what is compared when no metric is named
DEFAULT_METRICS = ("gpu_utilization", "cpu_utilization", "memory_used")
MAX_ALLOCATIONS = 16
#: points per series at most (Prometheus' own limit is 11,000)
MAX_POINTS = 11_000
#: points per series the automatic step aims at
TARGET_POINTS = 240
#: range queries in flight per request
CONCURRENCY = 8

#: the rollup over each step, per way of combining across nodes: a mean over time for
#: means and sums (a sum of rates is the sum of each node's mean rate), the peak for max
OVER_TIME = {"avg": "avg_over_time", "sum": "avg_over_time", "max": "max_over_time"}


# --- pure: parameters ---------------------------------------------------------------------


def parse_ids(ids: Iterable[str]) -> list[str]:
    """The allocations to compare, in the order given (comma-separated items split,
    blanks and repeats dropped): at least 2, at most 16."""
    out: list[str] = []
    for item in ids:
        for part in str(item).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    if len(out) < 2:
        raise ValidationError(
            "compare needs at least two allocations",
            details={"allocations": ", ".join(out) or "none"},
            hint="Name two or more allocation ids, e.g. `lattice compare ID1 ID2`.",
        )
    if len(out) > MAX_ALLOCATIONS:
        raise ValidationError(
            f"compare takes at most {MAX_ALLOCATIONS} allocations, not {len(out)}",
            hint="Compare fewer allocations at a time.",
        )
    return out


def parse_align(align: str | None) -> str:
    """Only relative-to-start alignment exists (``""``/None mean it)."""
    text = (align or RELATIVE).strip().lower()
    if text != RELATIVE:
        raise ValidationError(
            f"unknown alignment {align!r}",
            details={"available": RELATIVE},
            hint="Comparisons align each allocation at its start: use align=relative.",
        )
    return text


def compare_metrics(names: Iterable[str]) -> list[str]:
    """The catalog metrics asked for, in catalog order (:func:`select_metrics`); the
    default set when none is named."""
    given = [n for item in names for n in str(item).split(",") if n.strip()]
    return select_metrics(given, SUMMARY) if given else list(DEFAULT_METRICS)


def compare_duration(duration: str | float | int | None) -> float | None:
    """The offsets to show, 0..duration seconds (``"1h"``, ``3600``; at most 31 days);
    None (also "" and 0): the longest run of the compared allocations."""
    if duration is None or duration == "" or duration == 0:
        return None
    return parse_duration(duration)


def compare_step(step: str | float | int | None, duration: float, window: float) -> float:
    """The spacing of the points: given (at least the agents' ``window``, at most
    :data:`MAX_POINTS` points over ``duration``), or about :data:`TARGET_POINTS` points
    rounded up to a multiple of the window."""
    if step is None or step == "" or step == 0:
        return max(1, math.ceil(duration / TARGET_POINTS / window)) * window
    seconds = parse_seconds(step, field="step")
    if seconds < window:
        raise ValidationError(
            f"step {step!r} is finer than the telemetry's {window:g} s windows",
            details={"step": str(step), "window_seconds": window},
            hint=f"Give a step of {window:g}s or more (the agents push one value per window).",
        )
    if duration / seconds > MAX_POINTS:
        raise ValidationError(
            f"{duration:g} s every {seconds:g} s is more than {MAX_POINTS} points",
            details={"duration_seconds": duration, "step_seconds": seconds},
            hint="Give a larger step or a shorter duration.",
        )
    return seconds


def run_length(a: Allocation, now: float, window: float) -> float:
    """How long ``a`` has run (an ended one: to its end, plus the window its last
    samples are stamped with)."""
    assert a.started_at is not None
    end = a.finished_at + window if a.finished_at is not None else now
    return max(0.0, end - a.started_at)


# --- pure: queries and answers ------------------------------------------------------------


def series_queries(names: Sequence[str], alloc_id: str, step: float) -> list[Planned]:
    """One query per way of combining the ``names`` need (the catalog's): each node's
    (and GPU's) mean windows rolled up over the step, then combined across the
    allocation, one series per metric."""
    by_op: dict[str, list[str]] = {}
    for name in names:
        by_op.setdefault(CATALOG[name].combine, []).append(name)
    labels = {"alloc_id": alloc_id, "agg": PROD_AGG}
    out = []
    for op, group in by_op.items():
        inner = rollup(OVER_TIME[op], selector(labels, names=group), step, keep_metric_names=True)
        out.append(Planned(aggregate(op, ("__name__",), inner), op, tuple(group)))
    return out


def aligned_points(
    series: RangeSeries, start: float, step: float, duration: float
) -> list[list[float]]:
    """The points of ``series`` as ``[t_offset_seconds, value]`` with t=0 at ``start``:
    offsets are whole steps (the query was evaluated at ``start + k * step``), within
    ``0..duration``, in order."""
    out: dict[float, float] = {}
    for ts, value in series.points:
        offset = round((ts - start) / step) * step
        if 0 <= offset <= duration + 1e-6 and math.isfinite(value):
            out[offset] = value
    return [[t, out[t]] for t in sorted(out)]


def summarize(points: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """``mean`` (the points are evenly spaced: the time average), ``max`` and ``final``
    (the last point); None each without points."""
    if not points:
        return {"mean": None, "max": None, "final": None}
    values = [p[1] for p in points]
    return {"mean": math.fsum(values) / len(values), "max": max(values), "final": values[-1]}


def versus(mean: float | None, base: float | None) -> dict[str, float | None]:
    """``delta`` (mean - the first allocation's mean) and ``ratio`` (mean / it; None
    when it is 0 or either is missing)."""
    if mean is None or base is None:
        return {"delta": None, "ratio": None}
    return {"delta": mean - base, "ratio": mean / base if base != 0 else None}


def comparisons(
    names: Sequence[str],
    allocs: Sequence[Allocation],
    found: Mapping[str, Iterable[RangeSeries]],
    step: float,
    duration: float,
) -> list[dict[str, Any]]:
    """One record per metric: ``{metric, unit, combine, values (id -> mean, those with
    data), series: [{allocation_id, points, mean, max, final, delta, ratio}]}``."""
    out = []
    for name in names:
        rows = []
        for a in allocs:
            assert a.started_at is not None
            points: list[list[float]] = []
            for s in found.get(a.id, ()):
                if s.labels.get("__name__") == name:
                    points = aligned_points(s, a.started_at, step, duration)
            rows.append({"allocation_id": a.id, "points": points, **summarize(points)})
        base = rows[0]["mean"]
        for row in rows:
            row.update(versus(row["mean"], base))
        out.append(
            {
                "metric": name,
                "unit": CATALOG[name].unit,
                "combine": CATALOG[name].combine,
                "values": {r["allocation_id"]: r["mean"] for r in rows if r["mean"] is not None},
                "series": rows,
            }
        )
    return out


# --- the operation ------------------------------------------------------------------------


class CompareOps:
    """``compare`` (CompareMetrics, ``GET /api/v1/compare``), over the TSDB settings of
    ``metrics`` (its quorum, endpoint, timeout, the agents' window, audit and clock)."""

    def __init__(self, metrics: MetricsOps) -> None:
        self.metrics = metrics

    def _check_sensitive(self, allocs: Sequence[Allocation]) -> None:
        vclusters = {v.name: v for v in self.metrics.quorum.read(queries.vclusters)}
        sensitive = [a for a in allocs if is_sensitive(a, vclusters)]
        if not sensitive:
            return
        if len(sensitive) < len(allocs) or len({claimant(a) for a in allocs}) > 1:
            raise PermissionDenied(
                "sensitive allocations are compared only with sensitive allocations of "
                "the same claiming user",
                details={"sensitive": ", ".join(a.id for a in sensitive)},
                hint="Compare the sensitive allocations among themselves, and the others apart.",
            )

    async def compare(
        self,
        who: Identity,
        ids: Iterable[str],
        *,
        metrics: Iterable[str] = (),
        duration: str | float | int | None = None,
        step: str | float | int | None = None,
        align: str | None = None,
    ) -> dict[str, Any]:
        """``{align, duration_seconds, step_seconds, resolution_seconds, allocations:
        [{allocation_id, state, started_at, finished_at}], comparisons: [{metric, unit,
        combine, values, series: [{allocation_id, points: [[t_offset_seconds, value]],
        mean, max, final, delta, ratio}]}]}``; see the module docstring."""
        m = self.metrics
        wanted = parse_ids(ids)
        how = parse_align(align)
        names = compare_metrics(metrics)
        seconds = compare_duration(duration)
        allocs = [visible_allocation(m.quorum, who, i) for i in wanted]
        not_started = [a for a in allocs if a.started_at is None]
        if not_started:
            raise _not_started(not_started)
        self._check_sensitive(allocs)
        if not m.tsdb_endpoint:
            raise not_configured()
        now = m.clock()
        if seconds is None:
            longest = max(run_length(a, now, m.window) for a in allocs)
            seconds = min(MAX_DURATION, max(m.window, longest))
        every = compare_step(step, seconds, m.window)
        if m.audit is not None:
            for a in allocs:
                m.audit.record_access(
                    who.user, a, ALLOCATION_METRICS, {"compare": ",".join(wanted)}
                )
        found = await self._read(who, allocs, names, seconds, every, now)
        return {
            "align": how,
            "duration_seconds": seconds,
            "step_seconds": every,
            "resolution_seconds": m.window,
            "allocations": [
                {
                    "allocation_id": a.id,
                    "state": a.state.value,
                    "started_at": a.started_at,
                    "finished_at": a.finished_at,
                }
                for a in allocs
            ],
            "comparisons": comparisons(names, allocs, found, every, seconds),
        }

    async def _read(
        self,
        who: Identity,
        allocs: Sequence[Allocation],
        names: Sequence[str],
        duration: float,
        step: float,
        now: float,
    ) -> dict[str, list[RangeSeries]]:
        """Every allocation's range queries from its own start, at most
        :data:`CONCURRENCY` at once."""
        m = self.metrics
        gate = asyncio.Semaphore(CONCURRENCY)
        found: dict[str, list[RangeSeries]] = {a.id: [] for a in allocs}

        async with TsdbClient(m.tsdb_endpoint, timeout=m.timeout) as tsdb:

            async def one(a: Allocation, expr: str) -> None:
                assert a.started_at is not None
                start = a.started_at
                end = max(start, min(start + duration, now))
                async with gate:
                    got = await tsdb.query_range(
                        expr, scope=scope_of(who, a), start=start, end=end, step=step
                    )
                found[a.id].extend(got)

            await asyncio.gather(
                *(one(a, p.expr) for a in allocs for p in series_queries(names, a.id, step))
            )
        return found


def _not_started(allocs: Sequence[Allocation]) -> FailedPrecondition:
    hint = "Compare allocations once they have started (`lattice status ID` shows when)."
    if len(allocs) == 1:
        a = allocs[0]
        return FailedPrecondition(
            f"allocation {a.id} has not started ({a.state.value}): it has no t=0 to align to",
            details={"allocation": a.id, "state": a.state.value},
            hint=hint,
        )
    listed = ", ".join(f"{a.id} ({a.state.value})" for a in allocs)
    return FailedPrecondition(
        f"{len(allocs)} allocations have not started: {listed}; they have no t=0 to align to",
        details={"not_started": ", ".join(a.id for a in allocs)},
        hint=hint,
    )


__all__ = [
    "DEFAULT_METRICS",
    "MAX_ALLOCATIONS",
    "CompareOps",
    "aligned_points",
    "compare_duration",
    "compare_metrics",
    "compare_step",
    "comparisons",
    "parse_align",
    "parse_ids",
    "series_queries",
    "summarize",
    "versus",
]
