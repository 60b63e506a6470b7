"""File-access events into the audit log (NodeService.ReportFileAccess; spec: Sensitive
Workloads, Audit Trail: "Data access: every file open/read/write (from eBPF audit
telemetry)"; Telemetry Architecture, audit mode: "All file access events ... with user
identity").

A node agent reports the opens its audited allocations made (lattice_agent.telemetry
.fileaudit). The caller must be that node's agent (``NodeOps.bind_agent``: a node
certificate names its node), and each allocation must be one the node runs or ran
(``assigned_nodes``); other events are refused per allocation and counted in the
answer. Accepted events are recorded as ``file.access`` entries, one per allocation
and batch of at most :data:`EVENTS_PER_ENTRY` events, attributed to the allocation's
user (its identity in the quorum, never what the agent says): ``actor`` the user,
``target`` ``allocation:<id>``, ``tenant`` its tenant, ``details`` ``node``,
``events`` (how many records), ``opens`` (how many opens they stand for: repeats are
counted by the agent), ``sensitive``, ``sources`` and ``records`` (the events as a JSON
list of ``{time, pid, tid, uid, comm, path, cwd, flags, result, count, source,
suppressed}``). Events the node lost (its buffers were full) are recorded as a
``file.access`` entry on ``node:<id>`` with ``lost``, so a gap in the log is visible.
Read them with ``lattice admin audit query --action file.access --target <alloc id>``.

The answer also names the allocations of the node the cluster audits (those in
sensitive vClusters), which the agent keeps in audit mode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lattice_common.assignment import is_sensitive
from lattice_common.errors import NotFound, ValidationError
from lattice_quorum import queries
from prometheus_client import Counter

from lattice_api.auth import Identity
from lattice_api.ops.nodes import NodeOps

log = logging.getLogger("lattice.api.fileaudit")

FILE_ACCESS = "file.access"
MAX_EVENTS = 2000  # per call
EVENTS_PER_ENTRY = 200  # per audit entry
MAX_TEXT = 4096  # characters of a path (PATH_MAX) or any other text field kept
_FIELDS = (
    "time",
    "pid",
    "tid",
    "uid",
    "comm",
    "path",
    "cwd",
    "flags",
    "result",
    "count",
    "source",
    "suppressed",
)

RECORDED = Counter(
    "lattice_api_file_access_events_total",
    "File-access events recorded in the audit log, as the node agents reported them",
)
REFUSED = Counter(
    "lattice_api_file_access_events_refused_total",
    "File-access events refused (an allocation not on the reporting node, or unknown)",
)


class FileAccessOps:
    """NodeService.ReportFileAccess over the node operations (their quorum, their
    audit recorder, their agent binding)."""

    def __init__(self, nodes: NodeOps) -> None:
        self.nodes = nodes
        self.quorum = nodes.quorum

    def audited_allocations(self, node_id: str) -> list[str]:
        """The node's allocations the cluster audits: those of sensitive vClusters."""
        allocs = self.quorum.read(queries.desired_for, node_id).allocations
        if not allocs:
            return []
        vclusters = {v.name: v for v in self.quorum.read(queries.vclusters)}
        return sorted(a.id for a in allocs if is_sensitive(a, vclusters))

    def report(
        self,
        who: Identity,
        node_id: str,
        events: Sequence[Mapping[str, Any]],
        dropped: int = 0,
    ) -> dict[str, Any]:
        """Record a node's events (module docstring); answers ``{accepted, rejected:
        [{allocation_id, count, reason}], audited_allocations}``."""
        node_id = str(node_id or "").strip()
        if not node_id:
            raise ValidationError(
                "node_id is required", hint="The agent reports for its own node id."
            )
        self.nodes.bind_agent(who, node_id)
        if len(events) > MAX_EVENTS:
            raise ValidationError(
                f"too many file-access events in one report: {len(events)} (at most {MAX_EVENTS})",
                details={"count": len(events), "limit": MAX_EVENTS},
                hint="Send them in batches.",
            )
        if self.quorum.read(queries.node, node_id) is None:
            raise NotFound(f"node {node_id} not found", hint="The agent registers its node first.")
        recorder = self.nodes.audit
        by_alloc: dict[str, list[Mapping[str, Any]]] = {}
        for ev in events:
            by_alloc.setdefault(str(ev.get("allocation_id") or ""), []).append(ev)
        vclusters = {v.name: v for v in self.quorum.read(queries.vclusters)}
        accepted = 0
        rejected: list[dict[str, Any]] = []
        for alloc_id, evs in sorted(by_alloc.items()):
            a = self.quorum.read(queries.allocation, alloc_id) if alloc_id else None
            if a is None or node_id not in a.assigned_nodes:
                why = (
                    f"allocation {alloc_id or '(none)'} is not on node {node_id}"
                    if a is not None or not alloc_id
                    else f"allocation {alloc_id} not found"
                )
                rejected.append({"allocation_id": alloc_id, "count": len(evs), "reason": why})
                REFUSED.inc(len(evs))
                log.warning("file-access report from %s refused: %s", node_id, why)
                continue
            sensitive = is_sensitive(a, vclusters)
            for i in range(0, len(evs), EVENTS_PER_ENTRY):
                chunk = [_record(e) for e in evs[i : i + EVENTS_PER_ENTRY]]
                if recorder is not None:
                    recorder.record(
                        a.spec.user or a.spec.tenant,
                        FILE_ACCESS,
                        f"allocation:{a.id}",
                        tenant=a.spec.tenant,
                        details={
                            "node": node_id,
                            "events": len(chunk),
                            "opens": sum(int(r.get("count") or 1) for r in chunk),
                            "sensitive": sensitive,
                            "sources": sorted({str(r.get("source") or "") for r in chunk}),
                            "records": chunk,
                        },
                    )
            accepted += len(evs)
            RECORDED.inc(len(evs))
        if dropped > 0 and recorder is not None:
            recorder.record(
                f"node:{node_id}",
                FILE_ACCESS,
                f"node:{node_id}",
                details={
                    "lost": int(dropped),
                    "reason": "the node's file-access buffers were full",
                },
            )
        return {
            "accepted": accepted,
            "rejected": rejected,
            "audited_allocations": self.audited_allocations(node_id),
        }


def _record(e: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of one event kept in the log (the allocation and user are the
    entry's; anything else the agent sent is not kept)."""
    out = {k: e[k] for k in _FIELDS if k in e and e[k] not in (None, "")}
    for k in ("path", "cwd", "comm", "flags", "source"):
        if isinstance(out.get(k), str) and len(out[k]) > MAX_TEXT:
            out[k] = out[k][:MAX_TEXT]  # a node cannot bloat the replicated log
    return out


__all__ = ["EVENTS_PER_ENTRY", "FILE_ACCESS", "MAX_EVENTS", "FileAccessOps"]
