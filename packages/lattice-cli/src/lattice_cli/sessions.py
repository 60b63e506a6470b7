"""Interactive sessions from the CLI (``lattice session``, ``lattice salloc``): create one,
wait until its allocation runs, and say where it is. Progress goes to stderr."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import typer

from lattice_cli.context import State, run_api

#: how long to wait for the allocation to start (it keeps its place in the queue)
START_TIMEOUT = 600.0
TERMINAL_STATES = ("Completed", "Failed", "Cancelled")


def create(st: State, body: dict[str, Any] | Any) -> dict[str, Any]:
    """The new session (``body``: fields, or an SDK AllocationSpec)."""

    async def go(client: Any) -> dict[str, Any]:
        if isinstance(body, dict):
            return await client.create_session(**body)
        return await client.create_session(body)

    return run_api(st, go)


def wait_running(st: State, s: dict[str, Any], command: str = "lattice session") -> dict[str, Any]:
    """Block until the session's allocation runs; exits 1 with a clear message if it
    ends first or does not start within START_TIMEOUT."""
    print(
        f"Session {s['id']}: allocation {s['allocation_id']} queued; waiting for it to start "
        "(Ctrl-C stops waiting, the session stays queued).",
        file=sys.stderr,
    )

    async def wait(client: Any) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            cur = await client.get_session(s["id"])
            if cur["state"] == "Running" or cur["state"] in TERMINAL_STATES:
                return cur
            await asyncio.sleep(0.5)
        return await client.get_session(s["id"])

    cur = run_api(st, wait)
    if cur["state"] != "Running":
        why = (
            "it ended before a terminal could open"
            if cur["state"] in TERMINAL_STATES
            else f"attach when it runs: lattice attach {s['allocation_id']}"
        )
        print(f"{command}: {s['id']} is {cur['state']}; {why}", file=sys.stderr)
        raise typer.Exit(1)
    return cur


def delete(st: State, session_id: str) -> dict[str, Any]:
    async def go(client: Any) -> dict[str, Any]:
        return await client.delete_session(session_id)

    return run_api(st, go)
