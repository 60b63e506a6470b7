"""``lattice nodes``: list cluster nodes like sinfo, or show one."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(nodes)


def nodes(
    ctx: typer.Context,
    node_id: Annotated[
        str | None,
        typer.Argument(help="Show one node in detail.", metavar="[ID]", show_default=False),
    ] = None,
    state_filter: Annotated[
        str | None, typer.Option("--state", help="Only nodes in this state (e.g. ready).")
    ] = None,
    vcluster: Annotated[
        str | None, typer.Option("--vcluster", help="Only nodes of this vCluster.")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """List cluster nodes (like sinfo), or show one node."""
    from lattice_cli import output as out

    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        if node_id:
            return await client.get_node(node_id)
        return await client.list_nodes(state=state_filter)

    result = run_api(st, go)
    if node_id:
        emit(st, "table" if fmt == "wide" else fmt, result.raw, lambda: out.node_detail(result.raw))
        return
    raws = [n.raw for n in result]
    if vcluster:
        raws = [n for n in raws if vcluster in (n.get("owner_vcluster"), n.get("home_vcluster"))]
    if st.quiet and fmt in ("table", "wide"):
        for n in raws:
            print(n.get("id"))
        return
    color = fmt in ("table", "wide") and st.color()
    emit(st, fmt, raws, lambda: out.node_table(raws, wide=fmt == "wide", color=color))
