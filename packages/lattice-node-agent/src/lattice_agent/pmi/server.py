"""Asyncio shell around the pure PMI core: run one launch's ranks on this node.

One :class:`LocalLaunch` spawns the ranks a node agent serves for one
launch, each in its own process group with a ``PMI_FD`` socketpair, and
drives :class:`~lattice_agent.pmi.kvs.Launch` with what the ranks send::

    Reply      -> queued on the rank's writer (order per rank is preserved)
    FenceReady -> ``await fence(ready)`` (bounded by ``fence_timeout``),
                  then ``Launch.fence_done(merged)``
    Abort      -> SIGKILL every rank's process group, remember the status
    Close      -> the writer closes the socket after pending replies

``fence`` is the only cross-node hook: the single-node default returns
``ready.puts``; a multi-node launch passes a coroutine that exchanges
the puts with the other agents (via the head agent) and returns the
merged key-value space.

Why every rank gets its own process group: an abort (or the end of the
launch) must take down whatever a rank forked, and ``killpg`` does that
without touching the agent or the other launches.  ``run()`` kills every
group in ``finally``, so no rank survives a return, an exception or a
cancellation of the caller.

Ranks run as the allocation's user (``run_as``): the ``setpriv`` prefix of
``lattice_agent.identity`` goes in front of the command, keeping the
parent-death signal that the uid change would otherwise clear.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lattice_agent.identity import RunAs
from lattice_agent.lifecycle import signal_exit_code
from lattice_agent.pmi.kvs import (
    Abort,
    Action,
    Close,
    FenceReady,
    Launch,
    Reply,
    block_process_mapping,
)
from lattice_agent.pmi.wire import PmiDecoder, PmiProtocolError
from lattice_agent.procgroup import ProcessGroup

log = logging.getLogger("lattice.agent.pmi")

__all__ = [
    "FENCE_TIMEOUT_REASON",
    "FenceFn",
    "LaunchResult",
    "LocalLaunch",
    "OutputLine",
    "local_fence",
]

#: ``LaunchResult.reason`` when the cross-node fence did not finish in time.
FENCE_TIMEOUT_REASON = "PMI fence timeout"
#: Exit status of a launch whose fence failed or timed out.
FENCE_FAILURE_STATUS = 1
#: Exit status recorded for a rank whose executable could not be started.
SPAWN_FAILURE_STATUS = 127
#: Longest output line passed on; longer lines are split.
MAX_OUTPUT_LINE = 64 * 1024
#: How long to wait for output pipes to drain after the ranks have ended.
OUTPUT_DRAIN_TIMEOUT = 2.0
#: How long ``run()`` waits for killed groups to empty before returning.
KILL_WAIT_TIMEOUT = 5.0

FenceFn = Callable[[FenceReady], Awaitable[Mapping[str, str]]]

_PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """In the child before exec: SIGKILL when the agent dies, since its PMI server dies too."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# PMI variables that would make MPICH look for a server other than PMI_FD
_SCRUB_ENV = ("PMI_PORT", "PMI_ID", "PMI_HOSTNAME", "PMI_KVSNAME")


async def local_fence(ready: FenceReady) -> Mapping[str, str]:
    """Single-node fence: the merged KVS is exactly this node's puts."""
    return ready.puts


