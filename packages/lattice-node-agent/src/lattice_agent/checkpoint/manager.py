"""The agent's side of checkpoints: prepare every run of a checkpointable allocation
(its checkpoint directory, the shmem flag region, the gRPC registry socket and the
LATTICE_CHECKPOINT_* variables), start a coordinator when an allocation this node
heads goes Checkpointing, and turn its outcome into what the heartbeat reports:

* ``checkpointed`` (with the record) once it completed and the processes are gone;
* ``checkpoint_failed`` (with the reason) once it failed and the processes are gone;
* ``checkpointing`` while the processes have exited but the outcome is not known yet,
  so that an exit during a checkpoint is never taken for the job's own end.

The head node alone runs the protocol: it runs the job's entrypoint, which coordinates
its own ranks (as a batch script does); other nodes only hold launched tasks, which
end with the allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from lattice_common.types import (
    PHASE_CHECKPOINT_FAILED,
    PHASE_CHECKPOINTED,
    PHASE_CHECKPOINTING,
    Allocation,
    AllocationReport,
)

from lattice_agent.checkpoint import paths
from lattice_agent.checkpoint.base import CheckpointProtocol
from lattice_agent.checkpoint.callback import CallbackProtocol, Registry
from lattice_agent.checkpoint.coordinator import Coordinator, Outcome
from lattice_agent.checkpoint.shmem import ShmemProtocol, create_region
from lattice_agent.checkpoint.signal import SignalProtocol
from lattice_agent.identity import IdentityError, IdentityPolicy

if TYPE_CHECKING:
    from lattice_agent.runtime import ProcessRuntime

log = logging.getLogger("lattice.agent.checkpoint")


class CheckpointManager:
    def __init__(
        self,
        runtime: ProcessRuntime,
        *,
        node_id: str,
        work_dir: Path,
        root: Path | None,
        timeout: float = 600.0,
        max_deferral: float = 300.0,
        identities: IdentityPolicy | None = None,
        on_result: Callable[[], None] | None = None,
        poll_interval: float = 0.1,
    ) -> None:
        self.runtime = runtime
        self.node_id = node_id
        self.work_dir = Path(work_dir).absolute()
        self.root = Path(root).absolute() if root is not None else None
        self.timeout = timeout
        self.max_deferral = max_deferral
        self.identities = identities
        self.on_result = on_result
        self.poll_interval = poll_interval
        self._registries: dict[str, Registry] = {}
        self._tasks: dict[str, asyncio.Task[Outcome]] = {}
        self.outcomes: dict[str, Outcome] = {}

    # --- each run ------------------------------------------------------------------

    def _owner(self, alloc: Allocation) -> tuple[int, int] | None:
        if self.identities is None:
            return None
        try:
            who = self.identities.run_as(alloc)
        except IdentityError:
            return None
        return (who.uid, who.gid) if who.switches else None

    def environment(self, alloc: Allocation, alloc_dir: Path) -> dict[str, str]:
        """The run's checkpoint variables; makes its checkpoint directory and (shmem) a
        fresh flag region first. Called by the runtime right before it spawns."""
        env = paths.environment(self.root, alloc, alloc_dir)
        if self.root is None or not alloc.spec.checkpointable:
            return env
        owner = self._owner(alloc)
        try:
            directory = paths.checkpoint_dir(self.root, alloc)
            directory.mkdir(parents=True, exist_ok=True)
            if owner is not None:  # the job writes there: its allocation's part is its own
                top = paths.allocation_root(self.root, alloc)
                for d in (top, top / "checkpoints", directory):
                    os.chown(d, *owner)
            if alloc.spec.checkpoint_protocol == "shmem":
                alloc_dir.mkdir(parents=True, exist_ok=True)
                create_region(alloc_dir / paths.SHM_NAME, *(owner or (None, None)))
        except OSError as e:
            log.error("allocation %s: no checkpoint directory: %s", alloc.id, e)
        return env

    def _heads(self, a: Allocation) -> bool:
        return bool(a.assigned_nodes) and a.assigned_nodes[0] == self.node_id

    async def sync(self, assigned: Mapping[str, Allocation]) -> None:
        """Registry sockets for the gRPC allocations this node heads; everything of the
        allocations that left this node is dropped (a running coordinator cancelled)."""
        for aid in [a for a in self._registries if a not in assigned]:
            await self._registries.pop(aid).close()
        for aid in [a for a in self._tasks if a not in assigned]:
            self._tasks.pop(aid).cancel()
        for aid in [a for a in self.outcomes if a not in assigned]:
            del self.outcomes[aid]
        for aid, a in assigned.items():
            if (
                aid in self._registries
                or a.spec.checkpoint_protocol != "grpc"
                or not a.spec.checkpointable
                or not self._heads(a)
            ):
                continue
            reg = Registry(aid, self.work_dir / aid / paths.SOCKET_NAME)
            try:
                await reg.open(*(self._owner(a) or (None, None)))
            except (OSError, ValueError) as e:
                log.warning("allocation %s: no checkpoint socket: %s", aid, e)
                continue
            self._registries[aid] = reg

    # --- a checkpoint ----------------------------------------------------------------

    def _protocol(self, a: Allocation) -> CheckpointProtocol:
        name = a.spec.checkpoint_protocol
        if name == "signal":
            return SignalProtocol(lambda signum: self.runtime.signal(a.id, signum))
        if name == "shmem":
            return ShmemProtocol(self.work_dir / a.id / paths.SHM_NAME)
        reg = self._registries.get(a.id) or Registry(a.id, self.work_dir / a.id / paths.SOCKET_NAME)
        return CallbackProtocol(reg)

    def _report_of(self, alloc_id: str) -> AllocationReport | None:
        for r in self.runtime.reports():
            if r.allocation_id == alloc_id:
                return r
        return None

    def begin(self, a: Allocation) -> None:
        """Checkpoint ``a`` (idempotent: one coordinator per run)."""
        if a.id in self._tasks or a.id in self.outcomes or self.root is None:
            return
        directory = paths.checkpoint_dir(self.root, a)

        def alive() -> bool:
            r = self._report_of(a.id)
            return r is not None and r.phase == "running"

        def exit_reason() -> str:
            r = self._report_of(a.id)
            return r.reason if r is not None else ""

        async def stop(reason: str) -> None:
            await self.runtime.stop(a.id, reason=reason)

        coordinator = Coordinator(
            a.id,
            self._protocol(a),
            paths.checkpoint_id(a),
            directory,
            timeout=self.timeout,
            max_deferral=self.max_deferral,
            alive=alive,
            exit_reason=exit_reason,
            stop=stop,
            poll_interval=self.poll_interval,
        )
        log.info(
            "allocation %s: checkpoint %s requested (%s) into %s",
            a.id,
            paths.checkpoint_id(a),
            a.spec.checkpoint_protocol,
            directory,
        )
        task = asyncio.create_task(coordinator.run(), name=f"checkpoint-{a.id}")
        self._tasks[a.id] = task
        task.add_done_callback(lambda t, aid=a.id: self._done(aid, t))

    def _done(self, alloc_id: str, task: asyncio.Task[Outcome]) -> None:
        if self._tasks.get(alloc_id) is task:
            del self._tasks[alloc_id]
        if task.cancelled():
            return
        exc = task.exception()
        outcome = Outcome(ok=False, reason=f"checkpoint_failed: {exc}") if exc else task.result()
        if exc is not None:
            log.error("allocation %s: checkpoint coordinator failed", alloc_id, exc_info=exc)
        self.outcomes[alloc_id] = outcome
        if self.on_result is not None:
            self.on_result()

    def in_progress(self, alloc_id: str) -> bool:
        return alloc_id in self._tasks

    # --- reports -------------------------------------------------------------------

    def reports(self, reports: list[AllocationReport]) -> list[AllocationReport]:
        """The runtime's reports with checkpoint outcomes in place of the exits they
        explain."""
        out: list[AllocationReport] = []
        for r in reports:
            aid = r.allocation_id
            outcome = self.outcomes.get(aid)
            if r.phase != "exited" or (outcome is None and aid not in self._tasks):
                out.append(r)
            elif outcome is None:  # exited mid-checkpoint: the coordinator decides
                out.append(msgspec.structs.replace(r, phase=PHASE_CHECKPOINTING))
            elif outcome.ok and outcome.record is not None:
                ck = outcome.record
                out.append(
                    msgspec.structs.replace(
                        r,
                        phase=PHASE_CHECKPOINTED,
                        # walltime raced the checkpoint and the checkpoint won: said so
                        reason=r.reason if r.reason == "walltime_exceeded" else "",
                        checkpoint_id=ck.id,
                        checkpoint_path=ck.path,
                        checkpoint_size_bytes=ck.size_bytes,
                        checkpoint_duration_seconds=ck.duration_seconds,
                    )
                )
            else:
                out.append(
                    msgspec.structs.replace(r, phase=PHASE_CHECKPOINT_FAILED, reason=outcome.reason)
                )
        return out

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for t in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for reg in self._registries.values():
            await reg.close()
        self._registries.clear()
