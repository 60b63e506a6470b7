"""lifecycle.step(): the allocation's life as a pure function, tested without processes.

Examples for each rule, then two properties: any event sequence keeps the basic promises
(one spawn and at most one terminal report per record, a SIGKILL only after a SIGTERM), and a
simulated node (a process that obeys or ignores SIGTERM, exits on its own or not, timers,
agent restarts that reload the persisted record) always settles with exactly one report whose
reason and exit code follow the rules.
"""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent import lifecycle as lc
from lattice_agent.lifecycle import (
    ArmTimer,
    CancelTimer,
    Kill,
    Lifecycle,
    Persist,
    Reap,
    Report,
    Signal,
    Spawn,
    Status,
    Watch,
    step,
)
from lattice_agent.persist import SavedAlloc, from_entry, to_entry
from lattice_agent.spawn import AllocPaths

TERM = int(signal.SIGTERM)
KILL = int(signal.SIGKILL)
GRACE = 5.0


def run(
    rec: Lifecycle | None, *events: lc.Event, grace: float = GRACE
) -> tuple[Lifecycle | None, list[lc.Instruction]]:
    out: list[lc.Instruction] = []
    for ev in events:
        rec, ins = step(rec, ev, grace=grace)
        out += ins
    return rec, out


def running(walltime: float = 0.0, **kw: object) -> Lifecycle:
    rec, _ = run(None, lc.Assigned(allocation_id="a", walltime_seconds=walltime, at=100.0))
    rec, _ = run(rec, lc.Spawned())
    assert rec is not None
    return msgspec.structs.replace(rec, **kw)


def terminal(ins: list[lc.Instruction]) -> list[Report]:
    return [i for i in ins if isinstance(i, Report) and i.phase == lc.PHASE_EXITED]


# ---------------------------------------------------------------------------- examples


def test_assigned_spawns_once() -> None:
    rec, ins = run(None, lc.Assigned(allocation_id="a", walltime_seconds=60, at=100.0))
    assert ins == [Spawn()]
    assert rec is not None
    assert (rec.status, rec.started_at, rec.deadline) == (Status.ASSIGNED, 100.0, 160.0)
    again, ins = run(rec, lc.Assigned(allocation_id="a", walltime_seconds=60, at=200.0))
    assert (again, ins) == (rec, [])


def test_spawned_watches_arms_walltime_and_reports_running() -> None:
    rec, _ = run(None, lc.Assigned(allocation_id="a", walltime_seconds=60, at=100.0))
    rec, ins = run(rec, lc.Spawned())
    assert ins == [
        Persist(),
        Watch(),
        ArmTimer(timer=lc.TIMER_WALLTIME, at=160.0),
        Report(phase="running"),
    ]
    assert rec is not None and rec.phase == "running"
    rec, _ = run(None, lc.Assigned(allocation_id="b", at=100.0))
    _, ins = run(rec, lc.Spawned())
    assert not any(isinstance(i, ArmTimer) for i in ins)  # no walltime, no timer


def test_spawn_failure_is_terminal() -> None:
    rec, _ = run(None, lc.Assigned(allocation_id="a", at=100.0))
    rec, ins = run(rec, lc.SpawnFailed(at=101.0))
    assert rec is not None
    assert (rec.phase, rec.reason, rec.exit_code, rec.finished_at) == (
        "exited",
        "spawn_failed",
        None,
        101.0,
    )
    assert ins == [Persist(), Report(phase="exited", reason="spawn_failed")]


def test_normal_exit_reports_the_exit_file_status() -> None:
    rec, ins = run(running(), lc.Exited(at=150.0))
    assert ins == [Reap(wait_for_grace=False), CancelTimer(lc.TIMER_GRACE)]
    assert rec is not None and rec.phase == "running"  # not settled before the group is gone
    rec, ins = run(rec, lc.Reaped(exit_file_code=7, wait_code=7))
    assert rec is not None
    assert (rec.phase, rec.exit_code, rec.reason, rec.finished_at) == ("exited", 7, "", 150.0)
    assert ins == [CancelTimer(lc.TIMER_WALLTIME), Persist(), Report(phase="exited", exit_code=7)]


def test_walltime_terms_then_kills_after_grace() -> None:
    rec, ins = run(running(walltime=60), lc.WalltimeExpired())
    assert ins == [
        CancelTimer(lc.TIMER_WALLTIME),
        Persist(),
        Signal(TERM),
        ArmTimer(timer=lc.TIMER_GRACE, after=GRACE),
    ]
    assert rec is not None and (rec.stop_reason, rec.kill_signal) == ("walltime_exceeded", TERM)
    rec, ins = run(rec, lc.GraceExpired())
    assert ins == [Persist(), Kill()]
    rec, ins = run(rec, lc.Exited(at=170.0), lc.Reaped())
    assert terminal(ins) == [Report(phase="exited", exit_code=137, reason="walltime_exceeded")]


