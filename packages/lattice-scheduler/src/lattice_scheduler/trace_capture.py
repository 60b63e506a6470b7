"""Trace capture for RM-Replay (``scheduling.trace_capture: true``).

The scheduler appends one JSON line per submission and per completion it sees on the
watch-state stream, in the trace format RM-Replay reads (``{"ts", "type": "submit",
"alloc": {...}}`` and ``{"ts", "type": "complete", "alloc_id", "duration", "exit"}``).
Allocations that already existed when the stream started are not logged again, so a
restart never duplicates events (what happened while the scheduler was down is missed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
from lattice_common.types import Allocation, AllocationState
from lattice_common.watch import StateDelta

_enc = msgspec.json.Encoder()


def submit_line(a: Allocation) -> dict[str, Any]:
    c = a.spec.constraints
    alloc: dict[str, Any] = {
        "id": a.id,
        "tenant": a.spec.tenant,
        "nodes": a.spec.nodes,
        "priority": a.spec.preemption_class,
        "vcluster": a.spec.vcluster,
    }
    optional = {
        "min_nodes": a.spec.min_nodes,
        "walltime": a.spec.walltime_seconds,
        "gpu_type": c.gpu_type,
        "gpus": c.gpu_count,
        "memory_gb": c.memory_gb,
        "features": list(c.features),
        "topology": c.topology,
        "user": a.spec.user,
        "name": a.spec.name,
    }
    alloc.update({k: v for k, v in optional.items() if v})
    return {"ts": a.submitted_at, "type": "submit", "alloc": alloc}


def complete_line(a: Allocation) -> dict[str, Any]:
    start = a.started_at if a.started_at is not None else a.finished_at or a.submitted_at
    end = a.finished_at if a.finished_at is not None else start
    exit_code = (
        a.exit_code
        if a.exit_code is not None
        else (0 if a.state == AllocationState.COMPLETED else 1)
    )
    return {
        "ts": end,
        "type": "complete",
        "alloc_id": a.id,
        "duration": max(0.0, end - start),
        "exit": exit_code,
    }


class TraceCapture:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._submitted: set[str] = set()
        self._completed: set[str] = set()

    def observe(self, delta: StateDelta) -> int:
        """Record what ``delta`` shows; returns the number of lines written."""
        lines: list[dict[str, Any]] = []
        for a in delta.allocations:
            if delta.snapshot:  # history: remember, do not log
                self._submitted.add(a.id)
                if a.terminal:
                    self._completed.add(a.id)
                continue
            if a.id not in self._submitted:
                self._submitted.add(a.id)
                lines.append(submit_line(a))
            if a.terminal and a.id not in self._completed:
                self._completed.add(a.id)
                lines.append(complete_line(a))
        if lines:
            with self.path.open("ab") as f:
                f.write(b"".join(_enc.encode(x) + b"\n" for x in lines))
        return len(lines)
