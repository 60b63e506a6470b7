"""``lattice compare A B [C...]``: the same metrics of several allocations side by side,
each aligned at its own start (t=0), so runs days apart compare like with like.

::

    lattice compare a1b2c3d4 e5f6g7h8                          # gpu/cpu utilization, memory
    lattice compare a1b2c3d4 e5f6g7h8 --metric=gpu_utilization
    lattice compare a1 a2 a3 --metric gpu_utilization,cpu_utilization --duration 1h --step 1m
    lattice compare a1b2c3d4 e5f6g7h8 --series                 # every offset, one column each
    lattice compare a1b2c3d4 e5f6g7h8 -o json                  # the aligned series

The table has one row per metric and allocation: MEAN, MAX and FINAL over the offsets
shown, the mean's difference from the first allocation's (and their ratio), and a
sparkline whose characters are the same offsets for every allocation of a metric, on one
scale. The renderers here are pure (tested without a server).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24
COLUMNS = ("METRIC", "ALLOCATION", "MEAN", "MAX", "FINAL", "Δ_VS_FIRST", "TREND")


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)


def compare(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str],
        typer.Argument(
            help="Two or more allocation IDs; the first is the baseline.", metavar="ID..."
        ),
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            help="Metric to compare (repeatable, or comma-separated); default "
            "gpu_utilization, cpu_utilization, memory_used.",
            metavar="NAME",
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option(
            "--duration",
            help="Offsets to compare from each start: 30m, 1h, 2d (default: the longest run).",
            metavar="DURATION",
        ),
    ] = None,
    step: Annotated[
        str | None,
        typer.Option(
            "--step",
            help="Spacing of the points: 30s (the agents' window) or more (default: automatic).",
            metavar="STEP",
        ),
    ] = None,
    series: Annotated[
        bool,
        typer.Option(
            "--series", help="Also print every offset's value, one column per allocation."
        ),
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Compare metrics of allocations aligned at their starts (t=0), e.g. A/B training runs."""
    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        return await client.compare_metrics(
            list(alloc_ids), metrics=metric or None, duration=duration, step=step
        )

    answer = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, answer)
        return
    if not st.quiet:
        print(caption(answer))
    print(compare_table(answer))
    if series:
        for text in series_tables(answer):
            print()
            print(text)


# --- pure renderers -------------------------------------------------------------------------


def _offset(seconds: float) -> str:
    from lattice_cli.output import format_hms

    return format_hms(seconds)


def caption(answer: dict[str, Any]) -> str:
    """The line above the table: how many allocations, the offsets and the step."""
    n = len(answer.get("allocations") or [])
    step = answer.get("step_seconds") or 0
    return (
        f"{n} allocations aligned at their starts (t=0) · offsets "
        f"{_offset(0)} to {_offset(answer.get('duration_seconds') or 0)} every {step:g} s"
    )


def sparkline(
    points: Sequence[Sequence[float]],
    step: float,
    duration: float,
    lo: float,
    hi: float,
    width: int = SPARK_WIDTH,
) -> str:
    """``points`` (``[t_offset, value]``) as block characters: the offsets step..duration
    in ``width`` (at most one per step) equal buckets, each the mean of its points on the
    scale lo..hi; a bucket without points is a space."""
    steps = max(1, round(duration / step)) if step > 0 else 1
    width = max(1, min(width, steps))
    buckets: list[list[float]] = [[] for _ in range(width)]
    for t, v in points:
        k = min(steps, max(1, round(t / step))) if step > 0 else 1
        buckets[min(width - 1, (k - 1) * width // steps)].append(v)
    out = []
    for values in buckets:
        if not values:
            out.append(" ")
            continue
        mean = math.fsum(values) / len(values)
        level = 0.5 if hi <= lo else (mean - lo) / (hi - lo)
        out.append(SPARK[min(len(SPARK) - 1, max(0, int(level * len(SPARK))))])
    return "".join(out).rstrip()


def delta_cell(row: dict[str, Any], unit: str, first: bool) -> str:
    """``baseline`` for the first allocation; else the mean's difference from the
    first's in the metric's unit and their ratio: ``-5.1% (×0.94)``."""
    from lattice_cli.output import DASH, metric_cell

    if first:
        return "baseline"
    delta, ratio = row.get("delta"), row.get("ratio")
    if not isinstance(delta, int | float):
        return DASH
    text = ("+" if delta >= 0 else "-") + metric_cell(abs(delta), unit)
    if isinstance(ratio, int | float):
        text += f" (×{ratio:.2f})"
    return text


def compare_table(answer: dict[str, Any]) -> str:
    """METRIC ALLOCATION MEAN MAX FINAL Δ_VS_FIRST TREND: one row per metric and
    allocation (the metric named on its first row); sparklines of a metric share their
    offsets and scale."""
    from lattice_cli.output import metric_cell, render_table

    step = float(answer.get("step_seconds") or 0)
    duration = float(answer.get("duration_seconds") or 0)
    rows = []
    for comp in answer.get("comparisons") or []:
        unit = str(comp.get("unit") or "")
        values = [p[1] for s in comp.get("series") or [] for p in s.get("points") or []]
        lo, hi = (min(values), max(values)) if values else (0.0, 0.0)
        for i, s in enumerate(comp.get("series") or []):
            points = s.get("points") or []
            trend = sparkline(points, step, duration, lo, hi) if points else "no data"
            rows.append(
                [
                    str(comp.get("metric") or "") if i == 0 else "",
                    str(s.get("allocation_id") or ""),
                    metric_cell(s.get("mean"), unit),
                    metric_cell(s.get("max"), unit),
                    metric_cell(s.get("final"), unit),
                    delta_cell(s, unit, i == 0),
                    trend,
                ]
            )
    return render_table(COLUMNS, rows)


def series_tables(answer: dict[str, Any]) -> list[str]:
    """``--series``: per metric a title line and OFFSET plus one column per allocation,
    a row per offset any of them has."""
    from lattice_cli.output import DASH, metric_cell, render_table

    out = []
    for comp in answer.get("comparisons") or []:
        unit = str(comp.get("unit") or "")
        columns = comp.get("series") or []
        by_id = [{float(t): v for t, v in s.get("points") or []} for s in columns]
        offsets = sorted({t for points in by_id for t in points})
        rows = [
            [_offset(t), *(metric_cell(p[t], unit) if t in p else DASH for p in by_id)]
            for t in offsets
        ]
        headers = ("OFFSET", *(str(s.get("allocation_id") or "") for s in columns))
        title = f"{comp.get('metric')} ({unit}, {_COMBINE.get(comp.get('combine'), '')})"
        out.append(title + "\n" + render_table(headers, rows))
    return out


_COMBINE = {
    "avg": "mean across nodes and GPUs",
    "sum": "sum across nodes and GPUs",
    "max": "max across nodes",
}
