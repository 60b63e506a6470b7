"""Prometheus metrics of the accounting service (served on ``accounting.metrics_listen``,
9105 by default). The Waldur push has its own (:mod:`lattice_accounting.waldur.metrics`)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.charge_cycle = Histogram(
            "lattice_accounting_charge_cycle_duration_seconds",
            "One job charger pass: plan, charge, finalize, watchdog",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=reg,
        )
        self.balance = Gauge(
            "lattice_accounting_balance",
            "Ledger balance per tenant (available: the tenant's account and its projects'; "
            "reserved: open reservations)",
            ["tenant", "kind"],
            registry=reg,
        )
        self.rejected = Counter(
            "lattice_accounting_reservations_rejected",
            "Submissions refused at the reservation gate for insufficient funds",
            registry=reg,
        )
        self.reserved = Counter(
            "lattice_accounting_reservations",
            "Reservations made at the gate",
            registry=reg,
        )
        self.watchdog_releases = Counter(
            "lattice_accounting_watchdog_releases",
            "Reservations the watchdog released, by why (orphan: no allocation appeared; "
            "not_started: the allocation did not start in time; gone: left the quorum)",
            ["why"],
            registry=reg,
        )
        self.cancelled = Counter(
            "lattice_accounting_funds_exhausted_cancellations",
            "Allocations cancelled because their project ran out of funds",
            registry=reg,
        )
        self.charged_allocations = Gauge(
            "lattice_accounting_charged_allocations",
            "Allocations charged in the last pass",
            registry=reg,
        )
        self.cursor = Gauge(
            "lattice_accounting_cursor_revision",
            "The quorum revision the ledger has processed (the durable cursor)",
            registry=reg,
        )


__all__ = ["ServiceMetrics"]
