"""The signal protocol (spec: "Signal-based (legacy compatibility)"): SIGUSR1 to the
application's process group; the application writes its checkpoint into
$LATTICE_CHECKPOINT_DIR and then creates the sentinel file $LATTICE_CHECKPOINT_SENTINEL
(``CHECKPOINT_DONE`` in that directory) to say it is complete. The signal carries no
data, so a sign of life is only the checkpoint directory growing (the coordinator
watches it for every protocol)."""

from __future__ import annotations

import signal as _signal
from collections.abc import Callable
from pathlib import Path

from lattice_agent.checkpoint.base import Poll
from lattice_agent.checkpoint.paths import SENTINEL_NAME


class SignalProtocol:
    def __init__(self, send: Callable[[int], bool]) -> None:
        """``send(signum)`` signals the allocation's process group (False: it is gone)."""
        self._send = send
        self._sentinel: Path | None = None
        self._error = ""

    async def request(
        self,
        checkpoint_id: str,
        directory: Path,
        *,
        timeout: float,
        force: bool,
        deferral_left: float,
    ) -> None:
        self._sentinel = directory / SENTINEL_NAME
        if not self._send(_signal.SIGUSR1):
            self._error = "the process group is gone"

    def poll(self) -> Poll:
        done = self._sentinel is not None and self._sentinel.exists()
        return Poll(done=done, error="" if done else self._error)

    async def close(self) -> None:
        return None
