"""The ``rm-replay`` command.

::

    rm-replay run --trace T.jsonl --inventory inv.yaml --weights w.yaml --policy lattice \\
        --seed 0 --out results/a
    rm-replay run --swf F.swf --cores-per-node 64 --inventory inv.yaml --out results/swf
    rm-replay --trace=T.jsonl --weights=w.yaml --nodes=inv.yaml --output=results/a
    rm-replay --compare results/a results/b
    rm-replay regress ...
    rm-replay check --trace T.jsonl --inventory inv.yaml --weights w.yaml
    rm-replay convert-swf F.swf --cores-per-node 64 -o T.jsonl

The Tuning Guide's spellings work too: options without a subcommand mean ``run``
(``--nodes`` = ``--inventory``, ``--output`` = ``--out``), and ``--compare A B`` means
``compare A B``. ``compare``, ``regress`` and ``generate`` hand their arguments to
``rm_replay.compare`` / ``rm_replay.regress`` / ``rm_replay.generate``.

Bad input (a missing file, a malformed trace line, an SWF line without 18 fields, an
unknown weight) prints ``Error: ...`` and ``Hint: ...`` and exits with status 2; an
unexpected failure prints ``Error: internal error`` and exits with 1 (set
``RM_REPLAY_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import enum
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from lattice_common.error_text import render_error

from rm_replay import __version__
from rm_replay.model import (
    RESULT_FILE,
    CancelEvent,
    ReplayInputError,
    SimulationResult,
    SubmitEvent,
    TraceEvent,
    dump_result,
    dump_timing,
)

HELP = """RM-Replay: replay workload traces through the real Lattice scheduler in simulated time.

