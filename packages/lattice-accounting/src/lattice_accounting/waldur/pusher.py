"""The push loop: every ``push_interval_seconds``, send the buffered events to Waldur in
order; back off while Waldur is slow, down or failing; replay everything once it is back.

Why this module exists: accounting is asynchronous and Waldur's availability must never
matter to scheduling (spec: Accounting via Waldur). :meth:`WaldurPusher.submit` only
appends to the :class:`~lattice_accounting.waldur.buffer.EventBuffer` (memory, or the
disk WAL); :meth:`WaldurPusher.run` drains it. A round pushes events oldest first,
acknowledging each batch as Waldur takes it; the first failure ends the round (later
events wait: order is kept) and the next round comes after an exponential backoff
(``retry_initial_seconds`` doubling up to ``retry_max_seconds``) instead of the
interval. An event Waldur refuses as invalid (a 4xx other than 401/403) is logged,
counted in ``lattice_accounting_events_rejected_total`` and skipped, so that one bad
record cannot hold back the billing of everything after it.

:meth:`WaldurPusher.status` is what ``lattice admin accounting status`` shows:
``buffered`` (memory), ``wal_events`` (disk), ``last_push``, ``last_error``,
``dropped``, and the rest of :class:`PushStatus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from lattice_accounting.waldur.buffer import AppendResult, EventBuffer
from lattice_accounting.waldur.client import WaldurClient, WaldurError, WaldurRejected
from lattice_accounting.waldur.events import AccountingEvent
from lattice_accounting.waldur.metrics import WaldurMetrics

__all__ = ["PushStatus", "WaldurPusher", "backoff_delay"]

log = logging.getLogger("lattice.accounting.waldur.pusher")


def backoff_delay(failures: int, initial: float, maximum: float) -> float:
    """Seconds to wait after ``failures`` consecutive failed rounds (1, 2, 4, ... x
    ``initial``, at most ``maximum``)."""
    if failures <= 0:
        return 0.0
    return min(maximum, initial * (2 ** min(failures - 1, 30)))


@dataclass(frozen=True)
class PushStatus:
    waldur_url: str
    reachable: bool | None  # None: nothing pushed nor tried yet
    buffered: int  # events waiting in memory
    wal_events: int  # events waiting on disk
    disk_alert: bool  # wal_events > disk_buffer_max_events
    dropped: int  # since start (the metric counts them too)
    pushed: int
    rejected: int
    last_push: float | None  # when a round last ended with everything sent
    last_error: str
    last_error_at: float | None
    consecutive_failures: int
    next_attempt_at: float | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class WaldurPusher:
    def __init__(
        self,
        client: WaldurClient,
        buffer: EventBuffer,
        *,
        push_interval_seconds: float = 60.0,
        batch_size: int = 500,
        retry_initial_seconds: float = 1.0,
        retry_max_seconds: float = 300.0,
        metrics: WaldurMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.buffer = buffer
        self.push_interval_seconds = push_interval_seconds
        self.batch_size = batch_size
        self.retry_initial_seconds = retry_initial_seconds
        self.retry_max_seconds = retry_max_seconds
        self.metrics = metrics
        self.clock = clock
        self.pushed = 0
        self.rejected = 0
        self.last_push: float | None = None
        self.last_error = ""
        self.last_error_at: float | None = None
        self.consecutive_failures = 0
        self.next_attempt_at: float | None = None
        self._reachable: bool | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        #: called after every round (the feed moves its durable cursor there)
        self.after_round: list[Callable[[], None]] = []

    # -- input -----------------------------------------------------------------------------

    def submit(self, events: Iterable[AccountingEvent]) -> AppendResult:
        """Queue events (never waits for Waldur)."""
        return self.buffer.append(events)

    def flush_soon(self) -> None:
        """Start the next round now instead of at the end of the interval."""
        self._wake.set()

    # -- pushing ---------------------------------------------------------------------------

    async def push_once(self) -> int:
        """One round: push everything buffered, oldest first. Returns how many events
        Waldur took; raises the :class:`WaldurError` that ended the round early."""
        async with self._lock:
            try:
                return await self._round()
            finally:
                for cb in self.after_round:
                    try:
                        cb()
                    except Exception:
                        log.exception("after-round callback failed")

    async def _round(self) -> int:
        taken = 0
        while True:
            batch = self.buffer.peek(self.batch_size)
            if not batch:
                break
            done = 0  # sequence number of the last event Waldur has
            try:
                for seq, e in batch:
                    try:
                        await self.client.push_event(e)
                    except WaldurRejected as err:
                        self.rejected += 1
                        if self.metrics is not None:
                            self.metrics.rejected.inc()
                        log.error(
                            "Waldur refused accounting event %s (%s %s): %s; skipped",
                            e.event_id,
                            e.type.value,
                            e.allocation_id or ",".join(e.nodes),
                            err.message,
                        )
                    else:
                        taken += 1
                        self.pushed += 1
                        if self.metrics is not None:
                            self.metrics.pushed.inc()
                    done = seq
            except WaldurError as err:
                if done:
                    self.buffer.ack(done)
                self._failed(err)
                raise
            self.buffer.ack(done)
        self._succeeded()
        return taken

    def _succeeded(self) -> None:
        now = self.clock()
        if self.consecutive_failures:
            log.info(
                "Waldur reachable again after %d failed round(s); buffered events replayed",
                self.consecutive_failures,
            )
        self.last_push = now
        self.consecutive_failures = 0
        self._reachable = True
        if self.metrics is not None:
            self.metrics.last_push.set(now)

    def _failed(self, err: WaldurError) -> None:
        self.consecutive_failures += 1
        self.last_error = err.message
        self.last_error_at = self.clock()
        self._reachable = False
        if self.metrics is not None:
            self.metrics.push_errors.labels(kind=err.kind).inc()
        # one line per outage at warning level, the repeats at debug
        level = logging.WARNING if self.consecutive_failures == 1 else logging.DEBUG
        log.log(
            level,
            "accounting push to Waldur failed (%s): %s; %d event(s) buffered in memory, "
            "%d on disk; retrying with backoff",
            err.kind,
            err.message,
            self.buffer.buffered,
            self.buffer.wal_events,
        )

    def next_delay(self) -> float:
        if self.consecutive_failures:
            return backoff_delay(
                self.consecutive_failures, self.retry_initial_seconds, self.retry_max_seconds
            )
        return self.push_interval_seconds

    async def run(self) -> None:
        """Push forever (cancel to stop). A failed round waits the backoff delay, a
        successful one the push interval; :meth:`flush_soon` cuts the wait short."""
        while True:
            try:
                await self.push_once()
            except WaldurError:
                pass  # recorded by _failed; the backoff applies
            except Exception as e:  # a disk error, a bug: keep the loop, back off
                self.consecutive_failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self.last_error_at = self.clock()
                log.exception("accounting push round failed")
            delay = self.next_delay()
            self.next_attempt_at = self.clock() + delay
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    # -- status ----------------------------------------------------------------------------

    def status(self) -> PushStatus:
        b = self.buffer
        return PushStatus(
            waldur_url=self.client.base,
            reachable=self._reachable,
            buffered=b.buffered,
            wal_events=b.wal_events,
            disk_alert=b.disk_alert,
            dropped=b.dropped,
            pushed=self.pushed,
            rejected=self.rejected,
            last_push=self.last_push,
            last_error=self.last_error,
            last_error_at=self.last_error_at,
            consecutive_failures=self.consecutive_failures,
            next_attempt_at=self.next_attempt_at,
        )
