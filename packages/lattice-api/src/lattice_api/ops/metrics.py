"""AllocationService.QueryMetrics (``lattice top``): an allocation's latest metrics, read
from the TSDB the node agents push to.

The allocation must be visible to the caller (lattice_api.access.can_read: its owner,
a tenant admin of its tenant, the roles that read everything); anyone else gets the
NotFound of an id that does not exist. Every query is then confined to the allocation
by the TSDB itself (``extra_label=alloc_id=ID``, and ``tenant=T`` for a tenant admin:
lattice_api.tsdb) and names it again in its text, escaped.

What the agents push (the data contract): one series per catalog metric with the labels
``alloc_id, node_id, tenant, user, vcluster, agg`` (GPU series also ``gpu``, the index);
prod mode: ``agg`` mean/p50/p95/p99/max/count per aggregation window (30 s) stamped with
the window's end; debug mode: ``agg="raw"`` every second. Pushed series have no
staleness, so the current value of a series is ``last_over_time(m[duration])``.

The values are the ``mean`` series (prod) or the ``raw`` ones (debug), whichever has the
newest sample (its resolution is the answer's ``resolution_seconds``), aggregated by the
TSDB per mode:

* ``summary``: one value per metric across the allocation: the mean of cpu and GPU
  utilization, the sum of memory, GPU memory, GPU power, I/O and network throughput,
  the maximum of the I/O p99 latency;
* ``per-node``: one value per metric and node (GPU metrics over the node's GPUs, as
  above);
* ``per-gpu``: one value per GPU metric, node and GPU.

For an allocation that has ended, values are read as of its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lattice_common.errors import ValidationError
from lattice_common.types import Allocation

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity, Role
from lattice_api.ops.base import visible_allocation
from lattice_api.tsdb import (
    DEFAULT_TIMEOUT,
    Series,
    TsdbClient,
    aggregate,
    not_configured,
    parse_seconds,
    rollup,
    selector,
)

#: audit action (sensitive allocations only, like reading their logs)
ALLOCATION_METRICS = "allocation.metrics"

SUMMARY, PER_NODE, PER_GPU = "summary", "per-node", "per-gpu"
MODES = (SUMMARY, PER_NODE, PER_GPU)
PROD_AGG, DEBUG_AGG = "mean", "raw"
DEFAULT_DURATION = 300.0  # s: how far back the latest values are looked for
MAX_DURATION = 31 * 86400.0


@dataclass(frozen=True)
class Metric:
    """A metric of the user metrics catalog: its unit, how it is combined across nodes
    (and a node's GPUs), and whether it is per GPU."""

    name: str
    unit: str
    combine: str  # avg | sum | max
    gpu: bool = False


#: the user metrics catalog (spec: User Metrics Catalog), in the order it is shown
CATALOG: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("gpu_utilization", "percent", "avg", gpu=True),
        Metric("gpu_memory_used", "bytes", "sum", gpu=True),
        Metric("gpu_power_draw", "watts", "sum", gpu=True),
        Metric("cpu_utilization", "percent", "avg"),
        Metric("memory_used", "bytes", "sum"),
        Metric("network_tx_bytes", "bytes_per_second", "sum"),
        Metric("network_rx_bytes", "bytes_per_second", "sum"),
        Metric("io_read_bytes", "bytes_per_second", "sum"),
        Metric("io_write_bytes", "bytes_per_second", "sum"),
        Metric("io_latency_p99", "microseconds", "max"),
    )
}
_ORDER = {name: i for i, name in enumerate(CATALOG)}


# --- pure: what to ask, and what the answers mean ---------------------------------------


def parse_mode(mode: str | None) -> str:
    """``summary`` (also "" / None), ``per-node``, ``per-gpu`` (``_`` for ``-`` and the
    short ``node``/``gpu`` accepted); ValidationError otherwise."""
    text = (mode or SUMMARY).strip().lower().replace("_", "-")
    text = {"node": PER_NODE, "gpu": PER_GPU, "pernode": PER_NODE, "pergpu": PER_GPU}.get(
        text, text
    )
    if text not in MODES:
        raise ValidationError(
            f"unknown metrics mode {mode!r}",
            details={"available": ", ".join(MODES)},
            hint="Use mode=summary (default), per-node or per-gpu.",
        )
    return text


def parse_duration(duration: str | float | int | None) -> float:
    """The lookback in seconds: ``"5m"``, ``"1h"``, ``300``; None, "" or 0 -> 300 s;
    at most 31 days."""
    if duration is None or duration == "" or duration == 0:
        return DEFAULT_DURATION
    seconds = parse_seconds(duration)
    if seconds > MAX_DURATION:
        raise ValidationError(
            f"duration {duration!r} is longer than {MAX_DURATION / 86400:g} days",
            details={"duration": str(duration)},
            hint="Ask for at most 31d.",
        )
    return seconds


