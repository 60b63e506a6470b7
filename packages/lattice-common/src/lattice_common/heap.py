"""The cyclic garbage collector in processes that hold a large, long-lived state.

A quorum member holding 100,000 allocations and 10,000 nodes has over a million objects
the collector tracks (records and their lists). CPython's full collection walks every
one of them: about 0.25 s here, during which the process holds the GIL and neither
commits, answers heartbeats nor sends Raft heartbeats (a pause longer than the election
timeout deposes a leader). The records are long-lived and form no reference cycles, so
walking them finds nothing.

:class:`HeapKeeper` keeps them out of the walk: when a full collection took at least
``freeze_after_s`` of CPU, what survived it (garbage-free at that moment) is moved to
the permanent generation (``gc.freeze``, O(1)), right as the collection ends. Later full
collections walk only what was made since, so their pause stays near ``freeze_after_s``
instead of growing with the state. Frozen objects are still freed by their reference
counts (a replaced record goes at once); only a reference cycle that was alive at a
freeze and dies later is never collected, which bounds the cost to what was in flight at
each freeze (``lattice_gc_frozen_objects`` shows the total). ``freeze()`` also runs
right after a full state load (a Raft dump, a large watch snapshot).

Every collection's pause is observed in ``lattice_gc_pause_seconds`` by generation.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

GC_PAUSE = Histogram(
    "lattice_gc_pause_seconds",
    "Time the cyclic garbage collector held the process, by generation (2 = full)",
    ["generation"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
GC_FROZEN = Gauge(
    "lattice_gc_frozen_objects",
    "Objects kept out of the collector's full walks (gc.freeze), long-lived state",
)
GC_LONGEST_FULL = Gauge(
    "lattice_gc_longest_full_pause_seconds",
    "The longest full collection (generation 2) since the process started",
)
GC_FREEZES = Counter("lattice_gc_freezes_total", "Times the surviving heap was frozen")

FREEZE_AFTER_S = 0.02
"""CPU time of a full collection from which its survivors are frozen (about 80,000
tracked objects on a 2020s server core)."""


class HeapKeeper:
    """One per process (``keeper()``): the collector's callbacks and the freeze policy."""

    def __init__(self, *, freeze_after_s: float = FREEZE_AFTER_S) -> None:
        self.freeze_after_s = freeze_after_s
        self.full_collections = 0
        self.longest_full_s = 0.0
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._installed = False

    def install(self) -> HeapKeeper:
        """Observe every collection from now on and apply the policy (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
            GC_FROZEN.set_function(gc.get_freeze_count)
            GC_LONGEST_FULL.set_function(lambda: self.longest_full_s)
        return self

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collection, on whichever thread triggered it. At "stop" the
        # generations are consistent again, so freezing there is safe (it only splices
        # the generation lists onto the permanent one).
        if phase == "start":
            self._t0 = time.perf_counter()
            self._cpu0 = time.thread_time()
            return
        took = time.perf_counter() - self._t0
        generation = info.get("generation", 0)
        GC_PAUSE.labels(str(generation)).observe(took)
        if generation != 2:
            return
        self.full_collections += 1
        self.longest_full_s = max(self.longest_full_s, took)
        # CPU, not wall time: a busy machine must not make it freeze more often
        if time.thread_time() - self._cpu0 >= self.freeze_after_s:
            self.freeze()

    def freeze(self) -> None:
        freeze()


def freeze() -> None:
    """Move every object tracked now out of the full walks (O(1)): call it right after a
    large state was built, when what is alive is mostly that state. Needs no keeper."""
    gc.freeze()
    GC_FREEZES.inc()


_KEEPER: HeapKeeper | None = None


def keeper() -> HeapKeeper:
    """This process's keeper, installed (daemons: ``process.daemon_main``)."""
    global _KEEPER
    if _KEEPER is None:
        _KEEPER = HeapKeeper().install()
    return _KEEPER
