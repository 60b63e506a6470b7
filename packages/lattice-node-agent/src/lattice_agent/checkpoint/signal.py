"""The signal protocol (spec: "Signal-based (legacy compatibility)"): SIGUSR1 to the
application's process group; the application writes its checkpoint into
$LATTICE_CHECKPOINT_DIR and then creates the sentinel file $LATTICE_CHECKPOINT_SENTINEL
(``CHECKPOINT_DONE`` in that directory) to say it is complete. The signal carries no
data, so a sign of life is only the checkpoint directory growing (the coordinator
watches it for every protocol).

"The application's process group": every process of the job that catches SIGUSR1
gets it, and only those. The group signal itself would end every process that has the
default action (a script's shell waiting for its program, ``tee``, an application seconds
after its start, before it installs its handler) and would be lost in the trap of the
agent's own wrapper and entrypoint shell. So the signal is held back until a process of
the job other than those catches it (``SigCgt`` in /proc), then sent to each process that
does. A job in which nothing ever catches it gets no signal, and the request times out as
for an application that does not answer (the job runs on; a preemption then stops it as
usual); that is logged once, with a Hint. Without /proc the group is signalled."""

from __future__ import annotations

import logging
import signal as _signal
from collections.abc import Callable, Iterable
from pathlib import Path

from lattice_agent.checkpoint.base import Poll
from lattice_agent.checkpoint.paths import SENTINEL_NAME
from lattice_agent.procgroup import SignalDisposition

log = logging.getLogger("lattice.agent.checkpoint")


class SignalProtocol:
    def __init__(
        self,
        send_group: Callable[[int], bool],
        disposition: Callable[[int], SignalDisposition],
        send_to: Callable[[Iterable[int], int], int],
        name: str = "",
    ) -> None:
        """``send_group(signum)`` signals the allocation's process group (False: it is
        gone); ``disposition(signum)``: what the signal would do to its processes now;
        ``send_to(pids, signum)`` signals those of them still in the group (how many)."""
        self._send_group = send_group
        self._disposition = disposition
        self._send_to = send_to
        self._name = name
        self._sentinel: Path | None = None
        self._error = ""
        self._held = False  # asked, not sent yet: no process of the job catches it
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
        d = self._disposition(_signal.SIGUSR1)
        if not d.known:
            self._held = False
            if not self._send_group(_signal.SIGUSR1):
                self._error = "the process group is gone"
            return
        if d.catching and self._send_to(d.catching, _signal.SIGUSR1):
            self._held = False
            return
        if not self._said:
            self._said = True
            log.info(
                "allocation %s: checkpoint signal held back: no process of the job catches "
                "SIGUSR1 yet. Hint: the application installs its SIGUSR1 handler at start "
                "(a script traps USR1 itself)",
                self._name,
            )

    def poll(self) -> Poll:
        if self._held:
            self._deliver()
        done = self._sentinel is not None and self._sentinel.exists()
        return Poll(done=done, error="" if done else self._error)

    async def close(self) -> None:
        return None
