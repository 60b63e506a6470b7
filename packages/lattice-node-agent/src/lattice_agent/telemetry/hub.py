"""What the telemetry loop hands to live watchers (``lattice watch``): every collection,
every closed window's means, and the threshold alerts, per allocation.

:class:`MetricsHub` is fed by :class:`~lattice_agent.telemetry.loop.TelemetryLoop` on the
event loop (``sync`` the allocations running here, then ``reading`` per collection, then
``windows`` with the samples of the windows that closed) and evaluates the alert rules
(:mod:`~lattice_agent.telemetry.alerts`) on every reading, whatever the telemetry mode.
Watchers ``subscribe`` to one allocation and read :class:`Update` records; which of them a
watcher passes on (raw collections in debug mode, window means otherwise) is its own
business (:mod:`~lattice_agent.telemetry.watch`), so a mode switch takes effect on open
streams. A watcher that falls behind loses its oldest updates, never the loop's time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter

from lattice_agent.telemetry.alerts import (
    DEFAULT_RULES,
    FIRING,
    AlertEvent,
    AlertRule,
    RuleState,
    active,
    step,
)
from lattice_agent.telemetry.samples import Reading, Sample, series_key

log = logging.getLogger("lattice.agent.telemetry")

__all__ = ["ALERTS", "MetricsHub", "Subscription", "Update"]

ALERTS = Counter(
    "lattice_agent_telemetry_alerts_total",
    "Threshold alerts raised by this agent (telemetry.alert_rules)",
    ["rule"],
)

RAW, WINDOW, ALERT, END = "raw", "window", "alert", "end"


@dataclass(frozen=True)
class Update:
    """One thing a watcher of an allocation learns: a collection (``raw``, with the
    allocation's telemetry ``mode`` at that moment), a closed window's means
    (``window``, stamped with its end, ``window`` seconds long), alerts that fired or
    resolved (``alert``), or that the allocation left the node (``end``)."""

    kind: str
    at: float
    values: Mapping[str, float] = field(default_factory=dict)
    mode: str = ""
    window: float = 0.0
    alerts: tuple[AlertEvent, ...] = ()


class Subscription:
    """The updates of one allocation for one watcher, in order; at most ``maxlen`` are
    kept (the oldest go first)."""

    def __init__(self, hub: MetricsHub, alloc_id: str, maxlen: int = 512) -> None:
        self.hub = hub
        self.alloc_id = alloc_id
        self.maxlen = maxlen
        self.dropped = 0
        self._items: deque[Update] = deque()
        self._ready = asyncio.Event()

    def put(self, update: Update) -> None:
        if len(self._items) >= self.maxlen:
            self._items.popleft()
            self.dropped += 1
        self._items.append(update)
        self._ready.set()

    async def get(self, timeout: float | None = None) -> Update | None:
        """The next update; None when none came within ``timeout`` seconds."""
        while not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return None
        return self._items.popleft()

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsHub:
    """Alert state and watchers of the allocations running on one node (see the module
    docstring). ``rules`` are the node's alert rules (default: the specification's)."""

    def __init__(self, rules: Sequence[AlertRule] = DEFAULT_RULES) -> None:
        self.rules = tuple(rules)
        self.live: set[str] = set()
        self._state: dict[str, dict[str, RuleState]] = {}
        self._subs: dict[str, set[Subscription]] = {}

    # --- watchers ---------------------------------------------------------------------

    def subscribe(self, alloc_id: str, maxlen: int = 512) -> Subscription:
        sub = Subscription(self, alloc_id, maxlen)
        self._subs.setdefault(alloc_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.alloc_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.alloc_id]

    def watchers(self, alloc_id: str) -> int:
        return len(self._subs.get(alloc_id, ()))

    def _publish(self, alloc_id: str, update: Update) -> None:
        for sub in list(self._subs.get(alloc_id, ())):
            sub.put(update)

    def active(self, alloc_id: str) -> list[AlertEvent]:
        """The alerts firing for ``alloc_id`` now."""
        return active(self.rules, self._state.get(alloc_id, {}))

    # --- fed by the telemetry loop ----------------------------------------------------

    def sync(self, live: Iterable[str], at: float) -> None:
        """The allocations running here now; those that left are forgotten and their
        watchers told (``end``)."""
        live = set(live)
        for gone in self.live - live:
            self._state.pop(gone, None)
            self._publish(gone, Update(END, at))
        self.live = live

    def reading(self, reading: Reading, mode: str) -> list[AlertEvent]:
        """One collection of one allocation: evaluate the rules, tell the watchers;
        returns the alerts that fired or resolved."""
        aid = reading.alloc_id
        state, events = step(self.rules, self._state.get(aid, {}), reading.values, reading.at)
        if state:
            self._state[aid] = state
        else:
            self._state.pop(aid, None)
        for ev in events:
            if ev.state == FIRING:
                ALERTS.labels(ev.rule).inc()
            log.info(
                "allocation %s: alert %s %s (%s = %s): %s",
                aid,
                ev.rule,
                ev.state,
                ev.metric,
                f"{ev.value:g}",
                ev.message,
            )
        if aid in self._subs:  # nobody watching: nothing to hand out
            self._publish(aid, Update(RAW, reading.at, reading.values, mode=mode))
            if events:
                self._publish(aid, Update(ALERT, reading.at, alerts=tuple(events)))
        return events

    def windows(self, samples: Iterable[Sample], window: float) -> None:
        """The samples of the windows that closed: each allocation's means go to its
        watchers, one update per window."""
        if not self._subs:
            return
        means: dict[tuple[str, int], dict[str, float]] = {}
        for s in samples:
            labels = dict(s.labels)
            aid = labels.get("alloc_id", "")
            if labels.get("agg") != "mean" or aid not in self._subs:
                continue
            if math.isfinite(s.value):
                key = series_key(s.name, labels.get("gpu"))
                means.setdefault((aid, s.timestamp_ms), {})[key] = s.value
        for (aid, ts), values in sorted(means.items(), key=lambda kv: kv[0][1]):
            self._publish(aid, Update(WINDOW, ts / 1000.0, values, window=window))
