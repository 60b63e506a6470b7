"""``lattice history``: ended allocations (Completed, Failed, Cancelled) with elapsed
time, exit code and nodes, like sacct, and with accounting on what each cost;
``-o json|yaml`` prints the records (``cost``: decimal text, with accounting)."""

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
        # the server filters by end time and cuts to the latest `limit` (the history
        # store does it in SQL); the filter below only repeats it for older servers
        return await client.list_allocations(
            state=",".join(slurm_cli.TERMINAL_STATES),
            user=user,
            all=all_,
            # a limit alone is a window from the epoch: the latest `limit` to end
            since=start if start is not None else (0.0 if limit else None),
            until=end,
            limit=limit,
        )

    allocs = [a.raw for a in run_api(st, go)]
    allocs = [a for a in allocs if slurm_cli.finished_between(a, start, end)]
    allocs.sort(key=lambda a: a.get("finished_at") or a.get("submitted_at") or 0)
    if limit:
        allocs = allocs[-limit:]
    costs = _costs(st, [a["id"] for a in allocs]) if allocs else None
    if costs is not None:  # accounting on: each allocation's cost
        for a in allocs:
            a["cost"] = (costs.get(a["id"]) or {}).get("cost")
    if st.quiet and fmt in ("table", "wide"):
        for a in allocs:
            print(a.get("id"))
        return
    emit(
        st,
        fmt,
        allocs,
        lambda: with_costs(
            slurm_cli.sacct_text(allocs, now, slurm_cli.HISTORY_FORMAT), allocs, costs
        ),
    )


def _costs(st: Any, ids: list[str]) -> dict[str, Any] | None:
    """Each allocation's cost when accounting is on; None when it is off or not
    reachable (the history shows without the column)."""
    import asyncio

    from lattice_cli.context import make_client

    async def go() -> Any:
        async with make_client(st) as client:
            return await client.allocation_costs(ids)

    try:
        data = asyncio.run(go())
    except Exception:  # accounting off, an old server, unreachable: no cost column
        return None
    if not isinstance(data, dict) or not data.get("enabled"):
        return None
    return data.get("costs") or {}


def with_costs(text: str, allocs: list[dict[str, Any]], costs: dict[str, Any] | None) -> str:
    """The sacct table with a Cost column (charged so far, to the cent)."""
    if costs is None or not text:
        return text
    from decimal import Decimal, InvalidOperation

    def cell(a: dict[str, Any]) -> str:
        try:
            return f"{Decimal(str(a.get('cost'))).quantize(Decimal('0.01')):.2f}"
        except (InvalidOperation, ValueError):
            return "-"

    lines = text.split("\n")
    width = max(len(x) for x in lines)
    cells = ["Cost", "-" * 10, *(cell(a) for a in allocs)]
    return "\n".join(f"{x.ljust(width)} {c:>10}" for x, c in zip(lines, cells, strict=False))
