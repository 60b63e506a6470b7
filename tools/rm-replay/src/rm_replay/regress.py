"""The RM-Replay regression suite (Testing Strategy, Level 3): ``rm-replay regress``.

Generates the seven regression traces (:mod:`rm_replay.generate`, seeded), writes them
with their inventories and weight profiles, loads them back through the same loaders
as ``rm-replay --trace`` (``trace.load_trace``, ``inventory.load_inventory``,
``weights.load_weights``), replays each with the real scheduler (policy ``lattice``),
writes each run's outputs (``report.write_outputs``) and checks the specification's
thresholds:

=================  ===========================================  ======================
trace              metric                                       threshold
=================  ===========================================  ======================
steady-state       utilization (GPU-hours used / available)     > 85 %
burst              p99 wait                                     < 4 h
unfair             max tenant share deviation (demand-aware,    < 10 %
                   percentage points; ``metrics.fairness``)
sensitive-claim    max wait of sensitive (class 10) claims      = 0 (all started)
preemption-heavy   checkpoint success rate                      > 95 % (>= 1 attempt)
empty-to-full      ramp-up to 80 % busy; cycle latency p50/p99  reported (ramp-up
                                                                reached; p99 < 5 s,
                                                                the spec's benchmark)
checkpoint-broker  lost node-hours with the checkpoint broker   <= 50 %
                   / without it (the same trace replayed with
                   ``checkpoint_broker=False``)
checkpoint-broker  reactive allocations scaled                  reported (> 0)
=================  ===========================================  ======================

The checkpoint-broker trace is replayed twice (its ``meta.compare``): as Lattice runs
it, and without the checkpoint broker (every preemption a SIGTERM); the second run's
metrics go into the first's as ``without_broker`` (and its outputs beside it, in
``results/checkpoint-broker-without-broker/``). Its table also reports the class-8
work's p95 wait in both runs: checkpointing victims hold their nodes for their
checkpoint, so checkpoint-aware preemption may start the preemptor later; the suite
shows that cost and does not gate on it.

Prints a table (trace, metric, value, threshold, result) and exits 1 when a check
fails. A check listed in :data:`KNOWN_FAILURES` (a scheduler limitation found by this
suite, with the reason) is reported as ``KNOWN-FAIL`` and does not fail the run unless
``--strict``; if it starts passing it is reported as ``XPASS`` and does fail the run,
so that the entry gets removed.

``rm-replay regress [--out DIR] [--seed N] [--policy P] [--plots] [--strict]``
(also ``python -m rm_replay.regress``). Without ``--out`` everything goes to a
temporary directory that is removed afterwards.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rm_replay import generate
from rm_replay.report import fmt_duration, fmt_pct, fmt_wall, write_outputs

CYCLE_P99_LIMIT_S = 5.0

# Lost node-hours with the broker over those without it. In the checkpoint-broker
# trace 80 % of the batch jobs and every reactive service checkpoint, at the replay's
# default 98 % success, so if the scheduler picked the same victims in both runs the
# ratio would be about 0.2 + 0.8 x 0.02 = 0.22 of the batch part (seed 0: 81 / 277 h,
# 0.29: the victims differ between the runs); 0.5 leaves room for that and still fails
# when checkpointed work stops being kept (the ratio goes to 1).
LOST_WORK_RATIO_LIMIT = 0.5

# Checks that fail with the current scheduler, and why. Each entry is a finding of
# this suite; remove it when the scheduler is fixed (the run then reports XPASS).
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
# Empty since the fair share target became a score multiplier (cost.share_penalty);
# the unfair trace's deviation was 25.6% before it (tenants got their share of the
# demand, not of the targets).


@dataclass(frozen=True)
class Check:
    trace: str
    metric: str
    threshold: str
    value: Callable[[dict[str, Any], dict[str, Any]], Any]  # (metrics, wall) -> value
    ok: Callable[[Any], bool]
    fmt: Callable[[Any], str]


def _utilization(m: dict[str, Any], _w: dict[str, Any]) -> float | None:
    u = m["utilization"]
    return u["gpu_utilization"] if m["run"]["gpus"] else u["node_utilization"]


def _lost_ratio(m: dict[str, Any], _w: dict[str, Any]) -> tuple[float, float]:
    """(lost node-hours with the broker, without it)."""
    off = m.get("without_broker") or {}
    return (
        m["checkpoint"]["lost_node_hours"],
        (off.get("checkpoint") or {}).get("lost_node_hours") or 0.0,
    )


def _lost_ratio_ok(v: tuple[float, float]) -> bool:
    on, off = v
    return off > 0 and on / off <= LOST_WORK_RATIO_LIMIT


def _lost_ratio_fmt(v: tuple[float, float]) -> str:
    on, off = v
    ratio = f"{on / off:.0%}" if off > 0 else "n/a"
    return f"{on:,.0f} / {off:,.0f} h ({ratio})"


def _class8_p95(m: dict[str, Any], _w: dict[str, Any]) -> tuple[Any, Any]:
    off = (m.get("without_broker") or {}).get("wait", {}).get("by_class", {})
    return (
        m["wait"]["by_class"].get("8", {}).get("p95_s"),
        off.get("8", {}).get("p95_s"),
    )


def _sensitive(m: dict[str, Any], _w: dict[str, Any]) -> tuple[int, int, float | None]:
    s = m["sensitive"]
    return (s["jobs"], s["count"], s["max_s"])


def _sensitive_fmt(v: tuple[int, int, float | None]) -> str:
    jobs, _count, mx = v
    return f"{fmt_duration(mx)} max ({jobs} claims)" if jobs else "no sensitive jobs"


def _never_started_sensitive(m: dict[str, Any]) -> bool:
    # a never-started claim has a censored wait > 0, so max wait = 0 implies all started
    return m["sensitive"]["jobs"] > 0 and m["sensitive"]["max_s"] == 0.0


CHECKS: tuple[Check, ...] = (
    Check(
        "steady-state",
        "utilization",
        "> 85%",
        _utilization,
        lambda v: v is not None and v > 0.85,
        fmt_pct,
    ),
    Check(
        "burst",
        "p99 wait",
        "< 4 h",
        lambda m, _w: m["wait"]["overall"]["p99_s"],
        lambda v: v is not None and v < 4 * 3600,
        fmt_duration,
    ),
    Check(
        "unfair",
        "max tenant share deviation",
        "< 10%",
        lambda m, _w: m["fairness"]["max_share_deviation"],
        lambda v: v is not None and v < 0.10,
        fmt_pct,
    ),
    Check(
        "sensitive-claim",
        "sensitive wait",
        "= 0 (immediate)",
        _sensitive,
        lambda v: v[0] > 0 and v[2] is not None and v[2] == 0.0,
        _sensitive_fmt,
    ),
    Check(
        "preemption-heavy",
        "checkpoint success rate",
        "> 95%",
        lambda m, _w: (m["checkpoint"]["success_rate"], m["checkpoint"]["attempted"]),
        lambda v: v[1] > 0 and v[0] is not None and v[0] > 0.95,
        lambda v: f"{fmt_pct(v[0])} of {v[1]:,}",
    ),
    Check(
        "empty-to-full",
        "ramp-up to 80% busy",
        "reported (reached)",
        lambda m, _w: m["ramp_up"]["ramp_up_s"],
        lambda v: v is not None,
        lambda v: fmt_duration(v) if v is not None else "never",
    ),
    Check(
        "empty-to-full",
        "cycle latency p50 / p99 (wall)",
        f"reported (p99 < {CYCLE_P99_LIMIT_S:.0f} s)",
        lambda _m, w: (w.get("cycle_latency_p50_s"), w.get("cycle_latency_p99_s")),
        lambda v: v[1] is not None and v[1] < CYCLE_P99_LIMIT_S,
        lambda v: f"{fmt_wall(v[0])} / {fmt_wall(v[1])}",
    ),
    Check(
        "checkpoint-broker",
        "lost node-hours, broker / none",
        f"<= {LOST_WORK_RATIO_LIMIT:.0%}",
        _lost_ratio,
        _lost_ratio_ok,
        _lost_ratio_fmt,
    ),
    Check(
        "checkpoint-broker",
        "reactive scale-ups",
        "reported (> 0)",
        lambda m, _w: m["autoscaling"]["scale_ups"],
        lambda v: v > 0,
        lambda v: f"{v:,}",
    ),
    Check(
        "checkpoint-broker",
        "class-8 p95 wait, broker / none",
        "reported",
        _class8_p95,
        lambda v: v[0] is not None and v[1] is not None,
        lambda v: f"{fmt_duration(v[0])} / {fmt_duration(v[1])}",
    ),
)


@dataclass(frozen=True)
class Row:
    trace: str
    metric: str
    value: str
    threshold: str
    status: str  # PASS | FAIL | KNOWN-FAIL | XPASS
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "XPASS")


def replay_scenario(
    scenario: generate.Scenario,
    trace_dir: Path,
    *,
    policy: str = "lattice",
    checkpoint_broker: bool = True,
) -> Any:
    """Write a scenario's files, load them back with the CLI's loaders and replay."""
    from rm_replay.engine import simulate
    from rm_replay.inventory import load_inventory
    from rm_replay.trace import load_trace
    from rm_replay.weights import load_weights

    paths = scenario.write(trace_dir)
    return simulate(
        load_trace(paths["trace"]),
        load_inventory(paths["inventory"]),
        policy=policy,
        weights_by_vcluster=load_weights(paths["weights"]),
        seed=scenario.seed,
        trace_name=scenario.name,
        checkpoint_broker=checkpoint_broker,
    )


def run_suite(
    out_dir: Path,
    *,
    seed: int = 0,
    policy: str = "lattice",
    plots: bool = False,
    traces: Sequence[str] = generate.REGRESSION_TRACES,
    strict: bool = False,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Generate, replay and check; results under ``out_dir/results/<trace>/``."""
    from rm_replay import metrics as M

    rows: list[Row] = []
    for name in traces:
        t0 = time.perf_counter()
        scenario = generate.SCENARIOS[name](seed)
        result = replay_scenario(scenario, out_dir / "traces", policy=policy)
        write_outputs(result, out_dir / "results" / name, name=f"{name} ({policy})", plots=plots)
        m = M.metrics_dict(result)
        w = M.wall_metrics(result)
        if scenario.meta.get("compare") == "checkpoint_broker":
            off = replay_scenario(
                scenario, out_dir / "traces", policy=policy, checkpoint_broker=False
            )
            label = f"{name}-without-broker"
            write_outputs(off, out_dir / "results" / label, name=f"{label} ({policy})", plots=plots)
            m["without_broker"] = M.metrics_dict(off)
        if log:
            log(f"{name}: {len(scenario.events)} jobs replayed in {time.perf_counter() - t0:.1f} s")
        for check in CHECKS:
            if check.trace != name:
                continue
            value = check.value(m, w)
            passed = check.ok(value)
            known = KNOWN_FAILURES.get((name, check.metric))
            if passed:
                status = "XPASS" if known and not strict else "PASS"
                note = "known failure now passes: remove it from KNOWN_FAILURES" if known else ""
            elif known and not strict:
                status, note = "KNOWN-FAIL", known
            else:
                status, note = "FAIL", known or ""
            rows.append(Row(name, check.metric, check.fmt(value), check.threshold, status, note))
    return rows


