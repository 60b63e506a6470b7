"""Live telemetry of an allocation (spec: Telemetry Streaming, Switching Telemetry Mode):
StreamMetrics (``lattice watch``; ``GET /api/v1/allocations/{id}/metrics/stream``) and the
telemetry mode switch (``lattice telemetry``; AllocationService.Update,
``PATCH /api/v1/allocations/{id}``), both through the agents of the allocation's nodes
(NodeAgentService.StreamMetrics/SetTelemetryMode at their ``agent_address``). Not quorum
state: each agent owns its allocations' telemetry.

**Stream** (:meth:`TelemetryOps.open_stream`): refusals come before anything streams (a
missing or invisible allocation: NotFound; one that is not running: InvalidTransition).
Then one stream per node, merged in arrival order into records of the form
``{allocation_id, event, node_id, timestamp, telemetry_mode, mode_until,
resolution_seconds, state, samples: [{name, node_id, value, unit, timestamp, labels}],
alerts, alert_events: [{rule, metric, node_id, state, value, comparison, threshold,
for_seconds, since, timestamp, severity, message}]}``, ``event`` as the agents send it
(``metrics``, ``mode``, ``alert``; see ``lattice_agent.telemetry.watch``) plus:

* ``node_lost`` when a node's stream breaks, its agent has no address, or the quorum
  declares the node gone (a lost node's connection may hang rather than break); its
  ``alerts`` say why. It is reported once, and the node is retried every
  ``retry_interval`` while the allocation still runs there; ``node_back`` when it
  answers again. One node dropping out never ends the stream;
* ``end`` (once, last) when the allocation has ended or every node's stream ended.

**Mode** (:meth:`TelemetryOps.set_mode`): the owner, a tenant admin of its tenant or a
system admin (``access.check_update``); the allocation must hold nodes (Staging, Running,
Checkpointing). Sent to every node at once; the answer is ``{allocation_id,
telemetry_mode, duration_seconds, until, nodes: [{node, ok, mode, until | error}]}``
(Unavailable when no node took it). Sensitive allocations stay in audit mode (spec: audit
mode for sensitive vClusters): anything else is refused, and every switch and every stream
of a sensitive allocation is recorded in the audit log.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from lattice_common.agents import AgentChannels
from lattice_common.aiter import watched
from lattice_common.errors import (
    InvalidTransition,
    LatticeError,
    Unavailable,
    Unimplemented,
    ValidationError,
)
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, decode_grpc_error
from lattice_common.types import Allocation, AllocationState, NodeState, SchedulerType
from lattice_quorum import queries

from lattice_api import access
from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity
from lattice_api.ops.base import visible_allocation
from lattice_api.tsdb import parse_seconds

log = logging.getLogger("lattice.api.telemetry")

__all__ = [
    "ALLOCATION_METRICS_STREAM",
    "ALLOCATION_TELEMETRY_MODE",
    "MODES",
    "TelemetryOps",
    "alert_dict",
    "parse_mode_change",
    "snapshot_dict",
]

MODES = ("prod", "debug", "audit")
#: audit actions (sensitive allocations only)
ALLOCATION_METRICS_STREAM = "allocation.metrics_stream"
ALLOCATION_TELEMETRY_MODE = "allocation.telemetry_mode"
#: states in which an allocation holds nodes whose agents know it
LIVE_STATES = (AllocationState.STAGING, AllocationState.RUNNING, AllocationState.CHECKPOINTING)
#: node states in which the agent is not worth a connection attempt
_AGENT_GONE = (NodeState.DOWN, NodeState.FAILED, NodeState.UNKNOWN)
MAX_MODE_SECONDS = 31 * 86400.0
#: update fields the API knows but does not change yet
UPDATE_NOT_YET = ("walltime", "walltime_seconds", "tags", "preemption_class")
_WATCH_HINT = "`lattice top ID` shows the last metrics the TSDB holds."


def alert_dict(a: v1.MetricAlert) -> dict[str, Any]:
    return {
        "rule": a.rule,
        "metric": a.metric,
        "node_id": a.node_id,
        "state": a.state,
        "value": a.value if math.isfinite(a.value) else None,
        "comparison": a.comparison,
        "threshold": a.threshold,
        "for_seconds": a.for_seconds,
        "since": a.since,
        "timestamp": a.timestamp,
        "severity": a.severity,
        "message": a.message,
    }


def snapshot_dict(s: v1.MetricsSnapshot, state: str = "") -> dict[str, Any]:
    """An agent's message as a record of the merged stream (module docstring)."""
    return {
        "allocation_id": s.allocation_id,
        "event": s.event or "metrics",
        "node_id": s.node_id,
        "timestamp": s.timestamp,
        "telemetry_mode": s.telemetry_mode,
        "mode_until": s.mode_until or None,
        "resolution_seconds": s.resolution_seconds,
        "state": state or s.state,
        "samples": [
            {
                "name": m.name,
                "node_id": m.node_id,
                "value": m.value,
                "unit": m.unit,
                "timestamp": m.timestamp,
                "labels": dict(m.labels),
            }
            for m in s.samples
        ],
        "alerts": list(s.alerts),
        "alert_events": [alert_dict(a) for a in s.alert_events],
    }


