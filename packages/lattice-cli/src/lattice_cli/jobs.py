"""Fetching jobs for the Slurm-named commands (squeue, sacct): named ids (a task group's
id stands for its tasks) or a listing. Not a command module; the SDK is imported inside."""

from __future__ import annotations

from typing import Any


async def fetch_jobs(
    client: Any,
    ids: list[str],
    states: list[str],
    user: str | None,
    vcluster: str | None,
) -> list[dict[str, Any]]:
    """Records of the named jobs (a task group id: its tasks), else the listing."""
    if not ids:
        found = await client.list_allocations(state=",".join(states), user=user, vcluster=vcluster)
        return [a.raw for a in found]
    from lattice_sdk import LatticeNotFoundError

    out: list[dict[str, Any]] = []
    for job in ids:
        try:
            out.append((await client.status(job)).raw)
        except LatticeNotFoundError:
            tasks = await client.list_allocations(task_group=job, user=user)
            if not tasks:
                raise
            out.extend(t.raw for t in tasks)
    return [
        a
        for a in out
        if a.get("state") in states
        and (not vcluster or (a.get("spec") or {}).get("vcluster") == vcluster)
    ]