def test_sigterm_obeyed_lets_the_group_finish_its_grace() -> None:
    rec, _ = run(running(), lc.CancelRequested())
    rec, ins = run(rec, lc.Exited(at=120.0))
    assert ins == [Reap(wait_for_grace=True), CancelTimer(lc.TIMER_GRACE)]
    rec, ins = run(rec, lc.Reaped(exit_file_code=143))
    assert terminal(ins) == [Report(phase="exited", exit_code=143, reason="cancelled")]
    _, ins = run(rec, lc.GraceExpired())  # a late timer changes nothing
    assert ins == []


def test_zero_grace_kills_right_after_the_term() -> None:
    _, ins = run(running(), lc.CancelRequested(), grace=0.0)
    assert [i for i in ins if isinstance(i, Signal | Kill)] == [Signal(TERM), Kill()]
    assert not any(isinstance(i, ArmTimer) for i in ins)


def test_first_reason_wins_and_later_requests_wait() -> None:
    rec, _ = run(running(walltime=10), lc.PreemptRequested())
    rec, ins = run(rec, lc.CancelRequested(), lc.WalltimeExpired(), lc.CancelRequested("x"))
    assert ins == []
    assert rec is not None and rec.stop_reason == "preempted"
    _, ins = run(rec, lc.Exited(at=1.0), lc.Reaped(wait_code=143))
    assert terminal(ins)[0].reason == "preempted"


def test_cancel_while_reaping_names_the_end_without_signals() -> None:
    rec, _ = run(running(), lc.Exited(at=1.0))
    rec, ins = run(rec, lc.CancelRequested())
    assert ins == [Persist()]
    _, ins = run(rec, lc.Reaped(exit_file_code=0))
    assert terminal(ins) == [Report(phase="exited", exit_code=0, reason="cancelled")]


def test_requests_after_the_end_do_nothing() -> None:
    rec, _ = run(running(), lc.Exited(at=1.0), lc.Reaped(exit_file_code=0))
    for ev in (
        lc.CancelRequested(),
        lc.PreemptRequested(),
        lc.WalltimeExpired(),
        lc.GraceExpired(),
        lc.Exited(at=2.0),
        lc.Reaped(exit_file_code=1),
        lc.Spawned(),
        lc.Recovered(alive=True, at=3.0),
    ):
        assert step(rec, ev, grace=GRACE) == (rec, [])


@pytest.mark.parametrize(
    ("exit_file", "wait", "kill_signal", "stop", "expected"),
    [
        (3, None, 0, "", (3, "")),
        (None, 9, 0, "", (9, "")),
        (None, None, TERM, "cancelled", (143, "cancelled")),
        (None, None, KILL, "walltime_exceeded", (137, "walltime_exceeded")),
        (None, None, 0, "", (None, "lost_on_agent_restart")),
        (None, None, 0, "cancelled", (None, "cancelled")),
        (0, 143, TERM, "preempted", (0, "preempted")),  # the exit file wins
    ],
)
def test_exit_code_rules(
    exit_file: int | None,
    wait: int | None,
    kill_signal: int,
    stop: str,
    expected: tuple[int | None, str],
) -> None:
    rec = running(kill_signal=kill_signal, stop_reason=stop)
    assert lc.settle_exit(rec, exit_file, wait) == expected
    assert lc.signal_exit_code(TERM) == 143


def test_recovered_alive_rearms_walltime_from_started_at() -> None:
    rec = running(walltime=60)
    rec, ins = run(rec, lc.Recovered(alive=True, at=130.0))
    assert ins == [Watch(), ArmTimer(timer=lc.TIMER_WALLTIME, at=160.0)]


def test_recovered_alive_restarts_a_termination_in_progress() -> None:
    rec = running(stop_reason="cancelled", kill_signal=KILL)
    rec, ins = run(rec, lc.Recovered(alive=True, at=130.0))
    assert ins == [
        Watch(),
        CancelTimer(lc.TIMER_WALLTIME),
        Persist(),
        Signal(TERM),
        ArmTimer(timer=lc.TIMER_GRACE, after=GRACE),
    ]
    assert rec is not None and rec.kill_signal == TERM


