"""``lattice history``: ended allocations (Completed, Failed, Cancelled) with elapsed
time, exit code and nodes, like sacct; ``-o json|yaml`` prints the records."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(history)


def history(
    ctx: typer.Context,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Ended at or after: ISO 8601 (2026-03-01, 2026-03-01T10:00Z) or relative "
            "(-7d, -12h, today, yesterday). Default: all.",
        ),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Ended before this time (same forms).")
    ] = None,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="This user's (default: yours).")
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Every user's of the tenant (needs permission).")
    ] = False,
    limit: Annotated[
        int | None, typer.Option("--limit", help="At most this many (the latest).", min=1)
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Ended allocations (Completed, Failed, Cancelled), oldest first, like sacct:
    JobID JobName User Partition State ExitCode Elapsed NNodes NodeList End."""
    import time

    from lattice_cli import slurm_cli
    from lattice_cli.submit_options import DirectiveError

    st = state_of(ctx)
    fmt = st.output(output)
    now = time.time()
    try:
        start = slurm_cli.parse_date(since, now) if since else None
        end = slurm_cli.parse_date(until, now, end=True) if until else None
    except DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)

    async def go(client: Any) -> Any:
        return await client.list_allocations(
            state=",".join(slurm_cli.TERMINAL_STATES), user=user, all=all_
        )

    allocs = [a.raw for a in run_api(st, go)]
    allocs = [a for a in allocs if slurm_cli.finished_between(a, start, end)]
    allocs.sort(key=lambda a: a.get("finished_at") or a.get("submitted_at") or 0)
    if limit:
        allocs = allocs[-limit:]
    if st.quiet and fmt in ("table", "wide"):
        for a in allocs:
            print(a.get("id"))
        return
    emit(
        st,
        fmt,
        allocs,
        lambda: slurm_cli.sacct_text(allocs, now, slurm_cli.HISTORY_FORMAT),
    )