Capture a trace, replay it with different weight profiles (or against the FCFS and
EASY baselines), compare the results, deploy the weights with confidence.
Options without a subcommand mean `run`; `--compare A B` means `compare A B`.
"""

app = typer.Typer(
    name="rm-replay",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class PolicyName(enum.StrEnum):
    lattice = "lattice"
    fcfs = "fcfs"
    easy = "easy"


class TenantBy(enum.StrEnum):
    group = "group"
    user = "user"


class _Fail(Exception):
    def __init__(self, message: str, hint: str = "", code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code


def _fail(message: str, hint: str = "", code: int = 2) -> NoReturn:
    raise _Fail(message, hint, code)


def _guard(fn: Callable[[], int | None]) -> None:
    """Run a command body: bad input -> Error + Hint, exit 2; never a traceback."""
    try:
        code = fn()
    except _Fail as e:
        _print_error(e.message, e.hint)
        raise typer.Exit(e.code) from None
    except ReplayInputError as e:
        typer.echo(e.render(), err=True)
        raise typer.Exit(2) from None
    except FileNotFoundError as e:
        _print_error(f"no such file: {e.filename}", "Check the path.")
        raise typer.Exit(2) from None
    except IsADirectoryError as e:
        _print_error(f"{e.filename} is a directory, not a file", "Give the file's path.")
        raise typer.Exit(2) from None
    except OSError as e:
        _print_error(f"cannot use {e.filename or 'a file'}: {e.strerror or e}", "")
        raise typer.Exit(2) from None
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt:
        _print_error("interrupted", "")
        raise typer.Exit(130) from None
    except Exception as e:
        if os.environ.get("RM_REPLAY_DEBUG"):
            raise
        _print_error(
            f"internal error: {type(e).__name__}: {e}",
            "This is a bug in rm-replay; rerun with RM_REPLAY_DEBUG=1 for the traceback "
            "and report it.",
        )
        raise typer.Exit(1) from None
    if code:
        raise typer.Exit(code)


def _print_error(message: str, hint: str) -> None:
    typer.echo(render_error(message, hint=hint), err=True)


def _need_file(path: Path | None, option: str) -> Path:
    if path is None:
        _fail(f"{option} is required", f"Pass {option} PATH.")
    if not path.exists():
        _fail(
            f"{option}: {path} does not exist",
            "Check the path (relative to the current directory).",
        )
    if not path.is_file():
        _fail(f"{option}: {path} is not a file", "Give the path of a file.")
    return path


def _queue_map(items: Sequence[str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for item in items:
        q, sep, vc = item.partition("=")
        q = q.strip()
        if not sep or not q.lstrip("-").isdigit() or not q.isascii() or not vc.strip():
            _fail(
                f"--queue-map {item!r}: expected QUEUE=VCLUSTER",
                "For example --queue-map 1=hpc-batch --queue-map 2=ml-training.",
            )
        out[int(q)] = vc.strip()
    return out


def _load_events(
    trace: Path | None,
    swf: Path | None,
    cores_per_node: int | None,
    tenant_by: TenantBy,
    queue_map: Sequence[str],
    default_vcluster: str | None,
) -> tuple[list[TraceEvent], str]:
    from rm_replay.swf import parse_swf
    from rm_replay.trace import read_trace

    if (trace is None) == (swf is None):
        _fail(
            "give exactly one of --trace or --swf",
            "--trace reads a JSON-lines trace; --swf a Standard Workload Format file.",
        )
    if trace is not None:
        events, orphans = read_trace(_need_file(trace, "--trace"))
        if orphans:
            typer.echo(
                f"rm-replay: ignored {len(orphans)} completion(s) of allocations the trace "
                f"never submits (e.g. {orphans[0]!r}; work already running when capture began)",
                err=True,
            )
        return events, trace.stem
    assert swf is not None
    _need_file(swf, "--swf")
    if cores_per_node is None:
        _fail(
            "--swf needs --cores-per-node",
            "SWF counts processors; pass the cores of one node of the traced system, e.g. "
            "--cores-per-node 64.",
        )
    with swf.open("rb") as f:
        parsed = parse_swf(
            f,
            cores_per_node=cores_per_node,
            tenant_by=tenant_by.value,
            queue_map=_queue_map(queue_map),
            default_vcluster=default_vcluster or "",
            path=str(swf),
        )
    if parsed.skipped:
        reasons: dict[str, int] = {}
        for _, _, why in parsed.skipped:
            reasons[why] = reasons.get(why, 0) + 1
        detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        typer.echo(f"rm-replay: skipped {len(parsed.skipped)} SWF job(s): {detail}", err=True)
    return list(parsed.events), swf.stem


def _duration(text: str | None, option: str) -> float | None:
    from rm_replay.trace import parse_duration_value

    if text is None:
        return None
    try:
        return parse_duration_value(text, option)
    except ReplayInputError as e:
        _fail(f"{option}: {e.message}", e.hint)


# --------------------------------------------------------------------------- run

TraceOpt = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Workload trace, JSON lines (the Tuning Guide's format).",
        show_default=False,
    ),
]
SwfOpt = Annotated[
    Path | None,
    typer.Option(
        "--swf",
        help="Workload in the Standard Workload Format instead of --trace.",
        show_default=False,
    ),
]
InventoryOpt = Annotated[
    Path | None,
    typer.Option(
        "--inventory",
        "--nodes",
        help="Node inventory YAML (node classes: count, GPUs, dragonfly groups, conformance).",
        show_default=False,
    ),
]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        help="Weight profile YAML per vCluster (Tuning Guide keys or w1..w9). "
        "Default: each vCluster's named profile, else the balanced baseline.",
        show_default=False,
    ),
]
CoresOpt = Annotated[
    int | None,
    typer.Option(
        "--cores-per-node",
        min=1,
        help="SWF only: processors per node (nodes = ceil(processors / this)).",
        show_default=False,
    ),
]
TenantByOpt = Annotated[
    TenantBy,
    typer.Option("--tenant-by", help="SWF only: tenant from the job's group id or user id."),
]
QueueMapOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--queue-map",
        help="SWF only: QUEUE=VCLUSTER (repeatable); other queues go to the default vCluster.",
        show_default=False,
    ),
]
DefaultVcOpt = Annotated[
    str | None,
    typer.Option(
        "--default-vcluster",
        help="vCluster of submissions that name none. Default: the only vCluster in --weights, else 'default'.",
        show_default=False,
    ),
]


@app.command("run")
def run_cmd(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "--output",
            "-o",
            help="Result directory (created): result.json, timing.json, report.",
            show_default=False,
        ),
    ] = None,
    trace: TraceOpt = None,
    swf: SwfOpt = None,
    inventory: InventoryOpt = None,
    weights: WeightsOpt = None,
    policy: Annotated[
        PolicyName,
        typer.Option(
            "--policy",
            help="lattice: the real scheduler; fcfs: strict arrival order; easy: EASY backfill.",
        ),
    ] = PolicyName.lattice,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the checkpoint-success draws.")] = 0,
    cycle_interval: Annotated[
        float,
        typer.Option(
            "--cycle-interval",
            min=0.001,
            help="Seconds between scheduling cycles while work is pending.",
        ),
    ] = 30.0,
    schedule_on_arrival: Annotated[
        bool,
        typer.Option(
            "--schedule-on-arrival/--no-schedule-on-arrival",
            help="Run a cycle at once when a job arrives (the live scheduler's poke).",
        ),
    ] = True,
    backfill_depth: Annotated[
        int,
        typer.Option(
            "--backfill-depth",
            min=0,
            help="Reservations per cycle (lattice; 0 = none, 1 = EASY-like).",
        ),
    ] = 10,
    checkpoint_success_rate: Annotated[
        float,
        typer.Option(
            "--checkpoint-success-rate",
            min=0.0,
            max=1.0,
            help="Probability that a preempted job's checkpoint succeeds.",
        ),
    ] = 0.98,
    checkpoint_seconds: Annotated[
        float,
        typer.Option(
            "--checkpoint-seconds",
            min=0.0,
            help="How long a preempted job checkpoints before it frees its nodes.",
        ),
    ] = 60.0,
    checkpoint_broker: Annotated[
        bool,
        typer.Option(
            "--checkpoint-broker/--no-checkpoint-broker",
            help="Without the broker every preempted job is stopped at once and its run's "
            "work is lost (to compare with: checkpoint.lost_node_hours).",
        ),
    ] = True,
    sample_interval: Annotated[
        float,
        typer.Option("--sample-interval", min=0.001, help="Seconds between utilization samples."),
    ] = 300.0,
    budget_period_days: Annotated[
        float,
        typer.Option(
            "--budget-period-days",
            min=0.001,
            help="Rolling window of the budget ledger behind the budget penalty "
            "(scheduling.budget_period_days).",
        ),
    ] = 90.0,
    max_time: Annotated[
        str | None,
        typer.Option(
            "--max-time",
            help="Stop after this much simulated time (e.g. 7d); default: when the trace is done.",
            show_default=False,
        ),
    ] = None,
    default_vcluster: DefaultVcOpt = None,
    cores_per_node: CoresOpt = None,
    tenant_by: TenantByOpt = TenantBy.group,
    queue_map: QueueMapOpt = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name", help="Trace name in the result (default: the file name).", show_default=False
        ),
    ] = None,
    no_report: Annotated[
        bool,
        typer.Option(
            "--no-report",
            help="Write result.json and timing.json only (no metrics, report or plots).",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
) -> None:
    """Replay a trace and write the result (and the report) into --out."""

    def body() -> int:
        from rm_replay.engine import simulate
        from rm_replay.inventory import load_inventory
        from rm_replay.weights import load_weights

        if out is None:
            _fail("--out is required", "Pass --out DIR: where result.json and the report go.")
        events, stem = _load_events(
            trace, swf, cores_per_node, tenant_by, queue_map or [], default_vcluster
        )
        inv = load_inventory(_need_file(inventory, "--inventory"))
        w = load_weights(_need_file(weights, "--weights")) if weights is not None else {}
        limit = _duration(max_time, "--max-time")
        if out.exists() and not out.is_dir():
            _fail(f"--out: {out} exists and is not a directory", "Give a directory path.")
        start = min((ev.t for ev in events if isinstance(ev, SubmitEvent)), default=0.0)
        t0 = time.perf_counter()
        try:
            result = simulate(
                events,
                inv,
                policy=policy.value,
                weights_by_vcluster=w,
                cycle_interval=cycle_interval,
                schedule_on_arrival=schedule_on_arrival,
                backfill_depth=backfill_depth,
                seed=seed,
                checkpoint_success_rate=checkpoint_success_rate,
                checkpoint_seconds=checkpoint_seconds,
                checkpoint_broker=checkpoint_broker,
                sample_interval=sample_interval,
                budget_period_days=budget_period_days,
                default_vcluster=default_vcluster,
                max_time=None if limit is None else start + limit,
                trace_name=name or stem,
            )
        except ReplayInputError:
            raise
        except ValueError as e:
            _fail(str(e), "Check the option values.")
        wall = time.perf_counter() - t0
        written = write_result(result, out, report=not no_report)
        if not quiet:
            _summary(result, wall, out, written)
        return 0

    _guard(body)


def write_result(result: SimulationResult, out: Path, *, report: bool = True) -> list[Path]:
    """Write ``result.json`` (deterministic) and ``timing.json`` into ``out``, then the
    report, metrics and plots through ``rm_replay.report.write_outputs`` when that
    module is there (and ``report``)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    writer = None
    if report:
        try:
            writer = importlib.import_module("rm_replay.report").write_outputs
        except (ImportError, AttributeError):
            writer = None
    if writer is not None:
        paths = writer(result, out)
        written = list(paths.values()) if isinstance(paths, dict) else []
    if not (out / RESULT_FILE).is_file() or writer is None:
        (out / RESULT_FILE).write_bytes(dump_result(result))
        (out / "timing.json").write_bytes(dump_timing(result))
        written = [out / RESULT_FILE, out / "timing.json", *written]
    return written


