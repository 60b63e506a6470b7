"""``lattice cancel``: cancel allocations, like scancel (exit 1 if any failed)."""

from __future__ import annotations

from typing import Annotated

import typer

from lattice_cli.context import OutputOpt
from lattice_cli.each import act_on_each


def register(app: typer.Typer) -> None:
    app.command()(cancel)


def cancel(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str], typer.Argument(help="Allocation IDs to cancel.", metavar="ID...")
    ],
    output: OutputOpt = None,
) -> None:
    """Cancel allocations (like scancel). Exits 1 if any could not be cancelled."""
    act_on_each(
        ctx, alloc_ids, output, lambda c, a: c.cancel(a), lambda a: f"Cancelled allocation {a}"
    )