def _record(alloc: Allocation, event: str, node_id: str = "", **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "allocation_id": alloc.id,
        "event": event,
        "node_id": node_id,
        "timestamp": time.time(),
        "telemetry_mode": "",
        "mode_until": None,
        "resolution_seconds": 0.0,
        "state": alloc.state.value,
        "samples": [],
        "alerts": [],
        "alert_events": [],
    }
    out.update(kw)
    return out


def parse_mode_change(body: dict[str, Any]) -> tuple[str, float | None] | None:
    """The telemetry change of an update body: ``{"telemetry_mode": M, "duration": D}``
    or the specification's ``{"telemetry": {"mode": M, "duration": D}}``; None when the
    body asks for none. ``duration``: ``"30m"``, ``"1h"``, seconds (also
    ``duration_seconds``/``telemetry_duration_seconds``)."""
    nested = body.get("telemetry")
    if isinstance(nested, dict):
        mode = nested.get("mode")
        duration = nested.get("duration", nested.get("duration_seconds"))
    elif nested not in (None, ""):
        raise ValidationError(
            'telemetry must be an object like {"mode": "debug", "duration": "30m"}'
        )
    else:
        mode = body.get("telemetry_mode")
        duration = body.get(
            "duration", body.get("duration_seconds", body.get("telemetry_duration_seconds"))
        )
    if mode in (None, ""):
        if duration not in (None, "", 0):
            raise ValidationError(
                "a telemetry duration needs a telemetry mode",
                hint='Send {"telemetry_mode": "debug", "duration": "30m"}.',
            )
        return None
    text = str(mode).strip().lower()
    if text not in MODES:
        raise ValidationError(
            f"unknown telemetry mode {mode!r}",
            details={"available": ", ".join(MODES)},
            hint="Use prod, debug or audit.",
        )
    seconds = None
    if duration not in (None, "", 0):
        seconds = parse_seconds(duration, field="duration")
        if seconds > MAX_MODE_SECONDS:
            raise ValidationError(
                f"telemetry duration {duration!r} is longer than 31 days",
                details={"duration": str(duration)},
                hint="Ask for at most 31d.",
            )
    return text, seconds


@dataclass(frozen=True)
class _NodeDone:
    node_id: str


@dataclass(frozen=True)
class _Ended:
    state: str


