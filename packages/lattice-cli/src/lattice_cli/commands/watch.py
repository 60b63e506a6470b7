"""``lattice watch ID``: an allocation's live metrics and alerts, pushed by its node
agents (``lattice top`` reads the TSDB instead).

::

    lattice watch a1b2c3d4                                    # a live table (a terminal)
    lattice watch a1b2c3d4 --metrics=gpu_utilization,memory_used
    lattice watch a1b2c3d4 --alerts-only                      # alerts as they fire and clear
    lattice watch a1b2c3d4 -o json                            # one JSON record per line

Values come once per aggregation window (30 s) in prod mode and every second in debug
mode (``lattice telemetry --alloc=ID --mode=debug``); a mode switch shows at once. Ends
when the allocation ends (exit 0); Ctrl-C ends it too (exit 0). Rendering is in
:mod:`lattice_cli.watching`, pure.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, fail, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command("watch")(watch)


def watch(
    ctx: typer.Context,
    alloc_id: Annotated[str, typer.Argument(help="Allocation ID.", metavar="ID")],
    metrics: Annotated[
        list[str] | None,
        typer.Option(
            "--metrics",
            "--metric",
            help="Only these metrics (comma-separated or repeated), e.g. "
            "gpu_utilization,memory_used.",
            metavar="NAMES",
        ),
    ] = None,
    alerts_only: Annotated[
        bool,
        typer.Option("--alerts-only", help="Only alerts (and nodes dropping out), no values."),
    ] = False,
    node: Annotated[str | None, typer.Option("--node", help="Only this node.")] = None,
    interval: Annotated[
        float | None,
        typer.Option(
            "--interval", help="At most one update per node every this many seconds.", min=0
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Stream an allocation's live metrics and alerts from its nodes until it ends."""
    st = state_of(ctx)
    fmt = st.output(output)
    names = [n.strip() for item in metrics or [] for n in item.split(",") if n.strip()]
    if any(not n.replace("_", "").isalnum() for n in names):
        fail(
            f"invalid metric names: {', '.join(names)}",
            hint="e.g. --metrics=cpu_utilization",
            code=2,
        )
    live = fmt in ("table", "wide") and not alerts_only and sys.stdout.isatty()

    async def go(client: Any) -> None:
        from lattice_cli import output as out
        from lattice_cli import watching

        records = client.stream_metrics(
            alloc_id, metrics=names or None, node=node, alerts_only=alerts_only, interval=interval
        )
        if fmt == "json":
            async for rec in records:
                print(out.to_json(rec, compact=True), flush=True)
            return
        if fmt == "yaml":
            async for rec in records:
                print("---\n" + out.to_yaml(rec), end="", flush=True)
            return
        if not live:
            async for rec in records:
                if alerts_only and rec.get("event") not in watching.ALERT_EVENTS | {"end"}:
                    continue
                for line in watching.event_lines(rec, names):
                    print(line, flush=True)
            return
        await _live_table(records, watching.WatchView(alloc_id, names), st.color())

    try:
        run_api(st, go)
    except typer.Exit as exc:
        if exc.exit_code == 130:  # Ctrl-C ends a watch normally
            raise typer.Exit(0) from None
        raise


async def _live_table(records: Any, view: Any, color: bool) -> None:
    """The view redrawn in place (rich) on every record and every second."""
    import asyncio
    import time

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(no_color=not color, highlight=False)
    with Live(Text(view.render(time.time())), console=console, auto_refresh=False) as screen:
        pending = asyncio.ensure_future(anext(records, None))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=1.0)
                if done:
                    rec = pending.result()
                    if rec is None:
                        break
                    view.apply(rec)
                    pending = asyncio.ensure_future(anext(records, None))
                screen.update(Text(view.render(time.time())), refresh=True)
        finally:
            if not pending.done():
                pending.cancel()
