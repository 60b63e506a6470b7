"""Threshold alerts (spec: Alert Generation), pure: rules, the state of each rule for one
allocation, and :func:`step`, which moves that state by one collection.

A rule watches one metric of an allocation's collections (every second, whatever the
telemetry mode): it *fires* once the value has been below (``<``) or above (``>``) the
threshold on every collection for at least ``for_seconds`` (0: at the first such
collection), and *resolves* at the first collection where it is not, or where the metric
has no value (a source that stopped reporting it, or no GPU: an alert never stays up on
data that is gone). A firing rule does not fire again until it has resolved.

The rules are the ``telemetry.alert_rules`` of the configuration; by default the
specification's four:

* ``gpu_idle`` — ``gpu_utilization < 10`` for 60 s (potential hang);
* ``gpu_memory_high`` — ``gpu_memory_utilization > 95`` (OOM risk);
* ``network_errors`` — ``network_error_rate > 0.1`` (percent of packets);
* ``io_latency`` — ``io_latency_p99 > 10000`` µs (10 ms).

``gpu_memory_utilization`` and ``network_error_rate`` are :func:`derived` from what
sources report (``gpu_memory_used``/``gpu_memory_total``, ``network_errors``/
``network_packets``) when they do not report them directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lattice_agent.telemetry.samples import split_key

if TYPE_CHECKING:
    from lattice_common.config import TelemetryAlertRule

__all__ = [
    "DEFAULT_RULES",
    "FIRING",
    "RESOLVED",
    "AlertEvent",
    "AlertRule",
    "RuleState",
    "active",
    "derived",
    "rules_from_config",
    "step",
]

FIRING = "firing"
RESOLVED = "resolved"
_OPS = ("<", ">")


@dataclass(frozen=True)
class AlertRule:
    """``metric comparison threshold`` held for ``for_seconds``."""

    name: str
    metric: str
    comparison: str
    threshold: float
    for_seconds: float = 0.0
    severity: str = "warning"
    message: str = ""

    def __post_init__(self) -> None:
        if self.comparison not in _OPS:
            raise ValueError(f"alert rule {self.name}: comparison must be < or >")
        if not math.isfinite(self.threshold):
            raise ValueError(f"alert rule {self.name}: the threshold must be a number")
        if not self.for_seconds >= 0:
            raise ValueError(f"alert rule {self.name}: for_seconds must be >= 0")

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` is on the alerting side (None / NaN: never)."""
        if value is None or not math.isfinite(value):
            return False
        return value < self.threshold if self.comparison == "<" else value > self.threshold

    @property
    def text(self) -> str:
        if self.message:
            return self.message
        side = "below" if self.comparison == "<" else "above"
        held = f" for {self.for_seconds:g} s" if self.for_seconds else ""
        return f"{self.metric} {side} {self.threshold:g}{held}"


@dataclass(frozen=True)
class RuleState:
    """One rule of one allocation: since when its condition holds (None: it does not)
    and whether it fired."""

    since: float | None = None
    firing: bool = False
    value: float = math.nan  # the value it fired with ...
    fired_at: float = math.nan  # ... and when


@dataclass(frozen=True)
class AlertEvent:
    """A rule fired or resolved at ``at`` (``since``: when its condition began)."""

    rule: str
    metric: str
    state: str  # FIRING | RESOLVED
    value: float
    comparison: str
    threshold: float
    for_seconds: float
    since: float
    at: float
    severity: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "metric": self.metric,
            "state": self.state,
            "value": self.value,
            "comparison": self.comparison,
            "threshold": self.threshold,
            "for_seconds": self.for_seconds,
            "since": self.since,
            "timestamp": self.at,
            "severity": self.severity,
            "message": self.message,
        }


def _event(rule: AlertRule, state: str, value: float, since: float, at: float) -> AlertEvent:
    return AlertEvent(
        rule.name,
        rule.metric,
        state,
        value,
        rule.comparison,
        rule.threshold,
        rule.for_seconds,
        since,
        at,
        rule.severity,
        rule.text,
    )


