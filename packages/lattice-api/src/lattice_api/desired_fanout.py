"""Desired-state fan-out: one quorum subscription for all of a member's agent streams.

Every agent keeps a ``WatchDesiredState`` stream open, so a member holds one per node
(10,000 at scale). Subscribing each stream to the quorum separately costs a full state
snapshot per stream and a decode of every delta per stream: work proportional to
streams x state size on every change. Here a single subscription decodes each delta
once, works out which nodes it touches (nodes changed, nodes an allocation is assigned
to) and wakes only those nodes' streams; a snapshot or a state reset wakes them all.
A woken stream reads its node's desired set (one lookup) and sends it if it changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from lattice_common.watch import StateDelta, decode_delta
from lattice_quorum.queries import DesiredSet
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter

log = logging.getLogger("lattice.api.desired")

SENT = Counter(
    "lattice_api_desired_state_sent_total",
    "Desired sets sent to node agents (a start, an end, a change to their work)",
)
UNCHANGED = Counter(
    "lattice_api_desired_state_unchanged_total",
    "Looks at a node's desired set after a change touching the node that found the "
    "agent's work as already sent (e.g. the node's next allocation queued): not sent",
)


def touched_nodes(d: StateDelta) -> set[str]:
    """The nodes whose desired set a delta may change: the nodes it carries and those
    its allocations are assigned to."""
    out = {n.id for n in d.nodes}
    for a in d.allocations:
        out.update(a.assigned_nodes)
    return out


class _Waiter:
    __slots__ = ("event", "node_id")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.event = asyncio.Event()
        self.event.set()  # the first look is always due


class DesiredFanout:
    """Wakes the desired-state streams of the nodes each applied change touches."""

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self._by_node: dict[str, set[_Waiter]] = {}
        self._count = 0
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None

    @property
    def streams(self) -> int:
        return self._count

    def _ensure_subscribed(self) -> None:
        if self._pump is not None and not self._pump.done():
            return
        # raises Unavailable while this member is not caught up, to the stream opening
        self._queue = self.quorum.subscribe()
        self._failed = None
        self._pump = asyncio.create_task(self._run(self._queue), name="desired-fanout")

    def _wake_all(self) -> None:
        for waiters in self._by_node.values():
            for w in waiters:
                w.event.set()

    async def _run(self, q: asyncio.Queue[bytes | None]) -> None:
        first = True
        try:
            while True:
                raw = await q.get()
                if raw is None:  # the state was replaced: subscribe afresh, look again
                    self.quorum.unsubscribe(q)
                    q = self._queue = self.quorum.subscribe()
                    first = True
                    self._wake_all()
                    continue
                if first:  # the snapshot: every stream looks (they just did, or will)
                    first = False
                    self._wake_all()
                    continue
                d = decode_delta(raw)
                if d.snapshot:
                    self._wake_all()
                    continue
                by_node = self._by_node
                for node_id in touched_nodes(d):
                    waiters = by_node.get(node_id)
                    if waiters:
                        for w in waiters:
                            w.event.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # e.g. not caught up any more: the streams end, agents retry
            log.warning("desired-state fan-out stopped: %s", e)
            self._failed = e
            self._wake_all()
        finally:
            self.quorum.unsubscribe(q)

    def _add(self, w: _Waiter) -> None:
        self._by_node.setdefault(w.node_id, set()).add(w)
        self._count += 1

    def _remove(self, w: _Waiter) -> None:
        waiters = self._by_node.get(w.node_id)
        if waiters is not None:
            waiters.discard(w)
            if not waiters:
                del self._by_node[w.node_id]
        self._count -= 1
        if self._count == 0 and self._pump is not None:
            self._pump.cancel()  # nothing to feed: drop the subscription
            self._pump = None

    async def watch(
        self,
        node_id: str,
        read: Callable[[str], DesiredSet],
        *,
        known_generation: int = 0,
        generation: Callable[[str], int] | None = None,
    ) -> AsyncIterator[DesiredSet]:
        """``read(node_id)``, the node's desired set, now and after every change that
        touches the node, skipping repeats of the same content (``DesiredSet.content``:
        a change to the node alone, such as its next allocation, is not sent).

        ``known_generation``: the generation the agent already applied (a reconnecting
        stream, e.g. after a leader change). While the node's ``generation(node_id)``
        is still that one, its set is the one the agent has and is not sent again: after
        a failover every agent reconnects at once, and re-sending each its allocations
        would keep the new leader busy for seconds."""
        self._ensure_subscribed()
        w = _Waiter(node_id)
        self._add(w)
        try:
            last: object = None
            skip = known_generation if known_generation > 0 and generation is not None else 0
            while True:
                await w.event.wait()
                w.event.clear()
                if self._failed is not None:
                    raise self._failed
                if skip:
                    assert generation is not None
                    if generation(node_id) == skip:
                        continue  # unchanged since the agent's copy: nothing to send
                    skip = 0
                desired = read(node_id)
                key = desired.content()
                if key == last:
                    UNCHANGED.inc()
                    continue
                last = key
                SENT.inc()
                yield desired
        finally:
            with contextlib.suppress(Exception):
                self._remove(w)


__all__ = ["DesiredFanout", "touched_nodes"]
