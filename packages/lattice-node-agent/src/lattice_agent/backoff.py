"""Reconnect delays for the agent's streams to the quorum.

After a leader failover every agent of the site loses its desired-state stream and its
heartbeat at the same instant; a fixed retry delay brings them all back in the same
instant again (10,000 reconnects in one burst against a member that has just become
leader). A delay that grows while the failures go on and is jittered (a random factor
of 0.5 to 1.5) spreads them over seconds; the first success resets it. The agent caps
it by its heartbeat interval: a node must never go silent for longer than a missed
heartbeat or two because of it (the quorum would declare it lost and requeue its work).
"""

from __future__ import annotations

import random
from collections.abc import Callable

FIRST_DELAY = 0.2
MAX_DELAY = 8.0


class Backoff:
    """``next()`` gives the delay before the next try; ``reset()`` after a success.
    The step starts at ``first`` (at most ``limit``) and doubles up to ``limit``; each
    delay is the step times 0.5 to 1.5."""

    def __init__(
        self,
        first: float = FIRST_DELAY,
        limit: float = MAX_DELAY,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not (first > 0 and limit > 0):
            raise ValueError(f"backoff delays must be positive, got {first} and {limit}")
        self.first = min(first, limit)
        self.limit = limit
        self.rand = rand
        self._base = self.first

    def next(self) -> float:
        delay = self._base * (0.5 + self.rand())
        self._base = min(self._base * 2, self.limit)
        return delay

    def reset(self) -> None:
        self._base = self.first


__all__ = ["FIRST_DELAY", "MAX_DELAY", "Backoff"]
