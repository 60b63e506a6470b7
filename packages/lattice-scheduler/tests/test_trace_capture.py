"""Captured traces are what RM-Replay reads: submissions and completions, no duplicates."""

from __future__ import annotations

from pathlib import Path

import msgspec
from lattice_common.types import AllocationState
from lattice_common.watch import StateDelta
from lattice_scheduler.trace_capture import TraceCapture
from lattice_test_harness import builders as b


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
    lines = [msgspec.json.decode(x) for x in (tmp_path / "trace.jsonl").read_bytes().splitlines()]
    assert lines[0]["type"] == "submit" and lines[0]["alloc"]["gpu_type"] == "H100"
    assert lines[0]["alloc"]["nodes"] == 2 and lines[0]["ts"] == 100.0
    assert lines[1] == {
        "ts": 170.0,
        "type": "complete",
        "alloc_id": "a1",
        "duration": 60.0,
        "exit": 0,
    }


def test_rm_replay_reads_a_captured_trace(tmp_path: Path) -> None:
    from rm_replay.trace import load_trace

    cap = TraceCapture(tmp_path / "t.jsonl")
    cap.observe(StateDelta(revision=1, snapshot=True))
    a = b.allocation(id="x", submitted_at=1_772_323_200.0, walltime_seconds=3600)
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
