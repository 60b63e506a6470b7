"""``lattice sacct``: Slurm's sacct over ``GET /allocations``: jobs in a time window
(default: since midnight), fixed-width or ``-P`` pipe-separated, ``--format`` fields."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import fail, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(sacct)


def sacct(
    ctx: typer.Context,
    jobs: Annotated[
        str | None, typer.Option("--jobs", "-j", help="Only these job ids (comma-separated).")
    ] = None,
    starttime: Annotated[
        str | None,
        typer.Option(
            "--starttime",
            "-S",
            help="Jobs active at or after this time (ISO 8601, -7d, today...). "
            "Default: midnight today (none with --jobs).",
        ),
    ] = None,
    endtime: Annotated[
        str | None,
        typer.Option("--endtime", "-E", help="Jobs active before this time (default: now)."),
    ] = None,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="This user's jobs (default: yours).")
    ] = None,
    states: Annotated[
        str | None,
        typer.Option("--state", "-s", help="Only these states: CD,F,CA,TO,NF,R,PD (or names)."),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            "-o",
            help="Fields, comma-separated, optionally FIELD%WIDTH: JobID JobName User "
            "Partition Account State ExitCode Elapsed NNodes NodeList Start End Submit "
            "Timelimit.",
        ),
    ] = None,
    noheader: Annotated[
        bool, typer.Option("--noheader", "-n", help="Print no header lines.")
    ] = False,
    parsable2: Annotated[
        bool,
        typer.Option("--parsable2", "-P", help="Fields separated by |, no trailing |."),
    ] = False,
    allocations: Annotated[
        bool,
        typer.Option("--allocations", "-X", help="Accepted: Lattice has no job steps to hide."),
    ] = False,
) -> None:
    """Show accounting data for jobs like sacct (JobID JobName Partition Account
    NNodes State ExitCode)."""
    import time

    from lattice_cli import slurm_cli
    from lattice_cli.jobs import fetch_jobs
    from lattice_cli.submit_options import DirectiveError

    st = state_of(ctx)
    now = time.time()
    ids = [j.strip() for j in (jobs or "").split(",") if j.strip()]
    try:
        slurm_cli.parse_sacct_format(fmt or slurm_cli.SACCT_DEFAULT_FORMAT)
        wanted = (
            slurm_cli.lattice_states(states)
            if states
            else [*slurm_cli.ACTIVE_STATES, *slurm_cli.TERMINAL_STATES]
        )
        narrow = slurm_cli.state_filter(wanted, states) if states else None
        since = slurm_cli.parse_date(starttime, now) if starttime else None
        if since is None and not ids:
            since = slurm_cli.parse_date("today", now)
        until = slurm_cli.parse_date(endtime, now, end=True) if endtime else None
    except DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)
    allocs = run_api(st, lambda client: fetch_jobs(client, ids, wanted, user, None))
    if narrow is not None:
        allocs = [a for a in allocs if ("Failed", slurm_cli.state_code(a)[0]) in narrow]
    allocs = [a for a in allocs if _active_in(a, since, until)]
    text = slurm_cli.sacct_text(allocs, now, fmt, header=not noheader, parsable=parsable2)
    if text:
        print(text)


def _active_in(alloc: dict[str, Any], since: float | None, until: float | None) -> bool:
    """Submitted before ``until`` and not ended before ``since`` (sacct's window)."""
    submitted = alloc.get("submitted_at") or 0
    finished = alloc.get("finished_at")
    if until is not None and submitted >= until:
        return False
    return not (since is not None and isinstance(finished, int | float) and finished < since)
