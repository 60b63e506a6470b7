"""``lattice watch``'s rendering, pure: the records of the live metrics stream
(``LatticeClient.stream_metrics``) folded into a view, and the text of that view and of
each record. No I/O; the command (:mod:`lattice_cli.commands.watch`) prints.

A record is ``{allocation_id, event, node_id, timestamp, telemetry_mode, mode_until,
resolution_seconds, state, samples, alerts, alert_events}``; ``event`` is ``metrics``,
``mode``, ``alert``, ``node_lost``, ``node_back`` or ``end``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lattice_cli.output import DASH, TOP_COLUMNS, TOP_WIDE_METRICS, metric_cell, render_table

__all__ = ["ALERT_EVENTS", "WatchView", "clock", "event_lines", "mode_text"]

#: the events ``--alerts-only`` prints (the server sends only these then, and ``end``)
ALERT_EVENTS = frozenset({"alert", "node_lost", "node_back"})
_EXTRA_COLUMNS = {
    "gpu_memory_utilization": "GPU_MEM%",
    "runqueue_latency_p99": "RUNQ_P99",
    "context_switches": "CTX_SW",
    "page_faults": "FAULTS",
    "network_error_rate": "NET_ERR",
}


def clock(epoch: Any) -> str:
    """``HH:MM:SS`` local time (em dash for none)."""
    if not isinstance(epoch, int | float) or not epoch:
        return DASH
    return time.strftime("%H:%M:%S", time.localtime(float(epoch)))


def mode_text(mode: str, resolution: Any, until: Any = None) -> str:
    """``prod · 30 s``, ``debug · 1 s until 12:30:00``."""
    text = mode or "prod"
    if isinstance(resolution, int | float) and resolution:
        text += f" · {resolution:g} s"
    if isinstance(until, int | float) and until:
        text += f" until {clock(until)}"
    return text


def _number(value: Any) -> str:
    if not isinstance(value, int | float) or value != value:
        return DASH
    return f"{value:g}"


def alert_line(a: dict[str, Any]) -> str:
    """``12:00:05 node-001 FIRING gpu_idle (warning): GPU utilization ... [gpu_utilization
    = 3 < 10]``."""
    state = str(a.get("state") or "").upper()
    cond = f"{a.get('metric')} = {_number(a.get('value'))} {a.get('comparison')} "
    cond += _number(a.get("threshold"))
    return (
        f"{clock(a.get('timestamp'))} {a.get('node_id') or DASH} {state} {a.get('rule')} "
        f"({a.get('severity') or 'warning'}): {a.get('message')} [{cond}]"
    )


def _columns(names: Iterable[str], wanted: Sequence[str]) -> list[str]:
    present = set(names)
    if wanted:
        return [n for n in wanted if n in present]
    known = [n for n in TOP_WIDE_METRICS if n in present]
    return known + sorted(present - set(known))


def _header(name: str) -> str:
    return TOP_COLUMNS.get(name) or _EXTRA_COLUMNS.get(name) or name.upper()


def _values_text(rec: dict[str, Any], wanted: Sequence[str]) -> str:
    samples = {s.get("name"): s for s in rec.get("samples") or []}
    return "  ".join(
        f"{_header(n)} {metric_cell(samples[n].get('value'), samples[n].get('unit') or '')}"
        for n in _columns(samples, wanted)
    )


def event_lines(rec: dict[str, Any], wanted: Sequence[str] = ()) -> list[str]:
    """The lines a record prints as when the output is not a live table (a pipe, or
    ``--alerts-only``)."""
    event = rec.get("event") or "metrics"
    node = rec.get("node_id") or DASH
    at = clock(rec.get("timestamp"))
    if event == "alert":
        return [
            alert_line({**a, "node_id": a.get("node_id") or node})
            for a in rec.get("alert_events") or []
        ]
    if event in ("node_lost", "node_back"):
        why = "; ".join(rec.get("alerts") or []) or ("back" if event == "node_back" else "lost")
        if event == "node_back":
            why = f"node {node}: metrics stream back"
        return [f"{at} {node} {event.upper().replace('_', ' ')}: {why}"]
    if event == "mode":
        mode = mode_text(
            rec.get("telemetry_mode") or "", rec.get("resolution_seconds"), rec.get("mode_until")
        )
        return [f"{at} {node} MODE {mode}"]
    if event == "end":
        return [f"{at} {rec.get('allocation_id')} ended ({rec.get('state') or DASH})"]
    values = _values_text(rec, wanted) or "no values yet"
    mode = mode_text(rec.get("telemetry_mode") or "", rec.get("resolution_seconds"))
    return [f"{at} {node} [{mode}] {values}"]


@dataclass
class _Node:
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    timestamp: float = 0.0
    mode: str = ""
    resolution: float = 0.0
    until: float | None = None
    lost: bool = False


class WatchView:
    """What the live table shows: the latest values per node, each node's mode, the
    alerts firing and the last few events. :meth:`apply` a record, :meth:`render`."""

    def __init__(self, alloc_id: str, metrics: Sequence[str] = (), keep_events: int = 6) -> None:
        self.alloc_id = alloc_id
        self.metrics = list(metrics)
        self.state = ""
        self.nodes: dict[str, _Node] = {}
        self.firing: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: deque[str] = deque(maxlen=keep_events)
        self.ended = False

    def apply(self, rec: dict[str, Any]) -> None:
        event = rec.get("event") or "metrics"
        self.state = rec.get("state") or self.state
        node_id = rec.get("node_id") or ""
        if event == "end":
            self.ended = True
            self.events.extend(event_lines(rec))
            return
        node = self.nodes.setdefault(node_id, _Node()) if node_id else None
        if event == "metrics" and node is not None:
            node.values = {
                s["name"]: (s.get("value"), s.get("unit") or "") for s in rec.get("samples") or []
            } or node.values
            node.timestamp = float(rec.get("timestamp") or 0.0) or node.timestamp
            node.lost = False
        if node is not None and rec.get("telemetry_mode"):
            node.mode = rec["telemetry_mode"]
            node.until = rec.get("mode_until") or None
            node.resolution = float(rec.get("resolution_seconds") or 0.0)
        if event == "metrics" and "alert_events" in rec:
            for key in [k for k in self.firing if k[0] == node_id]:
                del self.firing[key]
            for a in rec.get("alert_events") or []:
                self.firing[(node_id, a.get("rule"))] = {**a, "node_id": node_id}
        if event == "alert":
            for a in rec.get("alert_events") or []:
                key = (a.get("node_id") or node_id, a.get("rule"))
                if a.get("state") == "firing":
                    self.firing[key] = {**a, "node_id": key[0]}
                else:
                    self.firing.pop(key, None)
        if event in ("node_lost", "node_back") and node is not None:
            node.lost = event == "node_lost"
        if event in ("alert", "mode", "node_lost", "node_back"):
            self.events.extend(event_lines(rec))

    def render(self, now: float) -> str:
        names = {n for node in self.nodes.values() for n in node.values}
        cols = _columns(names, self.metrics)
        rows = []
        for node_id in sorted(self.nodes):
            node = self.nodes[node_id]
            cells = [metric_cell(*node.values[c]) if c in node.values else DASH for c in cols]
            mode = "LOST" if node.lost else mode_text(node.mode, node.resolution, node.until)
            rows.append([node_id, mode, *cells, clock(node.timestamp)])
        title = [
            f"{self.alloc_id} ({self.state or '?'})",
            f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''}",
            f"{len(self.firing)} alert{'s' if len(self.firing) != 1 else ''} firing",
            f"at {clock(now)}",
        ]
        parts = [" · ".join(title), ""]
        if rows:
            parts.append(render_table(["NODE", "MODE", *map(_header, cols), "UPDATED"], rows))
        else:
            parts.append("waiting for the first values ...")
        if self.firing:
            parts += ["", "ALERTS"]
            parts += [f"  {alert_line(a)}" for _, a in sorted(self.firing.items())]
        if self.events:
            parts += ["", "EVENTS"]
            parts += [f"  {line}" for line in self.events]
        return "\n".join(parts)