def _summary(result: SimulationResult, wall: float, out: Path, written: list[Path]) -> None:
    counts: dict[str, int] = {}
    for j in result.jobs:
        counts[j.state] = counts.get(j.state, 0) + 1
    report = out / "report.txt"
    if report.is_file():
        typer.echo(report.read_text(encoding="utf-8").rstrip())
    states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    typer.echo(
        f"rm-replay: {len(result.jobs)} allocations ({states}) replayed with {result.policy} "
        f"in {wall:.1f} s; makespan {result.makespan / 3600:.1f} h; "
        f"{len(result.cycles)} scheduling decisions -> {out}/",
        err=True,
    )


# --------------------------------------------------------------------------- check, convert


@app.command("check")
def check_cmd(
    trace: TraceOpt = None,
    swf: SwfOpt = None,
    inventory: InventoryOpt = None,
    weights: WeightsOpt = None,
    cores_per_node: CoresOpt = None,
    tenant_by: TenantByOpt = TenantBy.group,
    queue_map: QueueMapOpt = None,
    default_vcluster: DefaultVcOpt = None,
) -> None:
    """Validate the inputs of a replay and summarise them, without replaying."""

    def body() -> int:
        from lattice_scheduler.profiles import weights_as_mapping

        from rm_replay.inventory import inventory_summary, load_inventory
        from rm_replay.weights import load_weights

        if trace is not None or swf is not None:
            events, stem = _load_events(
                trace, swf, cores_per_node, tenant_by, queue_map or [], default_vcluster
            )
            subs = [e for e in events if isinstance(e, SubmitEvent)]
            cancels = sum(isinstance(e, CancelEvent) for e in events)
            span = (max(e.t for e in subs) - min(e.t for e in subs)) if subs else 0.0
            typer.echo(
                f"trace {stem}: {len(subs)} submissions, "
                f"{len(events) - len(subs) - cancels} completions, {cancels} cancellations, "
                f"{len({e.tenant for e in subs})} tenants, "
                f"vClusters {sorted({e.vcluster or '(default)' for e in subs})}, "
                f"arrivals over {span / 3600:.1f} h"
            )
        if inventory is not None:
            inv = load_inventory(_need_file(inventory, "--inventory"))
            s = inventory_summary(inv)
            typer.echo(
                f"inventory {s['name']}: {s['nodes']} nodes, {s['gpus']} GPUs, "
                f"{s['groups']} dragonfly groups, {s['conformance_groups']} conformance groups, "
                f"{len(s['classes'])} node classes"
            )
        if weights is not None:
            for vc, w in sorted(load_weights(_need_file(weights, "--weights")).items()):
                vals = ", ".join(f"{k}={v:g}" for k, v in weights_as_mapping(w).items())
                typer.echo(f"weights {vc}: {vals}")
        if trace is None and swf is None and inventory is None and weights is None:
            _fail("nothing to check", "Pass --trace/--swf, --inventory and/or --weights.")
        return 0

    _guard(body)


