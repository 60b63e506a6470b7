"""The checkpoint timeout table as a pure state machine (spec: Preemption Policy,
Checkpoint Timeout Handling):

| Scenario                                   | Action                                   |
| application responds but slow              | extend the timeout by 50 %, once         |
| application unresponsive                   | SIGTERM -> grace -> SIGKILL, Failed      |
| gRPC callback: application requests defer  | grant up to max_deferral, then force     |

"Responds" means the agent saw a sign of life after the request: an estimate or
progress (gRPC callback, shmem progress) or bytes growing in the checkpoint directory
(any protocol). A deferral postpones the request itself: the application is asked again
when it ends, and the timeout starts afresh then; once max_deferral is used up the
request is forced (the application may not defer again).

The shell (``coordinator``) feeds events in with the time they happened and asks
:func:`decide` what to do; nothing here reads a clock.
"""

from __future__ import annotations

import enum

import msgspec

EXTENSION = 0.5
"""The one extension of a responsive application, as a share of the timeout."""


class Action(enum.StrEnum):
    WAIT = "wait"  # nothing to do yet
    ASK_AGAIN = "ask_again"  # a deferral ended: request the checkpoint again
    FAIL = "fail"  # the deadline passed: unresponsive (or slow after the extension)


class Clock(msgspec.Struct, frozen=True, kw_only=True):
    timeout: float
    max_deferral: float
    deadline: float
    extended: bool = False
    responsive: bool = False
    deferred: float = 0.0  # deferral granted so far
    defer_until: float | None = None  # asked to defer: ask again at this time
    forced: bool = False  # no more deferral

    @property
    def deferral_left(self) -> float:
        return max(0.0, self.max_deferral - self.deferred)


def start(now: float, timeout: float, max_deferral: float) -> Clock:
    """The clock of a checkpoint requested at ``now``."""
    return Clock(timeout=timeout, max_deferral=max_deferral, deadline=now + timeout)


def sign_of_life(c: Clock) -> Clock:
    """An estimate or progress after the request: the application is responsive."""
    return c if c.responsive else msgspec.structs.replace(c, responsive=True)


def defer(c: Clock, now: float, seconds: float) -> tuple[Clock, float]:
    """The application asks to be asked again in ``seconds``. Returns the new clock and
    the deferral granted (0: refused, the request is forced and its deadline stands)."""
    grant = min(max(0.0, seconds), c.deferral_left)
    if c.forced or grant <= 0:
        return msgspec.structs.replace(c, forced=True, responsive=True), 0.0
    until = now + grant
    return (
        msgspec.structs.replace(
            c,
            responsive=True,
            deferred=c.deferred + grant,
            defer_until=until,
            # nothing is expected while deferred; the timeout restarts when asked again
            deadline=until + c.timeout,
            forced=c.deferred + grant >= c.max_deferral,
        ),
        grant,
    )


def asked_again(c: Clock, now: float) -> Clock:
    """The request was made again after a deferral: a fresh timeout and extension."""
    return msgspec.structs.replace(
        c, defer_until=None, deadline=now + c.timeout, extended=False, responsive=False
    )


def decide(c: Clock, now: float) -> tuple[Clock, Action]:
    """What to do at ``now``: wait, ask again (a deferral ended), or fail. A responsive
    application past its deadline gets one extension of 50 % of the timeout first."""
    if c.defer_until is not None:
        return c, (Action.ASK_AGAIN if now >= c.defer_until else Action.WAIT)
    if now < c.deadline:
        return c, Action.WAIT
    if c.responsive and not c.extended:
        return (
            msgspec.structs.replace(c, extended=True, deadline=c.deadline + EXTENSION * c.timeout),
            Action.WAIT,
        )
    return c, Action.FAIL
