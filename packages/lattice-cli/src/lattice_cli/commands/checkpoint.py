"""``lattice checkpoint ID``: checkpoint running allocations now and let them run on.

The allocation must have been submitted with a checkpoint protocol
(``--checkpoint=signal|shmem|grpc``). It answers at once; the head node's agent asks the
application through its protocol, and the checkpoint becomes the allocation's last one
(``lattice status ID -o json`` shows ``last_checkpoint``). Refused while an earlier
checkpoint of the allocation is still being written. Exit 1 if any allocation could not
be asked.
"""

from __future__ import annotations

from typing import Annotated

import typer

from lattice_cli.context import OutputOpt
from lattice_cli.each import act_on_each


def register(app: typer.Typer) -> None:
    app.command()(checkpoint)


def checkpoint(
    ctx: typer.Context,
    alloc_ids: Annotated[
        list[str], typer.Argument(help="Allocation IDs to checkpoint.", metavar="ID...")
    ],
    output: OutputOpt = None,
) -> None:
    """Checkpoint running allocations now; they keep running."""
    act_on_each(
        ctx,
        alloc_ids,
        output,
        lambda client, aid: client.checkpoint(aid),
        lambda aid: (
            f"Checkpointing allocation {aid}: it keeps running "
            f"(`lattice status {aid} -o json` shows its last_checkpoint)"
        ),
    )
