"""Counts; on SIGUSR1 saves its counter to $LATTICE_CHECKPOINT_DIR and creates the
sentinel file (the signal protocol); on LATTICE_RESUME continues from the saved counter."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _counter import SLOW, options, save, say, start_value

asked = False


def on_usr1(signum: int, frame: object) -> None:
    global asked
    asked = True


def main() -> None:
    limit, step, mode = options()
    signal.signal(signal.SIGUSR1, on_usr1 if mode != "hang" else signal.SIG_IGN)
    n = start_value()
    global asked
    while n < limit:
        n += 1
        say(f"count {n}")
        time.sleep(step)
        if asked:
            asked = False
            save(n, os.environ["LATTICE_CHECKPOINT_DIR"], slow=SLOW if mode == "slow" else 0.0)
            Path(os.environ["LATTICE_CHECKPOINT_SENTINEL"]).touch()
            say(f"checkpointed at {n}")
    say(f"finished at {n}")


if __name__ == "__main__":
    main()
