"""``lattice salloc``: Slurm's salloc. Interactive allocations are Lattice sessions,
which are not built yet: this prints what to use meanwhile (exit 2)."""

from __future__ import annotations

from typing import Any

import typer

from lattice_cli.context import fail


def register(app: typer.Typer) -> None:
    app.command(
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "help_option_names": ["--help"],
        }
    )(salloc)


def salloc(ctx: typer.Context) -> None:
    """Interactive allocation (salloc): not available yet; Lattice's equivalent is
    `lattice session`. Meanwhile: hold nodes with a batch job and run into it."""
    args: list[Any] = list(ctx.args)
    shown = " ".join(a for a in args if a.startswith("-"))
    fail(
        "salloc: interactive allocations are Lattice sessions (`lattice session`), "
        "which this version does not have yet",
        hint="Hold nodes with a batch job and launch into it: "
        f"`lattice sbatch --parsable {shown + ' ' if shown else ''}--wrap='sleep infinity'`"
        ", then `lattice srun --jobid=ID CMD` (or `lattice launch --alloc=ID -- CMD`), "
        "and `lattice scancel ID` when done.",
        code=2,
    )
