"""The ``lattice`` command: typer wiring of submit, status, cancel, logs, nodes, admin.

Start time matters (``lattice status`` is typed all day), so this module imports only
typer and the standard library at the top. The SDK, asyncio, PyYAML and rich are imported
inside the commands that need them, and parsing/rendering lives in pure modules
(:mod:`lattice_cli.directives`, :mod:`lattice_cli.config`, :mod:`lattice_cli.output`).

Errors the user can fix print as ``Error: ...`` / ``  Key: value`` / ``Hint: ...`` on
stderr and exit 1 (2 for usage errors), never as a traceback.
"""

import enum
import os
import sys
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand

from lattice_cli import __version__, _fastparams

_fastparams.install()  # plain option conversion without importing pydantic (see module)

_HELP = """Lattice: submit and manage workloads on a Lattice HPC/AI cluster.

Slurm users: `sbatch` -> `lattice submit`, `squeue` -> `lattice status`,
`scancel` -> `lattice cancel`, `sinfo` -> `lattice nodes`.
"""

app = typer.Typer(
    name="lattice",
    help=_HELP,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
node_app = typer.Typer(
    help="Drain, undrain, disable and enable nodes (admin).", no_args_is_help=True
)
admin_app = typer.Typer(help="Administrative commands (system-admin role).", no_args_is_help=True)
tenant_app = typer.Typer(
    help="Create, list and update tenants and their quotas.", no_args_is_help=True
)
vcluster_app = typer.Typer(help="Create, list and update vClusters.", no_args_is_help=True)
raft_app = typer.Typer(help="Inspect the Raft quorum.", no_args_is_help=True)
app.add_typer(node_app, name="node")
app.add_typer(admin_app, name="admin")
admin_app.add_typer(tenant_app, name="tenant")
admin_app.add_typer(vcluster_app, name="vcluster")
admin_app.add_typer(raft_app, name="raft")


class OutputFormat(enum.StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


class RequeuePolicy(enum.StrEnum):
    never = "never"
    on_node_failure = "on_node_failure"
    always = "always"


class SchedulerType(enum.StrEnum):
    hpc_backfill = "hpc-backfill"
    service_binpack = "service-binpack"
    sensitive_reservation = "sensitive-reservation"
    interactive_fifo = "interactive-fifo"


OutputOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="Output format: table (default), wide, json or yaml.",
        case_sensitive=False,
    ),
]


# --------------------------------------------------------------------------- state


class State:
    """Global flags of one invocation, and the config resolved from them on first use."""

    def __init__(
        self,
        *,
        output: str | None = None,
        quiet: bool = False,
        verbose: bool = False,
        tenant: str | None = None,
        vcluster: str | None = None,
        config_path: str | None = None,
        no_color: bool = False,
        endpoint: str | None = None,
    ) -> None:
        self.output_flag = output
        self.quiet = quiet
        self.verbose = verbose
        self.tenant = tenant
        self.vcluster = vcluster
        self.config_path = config_path
        self.no_color = no_color
        self.endpoint = endpoint
        self._config: Any = None

    @property
    def config(self) -> Any:
        if self._config is None:
            from lattice_cli.config import ConfigError, load_config

            flags = {
                "endpoint": self.endpoint,
                "tenant": self.tenant,
                "vcluster": self.vcluster,
                "output_format": self.output_flag,
            }
            try:
                self._config = load_config(self.config_path, os.environ, flags)
            except ConfigError as exc:
                fail(exc.message, hint=exc.hint)
            if self.no_color:
                self._config.color = False
            if self.verbose:
                cfg = self._config
                _debug(f"config file: {cfg.path}")
                for key in ("endpoint", "tenant", "vcluster", "output_format"):
                    source = cfg.sources.get(key, "default")
                    _debug(f"{key} = {getattr(cfg, key)!r} (from {source})")
        return self._config

    def output(self, override: OutputFormat | None = None) -> str:
        if override is not None:
            return override.value
        return self.config.output_format

    def color(self, stream: Any = None) -> bool:
        stream = stream or sys.stdout
        if self.no_color or os.environ.get("NO_COLOR"):
            return False
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return tty and bool(self.config.color)


def _state(ctx: typer.Context) -> State:
    obj = ctx.find_root().obj
    if not isinstance(obj, State):
        obj = State()
        ctx.find_root().obj = obj
    return obj


