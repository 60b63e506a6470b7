"""``lattice cancel``: cancel allocations, like scancel (exit 1 if any failed)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, print_api_error, run_api, state_of


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
    from lattice_sdk import LatticeError

    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> int:
        failed = 0
        for alloc_id in alloc_ids:
            try:
                alloc = await client.cancel(alloc_id)
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
                print(f"Cancelled allocation {alloc.id or alloc_id}")
        return failed

    if run_api(st, go):
        raise typer.Exit(1)
