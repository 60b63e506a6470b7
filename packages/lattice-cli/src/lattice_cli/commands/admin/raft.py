"""``lattice admin raft status``: the quorum's leader, term, commit index and members."""

from __future__ import annotations

from typing import Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

raft_app = typer.Typer(help="Inspect the Raft quorum.", no_args_is_help=True)


@raft_app.command("status")
def raft_status(ctx: typer.Context, output: OutputOpt = None) -> None:
    """Show the quorum: leader, term, commit index and members."""
    from lattice_cli import output as out

    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.raft_status()

    data = run_api(st, go)
    fmt = st.output(output)
    emit(st, "table" if fmt == "wide" else fmt, data, lambda: out.raft_status_text(data))
