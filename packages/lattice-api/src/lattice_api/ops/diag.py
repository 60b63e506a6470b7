"""AllocationService.GetDiagnostics (``lattice diag``; ``GET /api/v1/allocations/{id}/
diagnostics?section=network|storage``): an allocation's network, storage and GPU health
in one view, each line with a health mark (spec: User-Facing Observability, Diagnostics
View).

Visibility is QueryMetrics': the allocation must be visible (``visible_allocation``;
another user's is the NotFound of an unknown id), and it must hold nodes (Staging,
Running, Checkpointing; else InvalidTransition with a hint). A sensitive allocation's
diagnostics are recorded in the audit log (``allocation.diagnostics``), and its network
section leaves out fabric-wide facts (spec: network diagnostics scoped to the
allocation's own traffic).

Where the facts come from:

* **the agents** of the allocation's nodes, all at once (NodeAgentService.Diagnose,
  ``AGENT_TIMEOUT`` each): mount health of its working directory and scratch, the latest
  telemetry values, the block I/O latency histogram. A node whose agent does not answer
  is reported (``nodes[].ok`` false and a critical ``agent`` line), never fatal;
* **the quorum**: the nodes' dragonfly groups (group span) and GPU capacity;
* **the TSDB** (``telemetry.tsdb_endpoint``, scoped like QueryMetrics: ``extra_label
  alloc_id=ID``, ``tenant=T`` for tenant admins): the last 30 s window means (``raw``
  where no mean exists) of the network, I/O and GPU series of the last 5 minutes; where
  it has nothing (or there is none, or it is down: ``tsdb`` says which) the agents'
  latest values fill in.

Where nothing measures a fact, its line says so with the mark ``unknown``; no number is
invented. The marks, their thresholds and the report are the pure
:mod:`lattice_api.diagnostics`; this module gathers the facts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from grpclib.exceptions import GRPCError
from lattice_common.agents import AgentChannels
from lattice_common.errors import InvalidTransition, LatticeError, Unavailable
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, decode_grpc_error
from lattice_common.types import Allocation, AllocationState, Node, NodeState, SchedulerType
from lattice_quorum import queries

from lattice_api.auth import Identity
from lattice_api.diagnostics import (
    METRICS,
    Facts,
    build_report,
    facts_from_series,
    parse_scope,
)
from lattice_api.ops.base import visible_allocation
from lattice_api.ops.metrics import MetricsOps, scope_of
from lattice_api.tsdb import TsdbClient, aggregate, rollup, selector

log = logging.getLogger("lattice.api.diag")

__all__ = [
    "ALLOCATION_DIAGNOSTICS",
    "DiagOps",
    "diagnosis_dict",
    "diagnostics_message",
    "diagnostics_record",
]

#: audit action (sensitive allocations only)
ALLOCATION_DIAGNOSTICS = "allocation.diagnostics"
#: states in which an allocation holds nodes whose agents know it
LIVE_STATES = (AllocationState.STAGING, AllocationState.RUNNING, AllocationState.CHECKPOINTING)
_AGENT_GONE = (NodeState.DOWN, NodeState.FAILED)

#: how long an agent has to answer (its probes take at most PROBE_TIMEOUT)
PROBE_TIMEOUT = 5.0
AGENT_TIMEOUT = PROBE_TIMEOUT + 5.0
AGENT_PARALLEL = 64
LOOKBACK = 300.0  # s: how far back the TSDB's last values are looked for


def diagnosis_dict(d: v1.NodeDiagnosis) -> dict[str, Any]:
    """An agent's answer as plain data (what :func:`build_report` reads)."""
    return {
        "node_id": d.node_id,
        "mounts": [
            {
                "role": m.role,
                "path": m.path,
                "mount_point": m.mount_point,
                "fs_type": m.fs_type,
                "total_bytes": m.total_bytes,
                "free_bytes": m.free_bytes,
                "total_inodes": m.total_inodes,
                "free_inodes": m.free_inodes,
                "probe_seconds": m.probe_seconds,
                "timed_out": m.timed_out,
                "error": m.error,
                "read_only": m.read_only,
            }
            for m in d.mounts
        ],
        "latest": dict(d.latest),
        "io_latency": [
            {"low_us": b.low_us, "high_us": b.high_us, "count": b.count} for b in d.io_latency
        ],
        "io_latency_p50_us": d.io_latency_p50_us,
        "io_latency_p95_us": d.io_latency_p95_us,
        "io_latency_p99_us": d.io_latency_p99_us,
        "runs_here": d.runs_here,
    }


# --- the operation ------------------------------------------------------------------------


