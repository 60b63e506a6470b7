"""``lattice queue [VCLUSTER]``: a vCluster's pending queue in the order the scheduler
considers it (like ``squeue --start``), with score, pending reason, reservation and
estimated start; ``--verbose`` adds each allocation's weighted factors."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(queue)


def queue(
    ctx: typer.Context,
    vcluster: Annotated[
        str | None,
        typer.Argument(
            help="vCluster (default: the configured one, else default).",
            metavar="[VCLUSTER]",
            show_default=False,
        ),
    ] = None,
    all_users: Annotated[
        bool,
        typer.Option("--all", "-a", help="Every user's entries (needs permission)."),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show each entry's weighted factors.")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Show a vCluster's pending queue: position, score, reason and estimated start.

    Positions count every user's allocations; you see your own unless --all. START_TIME
    is an estimate (~): "reservation" is the backfill reservation the scheduler holds for
    the allocation, "simulation" a forward simulation of the queue with full walltimes.
    """
    import time

    from lattice_cli import output as out

    st = state_of(ctx)
    fmt = st.output(output)
    name = vcluster or st.vcluster or st.config.vcluster or "default"

    async def go(client: Any) -> Any:
        return await client.vcluster_queue(name, all=all_users)

    q = run_api(st, go)
    raw = {**q, "entries": [e.raw for e in q["entries"]]}
    if st.quiet and fmt in ("table", "wide"):
        for e in raw["entries"]:
            print((e.get("allocation") or {}).get("id"))
        return
    now = time.time()
    emit(st, fmt, raw, lambda: out.queue_table(raw, now, verbose=verbose or fmt == "wide"))
