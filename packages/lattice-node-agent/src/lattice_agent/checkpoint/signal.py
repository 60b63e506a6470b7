"""The signal protocol (spec: "Signal-based (legacy compatibility)"): SIGUSR1 to the
application's process group; the application writes its checkpoint into
$LATTICE_CHECKPOINT_DIR and then creates the sentinel file $LATTICE_CHECKPOINT_SENTINEL
(``CHECKPOINT_DONE`` in that directory) to say it is complete. The signal carries no
data, so a sign of life is only the checkpoint directory growing (the coordinator
watches it for every protocol).

SIGUSR1's default action ends a process, and the whole group gets it: an application
that has not installed its handler yet (a hint seconds after the start) or a process
that never will (a shell that runs the application as its child, ``tee``) would be
killed by a checkpoint request. So the signal is held back while any process of the
group would die of it, and sent at the first poll after they all catch or ignore it; a
group that never does gets no signal, and the request times out as for an application
that does not answer (the job runs on; a preemption then stops it as usual)."""

from __future__ import annotations

import logging
import signal as _signal
from collections.abc import Callable
from pathlib import Path

from lattice_agent.checkpoint.base import Poll
from lattice_agent.checkpoint.paths import SENTINEL_NAME

log = logging.getLogger("lattice.agent.checkpoint")


class SignalProtocol:
    def __init__(
        self,
        send: Callable[[int], bool],
        unprepared: Callable[[int], list[int]] = lambda _signum: [],
        name: str = "",
    ) -> None:
        """``send(signum)`` signals the allocation's process group (False: it is gone);
        ``unprepared(signum)``: the pids of the group that the signal would end."""
        self._send = send
        self._unprepared = unprepared
        self._name = name
        self._sentinel: Path | None = None
        self._error = ""
        self._held = False  # asked, not sent yet: some process would die of it
        self._said = False

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
        self._held = True
        self._deliver()

    def _deliver(self) -> None:
        pids = self._unprepared(_signal.SIGUSR1)
        if pids:
            if not self._said:
                self._said = True
                log.info(
                    "allocation %s: checkpoint signal held back: SIGUSR1 would end pid %s "
                    "(it does not catch it, yet). Hint: the application installs its "
                    "handler at start and runs as the job's only process (exec it from a "
                    "script, or trap USR1 in the script)",
                    self._name,
                    ", ".join(str(p) for p in pids[:5]),
                )
            return
        self._held = False
        if not self._send(_signal.SIGUSR1):
            self._error = "the process group is gone"

    def poll(self) -> Poll:
        if self._held:
            self._deliver()
        done = self._sentinel is not None and self._sentinel.exists()
        return Poll(done=done, error="" if done else self._error)

    async def close(self) -> None:
        return None
