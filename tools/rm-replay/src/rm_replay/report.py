"""Write the outputs of one RM-Replay run: JSON, the text report, the plots.

``write_outputs(result, out_dir)`` writes into ``out_dir``:

=================  ====================================================================
``result.json``    the whole ``SimulationResult`` (:func:`rm_replay.model.dump_result`:
                   deterministic msgspec JSON, dict keys sorted, wall-clock fields
                   removed), so the same trace + weights + seed give byte-identical
                   files
``metrics.json``   :func:`rm_replay.metrics.metrics_dict` (deterministic as well)
``timing.json``    :func:`rm_replay.model.dump_timing`: replay wall time and each
                   cycle's decision time (wall clock; differs from run to run)
``report.txt``     the Performance Tuning Guide's summary report (``=== RM-Replay
                   Results: NAME ===``), plus the remaining metrics; only its "Scheduling
                   Cycles (wall clock)" lines differ between re-runs
``*.png``          :data:`rm_replay.plots.PLOT_FILES`
=================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from rm_replay import metrics as M
from rm_replay.model import dump_result, dump_timing

RESULT_FILE = "result.json"
METRICS_FILE = "metrics.json"
TIMING_FILE = "timing.json"
REPORT_FILE = "report.txt"


# -- formatting (shared with compare.py) -----------------------------------------------


def fmt_duration(seconds: float | None) -> str:
    """12 s / 12 min / 2.1 hr / 3.2 days, like the Tuning Guide's report."""
    if seconds is None:
        return "n/a"
    s = float(seconds)
    if s < 59.5:
        return f"{s:.0f} s"
    if s < 3600 - 30:
        m = s / 60.0
        return f"{m:.1f} min" if m < 9.95 else f"{m:.0f} min"
    h = s / 3600.0
    if h < 72:
        return f"{h:.1f} hr"
    return f"{h / 24.0:.1f} days"