def select_metrics(names: Iterable[str], mode: str) -> list[str]:
    """The catalog metrics asked for (all when none; names may be comma-separated), in
    catalog order; per-gpu keeps the GPU metrics. Unknown names are a ValidationError
    listing the catalog."""
    wanted = {n.strip() for item in names for n in str(item).split(",") if n.strip()}
    unknown = sorted(wanted - set(CATALOG))
    if unknown:
        raise ValidationError(
            f"unknown metric{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
            details={"available": ", ".join(CATALOG)},
            hint="Name metrics of the user metrics catalog, e.g. metrics=gpu_utilization.",
        )
    chosen = [n for n in CATALOG if not wanted or n in wanted]
    if mode == PER_GPU:
        chosen = [n for n in chosen if CATALOG[n].gpu]
        if not chosen:
            raise ValidationError(
                "per-gpu mode shows GPU metrics only",
                details={"available": ", ".join(n for n, m in CATALOG.items() if m.gpu)},
                hint="Ask for GPU metrics, or use the summary or per-node view.",
            )
    return chosen


#: a PromQL query, what its series are (the ``op`` applied) and which metrics it covers
@dataclass(frozen=True)
class Planned:
    expr: str
    op: str
    names: tuple[str, ...]


def _group_labels(mode: str) -> tuple[str, ...]:
    if mode == PER_NODE:
        return ("__name__", "agg", "node_id")
    if mode == PER_GPU:
        return ("__name__", "agg", "node_id", "gpu")
    return ("__name__", "agg")


def base_labels(alloc_id: str, node_id: str = "") -> dict[str, str]:
    labels = {"alloc_id": alloc_id}
    if node_id:
        labels["node_id"] = node_id
    return labels


def freshness_query(names: Sequence[str], labels: Mapping[str, str], seconds: float) -> str:
    """The newest sample time per aggregation kind and node: which kind is current, when,
    and on which nodes."""
    sel = selector(labels, names=names, regex={"agg": (PROD_AGG, DEBUG_AGG)})
    return aggregate("max", ("agg", "node_id"), rollup("tlast_over_time", sel, seconds))


def value_queries(
    mode: str, names: Sequence[str], labels: Mapping[str, str], seconds: float
) -> list[Planned]:
    """One query per way of combining (avg, sum, max) that ``names`` need in ``mode``:
    summary combines across everything, per-node across a node's GPUs (node metrics have
    one series per node: max), per-gpu nothing (max per GPU series)."""
    by_op: dict[str, list[str]] = {}
    for name in names:
        m = CATALOG[name]
        combined = mode == SUMMARY or (mode == PER_NODE and m.gpu)
        op = m.combine if combined else "max"
        by_op.setdefault(op, []).append(name)
    out = []
    for op, group in by_op.items():
        sel = selector(labels, names=group, regex={"agg": (PROD_AGG, DEBUG_AGG)})
        inner = rollup("last_over_time", sel, seconds, keep_metric_names=True)
        out.append(Planned(aggregate(op, _group_labels(mode), inner), op, tuple(group)))
    return out


@dataclass(frozen=True)
class Freshness:
    """What the freshness query says: the kind of data to show (``mean`` or ``raw``),
    its newest sample time, and per node the newest sample time of that kind."""

    agg: str
    timestamp: float
    nodes: dict[str, float]


def read_freshness(series: Iterable[Series]) -> Freshness | None:
    """None when nothing was pushed within the lookback; else the kind with the newest
    sample (raw wins a tie: debug mode pushes both)."""
    per: dict[str, dict[str, float]] = {}
    for s in series:
        agg = s.labels.get("agg", "")
        if agg in (PROD_AGG, DEBUG_AGG):
            per.setdefault(agg, {})[s.labels.get("node_id", "")] = s.value
    if not per:
        return None
    agg = max(per, key=lambda a: (max(per[a].values()), a == DEBUG_AGG))
    nodes = per[agg]
    return Freshness(agg, max(nodes.values()), dict(sorted(nodes.items())))


def _gpu_key(gpu: str) -> tuple[int, int | str]:
    return (0, int(gpu)) if gpu.isdigit() else (1, gpu)


def samples_of(mode: str, results: Iterable[Series], fresh: Freshness) -> list[dict[str, Any]]:
    """The samples of the value queries' series of kind ``fresh.agg``, sorted: summary in
    catalog order; per-node by node, then catalog; per-gpu by node, GPU, catalog."""
    rows = []
    for s in results:
        name = s.labels.get("__name__", "")
        if name not in CATALOG or s.labels.get("agg") != fresh.agg:
            continue
        node = s.labels.get("node_id", "") if mode != SUMMARY else ""
        labels = {"gpu": s.labels.get("gpu", "")} if mode == PER_GPU else {}
        ts = fresh.nodes.get(node, fresh.timestamp) if node else fresh.timestamp
        rows.append(
            {
                "name": name,
                "node_id": node,
                "value": s.value,
                "unit": CATALOG[name].unit,
                "timestamp": ts,
                "labels": labels,
            }
        )
    rows.sort(
        key=lambda r: (
            r["node_id"],
            _gpu_key(r["labels"].get("gpu", "")),
            _ORDER[r["name"]],
        )
    )
    return rows


