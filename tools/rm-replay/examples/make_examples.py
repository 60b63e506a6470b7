"""Regenerate the examples: EASY backfill vs the Lattice scheduler on a generated trace
and on an SWF trace, through the ``rm-replay`` command.

    uv run python tools/rm-replay/examples/make_examples.py

Inputs: ``inputs/hpc-batch.weights.yaml`` (the specification's HPC batch profile for
every vCluster) and ``inputs/*.inventory.yaml``; the traces are regenerated from their
seeds into a temporary directory (``rm_replay.generate``), so only small files are
kept here. Outputs: ``generated/{easy,lattice}/`` and ``swf/{easy,lattice}/``
(report.txt, metrics.json, the PNGs; result.json and timing.json are dropped: large,
and timing.json is wall clock) and ``generated/compare.txt`` / ``swf/compare.txt``
(``rm-replay --compare easy lattice``; its cycle-latency lines are wall clock and
change from run to run, everything else is deterministic), and the tables between the
markers in ``README.md``.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

from rm_replay import generate
from rm_replay.cli import main as rm_replay
from rm_replay.compare import comparison_rows
from rm_replay.report import load_metrics

HERE = Path(__file__).resolve().parent
INPUTS = HERE / "inputs"
WEIGHTS = INPUTS / "hpc-batch.weights.yaml"
SEED = 1
SWF_JOBS = 1000


def _run(args: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = rm_replay(args)
    if code != 0:
        sys.exit(f"rm-replay {' '.join(args)} exited {code}")
    return buf.getvalue()


def _replay(kind: str, source: list[str], inventory: Path) -> None:
    out = HERE / kind
    for policy in ("easy", "lattice"):
        d = out / policy
        shutil.rmtree(d, ignore_errors=True)
        _run(
            [
                "run",
                *source,
                "--inventory",
                str(inventory),
                "--weights",
                str(WEIGHTS),
                "--policy",
                policy,
                "--seed",
                str(SEED),
                "--out",
                str(d),
                "--quiet",
            ]
        )
    text = _run(["--compare", str(out / "easy"), str(out / "lattice")])
    (out / "compare.txt").write_text(text, encoding="utf-8")
    print(text)


BEGIN = "<!-- tables:begin (written by make_examples.py) -->"
END = "<!-- tables:end -->"
TITLES = {
    "generated": "Generated trace: `steady-state`, seed 1 (600 jobs: HPC 65 %, ML 25 %, "
    "services 10 %; ~100 % offered load)",
    "swf": f"SWF trace: `workload.swf`, seed 1 ({SWF_JOBS} jobs, 64-core nodes, daily cycle)",
}


NAMES = {
    ("utilization", "gpu_utilization"): "GPU utilization",
    ("utilization", "node_utilization"): "Node utilization",
    ("wait", "overall", "p50_s"): "Wait p50",
    ("wait", "overall", "p95_s"): "Wait p95",
    ("wait", "overall", "p99_s"): "Wait p99",
    ("slowdown", "mean"): "Bounded slowdown, mean",
    ("fairness", "jain_index"): "Jain's fairness index",
    ("fairness", "max_share_deviation"): "Max tenant share deviation",
    ("backfill", "jobs"): "Backfill jobs",
    ("backfill", "effectiveness"): "Backfill effectiveness",
    ("slo", "compliance"): "SLO compliance (wait <= 1 h)",
    ("preemption", "total"): "Preemptions",
    ("preemption", "per_hour"): "Preemptions per hour",
    ("checkpoint", "success_rate"): "Checkpoint success rate",
    ("run", "makespan_s"): "Makespan",
    ("ramp_up", "ramp_up_s"): "Ramp-up to 80% busy",
    ("wall", "cycle_latency_p50_s"): "Cycle latency p50 (wall clock)",
    ("wall", "cycle_latency_p99_s"): "Cycle latency p99 (wall clock)",
}


def _table(kind: str) -> str:
    out = HERE / kind
    base = load_metrics(out / "easy")
    cand = load_metrics(out / "lattice")
    lines = [
        f"### {TITLES[kind]}",
        "",
        "| metric | EASY | Lattice | change | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for metric, b, c, chs, ch in comparison_rows(base, cand):
        name = NAMES.get(metric.path, f"{metric.section}: {metric.label}")
        lines.append(f"| {name} | {b} | {c} | {chs} | {ch.verdict} |")
    return "\n".join(lines) + "\n"


def _write_readme() -> None:
    readme = HERE / "README.md"
    text = readme.read_text(encoding="utf-8")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    tables = "\n".join(_table(k) for k in ("generated", "swf"))
    readme.write_text(f"{head}{BEGIN}\n{tables}{END}{tail}", encoding="utf-8")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rm-replay-examples-") as tmp:
        t = Path(tmp)
        s = generate.steady_state(seed=SEED)
        paths = s.write(t)
        shutil.copyfile(paths["inventory"], INPUTS / "generated.inventory.yaml")
        _replay("generated", ["--trace", str(paths["trace"])], INPUTS / "generated.inventory.yaml")

        swf = generate.write_swf(t / "workload.swf", SWF_JOBS, seed=SEED)
        (INPUTS / "swf.inventory.yaml").write_text(
            generate._yaml(generate.swf_inventory()), encoding="utf-8"
        )
        _replay(
            "swf",
            ["--swf", str(swf), "--cores-per-node", str(generate.SWF_CORES_PER_NODE)],
            INPUTS / "swf.inventory.yaml",
        )
    _write_readme()
    for kind in ("generated", "swf"):
        for policy in ("easy", "lattice"):
            for f in ("result.json", "timing.json"):
                (HERE / kind / policy / f).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
