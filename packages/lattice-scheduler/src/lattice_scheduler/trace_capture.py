"""Trace capture for RM-Replay (``scheduling.trace_capture: true``).

The scheduler appends one JSON line per submission and per end it sees on the
watch-state stream, in the trace format RM-Replay reads:

* ``{"ts", "type": "submit", "alloc": {...}}`` when an allocation first appears;
* ``{"ts", "type": "cancel", "alloc_id"}`` when it ends Cancelled without ever having
  started (``started_at`` None; also after a preemption put it back in the queue):
  the user withdrew it, and the replay removes it from its queue at ``ts`` (the
  allocation's ``finished_at``, or when the capture saw it when that is unset; never
  before its submission). Written only for allocations whose submit line is in the
  file, since RM-Replay rejects a cancel of an allocation its trace never submits
  (one queued before capture began has no outcome worth replaying);
* ``{"ts", "type": "complete", "alloc_id", "duration", "exit"}`` for every other end
  (Completed, Failed, or Cancelled while running): ``duration`` = the time it ran,
  ``exit`` = its exit code, else 0 for Completed and 1 otherwise.

Allocations that already existed when the stream started are not logged again, so a
restart never duplicates events (what happened while the scheduler was down is
missed). The submit lines already in the file (from before a restart) are read when
the capture opens it, so that a later cancel of such an allocation is still written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from lattice_common.types import Allocation, AllocationState
from lattice_common.watch import StateDelta

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


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


def cancel_line(a: Allocation, observed_at: float) -> dict[str, Any]:
    """The cancel of an allocation that never started: at ``finished_at``, else at
    ``observed_at``; never before its submission (a trace may not cancel earlier)."""
    ts = a.finished_at if a.finished_at is not None else observed_at
    return {"ts": max(ts, a.submitted_at), "type": "cancel", "alloc_id": a.id}


def cancelled_before_start(a: Allocation) -> bool:
    return a.state == AllocationState.CANCELLED and a.started_at is None


def _logged_submits(path: Path) -> set[str]:
    """Ids of the submit lines already in ``path`` (unreadable lines are skipped)."""
    ids: set[str] = set()
    try:
        with path.open("rb") as f:
            for raw in f:
                if b'"submit"' not in raw:
                    continue
                try:
                    obj = _dec.decode(raw)
                except msgspec.DecodeError:
                    continue
                if not isinstance(obj, dict) or obj.get("type") != "submit":
                    continue
                alloc = obj.get("alloc")
                aid = alloc.get("id") if isinstance(alloc, dict) else None
                if aid is None:
                    aid = obj.get("alloc_id")
                if isinstance(aid, str):
                    ids.add(aid)
    except FileNotFoundError:
        pass
    return ids


class TraceCapture:
    def __init__(
        self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._submitted: set[str] = set()
        self._completed: set[str] = set()
        # allocations whose submit line is in the file (a cancel needs one)
        self._logged: set[str] = _logged_submits(self.path)

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
                self._logged.add(a.id)
                lines.append(submit_line(a))
            if a.terminal and a.id not in self._completed:
                self._completed.add(a.id)
                if not cancelled_before_start(a):
                    lines.append(complete_line(a))
                elif a.id in self._logged:
                    lines.append(cancel_line(a, self.clock()))
        if lines:
            with self.path.open("ab") as f:
                f.write(b"".join(_enc.encode(x) + b"\n" for x in lines))
        return len(lines)