@app.command("convert-swf")
def convert_swf_cmd(
    swf: Annotated[Path, typer.Argument(help="The SWF file.", show_default=False)],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="JSON-lines trace to write.", show_default=False),
    ] = None,
    cores_per_node: CoresOpt = None,
    tenant_by: TenantByOpt = TenantBy.group,
    queue_map: QueueMapOpt = None,
    default_vcluster: DefaultVcOpt = None,
) -> None:
    """Convert an SWF file into a JSON-lines trace (the mapping is in the README)."""

    def body() -> int:
        from rm_replay.trace import write_trace

        if output is None:
            _fail("--output is required", "Pass -o TRACE.jsonl.")
        events, _ = _load_events(
            None, swf, cores_per_node, tenant_by, queue_map or [], default_vcluster
        )
        write_trace(output, events)
        typer.echo(f"rm-replay: wrote {len(events)} submissions to {output}", err=True)
        return 0

    _guard(body)


# --------------------------------------------------------------------------- delegated

_PASSTHROUGH = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "help_option_names": [],
}


def _delegate(module: str, what: str, args: list[str]) -> int:
    try:
        mod = importlib.import_module(f"rm_replay.{module}")
    except ImportError as e:
        if e.name != f"rm_replay.{module}":
            raise
        _fail(
            f"{what} is not available: the module rm_replay.{module} is missing",
            "Install a complete rm-replay (tools/rm-replay in the Lattice workspace).",
            code=1,
        )
    entry: Any = getattr(mod, "main", None)
    if entry is None:
        _fail(f"{what} is not available: rm_replay.{module} has no main()", "", code=1)
    try:
        code = entry(args)
    except SystemExit as e:  # argparse's exits
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return int(code or 0)


