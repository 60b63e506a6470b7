"""``lattice salloc``: Slurm's salloc as a Lattice session. ``salloc [-N -t -p -J -A -C
--gres --mem ...] [COMMAND]`` queues an interactive allocation, waits until it runs,
then runs COMMAND (default: your shell) in a terminal on its first node; when that
ends, the allocation is released, as when salloc's command exits."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import typer

from lattice_cli.context import fail, state_of


def register(app: typer.Typer) -> None:
    app.command(
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "help_option_names": ["--help"],
        }
    )(salloc)


def salloc(ctx: typer.Context) -> None:
    """Interactive allocation (salloc -N 2 -t 1:00:00 [COMMAND]): a Lattice session,
    released when the command (default: your shell) ends. Flags as sbatch's."""
    from lattice_cli import sessions, slurm_cli, submitting
    from lattice_cli import submit_options as d
    from lattice_cli.terminal import run_terminal

    st = state_of(ctx)
    cfg = st.config
    try:
        cli = slurm_cli.parse_sbatch_argv(
            list(ctx.args), partition_map=cfg.partition_map, qos_map=cfg.qos_map
        )
    except d.DirectiveError as exc:
        fail(exc.message.replace("sbatch", "salloc"), hint=exc.hint, code=2)
    if cli.wrap is not None or cli.opts.task_group or cli.opts.dependency:
        fail("salloc takes no --wrap, --array or --dependency", code=2)
    spec: Any = submitting.build_spec(st, cli.opts, "", "salloc")
    if not spec.walltime:
        spec.walltime = "1h"
        print("salloc: no --time given; the session gets 1h", file=sys.stderr)
    s = sessions.create(st, spec)
    sessions.wait_running(st, s, "salloc")
    print(f"salloc: Granted job allocation {s['allocation_id']}", file=sys.stderr)
    remote = ["/bin/sh", "-c", shlex.join(cli.operands)] if cli.operands else None
    try:
        code = run_terminal(st, s["allocation_id"], remote=remote)
    finally:
        sessions.delete(st, s["id"])
        print(f"salloc: Relinquishing job allocation {s['allocation_id']}", file=sys.stderr)
    raise typer.Exit(code)
