"""PNG plots of one RM-Replay run (matplotlib, Agg; no pyplot global state).

Three figures with fixed file names (:data:`PLOT_FILES`):

* ``wait_cdf.png`` -- cumulative distribution of queue wait per preemption class
  (x in hours on a symmetric-log axis, so zero waits are visible);
* ``utilization.png`` -- busy nodes and GPUs as a share of the inventory over time,
  with the pending-queue length at each scheduling cycle below;
* ``tenant_share.png`` -- the inventory's nodes busy per tenant over time (stacked,
  1-hour rolling mean of the samples), and each tenant's share of the node-hours in
  the fairness window against its (demand-aware) fair share.

Files carry no timestamps or version strings (``metadata={"Software": None}``), so the
same result gives byte-identical PNGs on the same matplotlib and fonts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure

from rm_replay import metrics as M

PLOT_FILES = ("wait_cdf.png", "utilization.png", "tenant_share.png")
_METADATA = {"Software": None}
_DPI = 110
_SIZE = (8.0, 4.6)
_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _title(result: Any, what: str) -> str:
    trace = M._get(result, "trace_name") or "trace"
    policy = M._get(result, "policy") or "?"
    return f"{what} — {trace} ({policy})"


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=_DPI, metadata=_METADATA)


def _class_label(c: Any) -> str:
    names = {10: "sensitive", 0: "scavenger"}
    try:
        extra = names.get(int(c))
    except (TypeError, ValueError):
        extra = None
    return f"class {c}" + (f" ({extra})" if extra else "")


# Wait-axis ticks (seconds) and their labels; the axis is symmetric-log in minutes.
_WAIT_TICKS = (
    (0, "0"),
    (60, "1 min"),
    (300, "5 min"),
    (900, "15 min"),
    (3600, "1 h"),
    (4 * 3600, "4 h"),
    (12 * 3600, "12 h"),
    (86400, "1 d"),
    (3 * 86400, "3 d"),
    (7 * 86400, "7 d"),
    (30 * 86400, "30 d"),
)


def plot_wait_cdf(result: Any, path: Path) -> None:
    jobs = list(M._get(result, "jobs") or [])
    _, t_end = M.window(result)
    by_class: dict[Any, list[float]] = {}
    for j in jobs:
        if M.cancelled_before_start(j):
            continue  # withdrawn by its user: not a wait (as in the metrics)
        w, _ = M.job_wait(j, t_end)
        by_class.setdefault(j.preemption_class, []).append(w / 60.0)
    fig = Figure(figsize=_SIZE)
    ax = fig.subplots()
    top = 1.0
    for i, c in enumerate(sorted(by_class, key=M._class_key, reverse=True)):
        xs = sorted(by_class[c])
        n = len(xs)
        ys = [(k + 1) / n for k in range(n)]
        top = max(top, xs[-1])
        # ECDF as a step function from (0, 0), extended flat to the right edge.
        ax.step(
            [0.0, *xs],
            [0.0, *ys],
            where="post",
            color=_COLORS[i % len(_COLORS)],
            linewidth=1.8,
            label=f"{_class_label(c)}, n={n}",
        )
    if not by_class:
        ax.text(0.5, 0.5, "no jobs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    ticks = [(s / 60.0, lab) for s, lab in _WAIT_TICKS if s / 60.0 <= top * 1.5] or [(0, "0")]
    nxt = next((s / 60.0 for s, _ in _WAIT_TICKS if s / 60.0 > top * 1.5), None)
    right = max(top * 1.15, 1.0) if nxt is None else min(nxt, max(top * 1.15, 1.0))
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks])
    ax.set_xticks([], minor=True)
    ax.set_xlim(0.0, right)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("queue wait (log scale above 1 min; never-started jobs at their wait so far)")
    ax.set_ylabel("fraction of jobs with wait ≤ x")
    ax.grid(True, which="major", alpha=0.35)
    ax.set_title(_title(result, "Wait-time CDF per preemption class"))
    if by_class:
        ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    _save(fig, path)


def _rolling_mean(ts: Sequence[float], ys: Sequence[float], width: float) -> list[float]:
    """Trailing mean of ``ys`` over ``width`` seconds of ``ts`` (sorted)."""
    out: list[float] = []
    lo = 0
    acc = 0.0
    for i, (t, y) in enumerate(zip(ts, ys, strict=True)):
        acc += y
        while ts[lo] < t - width and lo < i:
            acc -= ys[lo]
            lo += 1
        out.append(acc / (i - lo + 1))
    return out


def plot_utilization(result: Any, path: Path, node_utilization: float | None = None) -> None:
    samples = sorted(M._get(result, "samples") or [], key=lambda s: s.t)
    cycles = sorted(M._get(result, "cycles") or [], key=lambda c: c.t)
    t0, _ = M.window(result)
    fig = Figure(figsize=(_SIZE[0], _SIZE[1] * 1.25))
    ax, axq = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if samples:
        ts = [(s.t - t0) / 3600.0 for s in samples]
        nodes = [100.0 * s.busy_nodes / s.total_nodes if s.total_nodes else 0.0 for s in samples]
        gpus = [100.0 * s.busy_gpus / s.total_gpus if s.total_gpus else 0.0 for s in samples]
        same = not any(s.total_gpus for s in samples) or all(
            abs(a - b) < 1e-9 for a, b in zip(nodes, gpus, strict=True)
        )
        label = "busy nodes" if not any(s.total_gpus for s in samples) else "busy nodes and GPUs"
        ax.step(
            ts,
            nodes,
            where="post",
            color=_COLORS[0],
            linewidth=1.4,
            label=label if same else "busy nodes",
        )
        if not same:
            ax.step(ts, gpus, where="post", color=_COLORS[2], linewidth=1.1, label="busy GPUs")
        if node_utilization is None:
            node_utilization = M.metrics_dict(result)["utilization"]["node_utilization"]
        m = 100.0 * (node_utilization or 0.0)
        ax.axhline(
            m,
            color="black",
            linestyle=":",
            linewidth=1.2,
            label=f"node utilization over the run: {m:.1f}%",
        )
        ax.legend(
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0),
            fontsize=8,
            ncol=3,
            frameon=False,
        )
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0.0, 105.0)
    ax.set_ylabel("inventory busy (%)")
    ax.grid(True, alpha=0.35)
    fig.suptitle(_title(result, "Utilization over time"))
    if cycles:
        axq.step(
            [(c.t - t0) / 3600.0 for c in cycles],
            [c.pending for c in cycles],
            where="post",
            color=_COLORS[1],
            linewidth=1.0,
        )
    axq.set_ylim(bottom=0)
    axq.set_ylabel("pending jobs\n(at each cycle)")
    axq.grid(True, alpha=0.35)
    axq.set_xlabel("simulated time since first submission (hours)")
    fig.tight_layout()
    _save(fig, path)


def plot_tenant_share(result: Any, path: Path, fairness: dict[str, Any] | None = None) -> None:
    """Left: the inventory's nodes busy per tenant over time (stacked, 1 h rolling
    mean). Right: each tenant's share of the node-hours in the fairness window
    against its (demand-aware) fair share, as in ``metrics.json``."""
    samples = sorted(M._get(result, "samples") or [], key=lambda s: s.t)
    t0, _ = M.window(result)
    tenants = sorted({t for s in samples for t in (s.per_tenant_busy_nodes or {})})
    if fairness is None:
        fairness = M.fairness(result)
    fig = Figure(figsize=(_SIZE[0] * 1.2, _SIZE[1] * 1.1))
    ax, axb = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.15]})
    colors = {t: _COLORS[i % len(_COLORS)] for i, t in enumerate(tenants)}
    if samples and tenants:
        ts_s = [s.t for s in samples]
        ts = [(t - t0) / 3600.0 for t in ts_s]
        series = []
        for tenant in tenants:
            busy = [
                100.0 * (s.per_tenant_busy_nodes or {}).get(tenant, 0) / s.total_nodes
                if s.total_nodes
                else 0.0
                for s in samples
            ]
            series.append(_rolling_mean(ts_s, busy, 3600.0))
        ax.stackplot(
            ts,
            *series,
            labels=tenants,
            colors=[colors[t] for t in tenants],
            alpha=0.85,
            linewidth=0.0,
        )
        ax.legend(
            loc="upper center",
            bbox_to_anchor=(0.5, -0.14),
            fontsize=8,
            ncol=min(len(tenants), 5),
            frameon=False,
        )
        lo = (fairness.get("window_start_s") or t0) - t0
        hi = (fairness.get("window_end_s") or t0) - t0
        ax.axvspan(lo / 3600.0, hi / 3600.0, color="black", alpha=0.04, linewidth=0)
    else:
        ax.text(0.5, 0.5, "no tenant usage", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0.0, 100.0)
    ax.set_xlabel("simulated time since first submission (hours)")
    ax.set_ylabel("inventory nodes busy, by tenant (%, 1 h mean)")
    ax.grid(True, alpha=0.35)
    ax.set_title("busy nodes by tenant (shaded: fairness window)", fontsize=9)

    rows = fairness.get("tenants") or {}
    names = [t for t in sorted(rows) if rows[t].get("share") is not None]
    ys = list(range(len(names)))[::-1]
    for y, t in zip(ys, names, strict=True):
        r = rows[t]
        axb.barh(y, 100.0 * r["share"], color=colors.get(t, "#888888"), height=0.6)
        if r.get("fair_share") is not None:
            axb.plot(
                [100.0 * r["fair_share"]] * 2,
                [y - 0.4, y + 0.4],
                color="black",
                linewidth=2.0,
            )
    axb.set_yticks(ys, names, fontsize=8)
    top = max(
        [100.0 * (rows[t].get("share") or 0) for t in names]
        + [100.0 * (rows[t].get("fair_share") or 0) for t in names]
        + [10.0]
    )
    axb.set_xlim(0.0, min(100.0, top * 1.15))
    axb.set_xlabel("share of node-hours (%)")
    axb.grid(True, axis="x", alpha=0.35)
    dev = fairness.get("max_share_deviation")
    jain = fairness.get("jain_index")
    axb.set_title(
        "window share (bar) vs fair share (|)\n"
        + (f"max dev {100.0 * dev:.1f} pp, Jain {jain:.2f}" if dev is not None else ""),
        fontsize=9,
    )
    fig.suptitle(_title(result, "Tenant share"))
    fig.tight_layout()
    _save(fig, path)


def write_plots(
    result: Any,
    out_dir: Path,
    *,
    node_utilization: float | None = None,
    fairness: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the three PNGs into ``out_dir``; returns their paths. ``node_utilization``
    / ``fairness``: from ``metrics_dict`` when the caller has it (saves recomputing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOT_FILES]
    plot_wait_cdf(result, paths[0])
    plot_utilization(result, paths[1], node_utilization)
    plot_tenant_share(result, paths[2], fairness)
    return paths