#: how per-GPU series (``name{gpu=N}``) roll up to the allocation's value on this node
GPU_ROLLUP = {
    "gpu_utilization": "avg",
    "gpu_memory_used": "sum",
    "gpu_memory_total": "sum",
    "gpu_power_draw": "sum",
}


def gpu_rollup(values: Mapping[str, float]) -> dict[str, float]:
    """The allocation-wide value of each per-GPU series in :data:`GPU_ROLLUP` (mean
    utilization, summed memory and power), where ``values`` has no such value itself."""
    parts: dict[str, list[float]] = {}
    for key, v in values.items():
        name, extra = split_key(key)
        if extra and name in GPU_ROLLUP and name not in values:
            parts.setdefault(name, []).append(v)
    return {
        name: (sum(vs) / len(vs) if GPU_ROLLUP[name] == "avg" else sum(vs))
        for name, vs in parts.items()
    }


def derived(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` with the allocation-wide GPU values (:func:`gpu_rollup`) and the ratios
    the default rules watch, where a source reported their parts but not the ratio:
    ``gpu_memory_utilization`` = 100 x used / total, ``network_error_rate`` = 100 x errors /
    packets (percent)."""
    out = dict(values)
    out.update(gpu_rollup(values))
    values = out
    used, total = values.get("gpu_memory_used"), values.get("gpu_memory_total")
    if "gpu_memory_utilization" not in out and used is not None and total:
        out["gpu_memory_utilization"] = 100.0 * used / total
    errors, packets = values.get("network_errors"), values.get("network_packets")
    if "network_error_rate" not in out and errors is not None and packets:
        out["network_error_rate"] = 100.0 * errors / packets
    return out


def step(
    rules: Sequence[AlertRule],
    state: Mapping[str, RuleState],
    values: Mapping[str, float],
    at: float,
) -> tuple[dict[str, RuleState], list[AlertEvent]]:
    """One collection (``values`` at wall time ``at``): the rules' new state and the
    alerts that fired or resolved with it (in rule order)."""
    values = derived(values)
    new: dict[str, RuleState] = {}
    events: list[AlertEvent] = []
    for rule in rules:
        prev = state.get(rule.name, RuleState())
        value = values.get(rule.metric)
        if rule.holds(value):
            assert value is not None
            since = prev.since if prev.since is not None and prev.since <= at else at
            cur = RuleState(since, prev.firing, prev.value, prev.fired_at)
            if not prev.firing and at - since >= rule.for_seconds:
                cur = replace(cur, firing=True, value=value, fired_at=at)
                events.append(_event(rule, FIRING, value, since, at))
            new[rule.name] = cur
            continue
        if prev.firing:
            gone = math.nan if value is None else float(value)
            events.append(_event(rule, RESOLVED, gone, prev.since or at, at))
        # the state of a rule that does not hold is the default: not stored
    return new, events


def active(rules: Sequence[AlertRule], state: Mapping[str, RuleState]) -> list[AlertEvent]:
    """The firing alerts of one allocation (as the FIRING events they fired with), in
    rule order."""
    out = []
    for rule in rules:
        st = state.get(rule.name)
        if st is not None and st.firing and st.since is not None:
            out.append(_event(rule, FIRING, st.value, st.since, st.fired_at))
    return out


def rules_from_config(rules: Iterable[TelemetryAlertRule]) -> list[AlertRule]:
    """``telemetry.alert_rules`` as :class:`AlertRule` objects."""
    return [
        AlertRule(r.name, r.metric, r.comparison, r.threshold, r.for_seconds, r.severity, r.message)
        for r in rules
    ]


def _defaults() -> list[AlertRule]:
    from lattice_common.config import TelemetryConfig

    return rules_from_config(TelemetryConfig().alert_rules)


#: the specification's four rules (``telemetry.alert_rules``' default)
DEFAULT_RULES: tuple[AlertRule, ...] = tuple(_defaults())
