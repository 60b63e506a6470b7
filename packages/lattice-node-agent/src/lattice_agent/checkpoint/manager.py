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
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from lattice_agent.checkpoint.remote import (
    PROBE_BYTES,
    PROBE_TIMEOUT_S,
    REASON_UNAVAILABLE,
    RemoteCheckpoints,
)
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
        remote: RemoteCheckpoints | None = None,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.runtime = runtime
        self.node_id = node_id
        self.work_dir = Path(work_dir).absolute()
        # an S3 root (lattice_agent.checkpoint.remote): applications write into its
        # staging directory on this node, the agent uploads what they wrote
        self.remote = remote
        if remote is not None:
            root = remote.staging
        self.root = Path(root).absolute() if root is not None else None
        # a file-system root (NFS, Lustre) is probed before preemption as a bucket is:
        # an unmounted or hung mount ends the allocation Failed instead of hanging it
        self.probe_timeout = probe_timeout
        self.timeout = timeout
        self.max_deferral = max_deferral
        self.identities = identities
        self.on_result = on_result
        self.poll_interval = poll_interval
        self._registries: dict[str, Registry] = {}
        self._tasks: dict[str, asyncio.Task[Outcome]] = {}
        self.outcomes: dict[str, Outcome] = {}
        # checkpoint broker hints (checkpoint and continue): allocation id -> (hint id,
        # its coordinator / its outcome until the quorum has recorded it)
        self._hint_tasks: dict[str, tuple[str, asyncio.Task[Outcome]]] = {}
        self.hint_outcomes: dict[str, tuple[str, Outcome]] = {}

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
        fresh flag region first. Called by the runtime right before it spawns; OSError
        when a stored checkpoint to resume from could not be fetched (the run fails to
        start, saying why)."""
        env = paths.environment(self.root, alloc, alloc_dir)
        if self.remote is not None:
            local = self.remote.local_path(alloc)  # downloaded by prepare()
            if local is not None:
                env[paths.ENV_CHECKPOINT_PATH] = str(local)
            if alloc.spec.checkpointable:
                self.remote.staged(alloc)
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

    async def prepare(self, alloc: Allocation) -> None:
        """Before a run starts: the checkpoint it resumes from, when that is in a bucket,
        downloaded into staging."""
        if self.remote is not None:
            await self.remote.restore(alloc)

    def _heads(self, a: Allocation) -> bool:
        return bool(a.assigned_nodes) and a.assigned_nodes[0] == self.node_id

    async def sync(self, assigned: Mapping[str, Allocation]) -> None:
        """Registry sockets for the gRPC allocations this node heads; everything of the
        allocations that left this node is dropped (a running coordinator cancelled)."""
        for aid in [a for a in self._registries if a not in assigned]:
            await self._registries.pop(aid).close()
        if self.remote is not None:
            await asyncio.to_thread(self.remote.keep, set(assigned))
        for aid in [a for a in self._tasks if a not in assigned]:
            self._tasks.pop(aid).cancel()
        for aid in [a for a in self.outcomes if a not in assigned]:
            del self.outcomes[aid]
        for aid in [a for a in self._hint_tasks if a not in assigned]:
            self._hint_tasks.pop(aid)[1].cancel()
        for aid, (hint_id, _) in list(self.hint_outcomes.items()):
            h = assigned[aid].checkpoint_hint if aid in assigned else None
            if h is None or h.id != hint_id or h.done_at is not None:
                del self.hint_outcomes[aid]  # recorded (or moot): no longer reported
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
            return SignalProtocol(
                lambda signum: self.runtime.signal(a.id, signum),
                lambda signum: self.runtime.signal_disposition(a.id, signum),
                lambda pids, signum: self.runtime.signal_processes(a.id, pids, signum),
                a.id,
            )
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
        hinted = self._hint_tasks.pop(a.id, None)
        if hinted is not None:  # preemption or suspend wins over a broker hint
            hinted[1].cancel()
        self._tasks[a.id] = self._start(a, stop=True)
        self._tasks[a.id].add_done_callback(lambda t, aid=a.id: self._done(aid, t))

    def begin_hint(self, a: Allocation, hint_id: str) -> None:
        """Checkpoint ``a`` for the broker's hint ``hint_id`` and let it run on
        (idempotent per hint). The application writes into its run's checkpoint
        directory as for any request; once complete that directory is moved to
        ``{id}-{hint_id}`` so the next request (a later hint, or preemption) starts from
        an empty one while the completed checkpoint stays where it was recorded."""
        if self.root is None or a.id in self._tasks or a.id in self.outcomes:
            return
        if self._hint_tasks.get(a.id, ("",))[0] == hint_id:
            return
        if self.hint_outcomes.get(a.id, ("",))[0] == hint_id:
            return
        task = self._start(a, stop=False, hint_id=hint_id)
        self._hint_tasks[a.id] = (hint_id, task)
        task.add_done_callback(lambda t, aid=a.id, h=hint_id: self._hint_done(aid, h, t))

    def _hint_done(self, alloc_id: str, hint_id: str, task: asyncio.Task[Outcome]) -> None:
        if self._hint_tasks.get(alloc_id, ("", None))[1] is task:
            del self._hint_tasks[alloc_id]
        if task.cancelled():
            return
        exc = task.exception()
        outcome = Outcome(ok=False, reason=f"checkpoint_failed: {exc}") if exc else task.result()
        if exc is not None:
            log.error("allocation %s: hinted checkpoint failed", alloc_id, exc_info=exc)
        self.hint_outcomes[alloc_id] = (hint_id, outcome)
        if self.on_result is not None:
            self.on_result()

    def _start(self, a: Allocation, *, stop: bool, hint_id: str = "") -> asyncio.Task[Outcome]:
        assert self.root is not None
        stop_processes = stop
        directory = paths.checkpoint_dir(self.root, a)

        def alive() -> bool:
            r = self._report_of(a.id)
            return r is not None and r.phase == "running"

        def exit_reason() -> str:
            r = self._report_of(a.id)
            return r.reason if r is not None else ""

        async def stop(reason: str) -> None:
            if stop_processes:
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
            "allocation %s: checkpoint %s requested (%s%s) into %s",
            a.id,
            paths.checkpoint_id(a),
            a.spec.checkpoint_protocol,
            f", {hint_id}: and continue" if hint_id else "",
            directory,
        )
        run = coordinator.run() if not hint_id else _kept(coordinator, directory, hint_id)
        if self.remote is not None:
            run = _stored(self.remote, a, coordinator, run, stop if stop_processes else None)
        elif stop_processes:
            run = _probed(self._probe_root, a, coordinator, run, stop)
        return asyncio.create_task(run, name=f"checkpoint-{a.id}")

    async def _probe_root(self) -> str:
        """'' when the file-system root takes a short write (64 KiB, fsync'd, read
        back) within the probe timeout, else what failed."""
        from lattice_checkpoint.storage.local import LocalCheckpointStore

        assert self.root is not None
        store = LocalCheckpointStore(
            self.root, probe_bytes=PROBE_BYTES, probe_timeout_s=self.probe_timeout
        )
        result = await store.probe()
        return "" if result.ok else (result.error or "the write probe failed")

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
            hinted = self.hint_outcomes.get(aid)
            if r.phase == "running" and hinted is not None:
                out.append(_hint_report(r, *hinted))
            elif r.phase != "exited" or (outcome is None and aid not in self._tasks):
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
        for _, t in self._hint_tasks.values():
            t.cancel()
        self._hint_tasks.clear()
        for t in self._tasks.values():
            t.cancel()
        for t in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for reg in self._registries.values():
            await reg.close()
        self._registries.clear()
        if self.remote is not None:
            await self.remote.close()


async def _stored(
    remote: RemoteCheckpoints,
    a: Allocation,
    coordinator: Coordinator,
    run: Coroutine[Any, Any, Outcome],
    stop: Callable[[str], Awaitable[None]] | None,
) -> Outcome:
    """A checkpoint into a bucket. For preemption or suspend (``stop`` given) the bucket
    is probed first: when it does not answer the application is not asked, its
    processes are stopped (SIGTERM, grace, SIGKILL) and the outcome fails, so the
    allocation ends Failed rather than waiting on a checkpoint that cannot be kept.
    Otherwise the application checkpoints into staging and what it wrote is uploaded."""
    if stop is not None:
        refused = await _unavailable(remote.probe, a, coordinator, run, stop)
        if refused is not None:
            return refused
    return await remote.publish(a, await run)


async def _probed(
    probe: Callable[[], Awaitable[str]],
    a: Allocation,
    coordinator: Coordinator,
    run: Coroutine[Any, Any, Outcome],
    stop: Callable[[str], Awaitable[None]],
) -> Outcome:
    """A preemption or suspend into a file-system root: probed first, like a bucket."""
    refused = await _unavailable(probe, a, coordinator, run, stop)
    return refused if refused is not None else await run


async def _unavailable(
    probe: Callable[[], Awaitable[str]],
    a: Allocation,
    coordinator: Coordinator,
    run: Coroutine[Any, Any, Outcome],
    stop: Callable[[str], Awaitable[None]],
) -> Outcome | None:
    """None when the destination answers its probe. Otherwise the application is not
    asked (it would write a checkpoint that cannot be kept, or hang in a dead mount):
    its processes are stopped (SIGTERM, grace, SIGKILL) and the outcome fails, so the
    allocation ends Failed rather than waiting on a checkpoint."""
    error = await probe()
    if not error:
        return None
    run.close()  # never started: the application is not asked
    await coordinator.protocol.close()
    reason = f"{REASON_UNAVAILABLE}: {error}"
    log.warning("allocation %s: %s; stopping it without a checkpoint", a.id, reason)
    await stop(reason)
    return Outcome(ok=False, reason=reason)


async def _kept(coordinator: Coordinator, directory: Path, hint_id: str) -> Outcome:
    """A hinted checkpoint's run: on success its directory is moved aside (to
    ``{id}-{hint_id}``) and the record points there."""
    outcome = await coordinator.run()
    if not outcome.ok or outcome.record is None:
        return outcome
    dest = directory.with_name(f"{directory.name}-{hint_id}")

    def move() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        directory.rename(dest)

    await asyncio.to_thread(move)
    record = msgspec.structs.replace(outcome.record, id=dest.name, path=str(dest))
    return msgspec.structs.replace(outcome, record=record)


def _hint_report(r: AllocationReport, hint_id: str, outcome: Outcome) -> AllocationReport:
    if outcome.ok and outcome.record is not None:
        ck = outcome.record
        return msgspec.structs.replace(
            r,
            hint_id=hint_id,
            checkpoint_id=ck.id,
            checkpoint_path=ck.path,
            checkpoint_size_bytes=ck.size_bytes,
            checkpoint_duration_seconds=ck.duration_seconds,
        )
    return msgspec.structs.replace(r, hint_id=hint_id, reason=outcome.reason or "checkpoint_failed")