def render_table(rows: Sequence[Row]) -> str:
    headers = ("trace", "metric", "value", "threshold", "result")
    cells = [(r.trace, r.metric, r.value, r.threshold, r.status) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    notes = [r for r in rows if r.note]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"{r.status} {r.trace} / {r.metric}: {r.note}")
    passed = sum(r.status == "PASS" for r in rows)
    failed = sum(r.failed for r in rows)
    known = sum(r.status == "KNOWN-FAIL" for r in rows)
    lines.append("")
    lines.append(
        f"{len(rows)} check{'s' if len(rows) != 1 else ''}: {passed} passed, {failed} failed"
        + (f", {known} known failure{'s' if known != 1 else ''}" if known else "")
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rm-replay regress",
        description="Generate and replay the seven regression traces and check their thresholds.",
    )
    p.add_argument("--out", type=Path, default=None, help="keep traces and results here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="lattice")
    p.add_argument("--plots", action="store_true", help="also write the PNG plots")
    p.add_argument(
        "--strict",
        action="store_true",
        default=True,
        help="every miss fails the run, known or not (the default)",
    )
    p.add_argument(
        "--allow-known-failures",
        dest="strict",
        action="store_false",
        help="report checks listed in KNOWN_FAILURES as KNOWN-FAIL without failing the run",
    )
    p.add_argument(
        "--trace",
        action="append",
        choices=generate.REGRESSION_TRACES,
        help="run only this trace (repeatable)",
    )
    args = p.parse_args(argv)
    traces = tuple(args.trace or generate.REGRESSION_TRACES)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def go(out: Path) -> list[Row]:
        return run_suite(
            out,
            seed=args.seed,
            policy=args.policy,
            plots=args.plots,
            traces=traces,
            strict=args.strict,
            log=log,
        )

    if args.out is not None:
        rows = go(args.out)
        where = f"; traces and results in {args.out}"
    else:
        with tempfile.TemporaryDirectory(prefix="rm-replay-regress-") as tmp:
            rows = go(Path(tmp))
        where = ""
    print(f"RM-Replay regression suite (policy {args.policy}, seed {args.seed}{where})")
    sys.stdout.write(render_table(rows))
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