def _debug(message: str) -> None:
    print(f"debug: {message}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def fail(message: str, *, hint: str = "", details: dict | None = None, code: int = 1) -> NoReturn:
    """Print ``Error: ...`` (with details and hint) to stderr and exit."""
    lines = [f"Error: {message}"]
    for key, value in (details or {}).items():
        label = str(key).replace("_", " ")
        lines.append(f"  {label[:1].upper() + label[1:]}: {value}")
    if hint:
        lines.append(f"Hint: {hint}")
    print("\n".join(lines), file=sys.stderr)
    raise typer.Exit(code)


def _print_api_error(state: State, exc: Any) -> None:
    from lattice_sdk import LatticeUnavailableError

    if isinstance(exc, LatticeUnavailableError) and exc.status_code is None:
        source = state.config.sources.get("endpoint", "default")
        exc.details.setdefault("endpoint_from", source)
    print(exc.render(), file=sys.stderr)
    if state.verbose:
        _debug(f"{type(exc).__name__} status={exc.status_code} code={exc.code!r}")


def make_client(state: State) -> Any:
    from lattice_sdk import LatticeClient

    cfg = state.config
    endpoint = cfg.parsed_endpoint
    headers = {"x-lattice-tenant": cfg.tenant} if cfg.tenant else {}
    timeout = float(os.environ.get("LATTICE_TIMEOUT") or 30)
    return LatticeClient(
        endpoint.host,
        endpoint.port,
        token=cfg.token or None,
        headers=headers,
        scheme=endpoint.scheme,
        timeout=timeout,
        transport=os.environ.get("LATTICE_HTTP_TRANSPORT") or "asyncio",
    )


def run_api(state: State, fn: Any) -> Any:
    """Run ``await fn(client)`` with a client for the configured endpoint.

    SDK errors are printed (exit 1); Ctrl-C exits 130 without a traceback.
    """
    import asyncio

    from lattice_sdk import LatticeError

    async def go() -> Any:
        async with make_client(state) as client:
            return await fn(client)

    try:
        return asyncio.run(go())
    except LatticeError as exc:
        _print_api_error(state, exc)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def emit(state: State, fmt: str, data: Any, text: Any = None) -> None:
    """Print ``data`` as JSON/YAML, or ``text()`` for table/wide."""
    from lattice_cli import output

    if fmt == "json":
        print(output.to_json(data))
    elif fmt == "yaml":
        print(output.to_yaml(data), end="")
    elif text is not None:
        rendered = text() if callable(text) else text
        if rendered:
            print(rendered)


# --------------------------------------------------------------------------- root


def _version_callback(value: bool) -> None:
    if value:
        print(f"lattice {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    output: OutputOpt = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only essential output (e.g. bare IDs).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print debug information to stderr.")
    ] = False,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", "-t", help="Tenant to act as (overrides config and env)."),
    ] = None,
    vcluster: Annotated[
        str | None,
        typer.Option("--vcluster", help="Default vCluster (overrides config and env)."),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="Config file (default: ~/.config/lattice/config.yaml, or $LATTICE_CONFIG).",
            metavar="PATH",
        ),
    ] = None,
    no_color: Annotated[bool, typer.Option("--no-color", help="Disable colored output.")] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="API address, e.g. http://127.0.0.1:8080 (overrides LATTICE_ENDPOINT).",
            metavar="URL",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Show the version and exit.",
            callback=_version_callback,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Lattice: submit and manage workloads on a Lattice HPC/AI cluster."""
    ctx.obj = State(
        output=output.value if output else None,
        quiet=quiet,
        verbose=verbose,
        tenant=tenant,
        vcluster=vcluster,
        config_path=config,
        no_color=no_color,
        endpoint=endpoint,
    )


# --------------------------------------------------------------------------- submit


class _SubmitCommand(TyperCommand):
    """Remembers what came after ``--`` so a command can be told apart from a script."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            ctx.meta["lattice.after_dashdash"] = list(args[args.index("--") + 1 :])
        return super().parse_args(ctx, args)


