"""``lattice status``: allocations like squeue, one in detail, or ``--watch``.

The command typed most often: keep its imports to typer and the standard library (the SDK,
asyncio and the renderers are imported inside the functions).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, State, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(status)


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
    st = state_of(ctx)
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
