"""One allocation's checkpoint, from the request to its outcome (the shell around
``timeouts``): ask through the protocol, watch for completion, signs of life and
deferral requests, apply the timeout table, then stop the processes.

* done: the checkpoint's size is measured, the processes are stopped (SIGTERM, grace,
  SIGKILL: reason ``preempted``) and the outcome carries the record;
* failed (error, unresponsive, or the processes ended first): the processes are
  stopped and the incomplete checkpoint is removed; the reason says why
  (``checkpoint_timeout``, ``checkpoint_failed: ...`` or the exit's own reason, e.g.
  ``walltime_exceeded`` when walltime won the race).

Walltime vs checkpoint (spec): walltime is never extended. If the application
completes the checkpoint while its processes are still in their SIGTERM grace, the
checkpoint is usable; if they are gone first, it is not.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from lattice_common.types import CheckpointRecord

from lattice_agent.checkpoint import timeouts
from lattice_agent.checkpoint.base import CheckpointProtocol
from lattice_agent.checkpoint.paths import directory_size

log = logging.getLogger("lattice.agent.checkpoint")

REASON_TIMEOUT = "checkpoint_timeout"
REASON_FAILED = "checkpoint_failed"
REASON_INCOMPLETE = "checkpoint_incomplete"


class Outcome(msgspec.Struct, kw_only=True):
    ok: bool
    reason: str = ""
    record: CheckpointRecord | None = None
    extended: bool = False  # the one 50 % extension was used
    deferred_seconds: float = 0.0  # deferral granted in all
    forced: bool = False  # asked again with force after max_deferral


class Coordinator:
    def __init__(
        self,
        alloc_id: str,
        protocol: CheckpointProtocol,
        checkpoint_id: str,
        directory: Path,
        *,
        timeout: float,
        max_deferral: float,
        alive: Callable[[], bool],
        exit_reason: Callable[[], str],
        stop: Callable[[str], Awaitable[None]],
        clock: Callable[[], float] = time.time,
        poll_interval: float = 0.1,
    ) -> None:
        self.alloc_id = alloc_id
        self.protocol = protocol
        self.checkpoint_id = checkpoint_id
        self.directory = directory
        self.timeout = timeout
        self.max_deferral = max_deferral
        self._alive = alive
        self._exit_reason = exit_reason
        self._stop = stop
        self._clock = clock
        self._poll_interval = poll_interval

    async def run(self) -> Outcome:
        started = self._clock()
        clock = timeouts.start(started, self.timeout, self.max_deferral)
        forced = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            await self.protocol.request(
                self.checkpoint_id,
                self.directory,
                timeout=self.timeout,
                force=False,
                deferral_left=clock.deferral_left,
            )
            size = await asyncio.to_thread(directory_size, self.directory)
            while True:
                await asyncio.sleep(self._poll_interval)
                now = self._clock()
                alive = self._alive()
                p = self.protocol.poll()
                if p.done:
                    return await self._completed(started, now, clock, forced)
                if p.error:
                    return await self._failed(f"{REASON_FAILED}: {p.error}", clock, forced)
                if not alive:  # ended before completing: walltime won, or it crashed
                    return await self._failed(
                        self._exit_reason() or REASON_INCOMPLETE, clock, forced, stop=False
                    )
                grown = await asyncio.to_thread(directory_size, self.directory)
                if p.sign_of_life or grown > size:
                    clock = timeouts.sign_of_life(clock)
                size = max(size, grown)
                if p.defer_seconds > 0:
                    clock, granted = timeouts.defer(clock, now, p.defer_seconds)
                    log.info(
                        "allocation %s: deferral of %.1fs asked, %.1fs granted",
                        self.alloc_id,
                        p.defer_seconds,
                        granted,
                    )
                    if granted <= 0:  # used up: ask again, forced, with the deadline kept
                        forced = True
                        await self._ask(clock, force=True)
                        continue
                clock, action = timeouts.decide(clock, now)
                if action == timeouts.Action.ASK_AGAIN:
                    clock = timeouts.asked_again(clock, now)
                    forced = forced or clock.forced
                    await self._ask(clock, force=clock.forced)
                elif action == timeouts.Action.FAIL:
                    log.warning(
                        "allocation %s: no checkpoint after %.1fs (%s)",
                        self.alloc_id,
                        now - started,
                        "slow after the extension" if clock.extended else "unresponsive",
                    )
                    return await self._failed(REASON_TIMEOUT, clock, forced)
        finally:
            await self.protocol.close()

    async def _ask(self, clock: timeouts.Clock, *, force: bool) -> None:
        await self.protocol.request(
            self.checkpoint_id,
            self.directory,
            timeout=self.timeout,
            force=force,
            deferral_left=clock.deferral_left,
        )

    async def _completed(
        self, started: float, now: float, clock: timeouts.Clock, forced: bool
    ) -> Outcome:
        size = await asyncio.to_thread(directory_size, self.directory)
        record = CheckpointRecord(
            id=self.checkpoint_id,
            path=str(self.directory),
            size_bytes=size,
            duration_seconds=max(0.0, now - started),
            at=now,
        )
        log.info(
            "allocation %s: checkpoint %s complete (%d bytes in %.2fs)",
            self.alloc_id,
            self.checkpoint_id,
            size,
            record.duration_seconds,
        )
        await self._stop("preempted")
        return Outcome(
            ok=True,
            record=record,
            extended=clock.extended,
            deferred_seconds=clock.deferred,
            forced=forced,
        )

    async def _failed(
        self, reason: str, clock: timeouts.Clock, forced: bool, *, stop: bool = True
    ) -> Outcome:
        if stop:
            await self._stop(reason)
        # an incomplete checkpoint is never used for a restart
        await asyncio.to_thread(shutil.rmtree, self.directory, True)
        return Outcome(
            ok=False,
            reason=reason,
            extended=clock.extended,
            deferred_seconds=clock.deferred,
            forced=forced,
        )