@app.command(cls=_SubmitCommand)
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
            help="Node range: start with as few as this when --nodes are not all free (services).",
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
    from lattice_cli import directives as d

    state = _state(ctx)
    cfg = state.config
    positional = list(args or [])
    after = ctx.meta.get("lattice.after_dashdash")
    before = positional[: len(positional) - len(after)] if after is not None else positional

    try:
        flags = d.SubmitOptions(
            nodes=d.parse_positive_int(str(nodes), "nodes") if nodes is not None else None,
            walltime=d.parse_walltime(walltime) if walltime is not None else None,
            name=name,
            tenant=tenant or state.tenant,  # `lattice -t X submit` is a flag too
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
            submit_dir=chdir,
        )
        if before:
            script = before[0]
            script_args = [*before[1:], *(after or [])]
            path, text = _read_script(script)
            from_script = d.parse_script(text, partition_map=cfg.partition_map, qos_map=cfg.qos_map)
            opts = d.merge(from_script, flags)
            entrypoint = d.script_entrypoint(path, text, script_args)
            default_name = os.path.basename(path)
        elif after:
            opts = flags
            entrypoint = d.command_entrypoint(after)
            default_name = os.path.basename(after[0])
        else:
            fail(
                "nothing to submit",
                hint="Give a script (`lattice submit job.sh`) or a command after `--` "
                "(`lattice submit -N 2 -- hostname`).",
                code=2,
            )
        if min_nodes is not None:
            d.parse_positive_int(str(min_nodes), "min nodes")
    except d.DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)

    for message in opts.warnings:
        warn(message)

    from lattice_sdk import AllocationSpec

    spec = AllocationSpec(
        entrypoint=entrypoint,
        nodes=opts.nodes or 1,
        walltime=opts.walltime,
        tenant=opts.tenant or cfg.tenant,
        vcluster=opts.vcluster or cfg.vcluster,
        name=opts.name or default_name,
        project=opts.project or "",
        preemption_class=5 if opts.preemption_class is None else opts.preemption_class,
        constraints=opts.constraints,
        env=opts.env,
        submit_dir=os.path.abspath(opts.submit_dir) if opts.submit_dir else os.getcwd(),
        uenv=opts.uenv or cfg.uenv,
        requeue_policy=opts.requeue,
        max_requeue=opts.max_requeue,
        tags=opts.tags,
        min_nodes=min_nodes,
    )
    fmt = state.output(output)
    if dry_run:
        emit(state, "yaml" if fmt == "yaml" else "json", spec.to_dict())
        return

    if task_group:

        async def go_group(client: Any) -> Any:
            return await client.submit_task_group(spec, task_group)

        group = run_api(state, go_group)
        if fmt in ("json", "yaml"):
            emit(state, fmt, group)
        elif state.quiet:
            print(group["task_group_id"])
        else:
            limit = f", at most {group['concurrency']} running" if group.get("concurrency") else ""
            print(f"Submitted task group {group['task_group_id']} ({group['tasks']} tasks{limit})")
        return

    async def go(client: Any) -> Any:
        return await client.submit(spec)

    alloc = run_api(state, go)
    if fmt in ("json", "yaml"):
        emit(state, fmt, alloc.raw)
    elif state.quiet:
        print(alloc.id)
    else:
        print(f"Submitted allocation {alloc.id}")