def fmt_wall(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    s = float(seconds)
    if s < 1.0:
        return f"{s * 1000.0:.1f} ms"
    return f"{s:.2f} s"


def fmt_pct(ratio: float | None, digits: int = 1) -> str:
    return "n/a" if ratio is None else f"{100.0 * ratio:.{digits}f}%"


def fmt_num(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}"


# -- result.json / timing.json --------------------------------------------------------


def result_json_bytes(result: Any) -> bytes:
    """``result.json``: :func:`rm_replay.model.dump_result` (deterministic; no wall-clock
    fields), so the same trace + inventory + weights + seed give the same bytes and
    :func:`rm_replay.model.load_result` reads it back."""
    return dump_result(result)


def _json_bytes(data: Any) -> bytes:
    return msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n"


# -- report.txt ------------------------------------------------------------------------


def _class_name(c: str) -> str:
    extra = {"10": " (sensitive)", "0": " (scavenger)"}.get(c, "")
    return f"class {c}{extra}"


def render_report(metrics: Mapping[str, Any], wall: Mapping[str, Any] | None, name: str) -> str:
    """The text report of one run (Performance Tuning Guide layout)."""
    m = metrics
    run, jobs, util = m["run"], m["jobs"], m["utilization"]
    wait, fair, bf = m["wait"], m["fairness"], m["backfill"]
    lines: list[str] = [f"=== RM-Replay Results: {name} ==="]
    states = ", ".join(f"{k} {v}" for k, v in jobs["states"].items())
    lines += [
        f"Trace: {run['trace']}    Policy: {run['policy']}    Seed: {run['seed']}",
        f"Cluster: {run['nodes']:,} nodes, {run['gpus']:,} GPUs    "
        f"Jobs: {jobs['total']:,} ({states})",
        f"Makespan: {fmt_duration(run['makespan_s'])}",
        "",
        "Utilization:",
    ]
    if run["gpus"]:
        lines.append(
            f"  GPU-hours consumed: {fmt_num(util['gpu_hours_used'])} / "
            f"{fmt_num(util['gpu_hours_available'])} available "
            f"({fmt_pct(util['gpu_utilization'])})"
        )
    lines.append(
        f"  Node-hours consumed: {fmt_num(util['node_hours_used'])} / "
        f"{fmt_num(util['node_hours_available'])} available "
        f"({fmt_pct(util['node_utilization'])})"
    )
    o = wait["overall"]
    lines += [
        "",
        "Wait Time:",
        f"  p50: {fmt_duration(o['p50_s'])}",
        f"  p95: {fmt_duration(o['p95_s'])}",
        f"  p99: {fmt_duration(o['p99_s'])}",
        f"  mean: {fmt_duration(o['mean_s'])}    max: {fmt_duration(o['max_s'])}",
    ]
    if jobs["never_started"]:
        lines.append(f"  never started: {jobs['never_started']} (counted with their wait so far)")
    withdrawn = jobs.get("cancelled_before_start", 0)
    if withdrawn:
        lines.append(f"  cancelled before start: {withdrawn} (left out: withdrawn by the user)")
    lines.append("  By preemption class:")
    lines.append(f"    {'class':<20} {'jobs':>6} {'p50':>9} {'p95':>9} {'p99':>9}")
    for c, s in wait["by_class"].items():
        lines.append(
            f"    {_class_name(c):<20} {s['count']:>6} {fmt_duration(s['p50_s']):>9} "
            f"{fmt_duration(s['p95_s']):>9} {fmt_duration(s['p99_s']):>9}"
        )
    sd = m["slowdown"]
    lines += [
        "",
        f"Bounded Slowdown (tau = {sd['tau_s']:.0f} s):",
        f"  mean: {fmt_num(sd['mean'], 2)}    p50: {fmt_num(sd['p50'], 2)}    "
        f"p99: {fmt_num(sd['p99'], 2)}",
        "",
        "Fairness (Jain's Index):",
        f"  {fair['jain_index']:.2f}",
        "",
        "Tenant Share Deviation:",
        f"  Max deviation: {fmt_pct(fair['max_share_deviation'])}",
        f"    {'tenant':<16} {'target':>8} {'fair':>8} {'share':>8} {'deviation':>10} "
        f"{'node-hours':>11} {'demand':>9}",
    ]
    for t, r in fair["tenants"].items():
        lines.append(
            f"    {t:<16} {fmt_pct(r['target']):>8} {fmt_pct(r['fair_share']):>8} "
            f"{fmt_pct(r['share']):>8} {fmt_pct(r['deviation']):>10} "
            f"{fmt_num(r['node_hours']):>11} {fmt_num(r['demand_node_hours']):>9}"
        )
    span = (
        f"{fmt_duration(fair['window_start_s'] - run['t0_s'])} - "
        f"{fmt_duration(fair['window_end_s'] - run['t0_s'])}"
    )
    lines += [
        f"    (shares of the node-hours used during the {fair['window']} window, {span};",
        "     fair = the target, demand-aware: capacity a tenant did not ask for goes to",
        f"     the others; against the raw targets: max {fmt_pct(fair['max_target_deviation'])})",
        "",
        "Backfill:",
        f"  Backfill jobs: {bf['jobs']:,} ({fmt_pct(bf['share_of_jobs'])} of jobs)",
        f"  Backfill effectiveness: {fmt_pct(bf['effectiveness'])} of the idle node-time "
        f"while jobs waited ({fmt_num(bf['node_hours'])} node-h filled, "
        f"{fmt_num(bf['idle_node_hours_while_pending'])} node-h left idle)",
    ]
    slo, pre, ck = m["slo"], m["preemption"], m["checkpoint"]
    lines += [
        "",
        f"SLO Compliance (wait <= {fmt_duration(slo['target_wait_s'])}):",
        f"  {fmt_pct(slo['compliance'])} ({slo['compliant_jobs']:,} / "
        f"{jobs['total'] - withdrawn:,} jobs)",
        "",
        "Preemptions:",
        f"  Total: {pre['total']:,} ({fmt_num(pre['per_hour'], 2)} per hour, "
        f"{pre['jobs_preempted']:,} jobs preempted)",
        "",
        "Checkpoints:",
        f"  Success rate: {fmt_pct(ck['success_rate'])} "
        f"({ck['succeeded']:,} / {ck['attempted']:,} attempted)",
    ]
    sens = m["sensitive"]
    if sens["jobs"]:
        lines += [
            "",
            "Sensitive Claims:",
            f"  {sens['jobs']:,} jobs    max wait: {fmt_duration(sens['max_s'])}    "
            f"p99: {fmt_duration(sens['p99_s'])}",
        ]
    ru = m["ramp_up"]
    ramp = ru["ramp_up_s"]
    lines += [
        "",
        "Ramp-up:",
        f"  {fmt_pct(ru['target_utilization'], 0)} of nodes busy after "
        + (fmt_duration(ramp) if ramp is not None else "never reached"),
    ]
    sch = m["scheduling"]
    lines += [
        "",
        "Scheduling Cycles:",
        f"  cycles: {sch['cycles']:,}    placed: {sch['placed']:,}    "
        f"backfilled: {sch['backfilled']:,}    max pending: {sch['max_pending']:,}",
    ]
    if wall:
        lines.append(
            f"  latency (wall clock): p50 {fmt_wall(wall.get('cycle_latency_p50_s'))}    "
            f"p99 {fmt_wall(wall.get('cycle_latency_p99_s'))}    "
            f"max {fmt_wall(wall.get('cycle_latency_max_s'))}"
        )
    return "\n".join(lines) + "\n"


def write_outputs(
    result: Any,
    out_dir: str | Path,
    *,
    name: str | None = None,
    slo_wait_s: float = M.DEFAULT_SLO_WAIT_S,
    plots: bool = True,
) -> dict[str, Path]:
    """Write result.json, metrics.json, timing.json, report.txt and the PNGs into
    ``out_dir`` (created). ``name`` (default: the directory's name) titles the report.
    Returns the written paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = name or out.resolve().name
    metrics = M.metrics_dict(result, slo_wait_s=slo_wait_s)
    wall = M.wall_metrics(result)
    paths = {
        "result": out / RESULT_FILE,
        "metrics": out / METRICS_FILE,
        "timing": out / TIMING_FILE,
        "report": out / REPORT_FILE,
    }
    paths["result"].write_bytes(result_json_bytes(result))
    paths["metrics"].write_bytes(_json_bytes(metrics))
    paths["timing"].write_bytes(dump_timing(result))
    paths["report"].write_text(render_report(metrics, wall, name), encoding="utf-8")
    if plots:
        from rm_replay.plots import write_plots

        for p in write_plots(
            result,
            out,
            node_utilization=metrics["utilization"]["node_utilization"],
            fairness=metrics["fairness"],
        ):
            paths[p.stem] = p
    return paths


def load_metrics(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(metrics, wall or None) of a directory written by :func:`write_outputs`."""
    d = Path(run_dir)
    metrics = msgspec.json.decode((d / METRICS_FILE).read_bytes())
    t = d / TIMING_FILE
    wall = None
    if t.is_file():
        timing = msgspec.json.decode(t.read_bytes())
        wall = M.wall_metrics_from_durations(timing.get("cycle_duration_s") or [])
        wall["replay_wall_s"] = M.rnd(timing.get("wall_time_s"))
    return metrics, wall