def test_recovered_dead_is_reaped_and_reported() -> None:
    rec, ins = run(running(), lc.Recovered(alive=False, at=130.0))
    assert ins == [Reap(wait_for_grace=False)]
    rec, ins = run(rec, lc.Reaped())
    assert terminal(ins) == [Report(phase="exited", exit_code=None, reason="lost_on_agent_restart")]
    assert rec is not None and rec.finished_at == 130.0
    rec, ins = run(
        running(stop_reason="cancelled", kill_signal=TERM), lc.Recovered(alive=False, at=1)
    )
    _, ins = run(rec, lc.Reaped())
    assert terminal(ins) == [Report(phase="exited", exit_code=143, reason="cancelled")]


def test_forget_only_after_the_end() -> None:
    rec = running()
    assert run(rec, lc.ForgetRequested()) == (rec, [])
    rec, _ = run(rec, lc.Exited(at=1.0), lc.Reaped(exit_file_code=0))
    assert run(rec, lc.ForgetRequested()) == (None, [lc.Forget(), Persist(deferrable=True)])
    assert run(None, lc.ForgetRequested()) == (None, [])  # nothing known: nothing to do


# ---------------------------------------------------------------------------- any order

ANY_EVENT = st.one_of(
    st.builds(
        lc.Assigned,
        allocation_id=st.just("a"),
        walltime_seconds=st.sampled_from([0, 5]),
        at=st.floats(0, 100),
    ),
    st.just(lc.Spawned()),
    st.builds(lc.SpawnFailed, at=st.floats(0, 100)),
    st.builds(lc.Exited, at=st.floats(0, 100)),
    st.builds(
        lc.Reaped,
        exit_file_code=st.none() | st.integers(0, 255),
        wait_code=st.none() | st.integers(0, 255),
    ),
    st.just(lc.WalltimeExpired()),
    st.builds(lc.CancelRequested, st.sampled_from(["cancelled", "requeued"])),
    st.just(lc.PreemptRequested()),
    st.just(lc.GraceExpired()),
    st.builds(lc.Recovered, alive=st.booleans(), at=st.floats(0, 100)),
    st.just(lc.ForgetRequested()),
)


@settings(max_examples=400, deadline=None)
@given(events=st.lists(ANY_EVENT, max_size=40), grace=st.sampled_from([0.0, 2.0]))
def test_any_event_sequence_keeps_the_promises(events: list[lc.Event], grace: float) -> None:
    rec: Lifecycle | None = None
    lifetime: list[lc.Instruction] = []  # instructions since the record was created
    for ev in events:
        before = rec
        rec, ins = step(rec, ev, grace=grace)
        if before is None:
            lifetime = []
            assert ins in ([], [Spawn()])
            assert (rec is None) == (ins == [])
        else:
            assert Spawn() not in ins, "spawned twice"
        if grace > 0 and Kill() in ins:
            assert Signal(TERM) not in ins, "no grace between SIGTERM and SIGKILL"
        lifetime += ins
        signals = [i for i in lifetime if isinstance(i, Signal | Kill)]
        for i, s in enumerate(signals):
            if isinstance(s, Kill):
                assert i > 0 and signals[i - 1] == Signal(TERM), "SIGKILL without a SIGTERM"
        ends = terminal(lifetime)
        assert len(ends) <= 1, "more than one terminal report"
        if ends:
            done_at = max(i for i, x in enumerate(lifetime) if x is ends[0])
            after = lifetime[done_at + 1 :]
            assert not [i for i in after if isinstance(i, Spawn | Watch | Signal | Kill | Reap)]
            assert ends[0].exit_code is not None or ends[0].reason
            if rec is not None:
                assert (rec.exit_code, rec.reason) == (ends[0].exit_code, ends[0].reason)
        if lc.Forget() in ins:
            assert rec is None
            assert ends, "forgot an allocation that had not ended"


# ---------------------------------------------------------------------------- a simulated node

PATHS = AllocPaths.of("a", Path("/w"), Path("/l"))


