"""``lattice resume ID``: put Suspended allocations back in the queue to resume from
their checkpoint (see :mod:`lattice_cli.commands.suspend`)."""

from __future__ import annotations

import typer

from lattice_cli.commands.suspend import resume


def register(app: typer.Typer) -> None:
    app.command()(resume)
