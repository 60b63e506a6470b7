"""Watching the process table in tests: e.g. that no ssh process ever runs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["NoSsh"]


class NoSsh:
    """While entered, samples /proc every 20 ms; any ssh/rsh/sshd process is recorded
    in ``seen`` (``samples`` counts the passes, so a test can tell it looked)."""

    NAMES = ("ssh", "rsh", "sshd")

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if comm in self.NAMES:
                    self.seen.append(f"{pid}:{comm}")
            self.samples += 1
            time.sleep(0.02)

    def __enter__(self) -> NoSsh:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
