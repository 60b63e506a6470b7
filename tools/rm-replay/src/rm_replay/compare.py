"""A/B comparison of two RM-Replay result directories (Performance Tuning Guide, step 4).

``rm-replay --compare results/baseline results/candidate`` (or
``python -m rm_replay.compare A B``): the first directory is the **baseline**, the
second the **candidate**; both were written by ``report.write_outputs``. The output
follows the Tuning Guide's example::

    === RM-Replay Results: fairness-boost ===
    Utilization:
      GPU-hours consumed: 1,234,567 / 1,500,000 available (82.3%)
      ↓ 2.1 pp vs baseline (84.4%)  worse (higher is better)
    Wait Time:
      p50: 12 min (baseline: 10 min) ↑ 20%  worse (lower is better)

Arrows give the direction of the change (↑ up, ↓ down, = unchanged); the word after
it says whether that is better or worse for the metric (or nothing for a metric with
no better direction, such as the number of backfilled jobs). Changes are relative
(``(candidate - baseline) / baseline``); utilization-like ratios are also given in
percentage points. A summary table closes the report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rm_replay.report import fmt_duration, fmt_num, fmt_pct, fmt_wall, load_metrics

HIGHER = "higher"
LOWER = "lower"


@dataclass(frozen=True)
class Metric:
    section: str
    label: str
    path: tuple[str, ...]  # into metrics.json, or ("wall", key) into timing.json
    kind: str  # duration | ratio | count | number | index | wall
    better: str | None  # HIGHER, LOWER or None


METRICS: tuple[Metric, ...] = (
    Metric("Utilization", "GPU utilization", ("utilization", "gpu_utilization"), "ratio", HIGHER),
    Metric("Utilization", "Node utilization", ("utilization", "node_utilization"), "ratio", HIGHER),
    Metric("Wait Time", "p50", ("wait", "overall", "p50_s"), "duration", LOWER),
    Metric("Wait Time", "p95", ("wait", "overall", "p95_s"), "duration", LOWER),
    Metric("Wait Time", "p99", ("wait", "overall", "p99_s"), "duration", LOWER),
    Metric("Bounded Slowdown", "mean", ("slowdown", "mean"), "number", LOWER),
    Metric("Fairness (Jain's Index)", "Jain's index", ("fairness", "jain_index"), "index", HIGHER),
    Metric(
        "Tenant Share Deviation",
        "Max deviation",
        ("fairness", "max_share_deviation"),
        "ratio",
        LOWER,
    ),
    Metric("Backfill", "Backfill jobs", ("backfill", "jobs"), "count", None),
    Metric("Backfill", "Backfill effectiveness", ("backfill", "effectiveness"), "ratio", HIGHER),
    Metric("SLO Compliance", "Wait within target", ("slo", "compliance"), "ratio", HIGHER),
    Metric("Preemptions", "Total", ("preemption", "total"), "count", LOWER),
    Metric("Preemptions", "Per hour", ("preemption", "per_hour"), "number", LOWER),
    Metric("Checkpoints", "Success rate", ("checkpoint", "success_rate"), "ratio", HIGHER),
    Metric("Makespan", "Makespan", ("run", "makespan_s"), "duration", LOWER),
    Metric("Ramp-up", "Time to 80% busy", ("ramp_up", "ramp_up_s"), "duration", LOWER),
    Metric("Scheduling Cycles", "Latency p50", ("wall", "cycle_latency_p50_s"), "wall", LOWER),
    Metric("Scheduling Cycles", "Latency p99", ("wall", "cycle_latency_p99_s"), "wall", LOWER),
)


def _lookup(metrics: Mapping[str, Any], wall: Mapping[str, Any] | None, path: Sequence[str]):
    if path[0] == "wall":
        return None if wall is None else wall.get(path[1])
    cur: Any = metrics
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _fmt(kind: str) -> Callable[[Any], str]:
    return {
        "duration": fmt_duration,
        "ratio": fmt_pct,
        "count": lambda v: fmt_num(v, 0),
        "number": lambda v: fmt_num(v, 2),
        "index": lambda v: fmt_num(v, 2),
        "wall": fmt_wall,
    }[kind]


@dataclass(frozen=True)
class Change:
    arrow: str  # ↑ ↓ = or ?
    pct: float | None  # relative change in %
    pp: float | None  # percentage points, for ratios
    verdict: str  # better | worse | same | "" (no direction) | n/a


def change(base: float | None, cand: float | None, better: str | None, kind: str) -> Change:
    """Direction, relative % change and verdict of ``base`` -> ``cand``."""
    if base is None or cand is None:
        return Change("?", None, None, "n/a")
    base = float(base)
    cand = float(cand)
    tol = 1e-12 + 1e-9 * max(abs(base), abs(cand))
    diff = cand - base
    pp = 100.0 * diff if kind == "ratio" else None
    if abs(diff) <= tol:
        return Change("=", 0.0, 0.0 if pp is not None else None, "same")
    arrow = "↑" if diff > 0 else "↓"
    pct = 100.0 * diff / abs(base) if abs(base) > tol else None
    if pct is not None and abs(pct) < 0.05 and (pp is None or abs(pp) < 0.05):
        return Change("=", 0.0, 0.0 if pp is not None else None, "same")  # below display
    verdict = ""
    if better is not None:
        verdict = "better" if (diff > 0) == (better == HIGHER) else "worse"
    return Change(arrow, pct, pp, verdict)


def _fmt_change(ch: Change, *, with_pp: bool) -> str:
    if ch.arrow == "?":
        return "n/a"
    if ch.arrow == "=":
        return "= 0%"
    mag = (
        "new"
        if ch.pct is None
        else f"{abs(ch.pct):.0f}%"
        if abs(ch.pct) >= 10
        else (f"{abs(ch.pct):.1f}%")
    )
    if with_pp and ch.pp is not None:
        return f"{ch.arrow} {abs(ch.pp):.1f} pp ({mag})"
    return f"{ch.arrow} {mag}"


def _verdict(ch: Change, better: str | None) -> str:
    if ch.verdict in ("better", "worse"):
        return f"{ch.verdict} ({better} is better)"
    return "" if ch.verdict == "n/a" else ch.verdict


def comparison_rows(
    base: tuple[Mapping[str, Any], Mapping[str, Any] | None],
    cand: tuple[Mapping[str, Any], Mapping[str, Any] | None],
) -> list[tuple[Metric, str, str, str, Change]]:
    """One row per :data:`METRICS` entry: (metric, baseline text, candidate text,
    change text, change)."""
    out = []
    for metric in METRICS:
        b = _lookup(base[0], base[1], metric.path)
        c = _lookup(cand[0], cand[1], metric.path)
        f = _fmt(metric.kind)
        ch = change(b, c, metric.better, metric.kind)
        out.append((metric, f(b), f(c), _fmt_change(ch, with_pp=metric.kind == "ratio"), ch))
    return out


def render_comparison(
    base: tuple[Mapping[str, Any], Mapping[str, Any] | None],
    cand: tuple[Mapping[str, Any], Mapping[str, Any] | None],
    *,
    base_name: str = "baseline",
    cand_name: str = "candidate",
) -> str:
    """The A/B report: ``cand`` against ``base`` (each ``(metrics, wall)``)."""
    bm = base[0]
    cm = cand[0]
    out: list[str] = [f"=== RM-Replay Results: {cand_name} ===", f"(baseline: {base_name})"]
    for key, label in (("trace", "Trace"), ("policy", "Policy"), ("seed", "Seed")):
        b, c = bm["run"].get(key), cm["run"].get(key)
        out.append(f"{label}: {c}" + ("" if b == c else f" (baseline: {b})"))

    # Headline: the Tuning Guide's utilization line.
    util_key = "gpu" if cm["run"].get("gpus") and bm["run"].get("gpus") else "node"
    unit = "GPU" if util_key == "gpu" else "Node"
    cu, bu = cm["utilization"], bm["utilization"]
    ch = change(bu[f"{util_key}_utilization"], cu[f"{util_key}_utilization"], HIGHER, "ratio")
    out += [
        "",
        "Utilization:",
        f"  {unit}-hours consumed: {fmt_num(cu[f'{util_key}_hours_used'])} / "
        f"{fmt_num(cu[f'{util_key}_hours_available'])} available "
        f"({fmt_pct(cu[f'{util_key}_utilization'])})",
        f"  {_fmt_change(ch, with_pp=True)} vs baseline "
        f"({fmt_pct(bu[f'{util_key}_utilization'])})  {_verdict(ch, HIGHER)}".rstrip(),
    ]

    rows: list[tuple[str, str, str, str, str]] = []
    section = "Utilization"
    for metric, b, c, chs, ch in comparison_rows(base, cand):
        rows.append((f"{metric.section}: {metric.label}", b, c, chs, ch.verdict))
        if metric.section == "Utilization":
            continue
        if metric.section != section:
            section = metric.section
            out += ["", f"{section}:"]
        label = "" if metric.label == section else f"{metric.label}: "
        if metric.section == "Fairness (Jain's Index)":
            label = ""
        line = f"  {label}{c} (baseline: {b}) {chs}"
        verdict = _verdict(ch, metric.better)
        out.append(f"{line}  {verdict}".rstrip())

    # Per-class waits (classes present in either run).
    classes = sorted(
        set(bm["wait"]["by_class"]) | set(cm["wait"]["by_class"]),
        key=lambda c: (int(c) if c.lstrip("-").isdigit() else 1 << 30, c),
    )
    if classes:
        out += ["", "Wait p99 by preemption class:"]
        for c in classes:
            b = bm["wait"]["by_class"].get(c, {}).get("p99_s")
            v = cm["wait"]["by_class"].get(c, {}).get("p99_s")
            ch = change(b, v, LOWER, "duration")
            line = f"  class {c}: {fmt_duration(v)} (baseline: {fmt_duration(b)}) "
            out.append(f"{line}{_fmt_change(ch, with_pp=False)}  {_verdict(ch, LOWER)}".rstrip())

    # Summary table.
    headers = ("metric", base_name, cand_name, "change", "verdict")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    sep = "  "
    out += ["", "Summary:"]
    out.append("  " + sep.join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    out.append("  " + sep.join("-" * w for w in widths))
    for r in rows:
        out.append("  " + sep.join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    better = sum(r[4] == "better" for r in rows)
    worse = sum(r[4] == "worse" for r in rows)
    out += ["", f"{better} metrics better, {worse} worse (candidate {cand_name} vs {base_name})"]
    return "\n".join(out) + "\n"


def compare_dirs(baseline: str | Path, candidate: str | Path) -> str:
    """The A/B report of two result directories (baseline first)."""
    b, c = Path(baseline), Path(candidate)
    return render_comparison(
        load_metrics(b),
        load_metrics(c),
        base_name=b.resolve().name,
        cand_name=c.resolve().name,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rm-replay --compare",
        description="Compare two RM-Replay result directories (baseline first).",
    )
    p.add_argument("baseline", type=Path)
    p.add_argument("candidate", type=Path)
    args = p.parse_args(argv)
    for d in (args.baseline, args.candidate):
        if not (d / "metrics.json").is_file():
            print(f"rm-replay: {d} has no metrics.json (not an RM-Replay output)", file=sys.stderr)
            return 2
    sys.stdout.write(compare_dirs(args.baseline, args.candidate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
