"""``lattice top ID``: an allocation's latest metrics, from the TSDB the node agents push
to (sstat's counterpart).

::

    lattice top a1b2c3d4                 # summary: one value per metric across the nodes
    lattice top a1b2c3d4 --per-node      # one row per node
    lattice top a1b2c3d4 --per-gpu       # one row per GPU
    lattice top a1b2c3d4 --wide          # every metric of the catalog
    lattice top a1b2c3d4 --duration 1h   # look back an hour for the latest values
    lattice top a1b2c3d4 --metric gpu_utilization -o json

Values are as fresh as the telemetry mode makes them: 30 s windows in prod mode, 1 s in
debug mode. Rendering is in :mod:`lattice_cli.output` (``metrics_*``), pure.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command("top")(top)


def top(
    ctx: typer.Context,
    alloc_id: Annotated[str, typer.Argument(help="Allocation ID.", metavar="ID")],
    per_node: Annotated[bool, typer.Option("--per-node", help="One row per node.")] = False,
    per_gpu: Annotated[bool, typer.Option("--per-gpu", help="One row per GPU.")] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Every metric (I/O, GPU power, I/O latency too).")
    ] = False,
    duration: Annotated[
        str | None,
        typer.Option(
            "--duration",
            help="How far back to look for the latest values: 30s, 5m (default), 1h, 2d.",
            metavar="DURATION",
        ),
    ] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            help="Only this metric (repeatable, or comma-separated), e.g. gpu_utilization.",
            metavar="NAME",
        ),
    ] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only this node.")] = None,
    output: OutputOpt = None,
) -> None:
    """Show an allocation's live metrics (GPU, CPU, memory, network, I/O) from the TSDB."""
    st = state_of(ctx)
    if per_node and per_gpu:
        fail("--per-node and --per-gpu exclude each other", hint="Pick one view.", code=2)
    fmt = st.output(output)
    if fmt == "wide":
        wide, fmt = True, "table"
    mode = "per-node" if per_node else "per-gpu" if per_gpu else "summary"

    async def go(client: Any) -> Any:
        return await client.query_metrics(
            alloc_id, mode=mode, duration=duration, metrics=metric or None, node=node
        )

    snap = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, snap)
        return

    from lattice_cli import output as out

    if not snap.get("samples"):
        print(out.no_metrics_text(snap, alloc_id))
        return
    if mode == "per-node":
        body = out.metrics_node_table(snap, wide=wide or bool(metric))
    elif mode == "per-gpu":
        body = out.metrics_gpu_table(snap)
    else:
        body = out.metrics_summary_table(snap, wide=wide or bool(metric))
    if not st.quiet:
        print(out.metrics_caption(snap, time.time()))
    print(body)
