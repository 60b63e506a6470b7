"""The agent's telemetry task: collect every second, aggregate, push.

Every ``interval`` (1 s) :class:`TelemetryLoop` asks its sources (today the /proc + cgroup
collector; eBPF and NVML later, behind the same :class:`~lattice_agent.telemetry.samples.Source`
interface) for the values of every allocation running on the node, adds them to the
prod-mode windows (:class:`~lattice_agent.telemetry.aggregate.Windows`) and, for the
allocations in debug mode, makes one ``agg="raw"`` sample per value at once. Windows close
one second after their end (so a sample is never younger than the TSDB's query latency
offset) and their summaries join the raw samples in the pusher's queue. Without
``telemetry.tsdb_endpoint`` nothing is pushed; the last reading of each allocation stays
available (:meth:`TelemetryLoop.latest`) for node-local consumers.

Modes (spec: Switching Telemetry Mode) are per allocation, pure state here
(:class:`ModeTable`): ``set_mode(alloc_id, "debug", duration)`` switches at the next
collection and reverts to the node's default (``telemetry.mode``, prod) after ``duration``
(default ``telemetry.debug_auto_revert_seconds``, 30 min). Debug mode adds the raw series;
the prod aggregates continue, so dashboards and the scheduler's feedback keep their
resolution-independent series. Audit mode aggregates as prod does; its file-access events
are :mod:`~lattice_agent.telemetry.fileaudit`'s. With ``modes_file`` the table is saved
after every change and restored at start (a mode whose end passed meanwhile reverts), so
modes survive an agent restart.

Every collection and every closed window also goes to :attr:`TelemetryLoop.hub`
(:class:`~lattice_agent.telemetry.hub.MetricsHub`), which evaluates the threshold alerts
(``telemetry.alert_rules``) and feeds live watchers (``lattice watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge, Histogram

from lattice_agent.cgroups import allocation_gpus
from lattice_agent.persist import read_json, write_json_atomic
from lattice_agent.telemetry.aggregate import Windows, raw_samples
from lattice_agent.telemetry.alerts import DEFAULT_RULES, AlertRule, rules_from_config
from lattice_agent.telemetry.ebpf import ebpf_source
from lattice_agent.telemetry.hub import MetricsHub
from lattice_agent.telemetry.nvml import nvml_source
from lattice_agent.telemetry.proc import ProcCollector
from lattice_agent.telemetry.push import VictoriaPusher
from lattice_agent.telemetry.samples import (
    MODE_DEBUG,
    MODE_PROD,
    MODES,
    AllocLabels,
    Reading,
    Sample,
    Source,
    Target,
)

if TYPE_CHECKING:
    from lattice_common.config import TelemetryConfig
    from lattice_common.types import Allocation, AllocationReport

    from lattice_agent.cgroups import CgroupManager

log = logging.getLogger("lattice.agent.telemetry")

__all__ = [
    "COLLECT_SECONDS",
    "SOURCE",
    "ModeTable",
    "TelemetryLoop",
    "running_targets",
    "telemetry_loop",
]

COLLECT_SECONDS = Histogram(
    "lattice_agent_telemetry_collect_seconds",
    "Duration of one telemetry collection over every allocation on the node",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
SOURCE = Gauge(
    "lattice_agent_telemetry_source",
    "1 for each telemetry source this node collects with (proc, ebpf, nvml)",
    ["source"],
)

# windows close this long after their end: every sample is at least this old when pushed
_CLOSE_LAG = 1.0


@dataclass
class ModeTable:
    """Telemetry mode per allocation with auto-revert; pure (times are passed in)."""

    default: str = MODE_PROD
    debug_seconds: float = 1800.0
    _modes: dict[str, tuple[str, float | None]] = field(default_factory=dict)
    # called after every change (the loop persists the table: modes survive a restart)
    on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def entries(self) -> dict[str, dict[str, object]]:
        """The table as plain data (alloc id -> mode and until), for the modes file."""
        return {aid: {"mode": m, "until": u} for aid, (m, u) in sorted(self._modes.items())}

    def restore(self, entries: Mapping[str, object], now: float) -> list[str]:
        """Take back saved ``entries``: those whose ``until`` passed revert (dropped),
        unknown modes and the default without an end are skipped; returns the restored
        allocation ids."""
        restored: list[str] = []
        for aid, e in entries.items():
            if not isinstance(e, Mapping):
                continue
            mode, until = e.get("mode"), e.get("until")
            if mode not in MODES or not (until is None or isinstance(until, int | float)):
                continue
            if until is not None and now >= until:
                log.info(
                    "allocation %s: telemetry mode %s ended while the agent was down", aid, mode
                )
                continue
            if mode == self.default and until is None:
                continue
            self._modes[str(aid)] = (str(mode), float(until) if until is not None else None)
            restored.append(str(aid))
        return restored

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise ValueError(f"telemetry mode {self.default!r}: expected one of {MODES}")

    def set(self, alloc_id: str, mode: str, duration: float | None, now: float) -> float | None:
        """Switch ``alloc_id`` to ``mode``; returns when it reverts (None: it does not).
        Debug lasts ``duration`` seconds (default ``debug_seconds``); another mode lasts
        ``duration`` when given, else until changed. The default mode clears the entry."""
        if mode not in MODES:
            raise ValueError(f"telemetry mode {mode!r}: expected one of {', '.join(MODES)}")
        if duration is not None and not duration > 0:
            raise ValueError(f"telemetry mode duration must be positive, not {duration}")
        if mode == self.default and duration is None:
            if self._modes.pop(alloc_id, None) is not None:
                self._changed()
            return None
        if duration is None and mode == MODE_DEBUG:
            duration = self.debug_seconds
        until = now + duration if duration is not None else None
        self._modes[alloc_id] = (mode, until)
        self._changed()
        return until

    def get(self, alloc_id: str, now: float) -> str:
        entry = self._modes.get(alloc_id)
        if entry is None:
            return self.default
        mode, until = entry
        if until is not None and now >= until:
            del self._modes[alloc_id]
            log.info(
                "allocation %s: telemetry mode %s ended; back to %s", alloc_id, mode, self.default
            )
            self._changed()
            return self.default
        return mode

    def until(self, alloc_id: str) -> float | None:
        entry = self._modes.get(alloc_id)
        return entry[1] if entry is not None else None

    def forget(self, alloc_id: str) -> None:
        """The allocation left the node: its mode goes with it."""
        if self._modes.pop(alloc_id, None) is not None:
            self._changed()

    def expire(self, now: float) -> None:
        for alloc_id in list(self._modes):
            self.get(alloc_id, now)


class TelemetryLoop:
    """One node's telemetry task (module docstring). ``targets`` is called on the event
    loop each interval and answers the allocations running here."""

    def __init__(
        self,
        targets: Callable[[], Iterable[Target]],
        sources: Sequence[Source],
        *,
        pusher: VictoriaPusher | None = None,
        window_seconds: float = 30.0,
        interval: float = 1.0,
        mode: str = MODE_PROD,
        debug_seconds: float = 1800.0,
        clock: Callable[[], float] = time.time,
        alert_rules: Sequence[AlertRule] = DEFAULT_RULES,
        modes_file: Path | None = None,
    ) -> None:
        # live watchers (NodeAgentService.StreamMetrics) and the threshold alerts
        self.hub = MetricsHub(alert_rules)
        self._targets = targets
        self.sources = list(sources)
        self.pusher = pusher
        self.windows = Windows(window_seconds)
        self.interval = float(interval)
        self.modes = ModeTable(mode, debug_seconds)
        self._clock = clock
        # modes survive an agent restart: restored from, and saved to, ``modes_file``
        self.modes_file = modes_file
        if modes_file is not None:
            self._restore_modes(modes_file)
            self.modes.on_change = self._save_modes
        self._latest: dict[str, Reading] = {}
        self._known: set[str] = set()
        self._errors: dict[str, str] = {}  # source -> last error said (said once)
        # debug traces: each debug-mode collection's raw samples (telemetry/traces.py)
        self.on_raw: Callable[[Reading, list[Sample]], None] | None = None
        for s in self.sources:
            SOURCE.labels(s.name).set(1)

    # --- modes ------------------------------------------------------------------------

    def _restore_modes(self, path: Path) -> None:
        data = read_json(path)
        if not data:
            return
        saved_default = data.get("default")
        if saved_default not in (None, self.modes.default):
            log.info(
                "telemetry: the node's default mode is now %s (was %s)",
                self.modes.default,
                saved_default,
            )
        entries = data.get("modes")
        restored = self.modes.restore(entries if isinstance(entries, dict) else {}, self._clock())
        if restored:
            log.info("telemetry: modes restored for %s", ", ".join(restored))
        if len(restored) != len(entries or {}):
            self._save_modes()  # the reverted ones are gone from the file too

    def _save_modes(self) -> None:
        if self.modes_file is None:
            return
        write_json_atomic(
            self.modes_file, {"default": self.modes.default, "modes": self.modes.entries()}
        )

    def set_mode(self, alloc_id: str, mode: str, duration: float | None = None) -> float | None:
        """Switch an allocation's telemetry mode (``prod``/``debug``/``audit``) from the
        next collection on; returns the wall time it reverts at (None: it does not)."""
        until = self.modes.set(alloc_id, mode, duration, self._clock())
        log.info(
            "allocation %s: telemetry mode %s%s",
            alloc_id,
            mode,
            f" for {until - self._clock():.0f} s" if until is not None else "",
        )
        return until

    def mode(self, alloc_id: str) -> str:
        return self.modes.get(alloc_id, self._clock())

    def latest(self, alloc_id: str) -> Reading | None:
        """The last collection of an allocation running here (None: none yet / gone)."""
        return self._latest.get(alloc_id)

    # --- one collection ---------------------------------------------------------------

    def _collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        merged: dict[str, dict[str, float]] = {}
        for src in self.sources:
            try:
                got = src.collect(targets)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                if self._errors.get(src.name) != why:
                    self._errors[src.name] = why
                    log.exception("telemetry source %s failed", src.name)
                continue
            self._errors.pop(src.name, None)
            for aid, values in got.items():
                merged.setdefault(aid, {}).update(values)
        return merged

    async def tick(self) -> list[Sample]:
        """Collect once; returns the samples it queued for the TSDB."""
        targets = list(self._targets())
        live = {t.alloc_id for t in targets}
        for gone in self._known - live:
            self._latest.pop(gone, None)
            self.modes.forget(gone)
            for src in self.sources:
                with contextlib.suppress(Exception):
                    src.forget(gone)
        self._known = live
        at = self._clock()
        self.modes.expire(at)
        self.hub.sync(live, at)
        samples: list[Sample] = []
        if targets:
            t0 = time.perf_counter()
            values = await asyncio.to_thread(self._collect, targets)
            COLLECT_SECONDS.observe(time.perf_counter() - t0)
            for t in targets:
                v = values.get(t.alloc_id)
                if not v:
                    continue
                reading = Reading(t.labels, at, v)
                self._latest[t.alloc_id] = reading
                self.windows.add(reading)
                mode = self.modes.get(t.alloc_id, at)
                if mode == MODE_DEBUG:
                    raw = raw_samples(reading)
                    samples.extend(raw)
                    if self.on_raw is not None:
                        self.on_raw(reading, raw)
                self.hub.reading(reading, mode)  # alerts, live watchers
        closed = self.windows.close(self._clock(), lag=_CLOSE_LAG)
        samples.extend(closed)
        if closed:
            self.hub.windows(closed, self.windows.window)
        if self.pusher is not None and samples:
            self.pusher.offer(samples)
            if closed:  # a window's summaries go out at once, raw samples at the interval
                self.pusher.kick()
        return samples

    async def run(self) -> None:
        """Collect every ``interval`` until cancelled; the pusher runs beside it."""
        push_task = (
            asyncio.create_task(self.pusher.run(), name="telemetry-push")
            if self.pusher is not None
            else None
        )
        log.info(
            "telemetry: sources %s, %s s windows, %s",
            ", ".join(s.name for s in self.sources) or "none",
            f"{self.windows.window:g}",
            f"pushing to {self.pusher.url}" if self.pusher is not None else "no TSDB configured",
        )
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        failed = False
        try:
            while True:
                try:
                    await self.tick()
                    failed = False
                except asyncio.CancelledError:
                    raise
                except Exception:  # telemetry degrades; the agent goes on
                    if not failed:
                        log.exception("telemetry collection failed; continuing")
                    failed = True
                next_at += self.interval
                delay = next_at - loop.time()
                if delay < 0:  # fell behind (a slow collection): skip, do not burst
                    next_at = loop.time()
                    delay = 0.0
                await asyncio.sleep(delay)
        finally:
            if push_task is not None:
                push_task.cancel()
                await asyncio.gather(push_task, return_exceptions=True)
            if self.pusher is not None:
                await self.pusher.close(final_flush_timeout=1.0)


def running_targets(
    node_id: str,
    assigned: Mapping[str, Allocation],
    reports: Iterable[AllocationReport],
    cgroups: CgroupManager | None = None,
    extra: Mapping[str, Sequence[int]] | None = None,
) -> list[Target]:
    """The allocations running on this node as telemetry targets: those the runtime
    reports ``running`` with a process (its session leader: pgid = pid) and the desired
    state assigns here (their labels), with their cgroup scope when cgroups are in use.
    ``extra``: allocation id -> more process groups of it on this node (task launches'
    ranks, attach sessions), which also make a target of an allocation whose batch
    script runs on another node (a multi-node allocation's other nodes)."""
    out: list[Target] = []
    extra = extra or {}
    seen: set[str] = set()
    for r in reports:
        if r.phase != "running" or r.pid <= 0:
            continue
        alloc = assigned.get(r.allocation_id)
        if alloc is None:
            continue
        seen.add(alloc.id)
        out.append(_target(node_id, alloc, (r.pid, *extra.get(alloc.id, ())), cgroups))
    for aid, groups in extra.items():
        alloc = assigned.get(aid)
        if aid in seen or alloc is None or not groups:
            continue
        out.append(_target(node_id, alloc, tuple(groups), cgroups))
    return out


def _target(
    node_id: str, alloc: Allocation, pgids: tuple[int, ...], cgroups: CgroupManager | None
) -> Target:
    scope = cgroups.scope(alloc.id) if cgroups is not None and cgroups.available else None
    return Target(AllocLabels.of(alloc, node_id), pgids, scope, allocation_gpus(alloc.spec.tags))


def telemetry_loop(
    config: TelemetryConfig,
    *,
    targets: Callable[[], Iterable[Target]],
    cgroups: CgroupManager | None = None,
    sources: Sequence[Source] | None = None,
    modes_file: Path | None = None,
) -> TelemetryLoop:
    """The loop the agent runs, from the ``telemetry`` config section: the /proc + cgroup
    source, and the eBPF one after it where :func:`~lattice_agent.telemetry.ebpf.probe`
    says it can run and a TSDB is configured (loading bcc costs ~120 MB and a compile per
    agent: not worth it where nothing keeps the series), unless ``sources`` are given; a
    pusher when ``tsdb_endpoint`` is set."""
    if sources is not None:
        srcs = list(sources)
    else:
        ebpf = (
            ebpf_source(on_state=lambda ok: SOURCE.labels("ebpf").set(1 if ok else 0))
            if config.tsdb_endpoint
            else None
        )
        nvml = nvml_source(on_state=lambda ok, _why: SOURCE.labels("nvml").set(1 if ok else 0))
        srcs = [ProcCollector(cgroups), *([ebpf] if ebpf is not None else [])]
        srcs += [nvml] if nvml is not None else []
        if ebpf is None:
            SOURCE.labels("ebpf").set(0)
    pusher = VictoriaPusher(config.tsdb_endpoint) if config.tsdb_endpoint else None
    return TelemetryLoop(
        targets,
        srcs,
        pusher=pusher,
        window_seconds=config.aggregation_window_seconds,
        mode=config.mode,
        debug_seconds=config.debug_auto_revert_seconds,
        alert_rules=rules_from_config(config.alert_rules),
        modes_file=modes_file,
    )
