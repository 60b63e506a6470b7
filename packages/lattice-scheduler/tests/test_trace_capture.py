"""Captured traces are what RM-Replay reads: submissions, completions and cancels of
work that never started, no duplicates."""

from __future__ import annotations

from pathlib import Path

import msgspec
from lattice_common.types import AllocationState
from lattice_common.watch import StateDelta
from lattice_scheduler.trace_capture import TraceCapture
from lattice_test_harness import builders as b

T = 1_772_323_200.0  # 2026-03-01T00:00:00Z


def _lines(path: Path) -> list[dict]:
    return [msgspec.json.decode(x) for x in path.read_bytes().splitlines()]


def test_submit_and_complete_lines_are_written_once(tmp_path: Path) -> None:
    cap = TraceCapture(tmp_path / "trace.jsonl")
    old = b.allocation(id="old", submitted_at=10.0)
    assert cap.observe(StateDelta(revision=1, snapshot=True, allocations=[old])) == 0
    a = b.allocation(id="a1", submitted_at=100.0, nodes=2, constraints={"gpu_type": "H100"})
    assert cap.observe(StateDelta(revision=2, allocations=[a])) == 1
    assert cap.observe(StateDelta(revision=3, allocations=[a])) == 0  # seen already
    done = msgspec.structs.replace(
        a, state=AllocationState.COMPLETED, started_at=110.0, finished_at=170.0, exit_code=0
    )
    assert cap.observe(StateDelta(revision=4, allocations=[done])) == 1
    lines = _lines(tmp_path / "trace.jsonl")
    assert lines[0]["type"] == "submit" and lines[0]["alloc"]["gpu_type"] == "H100"
    assert lines[0]["alloc"]["nodes"] == 2 and lines[0]["ts"] == 100.0
    assert lines[1] == {
        "ts": 170.0,
        "type": "complete",
        "alloc_id": "a1",
        "duration": 60.0,
        "exit": 0,
    }


def test_a_cancel_before_start_writes_a_cancel_line(tmp_path: Path) -> None:
    cap = TraceCapture(tmp_path / "t.jsonl", clock=lambda: 500.0)
    cap.observe(StateDelta(revision=1, snapshot=True))
    a = b.allocation(id="a", submitted_at=100.0)
    nb = b.allocation(id="nb", submitted_at=120.0)
    late = b.allocation(id="late", submitted_at=900.0)
    cap.observe(StateDelta(revision=2, allocations=[a, nb, late]))
    gone = msgspec.structs.replace(a, state=AllocationState.CANCELLED, finished_at=150.0)
    assert cap.observe(StateDelta(revision=3, allocations=[gone])) == 1
    assert cap.observe(StateDelta(revision=4, allocations=[gone])) == 0  # once
    # no finished_at: when the capture saw it; never before the submission
    cap.observe(
        StateDelta(
            revision=5,
            allocations=[
                msgspec.structs.replace(nb, state=AllocationState.CANCELLED),
                msgspec.structs.replace(late, state=AllocationState.CANCELLED),
            ],
        )
    )
    assert _lines(tmp_path / "t.jsonl")[3:] == [
        {"ts": 150.0, "type": "cancel", "alloc_id": "a"},
        {"ts": 500.0, "type": "cancel", "alloc_id": "nb"},
        {"ts": 900.0, "type": "cancel", "alloc_id": "late"},
    ]


def test_a_cancel_while_running_keeps_the_complete_line(tmp_path: Path) -> None:
    cap = TraceCapture(tmp_path / "t.jsonl")
    cap.observe(StateDelta(revision=1, snapshot=True))
    a = b.allocation(id="a", submitted_at=100.0)
    cap.observe(StateDelta(revision=2, allocations=[a]))
    stopped = msgspec.structs.replace(
        a, state=AllocationState.CANCELLED, started_at=110.0, finished_at=170.0
    )
    assert cap.observe(StateDelta(revision=3, allocations=[stopped])) == 1
    assert _lines(tmp_path / "t.jsonl")[1] == {
        "ts": 170.0,
        "type": "complete",
        "alloc_id": "a",
        "duration": 60.0,
        "exit": 1,  # no exit code: a failure
    }


def test_a_preempted_job_cancelled_while_requeued_writes_a_cancel_line(tmp_path: Path) -> None:
    # the quorum's requeue clears started_at: in the queue again, it never started
    cap = TraceCapture(tmp_path / "t.jsonl")
    cap.observe(StateDelta(revision=1, snapshot=True))
    a = b.allocation(id="a", submitted_at=100.0)
    cap.observe(StateDelta(revision=2, allocations=[a]))
    cancelled = msgspec.structs.replace(
        a, state=AllocationState.CANCELLED, preempted_count=1, finished_at=400.0
    )
    cap.observe(StateDelta(revision=3, allocations=[cancelled]))
    assert _lines(tmp_path / "t.jsonl")[1] == {"ts": 400.0, "type": "cancel", "alloc_id": "a"}


