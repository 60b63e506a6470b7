"""Counts; polls the shared-memory flag (lattice_sdk.checkpoint.shmem) and saves its
counter when asked; on LATTICE_RESUME continues from the saved counter."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _counter import SLOW, options, save, say, start_value
from lattice_sdk import checkpoint


def main() -> None:
    limit, step, mode = options()
    n = start_value()
    with checkpoint.shmem() as flag:
        while n < limit:
            n += 1
            say(f"count {n}")
            time.sleep(step)
            if flag.requested() and mode != "hang":
                if mode == "slow":  # progress through the flag: responsive, but slow
                    for i in range(10):
                        flag.progress((i + 1) / 10)
                        time.sleep(SLOW / 10)
                save(n, checkpoint.directory())
                flag.done()
                say(f"checkpointed at {n}")
    say(f"finished at {n}")


if __name__ == "__main__":
    main()