class DiagOps:
    """``diagnose`` (GetDiagnostics). Takes QueryMetrics' TSDB settings and audit log from
    ``metrics``; ``bandwidth_target`` (bytes/s per node, 0 = none) is what inter-node
    bandwidth is measured against."""

    def __init__(
        self,
        metrics: MetricsOps,
        agents: AgentChannels,
        *,
        agent_timeout: float = AGENT_TIMEOUT,
        probe_timeout: float = PROBE_TIMEOUT,
        bandwidth_target: float = 0.0,
    ) -> None:
        self.metrics = metrics
        self.quorum = metrics.quorum
        self.agents = agents
        self.agent_timeout = agent_timeout
        self.probe_timeout = probe_timeout
        self.bandwidth_target = bandwidth_target

    async def diagnose(
        self, who: Identity, alloc_id: str, scope: str | None = None
    ) -> dict[str, Any]:
        """The allocation's diagnostics (module docstring); see :func:`build_report`."""
        section = parse_scope(scope)
        a = visible_allocation(self.quorum, who, alloc_id)
        if a.state not in LIVE_STATES:
            raise InvalidTransition(
                f"allocation {a.id} is {a.state.value}: diagnostics need an allocation that holds nodes",
                details={"state": a.state.value},
                hint="Wait until it runs (`lattice status ID`); `lattice top ID` shows an ended one's last metrics.",
            )
        sensitive = self._sensitive(a)
        if self.metrics.audit is not None:
            self.metrics.audit.record_access(
                who.user, a, ALLOCATION_DIAGNOSTICS, {"section": section}
            )
        nodes = [self.quorum.read(queries.node, n) or Node(id=n) for n in a.assigned_nodes]
        answers, (tsdb_state, tsdb_facts) = await asyncio.gather(
            self._ask_agents(a.id, nodes), self._tsdb_facts(who, a)
        )
        return build_report(
            a,
            nodes,
            answers,
            tsdb_facts,
            scope=section,
            tsdb=tsdb_state,
            sensitive=sensitive,
            bandwidth_target=self.bandwidth_target,
            now=time.time(),
        )

    def _sensitive(self, a: Allocation) -> bool:
        v = self.quorum.read(queries.vcluster, a.spec.vcluster)
        return v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION

    async def _tsdb_facts(self, who: Identity, a: Allocation) -> tuple[str, Facts]:
        if not self.metrics.tsdb_endpoint:
            return "not configured", {}
        sel = selector({"alloc_id": a.id}, names=METRICS, regex={"agg": ("mean", "raw")})
        expr = aggregate(
            "max",
            ("__name__", "node_id", "gpu", "agg"),
            rollup("last_over_time", sel, LOOKBACK, keep_metric_names=True),
        )
        try:
            async with TsdbClient(self.metrics.tsdb_endpoint, timeout=self.metrics.timeout) as tsdb:
                series = await tsdb.query(
                    expr, scope=scope_of(who, a), at=self.metrics.eval_time(a)
                )
        except LatticeError as e:  # down, slow, failing: the agents' values stand in
            log.warning("diagnostics of %s without the TSDB: %s", a.id, e.message)
            return "unavailable", {}
        return "ok", facts_from_series(series)

    async def _ask_agents(
        self, alloc_id: str, nodes: Sequence[Node]
    ) -> dict[str, dict[str, Any] | LatticeError]:
        gate = asyncio.Semaphore(AGENT_PARALLEL)
        request = v1.DiagnoseRequest(
            allocation_id=alloc_id, probe_timeout_seconds=self.probe_timeout
        )

        async def one(n: Node) -> dict[str, Any] | LatticeError:
            if n.state in _AGENT_GONE or not n.agent_address:
                why = (
                    f"node {n.id} is {n.state.value}"
                    if n.agent_address
                    else f"node {n.id} has no agent address"
                )
                return Unavailable(why, details={"node": n.id, "cause": "unreachable"})
            async with gate:
                try:
                    stub = self.agents.stub(n.agent_address)
                    got = await asyncio.wait_for(
                        stub.diagnose(request, timeout=self.agent_timeout), self.agent_timeout + 1.0
                    )
                except GRPCError as e:
                    err = decode_grpc_error(e)
                    err.details.setdefault("node", n.id)
                    return err
                except (*TRANSPORT_ERRORS, ValueError) as e:
                    why = (
                        f"did not answer within {self.agent_timeout:g}s"
                        if isinstance(e, TimeoutError)
                        else f"could not be reached ({e or type(e).__name__})"
                    )
                    return Unavailable(
                        f"its agent at {n.agent_address} {why}",
                        details={"node": n.id, "cause": "unreachable"},
                    )
            return diagnosis_dict(got)

        got = await asyncio.gather(*(one(n) for n in nodes))
        return {n.id: g for n, g in zip(nodes, got, strict=True)}


# --- the wire form ----------------------------------------------------------------------


def diagnostics_message(answer: Mapping[str, Any]) -> v1.Diagnostics:
    """:meth:`DiagOps.diagnose`'s record as the proto message (a check's section is its
    ``scope``)."""
    return v1.Diagnostics(
        allocation_id=answer["allocation_id"],
        state=answer["state"],
        scope=answer["scope"],
        sections=list(answer["sections"]),
        timestamp=answer["timestamp"],
        status=answer["status"],
        summary=answer["summary"],
        tsdb=answer["tsdb"],
        nodes=[v1.DiagnosticNode(**n) for n in answer["nodes"]],
        checks=[
            v1.DiagnosticCheck(
                scope=c["section"],
                name=c["name"],
                node_id=c["node_id"],
                status=c["status"],
                message=c["message"],
                details=dict(c["details"]),
                values=dict(c["values"]),
                histogram=[
                    v1.LatencyBucket(
                        low_us=b["low_us"], high_us=b["high_us"], count=int(b["count"])
                    )
                    for b in c["histogram"]
                ],
            )
            for c in answer["checks"]
        ],
    )


def diagnostics_record(m: v1.Diagnostics) -> dict[str, Any]:
    """The proto message back as the REST record (:func:`diagnostics_message`'s inverse)."""
    return {
        "allocation_id": m.allocation_id,
        "state": m.state,
        "scope": m.scope,
        "sections": list(m.sections),
        "timestamp": m.timestamp,
        "status": m.status,
        "summary": m.summary,
        "tsdb": m.tsdb,
        "nodes": [
            {"node_id": n.node_id, "group": n.group, "ok": n.ok, "error": n.error} for n in m.nodes
        ],
        "checks": [
            {
                "section": c.scope,
                "name": c.name,
                "node_id": c.node_id,
                "status": c.status,
                "message": c.message,
                "details": dict(c.details),
                "values": dict(c.values),
                "histogram": [
                    {"low_us": b.low_us, "high_us": b.high_us, "count": b.count}
                    for b in c.histogram
                ],
            }
            for c in m.checks
        ],
    }
