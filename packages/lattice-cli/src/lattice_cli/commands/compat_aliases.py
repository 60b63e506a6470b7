"""``lattice compat-aliases``: a shell snippet defining sbatch, squeue, scancel, salloc,
srun, sinfo and sacct as functions calling ``lattice <cmd>``."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command(name="compat-aliases")(compat_aliases)


def compat_aliases() -> None:
    """Print shell functions for the Slurm commands: `eval "$(lattice compat-aliases)"`
    (bash, zsh, sh). Each calls `lattice sbatch`, `lattice squeue`, ... with its arguments."""
    from lattice_cli.slurm_cli import compat_aliases_script

    print(compat_aliases_script())
