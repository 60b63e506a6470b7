"""``lattice squeue``: Slurm's squeue over ``GET /allocations`` (same columns, codes and
``-o`` field codes, so scripts that parse squeue keep working)."""

from __future__ import annotations

from typing import Annotated

import typer

from lattice_cli.context import fail, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command(context_settings={"help_option_names": ["--help"]})(squeue)


def squeue(
    ctx: typer.Context,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="Only this user's jobs (default: yours).")
    ] = None,
    states: Annotated[
        str | None,
        typer.Option(
            "--states",
            "-t",
            help="Job states, comma-separated: PD,R,S,CD,F,TO,NF,CA (or names, or all). "
            "Default: the active ones.",
        ),
    ] = None,
    jobs: Annotated[
        str | None,
        typer.Option("--jobs", "-j", help="Only these job ids (comma-separated)."),
    ] = None,
    partition: Annotated[
        str | None,
        typer.Option("--partition", "-p", help="Only this partition (vCluster)."),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            "-o",
            help='squeue format, e.g. "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R". Codes: '
            "%i %j %u %t %T %M %D %R %N %r %P %a %l %S %V %q.",
        ),
    ] = None,
    noheader: Annotated[
        bool, typer.Option("--noheader", "-h", help="Print no header line.")
    ] = False,
) -> None:
    """Show jobs like squeue (JOBID PARTITION NAME USER ST TIME NODES NODELIST(REASON))."""
    import time

    from lattice_cli import slurm_cli
    from lattice_cli.jobs import fetch_jobs
    from lattice_cli.submit_options import DirectiveError

    st = state_of(ctx)
    try:
        wanted = slurm_cli.lattice_states(states) if states else list(slurm_cli.ACTIVE_STATES)
        narrow = slurm_cli.state_filter(wanted, states) if states else None
        slurm_cli.parse_squeue_format(fmt or slurm_cli.SQUEUE_DEFAULT_FORMAT)
    except DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)
    ids = [j.strip() for j in (jobs or "").split(",") if j.strip()]
    allocs = run_api(st, lambda client: fetch_jobs(client, ids, wanted, user, partition))
    if narrow is not None:
        allocs = [a for a in allocs if ("Failed", slurm_cli.state_code(a)[0]) in narrow]
    print(slurm_cli.squeue_text(allocs, time.time(), fmt, header=not noheader))
