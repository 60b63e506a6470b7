"""The life of one allocation on this node as a pure function: event + record -> instructions.

Every decision about an allocation's life is taken here, without processes, clocks or files,
in the style of dask's worker state machine: :func:`step` takes the allocation's current
:class:`Lifecycle` record (None before it exists) and one event, and returns the new record and
the instructions the runtime must carry out. The runtime (``runtime.py``) only does I/O: it
executes instructions (spawn, signal, arm a timer, reap, persist, report) and feeds back what
happened as events. Which reason an allocation ends with, which exit code it reports and the
SIGTERM -> grace -> SIGKILL sequence are therefore tested here without starting anything.

Rules decided here:

* An allocation is spawned once per record: ``Assigned`` for a known allocation does nothing
  (start is idempotent, also across agent restarts); only ``Forget`` ends a record.
* Termination (walltime, cancel, preempt, a restart that finds a termination in progress)
  sends SIGTERM to the group and arms the grace timer; when the grace expires with the
  wrapper still alive, SIGKILL. With a grace of 0 the SIGKILL follows the SIGTERM at once.
  The first reason wins; later requests wait for the same end.
* When the wrapper has ended, the group is reaped (after the rest of the grace if a polite
  termination is under way); then the exit is settled and reported exactly once:
  the exit file's status, else the wait status, else 128 + the last signal we sent, else
  None with reason ``lost_on_agent_restart``. The reason is the termination reason if any,
  else ``oom_killed`` when the shell saw an OOM kill in the allocation's cgroup.
"""

from __future__ import annotations

import signal

import msgspec

PHASE_RUNNING = "running"
PHASE_EXITED = "exited"
REASON_WALLTIME = "walltime_exceeded"
REASON_CANCELLED = "cancelled"
REASON_PREEMPTED = "preempted"
REASON_LOST = "lost_on_agent_restart"
REASON_SPAWN_FAILED = "spawn_failed"
REASON_OOM = "oom_killed"

TIMER_WALLTIME = "walltime"
TIMER_GRACE = "grace"

SIGTERM = int(signal.SIGTERM)
SIGKILL = int(signal.SIGKILL)


def signal_exit_code(signum: int) -> int:
    """The exit code reported for a process ended by signal ``signum`` (shell convention)."""
    return 128 + signum


class Status:
    """Where an allocation is in its life (only ``phase`` is reported and persisted)."""

    ASSIGNED = "assigned"  # the spawn is under way
    RUNNING = "running"  # the wrapper runs; no termination asked for
    STOPPING = "stopping"  # SIGTERM sent, grace timer armed
    KILLING = "killing"  # SIGKILL sent
    FINISHING = "finishing"  # the wrapper has ended; the group is being reaped
    EXITED = "exited"  # settled and reported


class Lifecycle(msgspec.Struct, frozen=True, kw_only=True):
    """The lifecycle part of what the runtime knows about one allocation."""

    allocation_id: str
    status: str = Status.ASSIGNED
    started_at: float = 0.0
    walltime_seconds: float = 0.0
    deadline: float | None = None
    exit_code: int | None = None
    reason: str = ""
    finished_at: float | None = None
    stop_reason: str = ""  # a termination in progress (or done), with its reason
    kill_signal: int = 0  # last signal sent to the group
    exited_at: float | None = None  # when the wrapper was seen gone (not persisted)
    peak_memory_bytes: int | None = None  # the cgroup's peak, read at the reap

    @property
    def phase(self) -> str:
        return PHASE_EXITED if self.status == Status.EXITED else PHASE_RUNNING


# ---------------------------------------------------------------------------- events


class Assigned(msgspec.Struct, frozen=True, kw_only=True):
    """The agent wants the allocation running here; ``at`` becomes ``started_at``."""

    allocation_id: str
    walltime_seconds: float = 0.0
    at: float


class Spawned(msgspec.Struct, frozen=True):
    """The wrapper process exists (its pid is the runtime's business)."""