def test_cancels_need_the_submit_line_in_the_file(tmp_path: Path) -> None:
    """RM-Replay rejects a cancel its trace has no submission for: one queued before
    capture began gets none; after a restart, the submit lines in the file count."""
    path = tmp_path / "t.jsonl"
    cap = TraceCapture(path)
    early = b.allocation(id="early", submitted_at=10.0)  # queued before capture began
    cap.observe(StateDelta(revision=1, snapshot=True, allocations=[early]))
    a = b.allocation(id="a", submitted_at=100.0)
    cap.observe(StateDelta(revision=2, allocations=[a]))
    gone = msgspec.structs.replace(early, state=AllocationState.CANCELLED, finished_at=120.0)
    assert cap.observe(StateDelta(revision=3, allocations=[gone])) == 0
    # the scheduler restarts; "a" is still queued and is cancelled afterwards
    path.write_bytes(path.read_bytes() + b"not json\n")  # a torn line is skipped
    cap = TraceCapture(path)
    cap.observe(StateDelta(revision=4, snapshot=True, allocations=[a]))
    a_gone = msgspec.structs.replace(a, state=AllocationState.CANCELLED, finished_at=200.0)
    assert cap.observe(StateDelta(revision=5, allocations=[a_gone])) == 1
    assert path.read_bytes().splitlines()[-1] == b'{"ts":200.0,"type":"cancel","alloc_id":"a"}'


def test_rm_replay_reads_a_captured_trace(tmp_path: Path) -> None:
    from rm_replay.engine import simulate
    from rm_replay.inventory import inventory_from_mapping
    from rm_replay.metrics import metrics_dict
    from rm_replay.trace import load_trace

    cap = TraceCapture(tmp_path / "t.jsonl")
    cap.observe(StateDelta(revision=1, snapshot=True))
    a = b.allocation(id="x", submitted_at=T, walltime_seconds=3600)
    cap.observe(StateDelta(revision=2, allocations=[a]))
    fin = msgspec.structs.replace(
        a,
        state=AllocationState.COMPLETED,
        started_at=a.submitted_at,
        finished_at=a.submitted_at + 60,
    )
    cap.observe(StateDelta(revision=3, allocations=[fin]))
    events = load_trace(tmp_path / "t.jsonl")
    assert [type(e).__name__ for e in events] == ["SubmitEvent", "CompleteEvent"]
    assert events[0].walltime == 3600 and events[1].duration == 60

    # q and u (unbounded) were cancelled in the queue, r while it ran
    q = b.allocation(id="q", submitted_at=T + 1, walltime_seconds=3600)
    r = b.allocation(id="r", submitted_at=T + 2, walltime_seconds=3600)
    u = b.allocation(id="u", submitted_at=T + 3)
    cap.observe(StateDelta(revision=4, allocations=[q, r, u]))
    cancelled = AllocationState.CANCELLED
    cap.observe(
        StateDelta(
            revision=5,
            allocations=[
                msgspec.structs.replace(q, state=cancelled, finished_at=T + 30),
                msgspec.structs.replace(u, state=cancelled, finished_at=T + 40),
                msgspec.structs.replace(r, state=cancelled, started_at=T + 60, finished_at=T + 90),
            ],
        )
    )
    events = load_trace(tmp_path / "t.jsonl")
    assert [(type(e).__name__, e.id) for e in events[5:]] == [
        ("CancelEvent", "q"),
        ("CancelEvent", "u"),
        ("CompleteEvent", "r"),
    ]
    # one node, as live: x runs first; q and u leave the queue without running, and
    # count for no wait; r runs its 30 s after x
    result = simulate(events, inventory_from_mapping({"node_classes": [{"name": "n", "count": 1}]}))
    jobs = {j.id: j for j in result.jobs}
    assert {k: (j.state, j.start) for k, j in jobs.items()} == {
        "x": ("completed", T),
        "q": ("cancelled", None),
        "r": ("failed", T + 60),
        "u": ("cancelled", None),
    }
    assert (jobs["q"].end, jobs["u"].end, jobs["q"].node_seconds) == (T + 30, T + 40, 0.0)
    m = metrics_dict(result)
    assert (m["jobs"]["cancelled_before_start"], m["wait"]["overall"]["count"]) == (2, 2)
