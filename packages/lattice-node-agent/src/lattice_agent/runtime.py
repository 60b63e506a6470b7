"""The node agent's process runtime: allocations as real process groups that outlive the agent.

The specification asks that running allocations survive an agent restart (systemd
``KillMode=process``: only the agent dies, its workloads keep running) and that a restarted
agent reattaches to them from ``agent-state.json``. :class:`ProcessRuntime` is the public entry
(the agent and its gRPC service use it) and a thin asyncio shell over the phases:

* ``lifecycle.py`` decides: a pure function from (record, event) to instructions. Reasons,
  exit codes (128+N for signal N) and SIGTERM -> grace -> SIGKILL are settled there.
* ``spawn.py`` starts the wrapper in its own session (environment, exit file, log files);
* ``procgroup.py`` signals, watches and reaps the process group;
* ``logtail.py`` tails the log files into the ring buffer behind ``tail``/``follow``;
* ``logship.py`` flushes the output into the log store (with a ``log_store``): every
  interval, and a final flush when the group is reaped, before the end is reported;
* ``persist.py`` writes the state file after every change;
* ``handle.py`` holds one allocation: its record plus that live machinery.

This module only carries out instructions and feeds back what happened as events; it never
blocks on the workload. ``asyncio.create_subprocess_exec`` is not used on purpose: its
transport kills the child when it is closed or garbage collected, which would break restart
survival. MPI process management (``pmi/``) and interactive attach (``pty.py``) will sit
beside these modules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from lattice_common.logstore import LogStore
from lattice_common.types import Allocation, AllocationReport

from lattice_agent import lifecycle as lc
from lattice_agent.cgroups import CgroupManager, NoCgroups
from lattice_agent.handle import AllocHandle, new_log_tail
from lattice_agent.identity import IdentityError, IdentityPolicy, RunAs
from lattice_agent.lifecycle import (
    PHASE_EXITED,
    PHASE_RUNNING,
    REASON_CANCELLED,
    REASON_LOST,
    REASON_PREEMPTED,
    REASON_SPAWN_FAILED,
    REASON_WALLTIME,
    Status,
    signal_exit_code,
)
from lattice_agent.logship import LogPools, LogShipper, state_path_for
from lattice_agent.logtail import STREAMS, LogRecord, LogTail, check_stream, tail_files
from lattice_agent.oci import OciError, OciStore
from lattice_agent.oci import parse_ref as parse_image_ref
from lattice_agent.persist import StateFile, WriteLater, from_entry, to_entry
from lattice_agent.procgroup import ProcessGroup, SignalDisposition, become_subreaper
from lattice_agent.scratch import Scratch, ScratchError, default_root
from lattice_agent.spawn import (
    AllocPaths,
    agent_shell,
    check_alloc_id,
    read_exit_file,
    spawn,
    wrapper_process,
)
from lattice_agent.uenv import UenvCache, UenvError

log = logging.getLogger("lattice.agent.runtime")

__all__ = [
    "PHASE_EXITED",
    "PHASE_RUNNING",
    "REASON_CANCELLED",
    "REASON_LOST",
    "REASON_SPAWN_FAILED",
    "REASON_WALLTIME",
    "LogRecord",
    "ProcessRuntime",
    "signal_exit_code",
]

_REAP_TIMEOUT = 10.0  # seconds to wait for a killed group to empty
_STOP_KILL_TIMEOUT = 30.0  # after SIGKILL, how long stop() waits for the group to be gone


class ProcessRuntime:
    """Runs allocations as process groups on this node; see the module docstring.

    All methods must be called from the event loop thread. ``on_change`` is called
    synchronously from the loop whenever an allocation starts or exits.
    """

    def __init__(
        self,
        *,
        node_id: str,
        work_dir: Path,
        log_dir: Path,
        state_file: Path,
        walltime_grace_seconds: float = 30.0,
        ring_buffer_lines: int = 10000,
        on_change: Callable[[AllocationReport], None] | None = None,
        clock: Callable[[], float] = time.time,
        subreaper: bool = True,
        slurm_env: bool = True,
        cgroups: CgroupManager | None = None,
        uenv: UenvCache | None = None,
        oci: OciStore | None = None,
        identities: IdentityPolicy | None = None,
        scratch: Scratch | None = None,
        log_store: LogStore | None = None,
        log_flush_interval: float = 10.0,
        log_pools: LogPools | None = None,  # log store: + the sensitive pool
        # checkpoints: the LATTICE_CHECKPOINT_*/LATTICE_RESUME variables of a run
        # (lattice_agent.checkpoint.CheckpointManager.environment)
        checkpoint_env: Callable[[Allocation, Path], dict[str, str]] | None = None,
    ) -> None:
        self._node_id = node_id
        # the log store (lattice_common.logstore) and what flushes into it; None: the
        # output stays in the files and the ring buffer
        self._shipper = (
            LogShipper(
                log_store,
                node_id=node_id,
                pools=log_pools,
                state_path=state_path_for(Path(state_file).absolute()),
                interval=log_flush_interval,
                clock=clock,
            )
            if log_store is not None or log_pools is not None
            else None
        )
        # who each allocation runs as (lattice_agent.identity); None: the agent itself
        self._identities = identities if identities is not None else IdentityPolicy()
        # per-allocation scratch directories (lattice_agent.scratch)
        self._scratch = scratch if scratch is not None else Scratch(default_root(work_dir))
        # OCI images and the container runtime (lattice_agent.oci); None: jobs with an
        # image fail to start
        self._oci = oci
        # per-allocation cgroup scopes (lattice_agent.cgroups); None: none (bare groups)
        self._cgroups = cgroups if cgroups is not None else NoCgroups("not configured")
        # uenv image cache (lattice_agent.uenv); None: a job asking for a uenv fails to start
        self._uenv = uenv if uenv is not None else UenvCache(None, work_dir, 0)
        self._slurm_env = slurm_env  # compat.slurm_env: SLURM_* variables in allocations
        self._work_dir = Path(work_dir).absolute()
        self._log_dir = Path(log_dir).absolute()
        self._state = StateFile(Path(state_file).absolute(), node_id=node_id, clock=clock)
        self._grace = float(walltime_grace_seconds)
        self._ring_lines = max(1, int(ring_buffer_lines))
        self._on_change = on_change
        self._checkpoint_env = checkpoint_env
        self._clock = clock
        self._allocs: dict[str, AllocHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recovered = False
        self._reattached: list[str] = []
        self._closed = False
        # a removal waits for the next write (lc.Persist(deferrable=True))
        self._persist_later = WriteLater(self._persist)
        if subreaper:
            become_subreaper()

    # ------------------------------------------------------------------ public API

    async def recover(self) -> list[str]:
        """Load the state file, reattach live processes and finish dead ones.

        Returns the ids of the allocations whose processes were alive and are now monitored
        again. Dead ones become ``exited`` (exit code from their exit file) and are reported
        through ``on_change``. Idempotent: a second call returns the first call's answer.
        """
        self._check_open()
        if self._recovered:
            return list(self._reattached)
        self._recovered = True
        loaded: list[AllocHandle] = []
        for entry in self._state.load():
            try:
                saved = from_entry(entry)
            except (KeyError, TypeError, ValueError) as e:
                log.error("skipping unreadable state entry %r: %s", entry, e)
                continue
            if saved.life.allocation_id in self._allocs:
                continue
            shipped = self._shipper.offsets(saved.life.allocation_id) if self._shipper else None
            rec = AllocHandle.recovered(
                saved, ring_lines=self._ring_lines, clock=self._clock, log_offsets=shipped
            )
            self._allocs[rec.id] = rec
            loaded.append(rec)
        self._remove_orphan_scopes(loaded)
        self._wipe_orphan_scratch(loaded)
        # every record is in place before any instruction persists the state file
        finishing: list[asyncio.Task[None]] = []
        for rec in loaded:
            assert rec.group is not None
            if rec.life.status == Status.EXITED:
                rec.done.set()
                rec.logs.drain()
                if self._shipper is not None:  # its final flush, if it was not done
                    self._shipper.resume(rec.id, rec.logs, ended=True)
                continue
            if self._shipper is not None:
                self._shipper.resume(rec.id, rec.logs, ended=False)
            rec.tail_task = self._spawn_task(rec.logs.run(rec.done), f"tail-{rec.id}")
            alive = rec.group.leader_alive()
            if alive:
                log.info("reattached allocation %s (pid %d)", rec.id, rec.group.pid)
                self._reattached.append(rec.id)
                rec.logs.read()
            else:
                log.info(
                    "allocation %s (pid %d) ended while the agent was away", rec.id, rec.group.pid
                )
            self._feed(rec, lc.Recovered(alive=alive, at=self._clock()))
            if not alive and rec.reap_task is not None:
                finishing.append(rec.reap_task)
        self._persist()
        if finishing:
            await asyncio.gather(*finishing, return_exceptions=True)
        return list(self._reattached)

    async def start(self, alloc: Allocation, *, nodelist: list[str]) -> None:
        """Start ``alloc`` here. A no-op for an allocation this runtime already knows.

        If ``recover()`` has not run yet it runs first, so that a process that survived an
        agent restart is never started a second time.
        """
        self._check_open()
        if not self._recovered:
            await self.recover()
        if alloc.id in self._allocs:
            return
        check_alloc_id(alloc.id)
        # From here on: no await until the allocation is registered (start is idempotent).
        event = lc.Assigned(
            allocation_id=alloc.id,
            walltime_seconds=float(alloc.spec.walltime_seconds or 0),
            at=self._clock(),
        )
        life, instructions = lc.step(None, event, grace=self._grace)
        assert life is not None
        paths = AllocPaths.of(alloc.id, self._work_dir, self._log_dir)
        rec = AllocHandle(life=life, paths=paths, logs=self._log_tail(alloc.id, paths))
        rec.launch = (alloc, list(nodelist))
        for answer in self._run(rec, instructions):
            self._feed(rec, answer)

    async def stop(self, alloc_id: str, *, reason: str = REASON_CANCELLED) -> None:
        """SIGTERM the allocation's process group, wait the grace period, SIGKILL it.

        Returns when the whole group is gone. Idempotent: stopping an unknown or exited
        allocation does nothing; a second stop waits for the first (whose reason wins).
        """
        rec = self._allocs.get(alloc_id)
        if rec is None or rec.life.phase == PHASE_EXITED:
            return
        event = lc.PreemptRequested() if reason == REASON_PREEMPTED else lc.CancelRequested(reason)
        self._feed(rec, event)
        try:
            await asyncio.wait_for(
                asyncio.shield(rec.done.wait()), 2 * self._grace + _STOP_KILL_TIMEOUT
            )
        except TimeoutError:
            pgid = rec.group.pgid if rec.group is not None else 0
            log.error("allocation %s: process group %d did not go away", alloc_id, pgid)

    def reports(self) -> list[AllocationReport]:
        return [rec.report() for rec in self._allocs.values()]

    def signal(self, alloc_id: str, signum: int) -> bool:
        """Send ``signum`` to a running allocation's process group. False when it is
        not running here."""
        rec = self._allocs.get(alloc_id)
        if rec is None or rec.life.phase != PHASE_RUNNING or rec.group is None:
            return False
        try:
            rec.signal(signum)
        except OSError:
            return False
        return True

    def signal_disposition(self, alloc_id: str, signum: int) -> SignalDisposition:
        """What ``signum`` would do to a running allocation's processes, the agent's
        wrapper and entrypoint shell left out (none when it is not running here)."""
        rec = self._allocs.get(alloc_id)
        if rec is None or rec.life.phase != PHASE_RUNNING or rec.group is None:
            return SignalDisposition()
        return rec.group.signal_disposition(signum, agent_shell)

    def signal_processes(self, alloc_id: str, pids: Iterable[int], signum: int) -> int:
        """Send ``signum`` to those of ``pids`` still in a running allocation's process
        group; how many got it."""
        rec = self._allocs.get(alloc_id)
        if rec is None or rec.life.phase != PHASE_RUNNING or rec.group is None:
            return 0
        return rec.group.signal_members(pids, signum)

    def forget(self, alloc_id: str) -> None:
        """Drop an exited allocation (its files stay on disk). Running ones are kept."""
        rec = self._allocs.get(alloc_id)
        if rec is None:
            return
        self._feed(rec, lc.ForgetRequested())
        if alloc_id in self._allocs:
            log.warning("not forgetting allocation %s: it is still running", alloc_id)

    def running_ids(self) -> set[str]:
        return {a for a, rec in self._allocs.items() if rec.life.phase == PHASE_RUNNING}

    def tail(self, alloc_id: str, n: int | None = None, stream: str = "both") -> list[LogRecord]:
        """The last ``n`` lines (all buffered lines if None) of ``stream``.

        Served from the ring buffer; falls back to the log files when the buffer has nothing
        for that stream (e.g. a forgotten allocation, or output the tailer has not read yet).
        """
        check_stream(stream)
        if n is not None and n <= 0:
            return []
        rec = self._allocs.get(alloc_id)
        if rec is not None:
            out = rec.logs.buffered(n, stream)
            if out:
                return out
            paths = rec.paths
        else:
            try:
                check_alloc_id(alloc_id)
            except ValueError:
                return []
            paths = AllocPaths.of(alloc_id, self._work_dir, self._log_dir)
        return tail_files(alloc_id, {s: paths.log(s) for s in STREAMS}, n, stream)

    async def follow(
        self, alloc_id: str, stream: str = "both", n: int | None = None
    ) -> AsyncIterator[LogRecord]:
        """Yield the buffered lines (the last ``n`` if given), then new lines as they come,
        until the allocation has exited and its logs are drained (or the runtime closes).

        A follower slower than the ring buffer skips the lines that were overwritten.
        """
        check_stream(stream)
        rec = self._allocs.get(alloc_id)
        if rec is None:
            for r in self.tail(alloc_id, n, stream):
                yield r
            return
        async for r in rec.logs.follow(stream, n):
            yield r

    async def close(self) -> None:
        """Stop monitoring, tailing and timers. Workloads keep running (KillMode=process)."""
        if self._closed:
            return
        self._closed = True
        if self._shipper is not None:  # a last, bounded flush while the tails still run
            await self._shipper.close()
        for rec in self._allocs.values():
            rec.cancel_timers()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self._allocs.values():
            rec.logs.close_files()
            rec.logs.mark_drained()
            rec.done.set()  # a stop() in progress returns
        self._persist()

    # ------------------------------------------------------------------ events in, I/O out

    def _feed(self, rec: AllocHandle, event: lc.Event) -> None:
        """Apply ``event`` and carry out the instructions (which may answer with events)."""
        pending = [event]
        while pending:
            new, instructions = lc.step(rec.life, pending.pop(0), grace=self._grace)
            if new is not None:
                rec.life = new
            pending += self._run(rec, instructions)

    def _run(self, rec: AllocHandle, instructions: list[lc.Instruction]) -> list[lc.Event]:
        answers: list[lc.Event] = []
        for ins in instructions:
            answer = self._execute(rec, ins)
            if answer is not None:
                answers.append(answer)
        return answers

    def _execute(self, rec: AllocHandle, ins: lc.Instruction) -> lc.Event | None:
        match ins:
            case lc.Spawn():
                return self._spawn(rec)
            case lc.Watch():
                self._spawn_task(self._watch(rec), f"watch-{rec.id}")
            case lc.Signal(signum=signum):
                group = rec.group
                # a fork of the wrapper before its exec takes the signal in the wrapper's
                # trap: its command gets it once it has exec'd
                forks = group.unexeced_forks(wrapper_process) if group is not None else []
                rec.signal(signum)
                if group is not None and forks:
                    self._spawn_task(
                        group.signal_after_exec(forks, signum, wrapper_process),
                        f"signal-after-exec-{rec.id}",
                    )
            case lc.Kill():
                rec.signal(lc.SIGKILL)
            case lc.ArmTimer():
                self._arm(rec, ins)
            case lc.CancelTimer(timer=timer):
                rec.cancel_timer(timer)
            case lc.Reap(wait_for_grace=wait_for_grace):
                quiet = None
                if wait_for_grace and rec.grace_end is not None:
                    quiet = rec.grace_end - asyncio.get_running_loop().time()
                rec.reap_task = self._spawn_task(self._reap(rec, quiet), f"finish-{rec.id}")
            case lc.Persist(deferrable=True):
                self._persist_later.soon()
            case lc.Persist():
                self._persist()
            case lc.Report():
                self._report(rec, ins)
            case lc.Forget():
                rec.release()
                del self._allocs[rec.id]
                if self._shipper is not None:
                    self._shipper.forget(rec.id)
        return None

    def _spawn(self, rec: AllocHandle) -> lc.Event:
        assert rec.launch is not None
        alloc, nodelist = rec.launch
        rec.launch = None
        nodes = nodelist or list(alloc.assigned_nodes) or [self._node_id]
        cg = self._cgroups
        scope = None
        try:
            # who it runs as first: an unknown user or a refused root ends the start at once
            run_as = self._identities.run_as(alloc)
            # the scope exists before the process: the wrapper joins it before anything runs
            scope = cg.create(alloc.id, cg.limits(alloc))
            scratch = self._scratch.create(alloc.id, run_as)
            uenv = view = None
            if alloc.spec.uenv:
                # exactly the image the API resolved at submit (uenv_sha256), when it did
                image = self._uenv.acquire(alloc.spec.uenv, alloc.id, sha256=alloc.uenv_sha256)
                uenv = (image, self._uenv.mount_point)
                if alloc.spec.view:
                    view = self._uenv.view(image, alloc.spec.uenv, alloc.spec.view)
            launched = spawn(
                alloc,
                nodes,
                self._node_id,
                rec.paths,
                slurm_env=self._slurm_env,
                procs_files=cg.procs_files(scope),
                uenv=uenv,
                view=view,
                container=self._container(alloc, rec.paths, run_as) if alloc.spec.image else None,
                run_as=run_as,
                scratch=scratch,
                extra_env=(
                    self._checkpoint_env(alloc, rec.paths.work_dir)
                    if self._checkpoint_env is not None
                    else None
                ),
            )
        except (OSError, ValueError, UenvError, OciError, IdentityError, ScratchError) as e:
            log.error("could not start allocation %s: %s", alloc.id, e)
            self._wipe_scratch(alloc.id)
            self._uenv.release(alloc.id)
            if alloc.spec.image and self._oci is not None:
                self._oci.cleanup(alloc.id)
            if scope is not None or cg.available:
                cg.remove(scope or cg.scope(alloc.id))
            rec.done.set()
            rec.logs.drained = True
            self._allocs[alloc.id] = rec
            return lc.SpawnFailed(at=self._clock(), message=str(e))
        rec.group = ProcessGroup(
            alloc.id, launched.pid, proc_start=launched.proc_start, is_child=True
        )
        rec.logs = self._log_tail(alloc.id, rec.paths, launched.offsets)
        if self._shipper is not None:
            self._shipper.track(alloc, rec.logs)
        self._allocs[alloc.id] = rec
        log.info("started allocation %s: pid %d, cwd %s", alloc.id, launched.pid, launched.cwd)
        rec.tail_task = self._spawn_task(rec.logs.run(rec.done), f"tail-{rec.id}")
        return lc.Spawned()

    def _container(
        self, alloc: Allocation, paths: AllocPaths, run_as: RunAs
    ) -> Callable[[dict[str, str], str], list[str]]:
        """The container command for an allocation with an OCI image: the image the
        prologue pulled (its digest), a bundle with the job's environment, working
        directory and allocation directories bound in."""
        oci = self._oci
        if oci is None:
            raise OciError(f"image {alloc.spec.image}: containers are not enabled on this node")
        ref = alloc.spec.image
        if alloc.image_digest:  # what the prologue pulled: cached, no registry round trip
            ref = parse_image_ref(ref).by_digest(alloc.image_digest)
        image = oci.pull(ref, pin_for=alloc.id)

        def command(env: dict[str, str], cwd: str) -> list[str]:
            # the scratch directory too: TMPDIR and LATTICE_SCRATCH name it
            dirs = (cwd, str(paths.work_dir), env.get("LATTICE_SCRATCH", ""))
            binds = [(d, d, False) for d in dict.fromkeys(dirs) if d]
            bundle = oci.bundle(
                alloc.id,
                image,
                argv=["/bin/sh", "-c", alloc.spec.entrypoint],
                env=env,
                cwd=cwd,
                # the runtime starts as root; the container's process is the job's user
                uid=run_as.uid,
                gid=run_as.gid,
                binds=binds,
            )
            return oci.run_argv(alloc.id, bundle)

        return command

    def _arm(self, rec: AllocHandle, ins: lc.ArmTimer) -> None:
        delay = max(0.0, ins.at - self._clock()) if ins.at is not None else ins.after
        if ins.timer == lc.TIMER_GRACE:
            rec.grace_end = asyncio.get_running_loop().time() + delay
        rec.arm(ins.timer, delay, self._timer_fired)

    def _timer_fired(self, rec: AllocHandle, timer: str) -> None:
        rec.timers.pop(timer, None)
        if self._closed or self._allocs.get(rec.id) is not rec:
            return
        if timer == lc.TIMER_WALLTIME:
            if rec.life.status == Status.RUNNING:
                log.info("allocation %s exceeded its walltime", rec.id)
            self._feed(rec, lc.WalltimeExpired())
        else:
            if rec.life.status == Status.STOPPING:
                log.info("allocation %s survived SIGTERM for %.1fs", rec.id, self._grace)
            self._feed(rec, lc.GraceExpired())

    async def _watch(self, rec: AllocHandle) -> None:
        assert rec.group is not None
        await rec.group.wait_leader()
        self._feed(rec, lc.Exited(at=self._clock()))

    async def _reap(self, rec: AllocHandle, quiet: float | None) -> None:
        """The wrapper has ended: let the group finish its grace, kill the rest, reap it."""
        group = rec.group
        assert group is not None
        if quiet is not None:
            await group.wait_quiet(quiet)
        if not await group.reap(_REAP_TIMEOUT):
            log.warning("allocation %s: process group %d still has members", rec.id, group.pgid)
        exit_file_code = read_exit_file(rec.paths.exit_file)
        # one hop to a worker thread, not one per step: each hop waits for a thread and
        # then for the event loop again, which is most of a trivial job's turnaround
        oom, peak = await asyncio.to_thread(self._clean_up_after, rec.id)
        self._uenv.release(rec.id)  # its mount namespace is gone with the group
        if self._shipper is not None and self._shipper.tracking(rec.id):
            # the group is gone, so is its output: read the rest, flush it before the end
            # is reported (bounded; the shipper keeps trying after a failure). Not at the
            # same time as the clean-up: what escaped the group writes until the scope's
            # removal kills it
            rec.logs.drain()
            await self._shipper.finish(rec.id)
        self._feed(
            rec,
            lc.Reaped(
                exit_file_code=exit_file_code,
                wait_code=group.wait_code,
                oom_killed=oom,
                peak_memory_bytes=peak,
            ),
        )

    def _clean_up_after(self, alloc_id: str) -> tuple[bool, int | None]:
        """In a worker thread, once the group is gone: the scope (OOM count, peak memory),
        the scratch (nothing of the job is left) and the container (none there: no-op)."""
        found = self._finish_scope(alloc_id)
        self._wipe_scratch(alloc_id)
        if self._oci is not None:
            self._oci.cleanup(alloc_id)
        return found

    def _finish_scope(self, alloc_id: str) -> tuple[bool, int | None]:
        """Read the scope's OOM count and peak memory, then remove it (what escaped the
        process group is killed there). (False, None) without cgroups."""
        cg = self._cgroups
        if not cg.available:
            return False, None
        scope = cg.scope(alloc_id)
        if not cg.exists(scope):
            return False, None
        oom = cg.oom_killed(scope)
        peak = cg.usage(scope).memory_peak
        if oom:
            log.warning("allocation %s: OOM kill in its cgroup (peak %s bytes)", alloc_id, peak)
        if not cg.remove(scope):
            log.warning("allocation %s: cgroup scope not fully removed", alloc_id)
        return oom, peak

    def _remove_orphan_scopes(self, loaded: list[AllocHandle]) -> None:
        """At start: scopes with no live state entry are killed and removed (crash recovery);
        those of allocations still running (reattached or to be reaped) are kept."""
        cg = self._cgroups
        if not cg.available:
            return
        known = {rec.id for rec in loaded if rec.life.status != Status.EXITED}
        for scope in cg.orphans(known):
            log.warning("removing orphaned cgroup scope of allocation %s", scope.alloc_id)
            cg.remove(scope)

    def _wipe_scratch(self, alloc_id: str) -> None:
        try:
            self._scratch.wipe(alloc_id)
        except (ScratchError, ValueError) as e:
            log.warning("allocation %s: %s", alloc_id, e)

    def _wipe_orphan_scratch(self, loaded: list[AllocHandle]) -> None:
        """At start: scratch of allocations with no live state entry is wiped (crash
        recovery, as for cgroup scopes); that of allocations still running is kept."""
        known = {rec.id for rec in loaded if rec.life.status != Status.EXITED}
        self._scratch.wipe_orphans(known)

    def _report(self, rec: AllocHandle, ins: lc.Report) -> None:
        if ins.phase == PHASE_EXITED:
            log.info("allocation %s exited: code %s reason %r", rec.id, ins.exit_code, ins.reason)
            rec.done.set()
            rec.logs.notify()
        if self._on_change is None:
            return
        try:
            self._on_change(rec.report())
        except Exception:
            log.exception("on_change callback failed for %s", rec.id)

    # ------------------------------------------------------------------ helpers

    def _log_tail(
        self, alloc_id: str, paths: AllocPaths, offsets: dict[str, int] | None = None
    ) -> LogTail:
        return new_log_tail(
            alloc_id, paths, ring_lines=self._ring_lines, clock=self._clock, offsets=offsets
        )

    def _spawn_task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runtime task %s failed", task.get_name(), exc_info=task.exception())

    def _persist(self) -> None:
        self._persist_later.done()
        if not self._recovered:
            return  # never overwrite a state file that has not been read yet
        saved = [rec.saved() for rec in self._allocs.values()]
        self._state.save([to_entry(s) for s in saved if s is not None])

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ProcessRuntime is closed")
