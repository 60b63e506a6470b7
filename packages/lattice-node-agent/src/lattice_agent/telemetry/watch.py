"""NodeAgentService.StreamMetrics and SetTelemetryMode (``lattice watch``, ``lattice
telemetry``): one allocation's live metrics on this node, from the telemetry loop's
:class:`~lattice_agent.telemetry.hub.MetricsHub`.

A stream sends, as ``MetricsSnapshot`` messages with ``event``:

* ``metrics`` first: the latest collection (``agg`` raw) and the alerts firing now; then,
  in prod and audit mode, one per aggregation window with the window's means (``agg``
  mean), or in debug mode one per 1 s collection (``agg`` raw). Which one follows the
  allocation's mode at each collection, so a switch (``SetTelemetryMode``, or debug's
  auto-revert) takes effect on open streams. ``resolution_seconds`` is always the
  current mode's: the window (prod, audit) or 1 (debug);
* ``mode`` when the allocation's mode changed (``telemetry_mode``, ``mode_until``,
  ``resolution_seconds``);
* ``alert`` when threshold alerts fire or resolve (``alert_events``; ``alerts``: the
  messages of those firing after the change);
* ``end`` when the allocation leaves the node; the stream then ends.

``alerts_only`` leaves out ``metrics`` and ``mode``; ``metrics`` (names, also
comma-separated) narrows the samples; ``interval_seconds`` sends metric snapshots at
most that often (by the data's time).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence

from lattice_common.errors import NotFound, ValidationError
from lattice_common.proto.lattice import v1

from lattice_agent.telemetry.alerts import AlertEvent
from lattice_agent.telemetry.hub import ALERT, END, RAW, WINDOW
from lattice_agent.telemetry.loop import TelemetryLoop
from lattice_agent.telemetry.samples import MODE_DEBUG, MODES, split_key

__all__ = ["UNITS", "metric_names", "metrics_stream", "set_mode", "snapshot"]

#: the unit of each metric the sources report (spec: User Metrics Catalog, eBPF extras)
UNITS: dict[str, str] = {
    "gpu_utilization": "percent",
    "gpu_memory_used": "bytes",
    "gpu_memory_utilization": "percent",
    "gpu_power_draw": "watts",
    "gpu_memory_total": "bytes",
    "gpu_memory_bandwidth_utilization": "percent",
    "gpu_ecc_errors_corrected": "count",
    "gpu_ecc_errors_uncorrected": "count",
    "gpu_pcie_tx_bytes": "bytes_per_second",
    "gpu_pcie_rx_bytes": "bytes_per_second",
    "gpu_nvlink_tx_bytes": "bytes_per_second",
    "gpu_nvlink_rx_bytes": "bytes_per_second",
    "gpu_temperature": "celsius",
    "cpu_utilization": "percent",
    "memory_used": "bytes",
    "network_tx_bytes": "bytes_per_second",
    "network_rx_bytes": "bytes_per_second",
    "network_error_rate": "percent",
    "io_read_bytes": "bytes_per_second",
    "io_write_bytes": "bytes_per_second",
    "io_latency_p99": "microseconds",
    "runqueue_latency_p99": "microseconds",
    "context_switches": "per_second",
    "page_faults": "per_second",
}

#: a quiet stream checks this often whether its allocation is still on the node
IDLE_CHECK_SECONDS = 5.0


def metric_names(requested: Iterable[str]) -> frozenset[str]:
    """The names asked for (each may be comma-separated); empty = every metric."""
    return frozenset(n.strip() for item in requested for n in item.split(",") if n.strip())


def alert_message(node_id: str, ev: AlertEvent) -> v1.MetricAlert:
    return v1.MetricAlert(
        rule=ev.rule,
        metric=ev.metric,
        node_id=node_id,
        state=ev.state,
        value=ev.value,
        comparison=ev.comparison,
        threshold=ev.threshold,
        for_seconds=ev.for_seconds,
        since=ev.since,
        timestamp=ev.at,
        severity=ev.severity,
        message=ev.message,
    )


def snapshot(
    node_id: str,
    alloc_id: str,
    event: str,
    *,
    at: float,
    mode: str,
    until: float | None,
    resolution: float = 0.0,
    values: Mapping[str, float] | None = None,
    agg: str = "",
    names: frozenset[str] = frozenset(),
    alert_events: Sequence[AlertEvent] = (),
    firing: Sequence[AlertEvent] = (),
) -> v1.MetricsSnapshot:
    """One message of the stream (pure)."""
    samples = []
    for key, value in sorted((values or {}).items()):
        name, extra = split_key(key)
        if (names and name not in names) or not math.isfinite(value):
            continue
        labels = dict(extra)
        if agg:
            labels["agg"] = agg
        samples.append(
            v1.MetricSample(
                name=name,
                node_id=node_id,
                value=float(value),
                unit=UNITS.get(name, ""),
                timestamp=at,
                labels=labels,
            )
        )
    return v1.MetricsSnapshot(
        allocation_id=alloc_id,
        node_id=node_id,
        event=event,
        timestamp=at,
        samples=samples,
        alerts=[a.message for a in firing],
        alert_events=[alert_message(node_id, a) for a in alert_events],
        telemetry_mode=mode,
        mode_until=until or 0.0,
        resolution_seconds=resolution,
        node_ids=[node_id],
    )


async def metrics_stream(
    loop: TelemetryLoop,
    node_id: str,
    request: v1.StreamMetricsRequest,
    *,
    assigned: Callable[[str], object | None] = lambda _: None,
    idle_check: float = IDLE_CHECK_SECONDS,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[v1.MetricsSnapshot]:
    """The stream of one allocation (module docstring). NotFound (before anything is
    sent) when the allocation is neither running here nor assigned to this node."""
    aid = request.allocation_id
    hub = loop.hub

    def here() -> bool:
        return aid in hub.live or assigned(aid) is not None

    if not aid or not here():
        raise NotFound(
            f"allocation {aid} is not running on node {node_id}",
            details={"node": node_id, "allocation": aid},
        )
    names = metric_names(request.metrics)
    alerts_only = request.alerts_only
    every = max(0.0, request.interval_seconds)
    window = loop.windows.window
    with hub.subscribe(aid) as sub:
        mode = loop.mode(aid)

        def msg(event: str, at: float, **kw: object) -> v1.MetricsSnapshot:
            return snapshot(
                node_id,
                aid,
                event,
                at=at,
                mode=mode,
                until=loop.modes.until(aid),
                names=names,
                firing=hub.active(aid),
                **kw,  # type: ignore[arg-type]
            )

        def resolution() -> float:
            return 1.0 if mode == MODE_DEBUG else window

        firing = hub.active(aid)
        latest = loop.latest(aid)
        last_at = -math.inf  # the data time of the last metrics snapshot sent
        if not alerts_only:
            yield msg(
                "metrics",
                latest.at if latest is not None else 0.0,
                values=latest.values if latest is not None else {},
                agg="raw",
                resolution=resolution(),
                alert_events=firing,
            )
            last_at = latest.at if latest is not None else last_at
        elif firing:
            yield msg("alert", clock(), alert_events=firing)
        while True:
            u = await sub.get(timeout=idle_check)
            if u is None:
                if not here():
                    yield msg("end", clock(), resolution=resolution())
                    return
                continue
            if u.kind == END:
                yield msg("end", u.at, resolution=resolution())
                return
            if u.kind == ALERT:
                yield msg("alert", u.at, alert_events=u.alerts)
                continue
            if u.kind == RAW:
                if u.mode != mode:
                    mode = u.mode
                    if not alerts_only:
                        yield msg("mode", u.at, resolution=resolution())
                if mode != MODE_DEBUG or alerts_only:
                    continue
                agg = "raw"
            elif u.kind == WINDOW:
                if mode == MODE_DEBUG or alerts_only:
                    continue
                agg = "mean"
            else:
                continue
            if every and u.at - last_at < every - 0.05:
                continue
            last_at = u.at
            res = 1.0 if u.kind == RAW else u.window
            yield msg("metrics", u.at, values=u.values, agg=agg, resolution=res)


def set_mode(
    loop: TelemetryLoop,
    node_id: str,
    request: v1.SetTelemetryModeRequest,
    *,
    assigned: Callable[[str], object | None] = lambda _: None,
    clock: Callable[[], float] = time.time,
) -> v1.TelemetryModeResponse:
    """Switch the allocation's mode on this node (NotFound when it is not here,
    ValidationError for an unknown mode or a negative duration)."""
    aid = request.allocation_id
    mode = request.mode.strip().lower()
    if mode not in MODES:
        raise ValidationError(
            f"unknown telemetry mode {request.mode!r}",
            details={"available": ", ".join(MODES)},
            hint="Use prod, debug or audit.",
        )
    if request.duration_seconds < 0 or not math.isfinite(request.duration_seconds):
        raise ValidationError(
            f"telemetry mode duration must be positive, not {request.duration_seconds}"
        )
    if not aid or (aid not in loop.hub.live and assigned(aid) is None):
        raise NotFound(
            f"allocation {aid} is not running on node {node_id}",
            details={"node": node_id, "allocation": aid},
        )
    until = loop.set_mode(aid, mode, request.duration_seconds or None)
    return v1.TelemetryModeResponse(
        node_id=node_id,
        allocation_id=aid,
        mode=loop.mode(aid),
        until=until or 0.0,
        default_mode=loop.modes.default,
    )
