"""``lattice suspend ID`` and ``lattice resume ID``: checkpoint a running allocation and
hold it Suspended, then put it back in the queue to resume from that checkpoint.

Suspend needs an allocation submitted with a checkpoint protocol
(``--checkpoint=signal|shmem|grpc``) in a vCluster that lets users suspend; it answers
at once (Checkpointing) and the allocation becomes Suspended when its checkpoint is
written (``lattice watch ID`` shows it). Resume puts a Suspended allocation back in the
queue with its original submit time. Exit 1 if any allocation could not be changed.
"""

from __future__ import annotations

from typing import Annotated

import typer

from lattice_cli.context import OutputOpt
from lattice_cli.each import act_on_each


def register(app: typer.Typer) -> None:
    app.command()(suspend)


def _said(verb: str, aid: str) -> str:
    if verb == "suspend":
        return (
            f"Suspending allocation {aid}: checkpointing "
            f"(`lattice watch {aid}` shows when it is Suspended)"
        )
    return f"Resumed allocation {aid}: Pending, it restarts from its checkpoint"


def _each(ctx: typer.Context, alloc_ids: list[str], output: str | None, verb: str) -> None:
    act_on_each(
        ctx,
        alloc_ids,
        output,
        lambda client, aid: getattr(client, verb)(aid),
        lambda aid: _said(verb, aid),
    )


def suspend(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str], typer.Argument(help="Allocation IDs to suspend.", metavar="ID...")
    ],
    output: OutputOpt = None,
) -> None:
    """Checkpoint running allocations and hold them Suspended (nodes released)."""
    _each(ctx, alloc_ids, output, "suspend")


def resume(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str], typer.Argument(help="Allocation IDs to resume.", metavar="ID...")
    ],
    output: OutputOpt = None,
) -> None:
    """Put Suspended allocations back in the queue to resume from their checkpoint."""
    _each(ctx, alloc_ids, output, "resume")
