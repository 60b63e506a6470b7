"""handle.py: one allocation's record plus its live machinery (reports, timers, release)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from lattice_agent.handle import AllocHandle, new_log_tail
from lattice_agent.lifecycle import Lifecycle, Status
from lattice_agent.persist import SavedAlloc
from lattice_agent.procgroup import ProcessGroup
from lattice_agent.spawn import AllocPaths

PATHS = AllocPaths.of("a1", Path("/nonexistent/w"), Path("/nonexistent/l"))


def handle(group: ProcessGroup | None = None) -> AllocHandle:
    life = Lifecycle(allocation_id="a1", status=Status.RUNNING, started_at=10.0)
    logs = new_log_tail("a1", PATHS, ring_lines=10, clock=lambda: 0.0)
    return AllocHandle(life=life, paths=PATHS, logs=logs, group=group)


def test_report_and_saved_without_a_process() -> None:
    h = handle()
    r = h.report()
    assert (r.allocation_id, r.phase, r.pid, r.started_at) == ("a1", "running", 0, 10.0)
    assert h.saved() is None  # a spawn that failed is not written down


def test_saved_with_a_process() -> None:
    h = handle(ProcessGroup("a1", 77, proc_start=5, is_child=False))
    assert h.report().pid == 77
    assert h.saved() == SavedAlloc(h.life, 77, 77, 5, PATHS)
    back = AllocHandle.recovered(h.saved(), ring_lines=10, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert (back.id, back.group.pid, back.group.is_child) == ("a1", 77, False)  # type: ignore[union-attr]


async def test_timers_fire_once_and_are_replaced_or_cancelled() -> None:
    h = handle()
    fired: list[str] = []
    h.arm("walltime", 0.05, lambda rec, timer: fired.append(timer))
    h.arm("walltime", 0.01, lambda rec, timer: fired.append("replaced " + timer))
    h.arm("grace", 0.01, lambda rec, timer: fired.append(timer))
    h.cancel_timer("grace")
    await asyncio.sleep(0.1)
    assert fired == ["replaced walltime"]
    h.arm("grace", 0.01, lambda rec, timer: fired.append(timer))
    h.release()
    await asyncio.sleep(0.05)
    assert fired == ["replaced walltime"]
    assert h.timers == {}
    assert h.logs.drained
