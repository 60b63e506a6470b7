"""``lattice node drain|undrain|disable|enable|release``: change one node (admin, or
the claiming user for ``release``)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

node_app = typer.Typer(
    help="Drain, undrain, disable and enable nodes (admin); release a sensitive claim.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")


def _node_action(ctx: typer.Context, node_id: str, action: str, reason: str, output: Any) -> None:
    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        if action == "release":
            return await client.release_node_claim(node_id)
        method = getattr(client, f"{action}_node")
        return await method(node_id, reason=reason)

    node = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, node.raw)
    elif action == "release" and not st.quiet:
        print(f"Node {node.id or node_id} released; it is {node.state} and unclaimed")
    elif not st.quiet:
        print(f"Node {node.id or node_id} is now {node.state}")


ReasonOpt = Annotated[
    str, typer.Option("--reason", "-r", help="Why (recorded with the node's state).")
]
NodeArg = Annotated[str, typer.Argument(help="Node ID.", metavar="ID")]


@node_app.command("drain")
def node_drain(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Stop placing new allocations on a node; running ones finish."""
    _node_action(ctx, node_id, "drain", reason, output)


@node_app.command("undrain")
def node_undrain(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Return a draining or drained node to service."""
    _node_action(ctx, node_id, "undrain", reason, output)


@node_app.command("disable")
def node_disable(
    ctx: typer.Context,
    node_id: NodeArg,
    reason: ReasonOpt = "",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    output: OutputOpt = None,
) -> None:
    """Take a node out of service entirely (asks for confirmation)."""
    if not yes and not typer.confirm(f"Disable node {node_id}?", default=False):
        print("Aborted.", file=sys.stderr)
        raise typer.Exit(1)
    _node_action(ctx, node_id, "disable", reason, output)


@node_app.command("enable")
def node_enable(
    ctx: typer.Context, node_id: NodeArg, reason: ReasonOpt = "", output: OutputOpt = None
) -> None:
    """Put a disabled node back into service."""
    _node_action(ctx, node_id, "enable", reason, output)


@node_app.command("release")
def node_release(ctx: typer.Context, node_id: NodeArg, output: OutputOpt = None) -> None:
    """End your sensitive claim on an idle node (administrators: anyone's claim)."""
    _node_action(ctx, node_id, "release", "", output)