class Node:
    """A process and an agent that carries out instructions the way the runtime does."""

    def __init__(self, grace: float, walltime: float, obeys_term: bool) -> None:
        self.grace = grace
        self.obeys_term = obeys_term
        self.rec: Lifecycle | None = None
        self.persisted: dict | None = None
        self.alive = False
        self.parent = True  # this agent spawned it, so it gets the wait status
        self.exit_file: int | None = None
        self.wait_status: int | None = None
        self.ended_by = ""
        self.timers: set[str] = set()
        self.watching = self.reaping = False
        self.instructions: list[lc.Instruction] = []
        self.requests: list[str] = []  # termination reasons asked for before the end
        self.grace_fired = 0
        self.feed(lc.Assigned(allocation_id="a", walltime_seconds=walltime, at=0.0))

    def feed(self, event: lc.Event) -> None:
        pending = [event]
        while pending:
            self.rec, ins = step(self.rec, pending.pop(0), grace=self.grace)
            self.instructions += ins
            for i in ins:
                answer = self.do(i)
                if answer is not None:
                    pending.append(answer)

    def end(self, how: str, code: int, *, exit_file: bool) -> None:
        if not self.alive:
            return
        self.alive, self.ended_by, self.wait_status = False, how, code
        self.exit_file = code if exit_file else None

    def do(self, ins: lc.Instruction) -> lc.Event | None:
        match ins:
            case Spawn():
                self.alive = True
                return lc.Spawned()
            case Watch():
                self.watching = True
            case Signal(signum=s) if s == TERM and self.obeys_term:
                self.end("term", 143, exit_file=True)  # the wrapper records the status
            case Kill():
                self.end("kill", 137, exit_file=False)
            case ArmTimer(timer=t):
                self.timers.add(t)
            case CancelTimer(timer=t):
                self.timers.discard(t)
            case Reap():
                self.reaping = True
            case Persist():
                self.persisted = None
                if self.rec is not None:
                    self.persisted = to_entry(SavedAlloc(self.rec, 42, 42, 1, PATHS))
        return None

    def options(self, natural_code: int | None, budget: dict[str, int]) -> list[str]:
        out = []
        if self.alive and natural_code is not None:
            out.append("exit")
        if self.watching and not self.alive:
            out.append("exited")
        if self.reaping:
            out.append("reaped")
        out += sorted(self.timers)
        if self.rec is not None and budget["cancel"] > 0:
            out += ["cancel", "preempt"]
        if self.persisted is not None and budget["restart"] > 0:
            out.append("restart")
        return out

    def act(self, what: str, natural_code: int | None, budget: dict[str, int]) -> None:
        rec = self.rec
        open_ = rec is not None and rec.status != Status.EXITED
        if what == "exit":
            assert natural_code is not None
            self.end("natural", natural_code, exit_file=True)
        elif what == "exited":
            self.watching = False
            self.feed(lc.Exited(at=1.0))
        elif what == "reaped":
            self.reaping = False
            wait = self.wait_status if self.parent else None
            self.feed(lc.Reaped(exit_file_code=self.exit_file, wait_code=wait))
        elif what == lc.TIMER_WALLTIME:
            self.timers.discard(what)
            if open_:
                self.requests.append(lc.REASON_WALLTIME)
            self.feed(lc.WalltimeExpired())
        elif what == lc.TIMER_GRACE:
            self.timers.discard(what)
            self.grace_fired += 1
            self.feed(lc.GraceExpired())
        elif what in ("cancel", "preempt"):
            budget["cancel"] -= 1
            if open_:
                self.requests.append("cancelled" if what == "cancel" else "preempted")
            self.feed(lc.CancelRequested() if what == "cancel" else lc.PreemptRequested())
        elif what == "restart":
            budget["restart"] -= 1
            assert self.persisted is not None
            self.rec = from_entry(self.persisted).life
            self.timers.clear()
            self.watching = self.reaping = False
            self.parent = False
            self.feed(lc.Recovered(alive=self.alive, at=2.0))


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    grace=st.sampled_from([0.0, 3.0]),
    walltime=st.sampled_from([0.0, 60.0]),
    obeys_term=st.booleans(),
    natural_code=st.none() | st.integers(0, 255),
)
def test_simulated_node_settles_once_by_the_rules(
    data: st.DataObject, grace: float, walltime: float, obeys_term: bool, natural_code: int | None
) -> None:
    node = Node(grace, walltime, obeys_term)
    budget = {"cancel": 2, "restart": 2}
    for _ in range(200):
        options = node.options(natural_code, budget)
        if not options:
            break
        node.act(data.draw(st.sampled_from(options)), natural_code, budget)
    else:
        pytest.fail("the node never settled")

    assert node.instructions.count(Spawn()) == 1
    ends = terminal(node.instructions)
    if node.alive:
        assert not node.requests and ends == []
        return
    assert node.rec is not None and node.rec.status == Status.EXITED
    assert len(ends) == 1
    end = ends[0]
    assert end.reason == (node.requests[0] if node.requests else "")
    expected = {"natural": natural_code, "term": 143, "kill": 137}[node.ended_by]
    assert end.exit_code == expected
    if grace > 0:
        assert node.instructions.count(Kill()) <= node.grace_fired
    rec, ins = step(node.rec, lc.ForgetRequested(), grace=grace)
    assert rec is None and lc.Forget() in ins
