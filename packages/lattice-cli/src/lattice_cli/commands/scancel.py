"""``lattice scancel``: Slurm's scancel: jobs by id (an array id: all its tasks) or all
of a user's active jobs; quiet on success, as scancel is."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import fail, print_api_error, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command()(scancel)


def scancel(
    ctx: typer.Context,
    job_ids: Annotated[
        list[str] | None,
        typer.Argument(
            help="Job ids to cancel (an array's id cancels its tasks).", metavar="ID..."
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option(
            "--user", "-u", help="Cancel this user's active jobs (with ids: only theirs)."
        ),
    ] = None,
) -> None:
    """Cancel jobs like scancel. Exits 1 if any could not be cancelled."""
    from lattice_sdk import LatticeError, LatticeNotFoundError

    from lattice_cli import slurm_cli

    st = state_of(ctx)
    ids = [part for j in job_ids or [] for part in j.replace(",", " ").split()]
    if not ids and not user:
        fail("scancel: no job identification provided", hint="Give job ids or --user.", code=2)

    async def go(client: Any) -> int:
        targets: list[str] = []
        failed = 0
        if not ids:
            active = ",".join(slurm_cli.ACTIVE_STATES)
            targets = [a.id for a in await client.list_allocations(state=active, user=user)]
        for job in ids:
            try:
                alloc = await client.status(job)
            except LatticeNotFoundError as exc:
                tasks = await client.list_allocations(task_group=job, user=user)
                if not tasks:
                    failed += 1
                    print_api_error(st, exc)
                    continue
                targets.extend(t.id for t in tasks if t.state not in slurm_cli.TERMINAL_STATES)
                continue
            if user and alloc.raw.get("spec", {}).get("user") != user:
                continue
            targets.append(alloc.id)
        for alloc_id in targets:
            try:
                await client.cancel(alloc_id)
            except LatticeError as exc:
                if exc.status_code is None:
                    raise
                failed += 1
                print_api_error(st, exc)
        return failed

    if run_api(st, go):
        raise typer.Exit(1)
