"""One action on each named allocation (``lattice cancel``, ``suspend``, ``resume``):
the SDK call per id, an API refusal printed and counted while the others go on, an
unreachable server stopping at once, ``-o json`` printing each answer; exit 1 if any
allocation could not be changed. Not a command module; the SDK is imported inside."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import typer

from lattice_cli.context import print_api_error, run_api, state_of


def act_on_each(
    ctx: typer.Context,
    alloc_ids: list[str],
    output: str | None,
    call: Callable[[Any, str], Awaitable[Any]],
    done: Callable[[str], str],
) -> None:
    """``call(client, id)`` for every id; ``done(id)`` is the line printed for each
    success (unless ``-o json`` or quiet)."""
    from lattice_sdk import LatticeError

    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> int:
        failed = 0
        for alloc_id in alloc_ids:
            try:
                alloc = await call(client, alloc_id)
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
                print(done(alloc.id or alloc_id))
        return failed

    if run_api(st, go):
        raise typer.Exit(1)