def _read_script(script: str) -> tuple[str, str]:
    path = os.path.abspath(os.path.expanduser(script))
    if not os.path.isfile(path):
        fail(
            f"script {script!r} not found",
            hint="To run a command rather than a script, put it after `--`: "
            f"lattice submit -- {script} ...",
            code=2,
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        fail(f"cannot read script {script!r}: {exc.strerror or exc}", code=2)
    if b"\0" in data[:8192]:
        fail(
            f"{script!r} is not a text script",
            hint=f"To run a program, put it after `--`: lattice submit -- {script}",
            code=2,
        )
    return path, data.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- status


@app.command()
def status(
    ctx: typer.Context,
    alloc_id: Annotated[
        str | None,
        typer.Argument(help="Show one allocation in detail.", metavar="[ID]", show_default=False),
    ] = None,
    state_filter: Annotated[
        str | None,
        typer.Option("--state", help="Only allocations in this state (e.g. running, pending)."),
    ] = None,
    all_: Annotated[
        bool,
        typer.Option("--all", "-a", help="All allocations of the tenant, not only yours."),
    ] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's.")] = None,
    vcluster: Annotated[
        str | None, typer.Option("--vcluster", help="Only this vCluster's.")
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", help="At most this many allocations.", min=1)
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh every --interval seconds until Ctrl-C.")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes with --watch.", min=0.2)
    ] = 5.0,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Say why pending allocations wait (the wide columns, incl. REASON).",
        ),
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Show allocations (like squeue): your own by default, or one in detail."""
    st = _state(ctx)
    fmt = st.output(output)
    if verbose and fmt == "table":
        fmt = "wide"
    color = fmt in ("table", "wide") and st.color()

    async def fetch(client: Any) -> Any:
        if alloc_id:
            from lattice_sdk import LatticeNotFoundError

            try:
                return await client.status(alloc_id)
            except LatticeNotFoundError:
                # a task group id: show its tasks
                tasks = await client.list_allocations(task_group=alloc_id, user=user)
                if not tasks:
                    raise
                return tasks
        return await client.list_allocations(
            state=state_filter,
            tenant=tenant,
            vcluster=vcluster,
            user=user,
            all=all_,
            limit=limit,
        )

    if not watch:
        result = run_api(st, fetch)
        _show_status(st, fmt, result, single=bool(alloc_id), color=color)
        return
    _watch_status(st, fmt, fetch, interval, single=bool(alloc_id), color=color)


def _show_status(state: State, fmt: str, result: Any, *, single: bool, color: bool) -> None:
    import time

    from lattice_cli import output

    now = time.time()
    expand = single and isinstance(result, list)  # the tasks of one task group
    single = single and not expand
    if single:
        if fmt == "wide":
            fmt = "table"
        emit(state, fmt, result.raw, lambda: output.allocation_detail(result.raw, now))
        return
    raws = [a.raw for a in result]
    if state.quiet and fmt in ("table", "wide"):
        for a in result:
            print(a.id)
        return
    emit(
        state,
        fmt,
        raws,
        lambda: output.allocation_table(raws, now, wide=fmt == "wide", color=color, expand=expand),
    )


def _watch_status(
    state: State, fmt: str, fetch: Any, interval: float, *, single: bool, color: bool
) -> None:
    import asyncio
    import time

    from lattice_sdk import LatticeUnavailableError

    from lattice_cli import output

    tty = sys.stdout.isatty()

    async def loop(client: Any) -> None:
        while True:
            try:
                result = await fetch(client)
                error = None
            except LatticeUnavailableError as exc:
                result, error = None, exc
            now = time.time()
            if fmt == "json":
                if error is not None:
                    print(error.render(), file=sys.stderr, flush=True)
                else:
                    data = result.raw if single else [a.raw for a in result]
                    print(output.to_json(data, compact=True), flush=True)
            else:
                if tty:
                    print("\x1b[H\x1b[2J", end="")
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    print(f"Every {interval:g}s: lattice status    {stamp}\n")
                if error is not None:
                    print(error.render(), file=sys.stderr)
                elif fmt == "yaml":
                    data = result.raw if single else [a.raw for a in result]
                    print(output.to_yaml(data), end="")
                elif single:
                    print(output.allocation_detail(result.raw, now))
                else:
                    raws = [a.raw for a in result]
                    print(output.allocation_table(raws, now, wide=fmt == "wide", color=color))
                if not tty:
                    print(flush=True)
            if single and result is not None and result.terminal:
                return
            await asyncio.sleep(interval)

    try:
        run_api(state, loop)
    except typer.Exit as exc:
        if exc.exit_code == 130:  # Ctrl-C ends watch mode normally
            raise typer.Exit(0) from None
        raise


# --------------------------------------------------------------------------- cancel


@app.command()
def cancel(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str], typer.Argument(help="Allocation IDs to cancel.", metavar="ID...")
    ],
    output: OutputOpt = None,
) -> None:
    """Cancel allocations (like scancel). Exits 1 if any could not be cancelled."""
    from lattice_sdk import LatticeError

    st = _state(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> int:
        failed = 0
        for alloc_id in alloc_ids:
            try:
                alloc = await client.cancel(alloc_id)
            except LatticeError as exc:
                if exc.status_code is None:  # unreachable: no point trying the others
                    raise
                failed += 1
                _print_api_error(st, exc)
                continue
            if fmt == "json":
                from lattice_cli import output as out

                print(out.to_json(alloc.raw, compact=True))
            elif not st.quiet:
                print(f"Cancelled allocation {alloc.id or alloc_id}")
        return failed

    if run_api(st, go):
        raise typer.Exit(1)


# --------------------------------------------------------------------------- logs


@app.command()
def logs(
    ctx: typer.Context,
    alloc_id: Annotated[str, typer.Argument(help="Allocation ID.", metavar="ID")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep streaming new output until it ends.")
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", "-n", help="Only the last N lines.", min=0)
    ] = None,
    stderr_only: Annotated[bool, typer.Option("--stderr", help="Only standard error.")] = False,
    stdout_only: Annotated[bool, typer.Option("--stdout", help="Only standard output.")] = False,
    node: Annotated[str | None, typer.Option("--node", help="Only output from this node.")] = None,
    timestamps: Annotated[
        bool,
        typer.Option("--timestamps/--no-timestamps", help="Prefix each line with its time."),
    ] = True,
    output: OutputOpt = None,
) -> None:
    """Show an allocation's output; stderr lines go to stderr. `-f` follows live."""
    st = _state(ctx)
    fmt = st.output(output)
    stream = "both"
    if stderr_only and not stdout_only:
        stream = "stderr"
    elif stdout_only and not stderr_only:
        stream = "stdout"

    from lattice_cli import output as out

    def show(line: Any, prefix_node: bool) -> None:
        if node and line.node_id != node:
            return
        if stream != "both" and line.stream != stream:
            return
        if fmt in ("json", "yaml"):
            print(out.to_json(line.raw, compact=True), flush=follow)
            return
        text = out.format_log_line(line.raw, timestamps=timestamps, node=prefix_node)
        target = sys.stderr if line.stream == "stderr" else sys.stdout
        print(text, file=target, flush=follow)

    async def go(client: Any) -> None:
        if follow:
            alloc = await client.status(alloc_id)  # also a clear 404 before streaming
            many = len(alloc.assigned_nodes) > 1 or (alloc.spec.nodes or 1) > 1
            async for line in client.stream_logs(alloc_id, tail=tail):
                show(line, many and not node)
            return
        lines = await client.logs(alloc_id, tail=tail, stream=stream)
        many = len({line.node_id for line in lines if line.node_id}) > 1
        for line in lines:
            show(line, many and not node)

    run_api(st, go)