def scope_of(who: Identity, alloc: Allocation) -> dict[str, str]:
    """The labels the TSDB confines every query to: the allocation, and for a tenant
    admin also their tenant."""
    scope = {"alloc_id": alloc.id}
    if who.role == Role.TENANT_ADMIN:
        scope["tenant"] = who.tenant
    return scope


# --- the operation ----------------------------------------------------------------------


class MetricsOps:
    """``query`` (QueryMetrics, ``GET /api/v1/allocations/{id}/metrics``).

    ``tsdb_endpoint`` "" = no TSDB: every query is Unavailable ("no TSDB configured").
    ``window`` is the agents' prod aggregation window (``telemetry.aggregation_window_
    seconds``) and ``telemetry_mode`` the cluster's default mode: what an answer without
    data says."""

    def __init__(
        self,
        quorum: Any,
        *,
        tsdb_endpoint: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        window: float = 30.0,
        telemetry_mode: str = "prod",
        audit: AuditRecorder | None = None,
        clock: Any = time.time,
    ) -> None:
        self.quorum = quorum
        self.tsdb_endpoint = tsdb_endpoint
        self.timeout = timeout
        self.window = window
        self.telemetry_mode = telemetry_mode
        self.audit = audit
        self.clock = clock

    def resolution(self, agg: str | None) -> tuple[float, str]:
        """(seconds, mode) of data of kind ``agg`` (None: the cluster's default)."""
        if agg == DEBUG_AGG or (agg is None and self.telemetry_mode == "debug"):
            return 1.0, "debug"
        return self.window, "prod" if agg is not None else self.telemetry_mode

    def eval_time(self, alloc: Allocation) -> float | None:
        """When to read values: now (None), or for an ended allocation shortly after its
        end (its last window is stamped up to one window later)."""
        if alloc.terminal and alloc.finished_at:
            at = alloc.finished_at + 2 * self.window
            return at if at < self.clock() else None
        return None

    async def query(
        self,
        who: Identity,
        alloc_id: str,
        *,
        mode: str | None = SUMMARY,
        duration: str | float | int | None = None,
        metrics: Sequence[str] = (),
        node_id: str = "",
    ) -> dict[str, Any]:
        """The allocation's latest metrics (see the module docstring):
        ``{allocation_id, state, mode, duration_seconds, timestamp (None: no data),
        resolution_seconds, telemetry_mode, node_ids, samples: [{name, node_id, value,
        unit, timestamp, labels}], alerts}``."""
        mode = parse_mode(mode)
        seconds = parse_duration(duration)
        names = select_metrics(metrics, mode)
        a = visible_allocation(self.quorum, who, alloc_id)
        if not self.tsdb_endpoint:
            raise not_configured()
        if self.audit is not None:
            self.audit.record_access(who.user, a, ALLOCATION_METRICS, {"mode": mode})
        labels = base_labels(a.id, node_id)
        scope = scope_of(who, a)
        at = self.eval_time(a)
        planned = value_queries(mode, names, labels, seconds)
        async with TsdbClient(self.tsdb_endpoint, timeout=self.timeout) as tsdb:
            answers = await asyncio.gather(
                tsdb.query(freshness_query(names, labels, seconds), scope=scope, at=at),
                *(tsdb.query(p.expr, scope=scope, at=at) for p in planned),
            )
        fresh = read_freshness(answers[0])
        resolution, telemetry_mode = self.resolution(fresh.agg if fresh else None)
        samples = samples_of(mode, (s for ans in answers[1:] for s in ans), fresh) if fresh else []
        return {
            "allocation_id": a.id,
            "state": a.state.value,
            "mode": mode,
            "duration_seconds": seconds,
            "timestamp": fresh.timestamp if fresh else None,
            "resolution_seconds": resolution,
            "telemetry_mode": telemetry_mode,
            "node_ids": list(fresh.nodes) if fresh else [],
            "samples": samples,
            "alerts": [],
        }


__all__ = [
    "CATALOG",
    "MODES",
    "Freshness",
    "Metric",
    "MetricsOps",
    "Planned",
    "freshness_query",
    "parse_duration",
    "parse_mode",
    "read_freshness",
    "samples_of",
    "scope_of",
    "select_metrics",
    "value_queries",
]
