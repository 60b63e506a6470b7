"""``lattice session``: an interactive allocation with a terminal (salloc, then a shell).

``lattice session [-N 1] [-t 4h] [--vcluster V] ...`` creates the session (its
allocation is queued like any other), waits until it runs, and opens a terminal on its
first node; leaving the shell ends the terminal, not the session: ``lattice attach ID``
opens another, ``lattice session delete ID`` ends it (or its walltime does).
``lattice session list`` shows yours.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    sub = typer.Typer(
        help="Interactive sessions: an allocation with a terminal (salloc).",
        invoke_without_command=True,
        no_args_is_help=False,
    )
    sub.callback(invoke_without_command=True)(session)
    sub.command("list")(list_sessions)
    sub.command("delete")(delete_session)
    app.add_typer(sub, name="session")


def session(
    ctx: typer.Context,
    nodes: Annotated[int, typer.Option("--nodes", "-N", help="Nodes.", min=1)] = 1,
    walltime: Annotated[
        str, typer.Option("--walltime", "-t", help="Time limit, e.g. 4h or 01:30:00.")
    ] = "4h",
    vcluster: Annotated[str | None, typer.Option("--vcluster", help="vCluster.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Tenant.")] = None,
    constraint: Annotated[
        list[str] | None,
        typer.Option("--constraint", "-C", help="Node property, e.g. gpu_type=GH200."),
    ] = None,
    uenv: Annotated[str | None, typer.Option("--uenv", help="Software environment.")] = None,
    view: Annotated[
        str | None, typer.Option("--view", help="View of the uenv to activate, e.g. default.")
    ] = None,
    no_attach: Annotated[
        bool, typer.Option("--no-attach", help="Create it and print its id; attach later.")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Create an interactive session and open a terminal in it once it runs."""
    if ctx.invoked_subcommand is not None:
        return
    from lattice_cli import submit_options as d

    st = state_of(ctx)
    cfg = st.config
    try:
        constraints = d.parse_constraints(constraint or [])
        d.parse_walltime(walltime)
    except d.DirectiveError as exc:
        raise typer.BadParameter(exc.message) from None
    body: dict[str, Any] = {
        "nodes": nodes,
        "walltime": walltime,
        "tenant": tenant or st.tenant or cfg.tenant,
        "vcluster": vcluster or st.vcluster or cfg.vcluster,
        "constraints": constraints,
        "uenv": uenv or cfg.uenv,
        "view": view,
    }
    body = {k: v for k, v in body.items() if v not in (None, "", {})}
    fmt = st.output(output)

    from lattice_cli import sessions

    s = sessions.create(st, body)
    if no_attach or fmt in ("json", "yaml"):
        emit(st, fmt, s, lambda: f"Session {s['id']} (allocation {s['allocation_id']})")
        return
    cur = sessions.wait_running(st, s)
    print(
        f"Session {s['id']} running on {', '.join(cur.get('nodes') or [])}. Leaving the shell "
        f"keeps the session; end it with: lattice session delete {s['id']}",
        file=sys.stderr,
    )
    from lattice_cli.terminal import run_terminal

    raise typer.Exit(run_terminal(st, s["allocation_id"]))


def list_sessions(
    ctx: typer.Context,
    all_users: Annotated[
        bool, typer.Option("--all", "-a", help="Everybody's (administrators).")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Your sessions, newest first."""
    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> list[dict[str, Any]]:
        return await client.list_sessions(all=all_users)

    rows = run_api(st, go)

    def table() -> str:
        if not rows:
            return "No sessions."
        lines = [f"{'SESSION':<10} {'ALLOCATION':<10} {'STATE':<10} NODES"]
        lines += [
            f"{r['id']:<10} {r['allocation_id']:<10} {r['state']:<10} "
            f"{','.join(r.get('nodes') or []) or '-'}"
            for r in rows
        ]
        return "\n".join(lines)

    emit(st, fmt, rows, table)


def delete_session(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(help="The session.", metavar="ID")],
) -> None:
    """End a session: its allocation is cancelled and every terminal in it closes."""
    st = state_of(ctx)

    from lattice_cli import sessions

    s = sessions.delete(st, session_id)
    if not st.quiet:
        print(f"Session {s['id']} ended (allocation {s['allocation_id']} {s['state']})")