@dataclass(frozen=True)
class OutputLine:
    """One line a rank wrote (without its newline)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    text: str

    @property
    def prefixed(self) -> str:
        """``[rank] text``, as ``mpiexec -prepend-rank`` shows it."""
        return f"[{self.rank}] {self.text}"


@dataclass
class LaunchResult:
    """Outcome of :meth:`LocalLaunch.run`.

    ``exit_status``: the abort status if the launch was aborted, else the
    first non-zero rank exit (in rank order), else 0.  Rank exit codes
    follow the shell convention (128+N for signal N).
    """

    exit_status: int
    rank_exit_codes: dict[int, int]
    rank_pids: dict[int, int]
    aborted: bool = False
    abort_rank: int | None = None
    reason: str = ""
    #: when the (first) abort happened, epoch seconds (0.0 when not aborted)
    aborted_at: float = 0.0
    #: collected output when no ``on_output`` callback was given
    output: list[OutputLine] = field(default_factory=list)


@dataclass
class _Rank:
    rank: int
    local_rank: int
    ours: socket.socket
    theirs: socket.socket | None
    proc: asyncio.subprocess.Process | None = None
    group: ProcessGroup | None = None
    exit_code: int | None = None
    outq: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    closed: bool = False


class LocalLaunch:
    """Run one launch's ranks on this node and serve their PMI.

    ``argv`` is run once per rank in ``ranks`` (global rank numbers);
    ``size`` is the job-wide rank count.  ``env`` is the complete base
    environment (default: the agent's own); the PMI and ``LATTICE_*``
    variables are added per rank.  ``ranks_per_node`` (job-wide, in node
    order) builds ``PMI_process_mapping``; the default treats this node
    as the only one.  ``on_output`` receives every output line; without
    it the lines are collected in :attr:`LaunchResult.output`.  ``run_as``:
    the user the ranks run as (None: the agent itself).
    """

    def __init__(
        self,
        argv: Sequence[str],
        ranks: Sequence[int],
        size: int,
        *,
        launch_id: str,
        kvsname: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        fence: FenceFn = local_fence,
        fence_timeout: float = 60.0,
        ranks_per_node: Sequence[int] | None = None,
        on_output: Callable[[OutputLine], None] | None = None,
        on_rank_exit: Callable[[int, int], None] | None = None,
        on_abort: Callable[[int | None, int, str], None] | None = None,
        kill_on_bad_exit: bool = True,
        pmi: bool = True,
        slurm_env: bool = False,
        run_as: RunAs | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [str(a) for a in argv]
        # setpriv ... -- (raises IdentityError now, not per rank); [] as the agent
        self._prefix = run_as.argv_prefix(keep_pdeathsig=True) if run_as is not None else []
        self.ranks = list(ranks)
        self.size = size
        self.launch_id = launch_id
        self.kvsname = kvsname or f"lattice_{launch_id}"
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.fence = fence
        self.fence_timeout = fence_timeout
        mapping = block_process_mapping(
            list(ranks_per_node) if ranks_per_node is not None else [len(self.ranks)]
        )
        # validates size and ranks
        self.launch = Launch(
            size=size,
            ranks_on_this_node=self.ranks,
            kvsname=self.kvsname,
            process_mapping=mapping,
        )
        self._on_output = on_output
        self._on_rank_exit = on_rank_exit
        self._on_abort = on_abort
        self.slurm_env = slurm_env
        self.kill_on_bad_exit = kill_on_bad_exit
        self.pmi = pmi
        #: set once every rank has been started (or starting failed)
        self.spawned = asyncio.Event()
        self._output: list[OutputLine] = []
        self._rank: dict[int, _Rank] = {}
        self._aborted = False
        self._aborted_at = 0.0
        self._abort_status = 0
        self._abort_rank: int | None = None
        self._reason = ""
        self._fence_task: asyncio.Task[None] | None = None
        self._started = False

    # ------------------------------------------------------------------ public

    async def run(self) -> LaunchResult:
        """Spawn the ranks, serve PMI until they have all ended, return the result."""
        if self._started:
            raise RuntimeError("a LocalLaunch runs once")
        self._started = True
        tasks: list[asyncio.Task[Any]] = []
        waits: list[asyncio.Task[Any]] = []
        pumps: list[asyncio.Task[Any]] = []
        try:
            for local_rank, rank in enumerate(self.ranks):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                ours.setblocking(False)
                self._rank[rank] = _Rank(rank, local_rank, ours, theirs)
            for r in self._rank.values():
                if self._aborted:
                    break
                await self._spawn(r)
                if r.proc is None:
                    continue
                if self.pmi:
                    tasks.append(asyncio.create_task(self._serve_pmi(r)))
                    tasks.append(asyncio.create_task(self._write_pmi(r)))
                assert r.proc.stdout is not None and r.proc.stderr is not None
                pumps.append(asyncio.create_task(self._pump(r.rank, "stdout", r.proc.stdout)))
                pumps.append(asyncio.create_task(self._pump(r.rank, "stderr", r.proc.stderr)))
                waits.append(asyncio.create_task(self._wait(r)))
            self.spawned.set()
            if waits:
                await asyncio.gather(*waits)
            # the leaders are gone; take down what they left in their groups
            self._kill_all()
            if pumps:
                _, pending = await asyncio.wait(pumps, timeout=OUTPUT_DRAIN_TIMEOUT)
                for t in pending:
                    t.cancel()
        finally:
            self.spawned.set()
            self._kill_all()
            if self._fence_task is not None:
                self._fence_task.cancel()
                tasks.append(self._fence_task)
            for t in (*tasks, *pumps):
                t.cancel()
            for r in self._rank.values():
                r.ours.close()
                if r.theirs is not None:
                    r.theirs.close()
            await self._reap_all()
            await asyncio.gather(*tasks, *pumps, *waits, return_exceptions=True)
        return self._result()

    @property
    def pids(self) -> dict[int, int]:
        """Global rank -> pid of the ranks started so far."""
        return {rank: r.proc.pid for rank, r in self._rank.items() if r.proc is not None}

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self, status: int, reason: str, rank: int | None = None) -> None:
        """Kill every rank now (another node's abort, a lost peer); the first abort wins."""
        self._abort(rank, status, reason)

    # ------------------------------------------------------------------ spawning

    def _rank_env(self, r: _Rank, fd: int) -> dict[str, str]:
        env = dict(self.env)
        for key in _SCRUB_ENV:
            env.pop(key, None)
        if self.pmi:
            env.update(
                {
                    "PMI_FD": str(fd),
                    "PMI_RANK": str(r.rank),
                    "PMI_SIZE": str(self.size),
                    "PMI_SPAWNED": "0",
                }
            )
        env.update(
            {
                "LATTICE_RANK": str(r.rank),
                "LATTICE_LAUNCH_ID": self.launch_id,
                "LATTICE_LOCAL_RANK": str(r.local_rank),
                "LATTICE_LOCAL_SIZE": str(len(self.ranks)),
                "LATTICE_NPROCS": str(self.size),
            }
        )
        if self.slurm_env:
            env.update(
                {
                    "SLURM_PROCID": str(r.rank),
                    "SLURM_LOCALID": str(r.local_rank),
                    "SLURM_NPROCS": str(self.size),
                    "SLURM_NTASKS": str(self.size),
                }
            )
        return env

    async def _spawn(self, r: _Rank) -> None:
        assert r.theirs is not None
        fd = r.theirs.fileno()
        try:
            r.proc = await asyncio.create_subprocess_exec(
                *self._prefix,
                *self.argv,
                env=self._rank_env(r, fd),
                cwd=self.cwd,
                pass_fds=(fd,) if self.pmi else (),
                start_new_session=True,
                preexec_fn=_die_with_agent,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            r.exit_code = SPAWN_FAILURE_STATUS
            self._abort(r.rank, SPAWN_FAILURE_STATUS, f"rank {r.rank} could not start: {exc}")
            return
        finally:
            r.theirs.close()
            r.theirs = None
        r.group = ProcessGroup(
            f"{self.launch_id}/rank{r.rank}", r.proc.pid, proc_start=None, is_child=False
        )
        if self._aborted:  # an abort raced with this spawn
            r.group.signal(signal.SIGKILL)

    async def _wait(self, r: _Rank) -> None:
        assert r.proc is not None
        code = await r.proc.wait()
        r.exit_code = signal_exit_code(-code) if code < 0 else code
        if self._on_rank_exit is not None:
            try:
                self._on_rank_exit(r.rank, r.exit_code)
            except Exception:
                log.exception("rank exit callback failed for launch %s", self.launch_id)
        if r.exit_code != 0 and self.kill_on_bad_exit and not self._aborted:
            # MPI peers of a dead rank hang in their next collective: end them all
            self._abort(r.rank, r.exit_code, f"rank {r.rank} exited with code {r.exit_code}")

    # ------------------------------------------------------------------ PMI I/O

    async def _serve_pmi(self, r: _Rank) -> None:
        loop = asyncio.get_running_loop()
        decoder = PmiDecoder()
        while not r.closed:
            try:
                data = await loop.sock_recv(r.ours, 65536)
            except OSError:
                data = b""
            if not data:
                try:
                    decoder.eof()
                except PmiProtocolError as exc:
                    self._apply(self.launch.protocol_error(r.rank, exc))
                    return
                self._apply(self.launch.connection_lost(r.rank))
                r.outq.put_nowait(None)
                return
            try:
                messages = decoder.feed(data)
            except PmiProtocolError as exc:
                self._apply(self.launch.protocol_error(r.rank, exc))
                return
            for msg in messages:
                self._apply(self.launch.handle(r.rank, msg))
                if r.closed:
                    return

    async def _write_pmi(self, r: _Rank) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await r.outq.get()
                if data is None:
                    break
                try:
                    await loop.sock_sendall(r.ours, data)
                except OSError as exc:
                    log.debug("PMI write to rank %d failed: %s", r.rank, exc)
                    break
        finally:
            r.closed = True
            try:
                r.ours.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Reply):
                target = self._rank.get(action.rank)
                if target is not None and not target.closed:
                    target.outq.put_nowait(action.data)
            elif isinstance(action, FenceReady):
                self._fence_task = asyncio.create_task(self._run_fence(action))
            elif isinstance(action, Abort):
                self._abort(action.rank, action.exit_status, action.message)
            elif isinstance(action, Close):
                target = self._rank.get(action.rank)
                if target is not None and not target.closed:
                    target.closed = True  # stop reading; writer drains, then closes
                    target.outq.put_nowait(None)

    async def _run_fence(self, ready: FenceReady) -> None:
        try:
            merged = await asyncio.wait_for(self.fence(ready), self.fence_timeout)
        except TimeoutError as e:
            # a remote coordinator's timeout names the nodes that never arrived
            why = str(e) if str(e).startswith(FENCE_TIMEOUT_REASON) else FENCE_TIMEOUT_REASON
            self._abort(None, FENCE_FAILURE_STATUS, why)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the exchange failed: the ranks would hang
            log.warning("PMI fence of %s failed: %s", self.launch_id, exc)
            self._abort(None, FENCE_FAILURE_STATUS, f"PMI fence failed: {exc}")
            return
        if not self._aborted:
            self._apply(self.launch.fence_done(merged))

    # ------------------------------------------------------------------ teardown

    def _abort(self, rank: int | None, status: int, reason: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._aborted_at = time.time()
        self._abort_status = status
        self._abort_rank = rank
        self._reason = reason
        log.info("launch %s aborted (rank %s, status %d): %s", self.launch_id, rank, status, reason)
        self._kill_all()
        if self._on_abort is not None:
            try:
                self._on_abort(rank, status, reason)
            except Exception:
                log.exception("abort callback failed for launch %s", self.launch_id)

    def _kill_all(self) -> None:
        for r in self._rank.values():
            if r.group is not None:
                r.group.signal(signal.SIGKILL)

    async def _reap_all(self) -> None:
        """Wait for every leader (asyncio reaps it) and for every group to be empty."""
        procs = [r.proc for r in self._rank.values() if r.proc is not None]
        if procs:
            waiters = [asyncio.ensure_future(p.wait()) for p in procs]
            _, pending = await asyncio.wait(waiters, timeout=KILL_WAIT_TIMEOUT)
            for t in pending:
                t.cancel()
        for r in self._rank.values():
            if r.proc is not None and r.exit_code is None and r.proc.returncode is not None:
                code = r.proc.returncode
                r.exit_code = signal_exit_code(-code) if code < 0 else code
            if r.group is not None:
                await r.group.wait_quiet(KILL_WAIT_TIMEOUT)

    # ------------------------------------------------------------------ output

    async def _pump(self, rank: int, stream: str, reader: asyncio.StreamReader) -> None:
        buf = bytearray()
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buf += chunk
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) >= MAX_OUTPUT_LINE:
                        self._emit(rank, stream, bytes(buf[:MAX_OUTPUT_LINE]))
                        del buf[:MAX_OUTPUT_LINE]
                        continue
                    break
                self._emit(rank, stream, bytes(buf[:nl]))
                del buf[: nl + 1]
        if buf:
            self._emit(rank, stream, bytes(buf))

    def _emit(self, rank: int, stream: str, data: bytes) -> None:
        line = OutputLine(rank, stream, data.decode("utf-8", errors="replace"))
        if self._on_output is None:
            self._output.append(line)
            return
        try:
            self._on_output(line)
        except Exception:  # a broken sink must not kill the launch
            log.exception("output callback failed for launch %s", self.launch_id)

    # ------------------------------------------------------------------ result

    def _result(self) -> LaunchResult:
        codes = {
            rank: (r.exit_code if r.exit_code is not None else signal_exit_code(signal.SIGKILL))
            for rank, r in self._rank.items()
        }
        if self._aborted:
            status = self._abort_status
        else:
            status = next((c for c in codes.values() if c != 0), 0)
        return LaunchResult(
            exit_status=status,
            rank_exit_codes=codes,
            rank_pids={rank: r.proc.pid for rank, r in self._rank.items() if r.proc is not None},
            aborted=self._aborted,
            abort_rank=self._abort_rank,
            reason=self._reason,
            aborted_at=self._aborted_at if self._aborted else 0.0,
            output=self._output,
        )
