"""``lattice attach``: a terminal in a Running allocation (``srun --jobid=ID --pty bash``).

With a terminal on stdin, the local terminal goes into raw mode, so Ctrl-C, Ctrl-Z and
Ctrl-\\ travel as bytes and the remote PTY turns them into signals; window size
changes (SIGWINCH) are sent as resizes. The terminal is restored on every way out
(the command's end, an error, SIGTERM/SIGHUP to this process). Without a terminal
(piped stdin) the command runs without a PTY: stdin is sent until EOF, stdout and
stderr come back apart, and Ctrl-C is forwarded as SIGINT. The exit status is the
remote command's (128+N for signal N).
"""

from __future__ import annotations

from typing import Annotated

import typer

from lattice_cli.context import state_of
from lattice_cli.terminal import run_terminal


def register(app: typer.Typer) -> None:
    app.command(
        epilog="Examples: lattice attach 123 | lattice attach 123 --node=nid001234 | "
        'lattice attach 123 --command="nvidia-smi -l 1" | lattice attach 123 -- htop',
    )(attach)


def attach(
    ctx: typer.Context,
    alloc_id: Annotated[str, typer.Argument(help="The allocation.", metavar="ID")],
    argv: Annotated[
        list[str] | None,
        typer.Argument(
            help="Program and arguments to run instead of a shell (after --).", metavar="CMD"
        ),
    ] = None,
    node: Annotated[
        str | None, typer.Option("--node", help="Node to attach on (default: its first).")
    ] = None,
    command: Annotated[
        str | None,
        typer.Option("--command", help="Command line to run (by /bin/sh -c) instead of a shell."),
    ] = None,
) -> None:
    """Open a terminal in a Running allocation of yours (srun --jobid=ID --pty bash).

    The remote command (default: your login shell) runs on a PTY in the allocation's
    working directory and environment; `exit` ends it and this command exits with its
    status. Several terminals may be open at once (at most 5 per user). Use tmux or
    screen inside for work that must survive a disconnect.
    """
    st = state_of(ctx)
    if command and argv:
        raise typer.BadParameter("give --command or a command after --, not both")
    remote: list[str] | None = (
        ["/bin/sh", "-c", command] if command else (list(argv) if argv else None)
    )
    raise typer.Exit(run_terminal(st, alloc_id, node=node, remote=remote))
