"""Allocation logs for the API: live from the agent of the allocation's head node over
NodeAgentService.StreamLogs (its ring buffer, then its log files), history from the log
store (lattice_common.logstore) that agents flush into.

Which source answers:

* an allocation that has ended and whose output is complete in the store: the store
  only (the node, its agent or its files may be gone);
* a running one: the store's history, then the agent's lines that came after it. Both
  carry the same timestamps (the agent stamps a line when it reads it and ships it with
  that stamp), so the join is exact: per stream and node, an agent line comes after the
  stored ones when its timestamp is later, or equal and beyond the count of stored lines
  with that timestamp;
* an ended one whose store copy is incomplete (the final flush failed): the agent, and
  the store when the agent cannot answer or has nothing;
* the agent unreachable (node lost, agent down): the store. ``follow`` then polls the
  store for new chunks and goes back to the agent when it answers again; it ends when the
  allocation has ended and the store has nothing more.

Without a store everything comes from the agent, as before.

Sensitive allocations (a sensitive-reservation vCluster) are read from the sensitive
pool (``storage.sensitive_log_store``, encrypted; the same reader through
lattice_common.logcrypt) and never from the ordinary store; without a sensitive pool
their output is on their nodes only, and a request the agent cannot answer says so.
Once the retention (lattice_api.log_retention) has removed an ended allocation's logs,
a request says that, with the retention that applied, instead of answering nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_common.agents import AgentChannels
from lattice_common.aiter import watched
from lattice_common.assignment import is_sensitive
from lattice_common.errors import NotFound, Unavailable
from lattice_common.logcrypt import LogKeyError
from lattice_common.logstore import (
    LogRead,
    LogStore,
    LogStoreError,
    SeqEnd,
    allocation_logs,
)
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationState, NodeState
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.log_retention import RetentionPolicy, removed_message

log = logging.getLogger("lattice.api.logs")

_STREAM_ORDER = {"stdout": 0, "stderr": 1}
# node states in which the agent is not worth a connection attempt
_AGENT_GONE = (NodeState.DOWN, NodeState.FAILED, NodeState.UNKNOWN)

Line = dict[str, Any]


class _Cursor:
    """How far a reader got, per (stream, node): the timestamp of the last line it
    passed on and how many lines with that timestamp it passed on."""

    def __init__(self, ends: Mapping[tuple[str, str], SeqEnd] | None = None) -> None:
        self.last: dict[tuple[str, str], tuple[float, int]] = {
            k: (e.last_ts, e.at_last_ts) for k, e in (ends or {}).items() if e.last_ts is not None
        }

    def source(self) -> Callable[[Line], bool]:
        """A filter for one pass over a source (an agent stream, a store read), in its
        order: True for a line that comes after the cursor (which then moves on)."""
        seen: dict[tuple[str, str], tuple[float, int]] = {}

        def keep(ln: Line) -> bool:
            key = (ln["stream"], ln["node_id"])
            ts = float(ln["timestamp"])
            prev = seen.get(key)
            count = prev[1] + 1 if prev is not None and prev[0] == ts else 1
            seen[key] = (ts, count)
            last = self.last.get(key)
            if last is not None and (ts < last[0] or (ts == last[0] and count <= last[1])):
                return False
            self.last[key] = (ts, count)
            return True

        return keep

    def floor(self) -> dict[tuple[str, str], float]:
        return {k: ts for k, (ts, _) in self.last.items()}


def _within(ln: Line, since: float | None, until: float | None) -> bool:
    ts = float(ln["timestamp"])
    return (since is None or ts >= since) and (until is None or ts <= until)


def _merge(a: list[Line], b: list[Line]) -> list[Line]:
    """Two time-ordered lists as one (``a`` first on equal timestamps)."""
    if not b:
        return a
    if not a:
        return b
    return list(heapq.merge(a, b, key=lambda ln: float(ln["timestamp"])))


class LogProxy:
    """The LogSource of lattice-server (agent channels shared with task launches)."""

    def __init__(
        self,
        quorum: Quorum,
        agents: AgentChannels,
        store: LogStore | None = None,
        *,
        sensitive_store: LogStore | None = None,
        retention: RetentionPolicy | None = None,
        poll_interval: float = 1.0,
        agent_retry_interval: float = 2.0,
        node_check_interval: float = 5.0,
    ) -> None:
        self.quorum = quorum
        self.agents = agents
        self.store = store
        # sensitive allocations' logs: the encrypted pool (None: on their nodes only)
        self.sensitive_store = sensitive_store
        self.retention = retention
        self.poll_interval = poll_interval  # store polls while the agent is away
        self.agent_retry_interval = agent_retry_interval
        # a quiet live stream checks this often whether the quorum declared the node gone
        self.node_check_interval = node_check_interval

    # ------------------------------------------------------------------ pools

    def _sensitive(self, alloc: Allocation) -> bool:
        v = self.quorum.read(queries.vcluster, alloc.spec.vcluster)
        return v is not None and is_sensitive(alloc, {v.name: v})

    def _store_for(self, alloc: Allocation) -> LogStore | None:
        """The store that holds ``alloc``'s output (never the ordinary one for
        sensitive work)."""
        return self.sensitive_store if self._sensitive(alloc) else self.store

    def _nothing_stored(self, alloc: Allocation) -> None:
        """The store holds nothing for ``alloc``: say why when the retention removed it."""
        if self.retention is None or self._store_for(alloc) is None:
            return
        msg = removed_message(
            alloc, self.retention, sensitive=self._sensitive(alloc), now=time.time()
        )
        if msg is not None:
            raise NotFound(
                msg,
                hint="Output is kept for the retention period after an allocation ends; "
                "keep copies of what you need beyond it.",
            )

    def _agent_failed(self, alloc: Allocation, e: Unavailable) -> Unavailable:
        """The agent could not answer and the store has nothing: for sensitive work
        without a sensitive pool, say that the node is the only copy."""
        if self._sensitive(alloc) and self.sensitive_store is None:
            return Unavailable(
                f"the logs of sensitive allocation {alloc.id} are kept only on its nodes "
                f"(storage.sensitive_log_store is none) and they cannot be read now: "
                f"{e.message}",
                hint="Try again when the node's agent is back; an administrator can "
                "configure storage.sensitive_log_store to keep them encrypted off the node.",
            )
        return e

    # ------------------------------------------------------------------ sources

    def _agent(self, alloc: Allocation) -> tuple[str, v1.NodeAgentServiceStub]:
        self._no_output_yet(alloc)
        head = alloc.assigned_nodes[0]
        node = self.quorum.read(queries.node, head)
        if node is None or not node.agent_address:
            raise Unavailable(f"node {head} has no reachable agent")
        try:
            return head, self.agents.stub(node.agent_address)
        except ValueError as e:
            raise Unavailable(f"node {head} has no reachable agent ({e})") from None

    def _no_output_yet(self, alloc: Allocation) -> None:
        if alloc.state == AllocationState.PENDING or not alloc.assigned_nodes:
            raise NotFound(
                f"allocation {alloc.id} has no output yet ({alloc.state.value})",
                hint="Logs appear once the allocation is running; check `lattice status ID`.",
            )

    def _agent_serves(self, alloc: Allocation, node: str | None) -> bool:
        """Whether the head node's agent may have lines for this request."""
        if alloc.state == AllocationState.PENDING or not alloc.assigned_nodes:
            return False
        return not node or node == alloc.assigned_nodes[0]

    def _agent_gone(self, alloc: Allocation) -> bool:
        n = self.quorum.read(queries.node, alloc.assigned_nodes[0])
        return n is None or not n.agent_address or n.state in _AGENT_GONE

    async def _from_agent(
        self, alloc: Allocation, *, stream: str, tail: int | None, follow: bool
    ) -> AsyncIterator[Line]:
        node_id, stub = self._agent(alloc)
        req = v1.LogRequest(
            allocation_id=alloc.id,
            stream="" if stream == "both" else stream,
            tail=tail if tail is not None else -1,
            follow=follow,
        )
        try:
            async for ln in stub.stream_logs(req):
                yield {
                    "allocation_id": alloc.id,
                    "node_id": ln.node_id or node_id,
                    "stream": ln.stream,
                    "line": ln.line,
                    "timestamp": ln.timestamp,
                }
        except (GRPCError, StreamTerminatedError, OSError) as e:
            raise Unavailable(
                f"could not read logs from node {node_id}: {e}",
                hint="The node's agent may be down; try again when it is back.",
            ) from None

    def _watched(self, alloc: Allocation, lines: AsyncIterator[Line]) -> AsyncIterator[Line]:
        """``lines`` from the agent, given up (Unavailable) once the quorum says its node
        is gone: a lost node's connection may hang rather than break."""

        def check() -> bool:
            now = self.quorum.read(queries.allocation, alloc.id)
            moved = now is None or now.assigned_nodes[:1] != alloc.assigned_nodes[:1]
            if moved or self._agent_gone(alloc):
                raise Unavailable(f"node {alloc.assigned_nodes[0]} is gone")
            return False

        return watched(lines, self.node_check_interval, check)

    async def _stored(
        self,
        alloc: Allocation,
        *,
        stream: str,
        node: str | None,
        since: float | None,
        until: float | None,
        tail: int | None,
        from_ts: Mapping[tuple[str, str], float] | None = None,
    ) -> LogRead | None:
        """What the store holds (None: no store, or it cannot be read now)."""
        store = self._store_for(alloc)
        if store is None:
            return None
        try:
            return await allocation_logs(store, alloc).read(
                stream=stream, node=node, since=since, until=until, tail=tail, from_ts=from_ts
            )
        except LogKeyError as e:  # a configuration error, not an outage: say it
            log.error("log store: reading the logs of %s: %s", alloc.id, e)
            raise Unavailable(
                f"the stored logs of allocation {alloc.id} cannot be decrypted: {e}",
                hint="An administrator must configure the key they were written with "
                "(storage.sensitive_log_key).",
            ) from None
        except (LogStoreError, ValueError) as e:
            log.warning("log store: reading the logs of %s: %s", alloc.id, e)
            return None

    # ------------------------------------------------------------------ LogSource

    async def fetch(
        self,
        alloc: Allocation,
        *,
        tail: int | None = None,
        stream: str = "both",
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
        offset: int = 0,
        limit: int | None = None,
    ) -> list[Line]:
        """The lines of ``stream`` (and ``node``) within [since, until], the last
        ``tail`` of them, then ``offset``/``limit`` (paging)."""
        lines = await self._fetch(
            alloc, tail=tail, stream=stream, node=node, since=since, until=until
        )
        if offset:
            lines = lines[offset:]
        if limit is not None:
            lines = lines[:limit]
        return lines

    async def _fetch(
        self,
        alloc: Allocation,
        *,
        tail: int | None,
        stream: str,
        node: str | None,
        since: float | None,
        until: float | None,
    ) -> list[Line]:
        hist = await self._stored(
            alloc, stream=stream, node=node, since=since, until=until, tail=tail
        )
        stored = [ln.to_dict(alloc.id) for ln in hist.lines] if hist else []
        found = hist is not None and hist.found
        if not found:
            self._nothing_stored(alloc)
        if not self._agent_serves(alloc, node):
            if not found:
                self._no_output_yet(alloc)
            return stored
        if alloc.terminal and found and hist is not None and hist.complete:
            return stored
        windowed = since is not None or until is not None
        try:
            live = [
                ln
                async for ln in self._from_agent(
                    alloc, stream=stream, tail=None if windowed else tail, follow=False
                )
            ]
        except Unavailable as e:
            if not found:
                raise self._agent_failed(alloc, e) from None
            return stored
        live = [ln for ln in live if _within(ln, since, until)]
        if alloc.terminal:
            # ended, stored copy incomplete: the agent's view (its ring buffer or its
            # files) when it has one, else the store's
            out = live or stored
        else:
            keep = _Cursor(hist.ends if hist else None).source()
            out = _merge(stored, [ln for ln in live if keep(ln)])
        if tail is not None:
            out = out[-tail:] if tail > 0 else []
        return out

    async def follow(
        self,
        alloc: Allocation,
        *,
        tail: int | None = None,
        stream: str = "both",
        follow: bool = True,
        node: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> AsyncIterator[Line]:
        """The history (the last ``tail`` lines), then new lines as they come until the
        allocation has ended and its output is drained (``follow``)."""
        if not follow:
            for ln in await self.fetch(
                alloc, tail=tail, stream=stream, node=node, since=since, until=until
            ):
                yield ln
            return
        hist = await self._stored(
            alloc, stream=stream, node=node, since=since, until=until, tail=tail
        )
        found = hist is not None and hist.found
        if not found:
            self._nothing_stored(alloc)
        if not found and not self._agent_serves(alloc, node):
            self._no_output_yet(alloc)
        if alloc.terminal and not (found and hist is not None and hist.complete):
            # ended: nothing live is coming; the stored copy may be incomplete
            for ln in await self.fetch(
                alloc, tail=tail, stream=stream, node=node, since=since, until=until
            ):
                yield ln
            return
        cursor = _Cursor(hist.ends if hist else None)
        for ln in hist.lines if hist else []:
            yield ln.to_dict(alloc.id)
        if alloc.terminal and found and hist.complete:
            return
        if until is not None and until <= time.time():
            return  # nothing live can fall into the window
        # history came from the store: the agent's whole ring buffer, joined at the cursor
        agent_tail = None if found else tail
        use_agent = self._agent_serves(alloc, node)
        last_try = 0.0
        while True:
            if use_agent:
                last_try = time.monotonic()
                keep = cursor.source()
                try:
                    live = self._from_agent(alloc, stream=stream, tail=agent_tail, follow=True)
                    async for ln in self._watched(alloc, live):
                        if until is not None and float(ln["timestamp"]) > until:
                            return
                        if keep(ln) and _within(ln, since, until):
                            yield ln
                except Unavailable as e:
                    if self._store_for(alloc) is None:
                        raise self._agent_failed(alloc, e) from None
                    log.info("logs of %s: agent unreachable, reading the log store", alloc.id)
                else:
                    # the agent ended the stream: normally the allocation's end
                    now = self.quorum.read(queries.allocation, alloc.id)
                    if now is None or now.terminal or now.state == AllocationState.PENDING:
                        return
                use_agent = False
                agent_tail = None  # from now on the cursor says where to join
            if self._store_for(alloc) is None:
                return
            # the store: what was flushed after the cursor
            got = await self._stored(
                alloc,
                stream=stream,
                node=node,
                since=since,
                until=until,
                tail=None,
                from_ts=cursor.floor(),
            )
            new = 0
            if got is not None:
                keep = cursor.source()
                for sl in got.lines:
                    ln = sl.to_dict(alloc.id)
                    if keep(ln):
                        new += 1
                        yield ln
            now = self.quorum.read(queries.allocation, alloc.id)
            ended = now is None or now.terminal or now.state == AllocationState.PENDING
            if ended and (new == 0 or (got is not None and got.complete)):
                return
            await asyncio.sleep(self.poll_interval)
            if (
                now is not None
                and not ended
                and self._agent_serves(now, node)
                and not self._agent_gone(now)
                and time.monotonic() - last_try >= self.agent_retry_interval
            ):
                alloc = now
                use_agent = True

    async def aclose(self) -> None:
        """Close the agent channels and the log stores."""
        self.agents.close()
        for store in (self.store, self.sensitive_store):
            if store is not None:
                try:
                    await store.close()
                except Exception as e:  # closing must not fail a shutdown
                    log.warning("closing the log store: %s", e)

    def close(self) -> None:
        """Close the agent channels (the log store's client is closed by ``aclose`` or
        with the event loop)."""
        self.agents.close()
        for store in (self.store, self.sensitive_store):
            if store is not None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return
                task = loop.create_task(store.close())
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