@app.command("compare", context_settings=_PASSTHROUGH, add_help_option=False)
def compare_cmd(ctx: typer.Context) -> None:
    """A/B comparison of result directories: compare BASELINE CANDIDATE (see compare --help)."""
    _guard(lambda: _delegate("compare", "compare", list(ctx.args)))


@app.command("regress", context_settings=_PASSTHROUGH, add_help_option=False)
def regress_cmd(ctx: typer.Context) -> None:
    """Run the regression suite of traces and check their thresholds (see regress --help)."""
    _guard(lambda: _delegate("regress", "regress", list(ctx.args)))


@app.command("generate", context_settings=_PASSTHROUGH, add_help_option=False)
def generate_cmd(ctx: typer.Context) -> None:
    """Write synthetic traces, inventories and weights (see generate --help)."""
    _guard(lambda: _delegate("generate", "generate", list(ctx.args)))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rm-replay {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """RM-Replay: replay workload traces through the real Lattice scheduler."""


# --------------------------------------------------------------------------- entry

_ROOT_OPTIONS = {"--help", "-h", "--version"}


def rewrite_args(args: Sequence[str]) -> list[str]:
    """The Tuning Guide's spellings: ``--compare A B`` -> ``compare A B``; options with no
    subcommand (``--trace=...``) -> ``run ...``."""
    args = list(args)
    if not args:
        return args
    first = args[0]
    if first == "--compare" or first.startswith("--compare="):
        rest = args[1:]
        if first.startswith("--compare="):
            rest = [first.split("=", 1)[1], *rest]
        return ["compare", *rest]
    if first.startswith("-") and first.split("=", 1)[0] not in _ROOT_OPTIONS:
        return ["run", *args]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    args = rewrite_args(sys.argv[1:] if argv is None else argv)
    try:
        app(args=args, prog_name="rm-replay")
    except SystemExit as e:
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
