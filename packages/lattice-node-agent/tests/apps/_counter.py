"""What the checkpoint test applications share: a counter saved into the checkpoint
directory and read back on resume. Every line is flushed so tests can read the log."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

COUNTER = "counter"
SLOW = float(os.environ.get("CKPT_SLOW", "8"))  # seconds a slow checkpoint takes


def say(text: str) -> None:
    print(text, flush=True)


def start_value() -> int:
    """0 on a fresh start; the saved counter when resumed from a checkpoint."""
    if os.environ.get("LATTICE_RESUME") == "1":
        saved = Path(os.environ["LATTICE_CHECKPOINT_PATH"]) / COUNTER
        value = int(saved.read_text())
        say(f"resumed from {value}")
        return value
    say("started fresh")
    return 0


def save(n: int, directory: str | os.PathLike[str], slow: float = 0.0) -> None:
    """Write the counter (taking ``slow`` seconds, in steps, when asked to be slow)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if slow:
        for i in range(10):
            (path / f"part-{i}").write_text("x" * 1000)
            time.sleep(slow / 10)
    (path / COUNTER).write_text(str(n))


def options() -> tuple[int, float, str]:
    """(limit, step seconds, mode) from argv: ``LIMIT [STEP] [MODE]``; mode is
    ``ok`` | ``hang`` (never answers) | ``slow`` (answers, takes long) | ``defer``."""
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    step = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    mode = sys.argv[3] if len(sys.argv) > 3 else "ok"
    return limit, step, mode
