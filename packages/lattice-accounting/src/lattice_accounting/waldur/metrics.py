"""Prometheus metrics of the Waldur push (names from the spec's accounting chapter where
it names them: ``lattice_accounting_events_buffered``,
``lattice_accounting_events_dropped_total``).

One :class:`WaldurMetrics` per registry: the service uses the default registry (served
on the accounting metrics port), tests pass their own so that they can read values."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

__all__ = ["WaldurMetrics"]


class WaldurMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.buffered = Gauge(
            "lattice_accounting_events_buffered",
            "Accounting events waiting to be pushed to Waldur, in memory or on disk (WAL)",
            ["where"],
            registry=reg,
        )
        self.dropped = Counter(
            "lattice_accounting_events_dropped",
            "Accounting events dropped because the memory buffer and the disk buffer were "
            "both full (alert when > 0; regenerate with `lattice admin accounting reconcile`)",
            registry=reg,
        )
        self.disk_alert = Gauge(
            "lattice_accounting_disk_buffer_alert",
            "1 while the disk buffer holds more than accounting.disk_buffer_max_events events",
            registry=reg,
        )
        self.wal_corrupt = Counter(
            "lattice_accounting_wal_corrupt_records",
            "Damaged records found (and truncated) at the end of a WAL segment on start",
            registry=reg,
        )
        self.pushed = Counter(
            "lattice_accounting_events_pushed",
            "Accounting events Waldur accepted",
            registry=reg,
        )
        self.rejected = Counter(
            "lattice_accounting_events_rejected",
            "Accounting events Waldur refused as invalid (4xx other than auth); logged, skipped",
            registry=reg,
        )
        self.push_errors = Counter(
            "lattice_accounting_push_errors",
            "Push rounds that stopped on an error, by kind (unreachable, timeout, server, auth)",
            ["kind"],
            registry=reg,
        )
        self.last_push = Gauge(
            "lattice_accounting_last_push_timestamp_seconds",
            "When a push round last succeeded (epoch seconds)",
            registry=reg,
        )