class SpawnFailed(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    message: str = ""  # the cause, appended to the reason: "spawn_failed: <message>"


class Exited(msgspec.Struct, frozen=True, kw_only=True):
    """The wrapper (the allocation's process group leader) has ended."""

    at: float


class Reaped(msgspec.Struct, frozen=True, kw_only=True):
    """The group is gone; what the exit file and ``waitpid`` said (None: nothing), and what
    the allocation's cgroup said: did the kernel OOM-kill a process in it, its peak memory."""

    exit_file_code: int | None = None
    wait_code: int | None = None
    oom_killed: bool = False
    peak_memory_bytes: int | None = None


class WalltimeExpired(msgspec.Struct, frozen=True):
    pass


class CancelRequested(msgspec.Struct, frozen=True):
    reason: str = REASON_CANCELLED


class PreemptRequested(msgspec.Struct, frozen=True):
    pass


class GraceExpired(msgspec.Struct, frozen=True):
    pass


class Recovered(msgspec.Struct, frozen=True, kw_only=True):
    """A restarted agent loaded the record from its state file; is the wrapper alive?"""

    alive: bool
    at: float


class ForgetRequested(msgspec.Struct, frozen=True):
    pass


Event = (
    Assigned
    | Spawned
    | SpawnFailed
    | Exited
    | Reaped
    | WalltimeExpired
    | CancelRequested
    | PreemptRequested
    | GraceExpired
    | Recovered
    | ForgetRequested
)

# ---------------------------------------------------------------------------- instructions


class Spawn(msgspec.Struct, frozen=True):
    """Start the wrapper in its own session; answer with Spawned or SpawnFailed."""


class Watch(msgspec.Struct, frozen=True):
    """Watch the wrapper; answer with Exited when it is gone."""


class Signal(msgspec.Struct, frozen=True):
    """Send ``signum`` to the whole process group."""

    signum: int


class Kill(msgspec.Struct, frozen=True):
    """SIGKILL the whole process group."""


class ArmTimer(msgspec.Struct, frozen=True, kw_only=True):
    """Fire ``timer`` (WalltimeExpired / GraceExpired) at the absolute time ``at`` (the
    runtime's clock) or ``after`` seconds from now."""

    timer: str
    at: float | None = None
    after: float = 0.0


class CancelTimer(msgspec.Struct, frozen=True):
    timer: str


class Reap(msgspec.Struct, frozen=True, kw_only=True):
    """Clean the group up: first let it go quiet for the rest of the grace period (when
    ``wait_for_grace``), then SIGKILL what is left and reap it; answer with Reaped."""

    wait_for_grace: bool = False


class Persist(msgspec.Struct, frozen=True):
    """Write the state file (every record of the runtime). ``deferrable``: only a
    removal, which may wait for the next write (a record left behind by a crash is of
    an allocation that has ended: reported again, then forgotten again)."""

    deferrable: bool = False


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """Tell the agent (``on_change``); ``phase`` exited is the terminal report."""

    phase: str
    exit_code: int | None = None
    reason: str = ""


class Forget(msgspec.Struct, frozen=True):
    """Drop the record (the files stay)."""


Instruction = (
    Spawn | Watch | Signal | Kill | ArmTimer | CancelTimer | Reap | Persist | Report | Forget
)

Step = tuple[Lifecycle | None, list[Instruction]]

# ---------------------------------------------------------------------------- the function


def settle_exit(
    rec: Lifecycle, exit_file_code: int | None, wait_code: int | None, oom_killed: bool = False
) -> tuple[int | None, str]:
    """The exit code and reason of an allocation whose group is gone.

    A termination we asked for keeps its reason; otherwise an OOM kill in the allocation's
    cgroup makes the reason ``oom_killed`` whatever the exit status (as Slurm's
    OUT_OF_MEMORY: a job whose worker was killed did not do its work)."""
    code = exit_file_code if exit_file_code is not None else wait_code
    if code is None and rec.kill_signal:
        code = signal_exit_code(rec.kill_signal)
    reason = rec.stop_reason or (REASON_OOM if oom_killed else "")
    if code is None and not reason:
        reason = REASON_LOST
    return code, reason


def step(rec: Lifecycle | None, event: Event, *, grace: float) -> Step:
    """Apply ``event`` to ``rec``; return the new record (None: forgotten) and instructions.

    Events that make no sense in the current state (a late timer, a second exit, a cancel
    after the end) change nothing and ask for nothing.
    """
    if rec is None:
        if isinstance(event, Assigned):
            walltime = float(event.walltime_seconds or 0)
            new = Lifecycle(
                allocation_id=event.allocation_id,
                started_at=event.at,
                walltime_seconds=walltime,
                deadline=event.at + walltime if walltime > 0 else None,
            )
            return new, [Spawn()]
        return None, []
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return rec, []
    return handler(rec, event, grace)


def _ignore(rec: Lifecycle, event: Event, grace: float) -> Step:
    return rec, []


def _spawned(rec: Lifecycle, event: Spawned, grace: float) -> Step:
    if rec.status != Status.ASSIGNED:
        return rec, []
    rec = msgspec.structs.replace(rec, status=Status.RUNNING)
    out: list[Instruction] = [Persist(), Watch()]
    out += _walltime_timer(rec)
    out.append(Report(phase=PHASE_RUNNING))
    return rec, out


def _spawn_failed(rec: Lifecycle, event: SpawnFailed, grace: float) -> Step:
    if rec.status != Status.ASSIGNED:
        return rec, []
    reason = f"{REASON_SPAWN_FAILED}: {event.message}" if event.message else REASON_SPAWN_FAILED
    rec = msgspec.structs.replace(rec, status=Status.EXITED, reason=reason, finished_at=event.at)
    return rec, [Persist(), Report(phase=PHASE_EXITED, reason=reason)]


def _walltime_timer(rec: Lifecycle) -> list[Instruction]:
    if rec.walltime_seconds <= 0:
        return []
    return [ArmTimer(timer=TIMER_WALLTIME, at=rec.started_at + rec.walltime_seconds)]


def _terminate(rec: Lifecycle, reason: str, grace: float) -> Step:
    """Start SIGTERM -> grace -> SIGKILL, unless a termination is already under way."""
    if rec.status == Status.FINISHING:
        # the wrapper is gone already: nothing to signal, but the end is ours
        if rec.stop_reason:
            return rec, []
        return msgspec.structs.replace(rec, stop_reason=reason), [Persist()]
    if rec.status != Status.RUNNING:
        return rec, []
    rec = msgspec.structs.replace(
        rec,
        status=Status.STOPPING,
        stop_reason=rec.stop_reason or reason,
        kill_signal=SIGTERM,
    )
    out: list[Instruction] = [CancelTimer(TIMER_WALLTIME), Persist(), Signal(SIGTERM)]
    if grace > 0:
        out.append(ArmTimer(timer=TIMER_GRACE, after=grace))
        return rec, out
    rec, more = _kill(rec)
    return rec, out + more


def _kill(rec: Lifecycle) -> Step:
    rec = msgspec.structs.replace(rec, status=Status.KILLING, kill_signal=SIGKILL)
    return rec, [Persist(), Kill()]


def _walltime_expired(rec: Lifecycle, event: WalltimeExpired, grace: float) -> Step:
    return _terminate(rec, REASON_WALLTIME, grace)


def _cancel_requested(rec: Lifecycle, event: CancelRequested, grace: float) -> Step:
    return _terminate(rec, event.reason or REASON_CANCELLED, grace)


def _preempt_requested(rec: Lifecycle, event: PreemptRequested, grace: float) -> Step:
    return _terminate(rec, REASON_PREEMPTED, grace)


def _grace_expired(rec: Lifecycle, event: GraceExpired, grace: float) -> Step:
    if rec.status != Status.STOPPING:
        return rec, []
    return _kill(rec)


def _exited(rec: Lifecycle, event: Exited, grace: float) -> Step:
    if rec.status not in (Status.RUNNING, Status.STOPPING, Status.KILLING):
        return rec, []
    in_grace = rec.status == Status.STOPPING
    rec = msgspec.structs.replace(rec, status=Status.FINISHING, exited_at=event.at)
    # the reap still needs to know where the grace period ends: cancel the timer after it
    return rec, [Reap(wait_for_grace=in_grace), CancelTimer(TIMER_GRACE)]


def _reaped(rec: Lifecycle, event: Reaped, grace: float) -> Step:
    if rec.status != Status.FINISHING:
        return rec, []
    code, reason = settle_exit(rec, event.exit_file_code, event.wait_code, event.oom_killed)
    rec = msgspec.structs.replace(
        rec,
        status=Status.EXITED,
        exit_code=code,
        reason=reason,
        finished_at=rec.exited_at,
        peak_memory_bytes=event.peak_memory_bytes,
    )
    return rec, [
        CancelTimer(TIMER_WALLTIME),
        Persist(),
        Report(phase=PHASE_EXITED, exit_code=code, reason=reason),
    ]


def _recovered(rec: Lifecycle, event: Recovered, grace: float) -> Step:
    """A new agent took the record over: its timers and watches are gone with the old one."""
    if rec.status in (Status.EXITED, Status.ASSIGNED, Status.FINISHING):
        return rec, []
    if not event.alive:
        # ended while no agent watched; a termination in progress has no grace left
        rec = msgspec.structs.replace(rec, status=Status.FINISHING, exited_at=event.at)
        return rec, [Reap(wait_for_grace=False)]
    rec = msgspec.structs.replace(rec, status=Status.RUNNING)
    out: list[Instruction] = [Watch()]
    if rec.stop_reason:  # a termination was under way: start it over
        rec, more = _terminate(rec, rec.stop_reason, grace)
        return rec, out + more
    return rec, out + _walltime_timer(rec)


def _forget_requested(rec: Lifecycle, event: ForgetRequested, grace: float) -> Step:
    if rec.status != Status.EXITED:
        return rec, []  # never drop an allocation whose processes may still run
    return None, [Forget(), Persist(deferrable=True)]


_HANDLERS = {
    Spawned: _spawned,
    SpawnFailed: _spawn_failed,
    Exited: _exited,
    Reaped: _reaped,
    WalltimeExpired: _walltime_expired,
    CancelRequested: _cancel_requested,
    PreemptRequested: _preempt_requested,
    GraceExpired: _grace_expired,
    Recovered: _recovered,
    ForgetRequested: _forget_requested,
    Assigned: _ignore,  # already known: never spawn twice
}