# --------------------------------------------------------------------------- nodes


@app.command()
def nodes(
    ctx: typer.Context,
    node_id: Annotated[
        str | None,
        typer.Argument(help="Show one node in detail.", metavar="[ID]", show_default=False),
    ] = None,
    state_filter: Annotated[
        str | None, typer.Option("--state", help="Only nodes in this state (e.g. ready).")
    ] = None,
    vcluster: Annotated[
        str | None, typer.Option("--vcluster", help="Only nodes of this vCluster.")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """List cluster nodes (like sinfo), or show one node."""
    from lattice_cli import output as out

    st = _state(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        if node_id:
            return await client.get_node(node_id)
        return await client.list_nodes(state=state_filter)

    result = run_api(st, go)
    if node_id:
        emit(st, "table" if fmt == "wide" else fmt, result.raw, lambda: out.node_detail(result.raw))
        return
    raws = [n.raw for n in result]
    if vcluster:
        raws = [n for n in raws if vcluster in (n.get("owner_vcluster"), n.get("home_vcluster"))]
    if st.quiet and fmt in ("table", "wide"):
        for n in raws:
            print(n.get("id"))
        return
    color = fmt in ("table", "wide") and st.color()
    emit(st, fmt, raws, lambda: out.node_table(raws, wide=fmt == "wide", color=color))


def _node_action(ctx: typer.Context, node_id: str, action: str, reason: str, output: Any) -> None:
    st = _state(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        if action == "release":
            return await client.release_node_claim(node_id)
        method = getattr(client, f"{action}_node")
        return await method(node_id, reason=reason)

    node = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, node.raw)
    elif action == "release" and not st.quiet:
        print(f"Node {node.id or node_id} released; it is {node.state} and unclaimed")
    elif not st.quiet:
        print(f"Node {node.id or node_id} is now {node.state}")


ReasonOpt = Annotated[
    str, typer.Option("--reason", "-r", help="Why (recorded with the node's state).")
]
NodeArg = Annotated[str, typer.Argument(help="Node ID.", metavar="ID")]


@node_app.command("drain")
def node_drain(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Stop placing new allocations on a node; running ones finish."""
    _node_action(ctx, node_id, "drain", reason, output)


@node_app.command("undrain")
def node_undrain(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Return a draining or drained node to service."""
    _node_action(ctx, node_id, "undrain", reason, output)


@node_app.command("disable")
def node_disable(
    ctx: typer.Context,
    node_id: NodeArg,
    reason: ReasonOpt = "",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    output: OutputOpt = None,
) -> None:
    """Take a node out of service entirely (asks for confirmation)."""
    if not yes and not typer.confirm(f"Disable node {node_id}?", default=False):
        print("Aborted.", file=sys.stderr)
        raise typer.Exit(1)
    _node_action(ctx, node_id, "disable", reason, output)


@node_app.command("enable")
def node_enable(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Put a disabled node back into service."""
    _node_action(ctx, node_id, "enable", reason, output)


@node_app.command("release")
def node_release(ctx: typer.Context, node_id: NodeArg, output: OutputOpt = None) -> None:
    """End your sensitive claim on an idle node (administrators: anyone's claim)."""
    _node_action(ctx, node_id, "release", "", output)


# --------------------------------------------------------------------------- admin


MaxNodesOpt = Annotated[
    int | None, typer.Option("--max-nodes", help="Hard limit on nodes in use.", min=0)
]
MaxConcurrentOpt = Annotated[
    int | None,
    typer.Option("--max-concurrent-allocations", help="Hard limit on running allocations.", min=0),
]
FairShareOpt = Annotated[
    float | None,
    typer.Option("--fair-share-target", help="Soft share of the cluster (0..1).", min=0),
]
BurstOpt = Annotated[
    float | None,
    typer.Option(
        "--burst-allowance",
        help=(
            "How far above its fair share target the tenant may burst, as a multiple of "
            "the target (1.5 = up to 150%); beyond it its work only starts when no one "
            "else's can. 0 = not set."
        ),
        min=0,
    ),
]
GpuHoursOpt = Annotated[
    float | None, typer.Option("--gpu-hours-budget", help="GPU-hours budget.", min=0)
]
NodeHoursOpt = Annotated[
    float | None, typer.Option("--node-hours-budget", help="Node-hours budget.", min=0)
]
IsolationOpt = Annotated[
    str | None, typer.Option("--isolation", help="standard or strict (sensitive workloads).")
]


def _tenant_fields(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


@tenant_app.command("create")
def tenant_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="Tenant name.")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    fair_share_target: FairShareOpt = None,
    burst_allowance: BurstOpt = None,
    gpu_hours_budget: GpuHoursOpt = None,
    node_hours_budget: NodeHoursOpt = None,
    isolation: IsolationOpt = None,
    output: OutputOpt = None,
) -> None:
    """Create a tenant with its quotas."""
    st = _state(ctx)
    fields = _tenant_fields(
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
        fair_share_target=fair_share_target,
        burst_allowance=burst_allowance,
        gpu_hours_budget=gpu_hours_budget,
        node_hours_budget=node_hours_budget,
        isolation=isolation,
    )

    async def go(client: Any) -> Any:
        return await client.create_tenant(name, **fields)

    tenant = run_api(st, go)
    _show_one(st, output, tenant, f"Created tenant {tenant.name or name}")


def _show_one(st: State, output: Any, record: Any, message: str) -> None:
    fmt = st.output(output)
    if fmt in ("json", "yaml"):
        emit(st, fmt, record.raw)
    elif not st.quiet:
        print(message)


@tenant_app.command("list")
def tenant_list(ctx: typer.Context, output: OutputOpt = None) -> None:
    """List tenants and their quotas."""
    from lattice_cli import output as out

    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.list_tenants()

    raws = [t.raw for t in run_api(st, go)]
    emit(st, st.output(output), raws, lambda: out.tenant_table(raws))


def _tenant_update(ctx: typer.Context, name: str, output: Any, **kwargs: Any) -> None:
    st = _state(ctx)
    fields = _tenant_fields(**kwargs)
    if not fields:
        fail("nothing to update", hint="Give at least one option, e.g. --max-nodes=250.", code=2)

    async def go(client: Any) -> Any:
        return await client.update_tenant(name, **fields)

    tenant = run_api(st, go)
    _show_one(st, output, tenant, f"Updated tenant {tenant.name or name}")


@tenant_app.command("update")
def tenant_update(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tenant name.", metavar="NAME")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    fair_share_target: FairShareOpt = None,
    burst_allowance: BurstOpt = None,
    gpu_hours_budget: GpuHoursOpt = None,
    node_hours_budget: NodeHoursOpt = None,
    isolation: IsolationOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change a tenant's quotas; options not given stay as they are."""
    _tenant_update(
        ctx,
        name,
        output,
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
        fair_share_target=fair_share_target,
        burst_allowance=burst_allowance,
        gpu_hours_budget=gpu_hours_budget,
        node_hours_budget=node_hours_budget,
        isolation=isolation,
    )


@tenant_app.command("set-quota")
def tenant_set_quota(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="Tenant name.")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change a tenant's hard quotas (same as `update`, spelled as in the spec)."""
    _tenant_update(
        ctx,
        name,
        output,
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
    )


@vcluster_app.command("create")
def vcluster_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="vCluster name.")],
    scheduler: Annotated[
        SchedulerType,
        typer.Option("--scheduler-type", "--scheduler", help="Scheduling policy of the vCluster."),
    ] = SchedulerType.hpc_backfill,
    tenant: Annotated[
        str, typer.Option("--tenant", help="Owning tenant (empty: shared by all tenants).")
    ] = "",
    cycle_interval: Annotated[
        float | None,
        typer.Option("--cycle-interval", help="Seconds between scheduling cycles.", min=0),
    ] = None,
    backfill_depth: Annotated[
        int | None, typer.Option("--backfill-depth", help="Backfill look-ahead.", min=0)
    ] = None,
    allow_borrowing: Annotated[
        bool | None,
        typer.Option(
            "--allow-borrowing/--no-allow-borrowing", help="Lend idle nodes to other vClusters."
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Create a vCluster."""
    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.create_vcluster(
            name,
            scheduler_type=scheduler.value,
            tenant=tenant,
            cycle_interval_seconds=cycle_interval,
            backfill_depth=backfill_depth,
            allow_borrowing=allow_borrowing,
        )

    vc = run_api(st, go)
    _show_one(st, output, vc, f"Created vCluster {vc.name or name}")


@vcluster_app.command("list")
def vcluster_list(ctx: typer.Context, output: OutputOpt = None) -> None:
    """List vClusters."""
    from lattice_cli import output as out

    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.list_vclusters()

    raws = [v.raw for v in run_api(st, go)]
    emit(st, st.output(output), raws, lambda: out.vcluster_table(raws))


@vcluster_app.command("show")
def vcluster_show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="vCluster name.", metavar="NAME")],
    output: OutputOpt = None,
) -> None:
    """Show one vCluster: scheduler type, cycle, backfill depth and its weights."""
    from lattice_cli import output as out

    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.get_vcluster(name)

    raw = run_api(st, go).raw
    emit(st, st.output(output), raw, lambda: out.vcluster_detail(raw))


# CostWeights' field names, spelled out: importing lattice_common.types (msgspec) would
# add ~80 ms to every command's start.
WEIGHTS = (
    "priority",
    "wait_time",
    "fair_share",
    "topology",
    "data_readiness",
    "backlog",
    "energy",
    "checkpoint_efficiency",
    "conformance",
)


@vcluster_app.command("set-weights")
def vcluster_set_weights(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="vCluster name.")],
    weight: Annotated[
        list[str] | None,
        typer.Option(
            "--weight",
            "-w",
            help="NAME=VALUE, repeatable; names: " + ", ".join(WEIGHTS) + ".",
        ),
    ] = None,
    priority: Annotated[
        float | None, typer.Option("--priority", help="w1, priority class.")
    ] = None,
    wait_time: Annotated[float | None, typer.Option("--wait-time", help="w2, wait time.")] = None,
    fair_share: Annotated[
        float | None, typer.Option("--fair-share", help="w3, fair share.")
    ] = None,
    topology: Annotated[
        float | None, typer.Option("--topology", help="w4, topology fitness.")
    ] = None,
    data_readiness: Annotated[
        float | None, typer.Option("--data-readiness", help="w5, data readiness.")
    ] = None,
    backlog: Annotated[
        float | None, typer.Option("--backlog", help="w6, backlog pressure.")
    ] = None,
    energy: Annotated[float | None, typer.Option("--energy", help="w7, energy cost.")] = None,
    checkpoint: Annotated[
        float | None, typer.Option("--checkpoint", help="w8, checkpoint efficiency.")
    ] = None,
    conformance: Annotated[
        float | None, typer.Option("--conformance", help="w9, conformance fitness.")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Change cost-function weights of a vCluster (only the ones given); the scheduler
    uses them from its next cycle, no restart needed."""
    weights: dict[str, float] = {
        k: v
        for k, v in {
            "priority": priority,
            "wait_time": wait_time,
            "fair_share": fair_share,
            "topology": topology,
            "data_readiness": data_readiness,
            "backlog": backlog,
            "energy": energy,
            "checkpoint_efficiency": checkpoint,
            "conformance": conformance,
        }.items()
        if v is not None
    }
    for key, val in weights.items():
        if not 0.0 <= val <= 1.0:
            fail(
                f"weight {key} must be between 0 and 1, not {val}",
                hint="e.g. --priority=0.3",
                code=2,
            )
    for item in weight or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in WEIGHTS:
            fail(
                f"invalid weight {item!r}",
                hint="Use NAME=VALUE with NAME one of: " + ", ".join(WEIGHTS),
                code=2,
            )
        try:
            weights[key] = float(value)
        except ValueError:
            fail(f"weight {key} must be a number, not {value!r}", code=2)
    if not weights:
        fail(
            "nothing to update",
            hint="Give at least one weight, e.g. --priority=0.3 (or --weight priority=0.3).",
            code=2,
        )
    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.update_vcluster(name, weights=weights)

    vc = run_api(st, go)
    _show_one(st, output, vc, f"Updated weights of vCluster {vc.name or name}")


@raft_app.command("status")
def raft_status(ctx: typer.Context, output: OutputOpt = None) -> None:
    """Show the quorum: leader, term, commit index and members."""
    from lattice_cli import output as out

    st = _state(ctx)

    async def go(client: Any) -> Any:
        return await client.raft_status()

    data = run_api(st, go)
    fmt = st.output(output)
    emit(st, "table" if fmt == "wide" else fmt, data, lambda: out.raft_status_text(data))


# --------------------------------------------------------------------------- entry point

_ROOT_VALUE_OPTIONS = {"-o", "--output", "-t", "--tenant", "--vcluster", "--config", "--endpoint"}


def _command_word(args: list[str]) -> str | None:
    """The subcommand named in ``args`` (skipping root options and their values)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return None
        if arg.startswith("-"):
            if arg in _ROOT_VALUE_OPTIONS:
                i += 1
            i += 1
            continue
        return arg
    return None


_dev_registered = False


def register_dev(args: list[str] | None = None) -> None:
    """Add the ``dev`` sub-app (lattice_cli.dev, when it exists) if it may be needed.

    It is imported only for ``lattice dev ...`` and for the root help, so other commands
    do not pay for whatever it imports.
    """
    global _dev_registered
    if _dev_registered:
        return
    if args is not None and _command_word(args) not in (None, "dev"):
        return
    try:
        from lattice_cli.dev import app as dev_app  # type: ignore[import-not-found]
    except ModuleNotFoundError as exc:
        if exc.name != "lattice_cli.dev":
            raise
        return
    app.add_typer(dev_app, name="dev", help="Run a local Lattice cluster for development.")
    _dev_registered = True


# --- usage: `lattice usage` (lattice_cli.usage_cmd), registered like `dev` ---
_usage_registered = False


def register_usage(args: list[str] | None = None) -> None:
    """Add ``usage`` for ``lattice usage ...`` and the root help only (no import otherwise)."""
    global _usage_registered
    if _usage_registered or (args is not None and _command_word(args) not in (None, "usage")):
        return
    from lattice_cli import usage_cmd

    usage_cmd.register(app, sys.modules[__name__])
    _usage_registered = True


# --- end usage ---


def main(argv: list[str] | None = None) -> Any:
    args = list(sys.argv[1:] if argv is None else argv)
    register_dev(args)
    register_usage(args)
    try:
        return app(args=args, prog_name="lattice")
    except BrokenPipeError:  # `lattice status | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
