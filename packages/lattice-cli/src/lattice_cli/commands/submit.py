"""``lattice submit``: a batch script or a command, like sbatch.

Parsing is pure and lives in :mod:`lattice_cli.submit_options` (values) and
:mod:`lattice_cli.directives` (script directives); this module turns flags, directives and
config into an :class:`lattice_sdk.AllocationSpec` and sends it.
"""

from __future__ import annotations

import enum
import os
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from lattice_cli.context import OutputOpt, emit, fail, state_of


def register(app: typer.Typer) -> None:
    app.command(cls=_SubmitCommand)(submit)


class RequeuePolicy(enum.StrEnum):
    """``--requeue``; a copy of :class:`lattice_common.types.RequeuePolicy` (importing that
    module costs ~80 ms at start; ``tests/test_core_names.py`` keeps the two equal)."""

    never = "never"
    on_node_failure = "on_node_failure"
    always = "always"


class _SubmitCommand(TyperCommand):
    """Remembers what came after ``--`` so a command can be told apart from a script."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            ctx.meta["lattice.after_dashdash"] = list(args[args.index("--") + 1 :])
        return super().parse_args(ctx, args)


def submit(
    ctx: typer.Context,
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="A batch script (its #LATTICE and #SBATCH directives are read) and its "
            "arguments, or `-- COMMAND ARGS...` to run a command directly.",
            metavar="[SCRIPT [ARGS...]] [-- COMMAND ARGS...]",
            show_default=False,
        ),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", "-N", help="Number of whole nodes (at least 1).")
    ] = None,
    min_nodes: Annotated[
        int | None,
        typer.Option(
            "--min-nodes",
            help="Node range: start with as few as this when --nodes are not all free "
            "(services); with --lifecycle reactive the fewest nodes it scales down to.",
        ),
    ] = None,
    max_nodes: Annotated[
        int | None,
        typer.Option(
            "--max-nodes", help="Reactive: the most nodes it scales up to (instead of --nodes)."
        ),
    ] = None,
    lifecycle: Annotated[
        str | None,
        typer.Option(
            "--lifecycle",
            help="bounded (batch, default), unbounded (service) or reactive (autoscaling "
            "between --min-nodes and --max-nodes on --scale-metric).",
        ),
    ] = None,
    reactive: Annotated[
        bool, typer.Option("--reactive", help="Same as --lifecycle reactive.")
    ] = False,
    scale_metric: Annotated[
        str | None,
        typer.Option(
            "--scale-metric",
            help="Reactive: the metric to scale on (default cpu_utilization; gpu_utilization, "
            'or a TSDB series such as custom_metric{job="x"}).',
        ),
    ] = None,
    scale_target: Annotated[
        str | None,
        typer.Option(
            "--scale-target",
            help="Reactive: add a node when the metric stays at or above this (default 0.8).",
        ),
    ] = None,
    scale_interval: Annotated[
        str | None,
        typer.Option("--scale-interval", help="Reactive: evaluate every (default 60s)."),
    ] = None,
    scale_up_window: Annotated[
        str | None,
        typer.Option(
            "--scale-up-window", help="Reactive: at or above target this long to add (2m)."
        ),
    ] = None,
    scale_down_window: Annotated[
        str | None,
        typer.Option(
            "--scale-down-window",
            help="Reactive: at or below target x threshold this long to remove (5m).",
        ),
    ] = None,
    scale_down_threshold: Annotated[
        str | None,
        typer.Option(
            "--scale-down-threshold", help="Reactive: fraction of the target (default 0.5)."
        ),
    ] = None,
    scale_cooldown: Annotated[
        str | None,
        typer.Option(
            "--scale-cooldown", help="Reactive: no scaling this long after a change (3m)."
        ),
    ] = None,
    walltime: Annotated[
        str | None,
        typer.Option("--walltime", "-t", help="Time limit: 30m, 24h, 1d, HH:MM:SS, D-HH:MM:SS."),
    ] = None,
    vcluster: Annotated[
        str | None, typer.Option("--vcluster", help="vCluster to run in (Slurm: partition).")
    ] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Tenant to charge (Slurm: account).")
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", "-J", help="Allocation name (default: script or command name)."),
    ] = None,
    project: Annotated[str | None, typer.Option("--project", help="Project label.")] = None,
    preemption_class: Annotated[
        int | None,
        typer.Option(
            "--preemption-class",
            help="0 (preempted first) .. 10 (never preempted); default 5.",
        ),
    ] = None,
    constraint: Annotated[
        list[str] | None,
        typer.Option(
            "--constraint",
            "-C",
            help='Node constraints, e.g. "gpu_type=GH200,gpu_count=4", "memory_gb>=512"; '
            "bare words are node features. Repeatable.",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", help="Environment variable KEY=VALUE. Repeatable."),
    ] = None,
    requeue: Annotated[
        RequeuePolicy | None,
        typer.Option("--requeue", help="Requeue on failure: never, on_node_failure or always."),
    ] = None,
    max_requeue: Annotated[
        int | None, typer.Option("--max-requeue", help="Most times to requeue.", min=0)
    ] = None,
    uenv: Annotated[
        str | None,
        typer.Option("--uenv", help="Software environment, e.g. prgenv-gnu/24.11:v1."),
    ] = None,
    view: Annotated[
        str | None,
        typer.Option(
            "--view", help="View of the uenv to activate (its environment), e.g. default."
        ),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            "--image",
            help="OCI image to run in, registry/name:tag (read-only root, as you).",
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help="How the job is asked to checkpoint before preemption or suspend: "
            "signal (SIGUSR1), shmem (a flag region) or grpc (a callback); none = not "
            "checkpointable.",
        ),
    ] = None,
    task_group: Annotated[
        str | None,
        typer.Option(
            "--task-group",
            help="Run a task group (job array): START-END[:STEP][%CONCURRENCY], e.g. 0-99%20. "
            "Each task gets $LATTICE_TASK_INDEX.",
        ),
    ] = None,
    chdir: Annotated[
        str | None,
        typer.Option("--chdir", "-D", help="Working directory of the job (default: current)."),
    ] = None,
    dependency: Annotated[
        str | None,
        typer.Option(
            "--dependency",
            help="Start after other allocations end (sbatch --dependency): afterok:ID[:ID...], "
            "afternotok:ID, afterany:ID, singleton; several joined with ','. The job waits "
            "Pending, and is cancelled if a condition can no longer hold.",
        ),
    ] = None,
    expose: Annotated[
        list[str] | None,
        typer.Option(
            "--expose",
            help="A service port to register (repeatable): NAME:PORT or PORT, e.g. api:8080. "
            "`lattice services` finds it while the job runs.",
            metavar="NAME:PORT",
        ),
    ] = None,
    liveness: Annotated[
        str | None,
        typer.Option(
            "--liveness",
            help="Liveness probe of a service: http:PORT/PATH or tcp:PORT, e.g. "
            "http:8080/healthz. Failing it --liveness-threshold times in a row ends the job "
            "Failed (liveness_probe_failed), requeued per --requeue.",
            metavar="PROBE",
        ),
    ] = None,
    liveness_period: Annotated[
        int | None,
        typer.Option("--liveness-period", help="Seconds between probes (default 30).", min=1),
    ] = None,
    liveness_threshold: Annotated[
        int | None,
        typer.Option(
            "--liveness-threshold", help="Failures in a row that end it (default 3).", min=1
        ),
    ] = None,
    liveness_delay: Annotated[
        int | None,
        typer.Option(
            "--liveness-delay", help="Seconds before the first probe (default 10).", min=0
        ),
    ] = None,
    wait_for_capacity: Annotated[
        bool,
        typer.Option(
            "--wait-for-capacity",
            help="Accept the job even if the vCluster has too few nodes (or none with the "
            "constraints) yet, and wait until they are added. (Slurm's --hold is different: "
            "a user hold.)",
        ),
    ] = False,
    test_only: Annotated[
        bool,
        typer.Option(
            "--test-only",
            help="Say when and on how many nodes the job would start (an estimate), or why "
            "it would be refused; submit nothing (like sbatch --test-only).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the allocation spec that would be sent, and do not submit."
        ),
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Submit a batch script or a command (like sbatch).

    Directives in the script (`#LATTICE --nodes=4`, `#SBATCH --time=1:00:00`) are read;
    command-line flags override them. Prints `Submitted allocation <id>`.
    """
    from lattice_cli import directives
    from lattice_cli import submit_options as d

    state = state_of(ctx)
    cfg = state.config
    positional = list(args or [])
    after = ctx.meta.get("lattice.after_dashdash")
    before = positional[: len(positional) - len(after)] if after is not None else positional

    try:
        flags = d.SubmitOptions(
            nodes=d.parse_positive_int(str(nodes), "nodes") if nodes is not None else None,
            walltime=d.parse_walltime(walltime) if walltime is not None else None,
            name=name,
            tenant=tenant or state.tenant,  # `lattice --tenant X submit` is a flag too
            vcluster=vcluster or state.vcluster,
            project=project,
            preemption_class=(
                d.parse_preemption_class(str(preemption_class))
                if preemption_class is not None
                else None
            ),
            constraints=d.parse_constraints(constraint or []),
            env=d.parse_env(env or []),
            requeue=requeue.value if requeue else None,
            max_requeue=max_requeue,
            uenv=uenv,
            view=view,
            image=image,
            checkpoint=d.parse_checkpoint(checkpoint) if checkpoint is not None else None,
            submit_dir=chdir,
            task_group=task_group,
            dependency=dependency,
            lifecycle="reactive"
            if reactive
            else d.parse_lifecycle(lifecycle)
            if lifecycle
            else None,
            min_nodes=d.parse_positive_int(str(min_nodes), "min nodes")
            if min_nodes is not None
            else None,
            max_nodes=d.parse_positive_int(str(max_nodes), "max nodes")
            if max_nodes is not None
            else None,
            scaling={
                d.SCALE_OPTIONS[option]: d.parse_scale_value(option, value)
                for option, value in (
                    ("--scale-metric", scale_metric),
                    ("--scale-target", scale_target),
                    ("--scale-interval", scale_interval),
                    ("--scale-up-window", scale_up_window),
                    ("--scale-down-window", scale_down_window),
                    ("--scale-down-threshold", scale_down_threshold),
                    ("--scale-cooldown", scale_cooldown),
                )
                if value is not None
            },
        )
        if dependency is not None:
            directives.check_dependency(dependency, "--dependency")
        if before:
            script = before[0]
            script_args = [*before[1:], *(after or [])]
            from lattice_cli.submitting import read_script

            path, text = read_script(script)
            from_script = directives.parse_script(
                text,
                partition_map=cfg.partition_map,
                qos_map=cfg.qos_map,
                environ=dict(os.environ),
            )
            opts = d.merge(from_script, flags)
            entrypoint = directives.script_entrypoint(path, text, script_args)
            default_name = os.path.basename(path)
        elif after:
            opts = flags
            entrypoint = directives.command_entrypoint(after)
            default_name = os.path.basename(after[0])
        else:
            fail(
                "nothing to submit",
                hint="Give a script (`lattice submit job.sh`) or a command after `--` "
                "(`lattice submit -N 2 -- hostname`).",
                code=2,
            )
    except d.DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)

    from lattice_cli import submitting

    task_group = opts.task_group  # --task-group, else #SBATCH --array
    spec = submitting.build_spec(
        state,
        opts,
        entrypoint,
        default_name,
        min_nodes=opts.min_nodes,
        wait_for_capacity=wait_for_capacity,
    )
    # lifecycle and reactive scaling: bounds min_nodes..max_nodes, the server checks them
    if opts.lifecycle:
        spec.lifecycle = opts.lifecycle
    if opts.max_nodes is not None:
        spec.nodes = opts.max_nodes
    if opts.scaling:
        spec.scaling = dict(opts.scaling)
    try:
        spec.expose = [d.parse_expose(e) for e in expose or []]
        if liveness:
            spec.liveness_probe = d.parse_liveness(
                liveness,
                period_secs=liveness_period,
                failure_threshold=liveness_threshold,
                initial_delay_secs=liveness_delay,
            )
        elif liveness_period or liveness_threshold or liveness_delay is not None:
            raise d.DirectiveError(
                "--liveness-period/-threshold/-delay need --liveness",
                hint="e.g. --liveness=http:8080/healthz --liveness-period=10",
            )
    except d.DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)
    fmt = state.output(output)
    if dry_run:
        emit(state, "yaml" if fmt == "yaml" else "json", spec.to_dict())
        return
    if test_only:
        if task_group:
            fail("--test-only takes a single allocation, not a task group", code=2)
        submitting.test_only(state, fmt, spec)
        return

    kind, result = submitting.send(state, spec, task_group)
    if kind == "group":
        group = result
        if fmt in ("json", "yaml"):
            emit(state, fmt, group)
        elif state.quiet:
            print(group["task_group_id"])
        else:
            limit = f", at most {group['concurrency']} running" if group.get("concurrency") else ""
            print(f"Submitted task group {group['task_group_id']} ({group['tasks']} tasks{limit})")
        return
    alloc = result
    if fmt in ("json", "yaml"):
        emit(state, fmt, alloc.raw)
    elif state.quiet:
        print(alloc.id)
    else:
        print(f"Submitted allocation {alloc.id}")
