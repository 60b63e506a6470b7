"""Counts; registers a checkpoint endpoint with the agent (lattice_sdk.checkpoint.serve)
that saves the counter when called; on LATTICE_RESUME continues from the saved counter.
Mode ``defer`` asks for deferral whenever it may (until the agent forces it)."""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _counter import SLOW, options, save, say, start_value
from lattice_sdk import checkpoint

lock = threading.Lock()
n = 0


def main() -> None:
    global n
    limit, step, mode = options()
    n = start_value()

    def on_checkpoint(req: checkpoint.Request) -> None:
        if mode == "hang":
            time.sleep(3600)
        if mode == "slow":
            for i in range(10):
                req.progress((i + 1) / 10)
                time.sleep(SLOW / 10)
        with lock:
            save(n, req.directory)
            say(f"checkpointed at {n} (forced={req.force})")

    def defer(req: checkpoint.Request) -> float:
        if mode != "defer":
            return 0.0
        say(f"deferring (left {req.deferral_left:.1f}s)")
        return 1.0

    checkpoint.serve(on_checkpoint, estimate=1.0, defer=defer)
    say("checkpoint endpoint registered")
    while n < limit:
        with lock:
            n += 1
            say(f"count {n}")
        time.sleep(step)
    say(f"finished at {n}")


if __name__ == "__main__":
    main()
