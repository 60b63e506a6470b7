"""One allocation as the runtime holds it: its lifecycle record plus the live machinery.

The record (``lifecycle.Lifecycle``) is what the pure lifecycle function reads and returns;
everything else here (the process group, the log tail, timers, tasks) is I/O that dies with
the agent process and is rebuilt from the state file by a restarted one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from lattice_common.types import Allocation, AllocationReport

from lattice_agent.lifecycle import Lifecycle
from lattice_agent.logtail import STREAMS, LogTail
from lattice_agent.persist import SavedAlloc
from lattice_agent.procgroup import ProcessGroup
from lattice_agent.spawn import AllocPaths

__all__ = ["AllocHandle", "new_log_tail"]


def new_log_tail(
    alloc_id: str,
    paths: AllocPaths,
    *,
    ring_lines: int,
    clock: Callable[[], float],
    offsets: dict[str, int] | None = None,
    resume: bool = False,
) -> LogTail:
    return LogTail(
        alloc_id,
        {s: paths.log(s) for s in STREAMS},
        ring_lines=ring_lines,
        clock=clock,
        offsets=offsets,
        resume=resume,
    )


@dataclass(eq=False)
class AllocHandle:
    life: Lifecycle
    paths: AllocPaths
    logs: LogTail
    group: ProcessGroup | None = None  # None until spawned (and after a failed spawn)
    launch: tuple[Allocation, list[str]] | None = None  # what the Spawn instruction starts
    # set once exited and reported, or when the runtime closes: what stop() waits for
    done: asyncio.Event = field(default_factory=asyncio.Event)
    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    grace_end: float | None = None  # loop time at which the SIGTERM grace period ends
    tail_task: asyncio.Task[None] | None = None
    reap_task: asyncio.Task[None] | None = None

    @classmethod
    def recovered(
        cls,
        saved: SavedAlloc,
        *,
        ring_lines: int,
        clock: Callable[[], float],
        log_offsets: dict[str, int] | None = None,
    ) -> AllocHandle:
        """A record from the state file; its logs resume at ``log_offsets`` (where the
        log shipper got to) or, without them, near the end of the files."""
        aid = saved.life.allocation_id
        return cls(
            life=saved.life,
            paths=saved.paths,
            logs=new_log_tail(
                aid,
                saved.paths,
                ring_lines=ring_lines,
                clock=clock,
                offsets=log_offsets,
                resume=log_offsets is None,
            ),
            group=ProcessGroup(
                aid, saved.pid, pgid=saved.pgid, proc_start=saved.proc_start, is_child=False
            ),
        )

    @property
    def id(self) -> str:
        return self.life.allocation_id

    def report(self) -> AllocationReport:
        life = self.life
        return AllocationReport(
            allocation_id=life.allocation_id,
            phase=life.phase,
            pid=self.group.pid if self.group is not None else 0,
            exit_code=life.exit_code,
            reason=life.reason,
            started_at=life.started_at,
            finished_at=life.finished_at,
            peak_memory_bytes=life.peak_memory_bytes,
        )

    def saved(self) -> SavedAlloc | None:
        """What the state file keeps (None: no process was ever started)."""
        g = self.group
        if g is None or g.pid <= 0:
            return None
        return SavedAlloc(self.life, g.pid, g.pgid, g.proc_start, self.paths)

    def signal(self, signum: int) -> None:
        if self.group is not None:
            self.group.signal(signum)

    def arm(self, timer: str, delay: float, fire: Callable[[AllocHandle, str], None]) -> None:
        """Call ``fire(self, timer)`` after ``delay`` seconds, replacing an armed one."""
        self.cancel_timer(timer)
        loop = asyncio.get_running_loop()
        self.timers[timer] = loop.call_later(delay, fire, self, timer)

    def cancel_timer(self, timer: str) -> None:
        handle = self.timers.pop(timer, None)
        if handle is not None:
            handle.cancel()

    def cancel_timers(self) -> None:
        for handle in self.timers.values():
            handle.cancel()
        self.timers.clear()

    def release(self) -> None:
        """Stop timers and tailing; followers end. The files stay."""
        self.cancel_timers()
        if self.tail_task is not None:
            self.tail_task.cancel()
        self.logs.close_files()
        self.logs.mark_drained()
