"""``lattice sinfo``: Slurm's sinfo over the node list: per partition (vCluster) and
state, or one line per node (``-N``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import run_api, state_of


def register(app: typer.Typer) -> None:
    app.command(context_settings={"help_option_names": ["--help"]})(sinfo)


# Lattice node state -> sinfo's short state (a Ready node holding a job is "alloc").
_NODE_STATES = {
    "Ready": "idle",
    "Booting": "boot",
    "Degraded": "mix",
    "Down": "down",
    "Draining": "drng",
    "Drained": "drain",
    "Failed": "fail",
    "Unknown": "unk",
}


def node_state(node: dict[str, Any]) -> str:
    state = str(node.get("state") or "Unknown")
    if state == "Ready" and node.get("owner"):
        return "alloc"
    short = _NODE_STATES.get(state, state.lower())
    return short + ("*" if state == "Down" else "")


def partition_of(node: dict[str, Any]) -> str:
    return str(node.get("owner_vcluster") or node.get("home_vcluster") or "(none)")


def sinfo_text(nodes: list[dict[str, Any]], *, per_node: bool, header: bool = True) -> str:
    """sinfo's ``PARTITION AVAIL TIMELIMIT NODES STATE NODELIST`` (``-N``:
    ``NODELIST NODES PARTITION STATE``)."""
    from lattice_common.slurm import compress_hostlist, hostname_sort_key

    if per_node:
        rows = [
            [str(n.get("id")), "1", partition_of(n), node_state(n)]
            for n in sorted(nodes, key=lambda n: hostname_sort_key(str(n.get("id"))))
        ]
        heads = ["NODELIST", "NODES", "PARTITION", "STATE"]
    else:
        groups: dict[tuple[str, str], list[str]] = {}
        for n in nodes:
            groups.setdefault((partition_of(n), node_state(n)), []).append(str(n.get("id")))
        rows = [
            [part, "up", "infinite", str(len(ids)), state, compress_hostlist(ids, sort=True)]
            for (part, state), ids in sorted(groups.items())
        ]
        heads = ["PARTITION", "AVAIL", "TIMELIMIT", "NODES", "STATE", "NODELIST"]
    table = ([heads] if header else []) + rows
    if not table:
        return ""
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    return "\n".join(
        " ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table
    )


def sinfo(
    ctx: typer.Context,
    node_oriented: Annotated[
        bool, typer.Option("--Node", "-N", help="One line per node (node-oriented).")
    ] = False,
    partition: Annotated[
        str | None,
        typer.Option("--partition", "-p", help="Only this partition (vCluster)."),
    ] = None,
    noheader: Annotated[
        bool, typer.Option("--noheader", "-h", help="Print no header line.")
    ] = False,
) -> None:
    """Show nodes like sinfo: PARTITION AVAIL TIMELIMIT NODES STATE NODELIST."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.list_nodes()

    nodes = [n.raw for n in run_api(st, go)]
    if partition:
        nodes = [n for n in nodes if partition_of(n) == partition]
    text = sinfo_text(nodes, per_node=node_oriented, header=not noheader)
    if text:
        print(text)