class TelemetryOps:
    """StreamMetrics and the telemetry mode switch (module docstring)."""

    def __init__(
        self,
        quorum: Any,
        agents: AgentChannels,
        *,
        audit: AuditRecorder | None = None,
        retry_interval: float = 2.0,
        node_check_interval: float = 5.0,
        mode_timeout: float = 10.0,
    ) -> None:
        self.quorum = quorum
        self.agents = agents
        self.audit = audit
        self.retry_interval = retry_interval
        self.node_check_interval = node_check_interval
        self.mode_timeout = mode_timeout

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _live(a: Allocation) -> Allocation:
        """``a`` when it holds nodes whose agents know it; InvalidTransition otherwise."""
        if a.state not in LIVE_STATES or not a.assigned_nodes:
            if a.terminal:
                raise InvalidTransition(
                    f"allocation {a.id} has ended ({a.state.value}): it has no live metrics",
                    details={"state": a.state.value},
                    hint=_WATCH_HINT,
                )
            raise InvalidTransition(
                f"allocation {a.id} is {a.state.value}: it has no live metrics until it runs",
                details={"state": a.state.value},
                hint="Wait until it runs (`lattice status ID`).",
            )
        return a

    def _sensitive(self, a: Allocation) -> bool:
        v = self.quorum.read(queries.vcluster, a.spec.vcluster)
        return v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION

    def _stub(self, node_id: str) -> v1.NodeAgentServiceStub:
        """The node's agent (Unavailable: unknown, gone, or no address)."""
        node = self.quorum.read(queries.node, node_id)
        if node is None or not node.agent_address:
            raise Unavailable(f"node {node_id} has no reachable agent")
        if node.state in _AGENT_GONE:
            raise Unavailable(f"node {node_id} is {node.state.value}")
        try:
            return self.agents.stub(node.agent_address)
        except ValueError as e:
            raise Unavailable(f"node {node_id} has no reachable agent ({e})") from None

    # ------------------------------------------------------------------ StreamMetrics

    def open_stream(
        self,
        who: Identity,
        alloc_id: str,
        *,
        metrics: Sequence[str] = (),
        node_id: str = "",
        alerts_only: bool = False,
        interval: float = 0.0,
    ) -> AsyncIterator[dict[str, Any]]:
        """Check now (NotFound, InvalidTransition, ValidationError for a node that is not
        the allocation's), then the merged stream (module docstring)."""
        a = self._live(visible_allocation(self.quorum, who, alloc_id))
        nodes = list(dict.fromkeys(a.assigned_nodes))
        if node_id:
            if node_id not in nodes:
                raise ValidationError(
                    f"node {node_id} is not one of allocation {a.id}'s nodes",
                    details={"nodes": ", ".join(nodes)},
                )
            nodes = [node_id]
        if not math.isfinite(interval) or interval < 0:
            raise ValidationError(f"interval must be a positive number of seconds, not {interval}")
        if self.audit is not None:
            self.audit.record_access(
                who.user, a, ALLOCATION_METRICS_STREAM, {"alerts_only": alerts_only}
            )
        request = v1.StreamMetricsRequest(
            allocation_id=a.id,
            metrics=[n for n in metrics if n],
            alerts_only=alerts_only,
            interval_seconds=interval,
        )
        return self._merged(a, nodes, request)

    async def _merged(
        self, alloc: Allocation, nodes: list[str], request: v1.StreamMetricsRequest
    ) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        state = {"value": alloc.state.value}
        tasks = [
            asyncio.create_task(self._follow(alloc, n, request, queue, state), name=f"watch-{n}")
            for n in nodes
        ]
        tasks.append(asyncio.create_task(self._check_alloc(alloc, queue, state), name="watch"))
        done: set[str] = set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _NodeDone):
                    done.add(item.node_id)
                    if done >= set(nodes):
                        cur = self.quorum.read(queries.allocation, alloc.id)
                        final = cur.state.value if cur is not None else state["value"]
                        yield _record(alloc, "end", state=final)
                        return
                    continue
                if isinstance(item, _Ended):
                    yield _record(alloc, "end", state=item.state)
                    return
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check_alloc(
        self, alloc: Allocation, queue: asyncio.Queue[Any], state: dict[str, str]
    ) -> None:
        """Ends the stream once the allocation has ended (its agents may be gone)."""
        while True:
            await asyncio.sleep(self.node_check_interval)
            cur = self.quorum.read(queries.allocation, alloc.id)
            if cur is None or cur.terminal:
                await asyncio.sleep(min(2.0, self.node_check_interval))  # the agents' "end"
                await queue.put(_Ended(cur.state.value if cur is not None else "Unknown"))
                return
            state["value"] = cur.state.value

    def _still_there(self, alloc: Allocation, node_id: str) -> bool:
        cur = self.quorum.read(queries.allocation, alloc.id)
        return cur is not None and not cur.terminal and node_id in cur.assigned_nodes

    def _node_gone(self, node_id: str) -> str | None:
        node = self.quorum.read(queries.node, node_id)
        if node is None:
            return f"node {node_id} is no longer registered"
        if node.state in _AGENT_GONE:
            return f"node {node_id} is {node.state.value}"
        return None

    async def _follow(
        self,
        alloc: Allocation,
        node_id: str,
        request: v1.StreamMetricsRequest,
        queue: asyncio.Queue[Any],
        state: dict[str, str],
    ) -> None:
        """One node's stream into ``queue``, retried while the allocation runs there."""
        lost = False
        while True:
            why = ""
            try:
                stub = self._stub(node_id)
                async for snap in self._watched(node_id, stub.stream_metrics(request)):
                    if lost:
                        lost = False
                        await queue.put(_record(alloc, "node_back", node_id, state=state["value"]))
                    if snap.event == "end":
                        await queue.put(_NodeDone(node_id))
                        return
                    await queue.put(snapshot_dict(snap, state["value"]))
                why = "its stream ended"
            except GRPCError as e:
                if e.status == Status.NOT_FOUND and not self._still_there(alloc, node_id):
                    await queue.put(_NodeDone(node_id))
                    return
                why = decode_grpc_error(e).message
            except LatticeError as e:
                why = e.message
            except TRANSPORT_ERRORS as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self._still_there(alloc, node_id):
                await queue.put(_NodeDone(node_id))
                return
            if not lost:
                lost = True
                log.info("watch %s: node %s dropped out: %s", alloc.id, node_id, why)
                message = f"node {node_id}: metrics stream lost ({why}); retrying"
                await queue.put(
                    _record(alloc, "node_lost", node_id, state=state["value"], alerts=[message])
                )
            await asyncio.sleep(self.retry_interval)

    def _watched(
        self, node_id: str, stream: AsyncIterator[v1.MetricsSnapshot]
    ) -> AsyncIterator[v1.MetricsSnapshot]:
        """``stream``, given up (Unavailable) once the quorum says its node is gone: a lost
        node's connection may hang rather than break."""

        def check() -> bool:
            gone = self._node_gone(node_id)
            if gone:
                raise Unavailable(gone)
            return False

        return watched(stream, self.node_check_interval, check)

    # ------------------------------------------------------------------ mode

    async def set_mode(
        self, who: Identity, alloc_id: str, mode: str, duration: float | str | None = None
    ) -> dict[str, Any]:
        """Switch the allocation's telemetry mode on all its nodes (module docstring)."""
        return await self.update(who, alloc_id, {"telemetry_mode": mode, "duration": duration})

    async def update(self, who: Identity, alloc_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """An allocation update (``PATCH /api/v1/allocations/{id}``, Update): the caller
        may change it (NotFound / PermissionDenied first, so ids cannot be probed), then
        the telemetry mode of :func:`parse_mode_change`; other fields are Unimplemented."""
        a = visible_allocation(self.quorum, who, alloc_id)
        access.check_update(who, a)
        others = [k for k in UPDATE_NOT_YET if body.get(k) not in (None, "", {})]
        if others:
            raise Unimplemented(
                f"changing {', '.join(others)} of an allocation is not implemented yet",
                hint="Only the telemetry mode can be changed: "
                '{"telemetry_mode": "debug", "duration": "30m"}.',
            )
        change = parse_mode_change(body)
        if change is None:
            raise ValidationError(
                "the update changes nothing",
                hint='Send {"telemetry_mode": "debug", "duration": "30m"}.',
            )
        mode, seconds = change
        self._live(a)
        if self._sensitive(a) and mode != "audit":
            raise InvalidTransition(
                f"allocation {a.id} is sensitive: its telemetry stays in audit mode",
                details={"mode": mode},
                hint="Sensitive allocations are always audited; debug traces would leave "
                "the sensitive storage pool.",
            )
        nodes = list(dict.fromkeys(a.assigned_nodes))
        request = v1.SetTelemetryModeRequest(
            allocation_id=a.id, mode=mode, duration_seconds=seconds or 0.0
        )
        answers = await asyncio.gather(*(self._set_one(n, request) for n in nodes))
        results = sorted(answers, key=lambda r: r["node"])
        if not any(r["ok"] for r in results):
            first = next(r["error"] for r in results if not r["ok"])
            raise Unavailable(
                f"no node of allocation {a.id} took the telemetry mode: {first['message']}",
                details={"nodes": ", ".join(r["node"] for r in results)},
                hint="Check the nodes with `lattice nodes`; their agents may be down.",
            )
        log.info(
            "allocation %s: telemetry mode %s%s by %s on %d node(s)",
            a.id,
            mode,
            f" for {seconds:g} s" if seconds else "",
            who.user,
            sum(r["ok"] for r in results),
        )
        if self.audit is not None:
            self.audit.record_access(
                who.user, a, ALLOCATION_TELEMETRY_MODE, {"mode": mode, "duration": seconds or 0}
            )
        untils = [r["until"] for r in results if r["ok"] and r.get("until")]
        return {
            "allocation_id": a.id,
            "telemetry_mode": mode,
            "duration_seconds": seconds,
            "until": max(untils) if untils else None,
            "nodes": results,
        }

    async def _set_one(self, node_id: str, request: v1.SetTelemetryModeRequest) -> dict[str, Any]:
        try:
            stub = self._stub(node_id)
            got = await stub.set_telemetry_mode(request, timeout=self.mode_timeout)
        except GRPCError as e:
            err: LatticeError = decode_grpc_error(e)
        except LatticeError as e:
            err = e
        except TRANSPORT_ERRORS as e:
            err = Unavailable(
                f"node {node_id} did not answer: {type(e).__name__}",
                details={"node": node_id, "cause": "unreachable"},
            )
        else:
            return {
                "node": node_id,
                "ok": True,
                "mode": got.mode,
                "until": got.until or None,
                "default_mode": got.default_mode,
            }
        return {"node": node_id, "ok": False, "error": err.to_dict()}
