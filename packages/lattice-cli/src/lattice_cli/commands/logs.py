"""``lattice logs``: an allocation's output, or ``-f`` to follow it live.

Lines come from the node's agent while it runs and from the log store afterwards (or
when the node is gone); ``--since``/``--until`` keep the lines whose capture time falls
in the window, ``--node`` one node's lines, both applied by the server (``--tail`` then
counts within them).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(logs)


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
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Only lines written at or after this time: 10m / 2h / 1d ago, "
            "2026-03-01T10:00:00Z, or epoch seconds.",
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option("--until", help="Only lines written at or before this time (as --since)."),
    ] = None,
    timestamps: Annotated[
        bool,
        typer.Option("--timestamps/--no-timestamps", help="Prefix each line with its time."),
    ] = True,
    output: OutputOpt = None,
) -> None:
    """Show an allocation's output; stderr lines go to stderr. `-f` follows live."""
    from lattice_cli.commands.admin.audit import parse_when

    st = state_of(ctx)
    fmt = st.output(output)
    t_since = parse_when(since, "since")
    t_until = parse_when(until, "until")

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
        # the server filters (stream, node, the --since/--until window) and then takes
        # the last --tail lines of what is left
        window = {"node": node, "since": t_since, "until": t_until}
        if follow:
            alloc = await client.status(alloc_id)  # also a clear 404 before streaming
            many = len(alloc.assigned_nodes) > 1 or (alloc.spec.nodes or 1) > 1
            async for line in client.stream_logs(alloc_id, tail=tail, stream=stream, **window):
                show(line, many and not node)
            # the stream also ends when the allocation goes back to the queue (its node
            # was lost, or it was requeued): say so rather than end as if it had finished
            now = await client.status(alloc_id)
            if now.state == "Pending":
                why = f" ({now.reason})" if now.reason else ""
                print(
                    f"lattice: allocation {alloc_id} went back to the queue{why}; "
                    "following stopped.\n"
                    f"Hint: `lattice logs {alloc_id} --follow` again once it runs "
                    f"(`lattice status {alloc_id}` shows its state).",
                    file=sys.stderr,
                )
            return
        lines = await client.logs(alloc_id, tail=tail, stream=stream, **window)
        many = len({line.node_id for line in lines if line.node_id}) > 1
        for line in lines:
            show(line, many and not node)

    run_api(st, go)
