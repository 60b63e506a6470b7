"""``lattice suspend ID`` and ``lattice resume ID``: checkpoint a running allocation and
hold it Suspended, then put it back in the queue to resume from that checkpoint.

Suspend needs an allocation submitted with a checkpoint protocol
(``--checkpoint=signal|shmem|grpc``) in a vCluster that lets users suspend; it answers
at once (Checkpointing) and the allocation becomes Suspended when its checkpoint is
written (``lattice watch ID`` shows it). Resume puts a Suspended allocation back in the
queue with its original submit time. Exit 1 if any allocation could not be changed.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, print_api_error, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(suspend)


def _each(ctx: typer.Context, alloc_ids: list[str], output: str | None, verb: str) -> None:
    from lattice_sdk import LatticeError

    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> int:
        failed = 0
        for alloc_id in alloc_ids:
            try:
                alloc = await getattr(client, verb)(alloc_id)
            except LatticeError as exc:
                if exc.status_code is None:  # unreachable: no point trying the others
                    raise
                failed += 1
                print_api_error(st, exc)
                continue
            if fmt == "json":
                from lattice_cli import output as out

                print(out.to_json(alloc.raw, compact=True))
            elif not st.quiet:
                aid = alloc.id or alloc_id
                if verb == "suspend":
                    print(
                        f"Suspending allocation {aid}: checkpointing "
                        f"(`lattice watch {aid}` shows when it is Suspended)"
                    )
                else:
                    print(f"Resumed allocation {aid}: Pending, it restarts from its checkpoint")
        return failed

    if run_api(st, go):
        raise typer.Exit(1)


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
