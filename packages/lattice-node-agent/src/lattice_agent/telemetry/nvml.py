"""The NVML telemetry source (spec: Telemetry, Layer 1, GPU metrics): SM utilization,
memory, power, ECC error counts and PCIe/NVLink throughput per GPU, attributed to the
allocations running on the node.

Reading the devices (:func:`read_gpus`) is the only part that talks to the driver, through
``nvidia-ml-py`` (``pynvml``); a metric the device does not support is left out of its
:class:`GpuReading`, never reported as zero. Everything else is pure:

* :func:`gpu_owners` decides which allocation each GPU belongs to. An allocation's GPUs are
  its ``tags["gpus"]`` indices, or every GPU of the node when it names none (nodes are
  allocated whole today). A GPU claimed by several allocations goes to the one whose
  processes hold a context on it (NVML's compute processes), and to nobody when that does
  not settle it: its device-wide values cannot be split.
* :func:`attribute` turns the readings into each allocation's values, one series per GPU
  (keys :func:`~lattice_agent.telemetry.samples.series_key` ``name{gpu=N}``, the ``gpu``
  label of the TSDB series). Counters (NVLink and PCIe bytes) become rates between
  collections.

Series, all per GPU: ``gpu_utilization`` (%, SM busy), ``gpu_memory_bandwidth_utilization``
(%, memory controller busy), ``gpu_memory_used``/``gpu_memory_total`` (bytes),
``gpu_power_draw`` (W), ``gpu_ecc_errors_corrected``/``gpu_ecc_errors_uncorrected`` (volatile
counts since the driver loaded), ``gpu_pcie_tx_bytes``/``gpu_pcie_rx_bytes`` and
``gpu_nvlink_tx_bytes``/``gpu_nvlink_rx_bytes`` (bytes per second), ``gpu_temperature``
(degrees C).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from lattice_agent.telemetry.members import by_process_group, target_pids
from lattice_agent.telemetry.samples import (
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER_DRAW,
    GPU_UTILIZATION,
    Target,
    series_key,
)

log = logging.getLogger("lattice.agent.telemetry")

__all__ = [
    "GPU_SERIES",
    "GpuReading",
    "NvmlSource",
    "attribute",
    "gpu_owners",
    "nvml_source",
    "read_gpus",
]

GPU_MEMORY_BANDWIDTH = "gpu_memory_bandwidth_utilization"
GPU_ECC_CORRECTED = "gpu_ecc_errors_corrected"
GPU_ECC_UNCORRECTED = "gpu_ecc_errors_uncorrected"
GPU_PCIE_TX = "gpu_pcie_tx_bytes"
GPU_PCIE_RX = "gpu_pcie_rx_bytes"
GPU_NVLINK_TX = "gpu_nvlink_tx_bytes"
GPU_NVLINK_RX = "gpu_nvlink_rx_bytes"
GPU_TEMPERATURE = "gpu_temperature"

#: every per-GPU series this source reports
GPU_SERIES = (
    GPU_UTILIZATION,
    GPU_MEMORY_BANDWIDTH,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_POWER_DRAW,
    GPU_ECC_CORRECTED,
    GPU_ECC_UNCORRECTED,
    GPU_PCIE_TX,
    GPU_PCIE_RX,
    GPU_NVLINK_TX,
    GPU_NVLINK_RX,
    GPU_TEMPERATURE,
)

# NVML reports NVLink data throughput as a counter of KiB; scope UINT_MAX = all links
_ALL_LINKS = 0xFFFFFFFF
_MAX_NVLINKS = 18


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one collection. ``values`` holds the instantaneous series (a name the
    device does not support is absent); ``counters`` the cumulative ones (NVLink and PCIe
    bytes),
    turned into rates by :func:`attribute`; ``processes`` the pids holding a compute
    context with their GPU memory (bytes, None where the driver does not say)."""

    index: int
    values: Mapping[str, float] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    processes: tuple[tuple[int, int | None], ...] = ()


# --- pure: who owns a GPU, and what each allocation gets -----------------------------------


def gpu_owners(
    gpus: Sequence[int],
    claims: Mapping[str, frozenset[int] | None],
    holders: Mapping[int, frozenset[str]],
) -> dict[int, str]:
    """GPU index -> the allocation it is attributed to. ``claims``: allocation -> its GPU
    indices (None: every GPU of the node). ``holders``: GPU -> the allocations whose
    processes hold a context on it. One claimant owns the GPU; several are settled by
    which of them holds it; otherwise the GPU is nobody's (left out, never guessed)."""
    out: dict[int, str] = {}
    for g in gpus:
        claimants = [a for a, mine in claims.items() if mine is None or g in mine]
        if len(claimants) == 1:
            out[g] = claimants[0]
            continue
        holding = [a for a in claimants if a in holders.get(g, frozenset())]
        if len(holding) == 1:
            out[g] = holding[0]
    return out


def attribute(
    readings: Sequence[GpuReading],
    owners: Mapping[int, str],
    previous: Mapping[int, tuple[float, Mapping[str, float]]],
    now: float,
) -> tuple[dict[str, dict[str, float]], dict[int, tuple[float, Mapping[str, float]]]]:
    """Each owned GPU's values as its owner's ``name{gpu=N}`` series, counters as rates
    since ``previous`` (GPU -> (time, counters)); returns the values and the counters to
    keep for the next call. A counter that went backwards (a driver reload) gives no rate
    that time."""
    out: dict[str, dict[str, float]] = {}
    keep: dict[int, tuple[float, Mapping[str, float]]] = {}
    for r in readings:
        keep[r.index] = (now, dict(r.counters))
        owner = owners.get(r.index)
        if owner is None:
            continue
        values = out.setdefault(owner, {})
        for name, v in r.values.items():
            values[series_key(name, r.index)] = float(v)
        prev = previous.get(r.index)
        if prev is None:
            continue
        dt = now - prev[0]
        if dt <= 0:
            continue
        for name, v in r.counters.items():
            before = prev[1].get(name)
            if before is not None and v >= before:
                values[series_key(name, r.index)] = (v - before) / dt
    return out, keep


def gpu_claims(targets: Sequence[Target]) -> dict[str, frozenset[int] | None]:
    """Allocation -> its GPU indices (``Target.gpus``; None: every GPU)."""
    return {t.alloc_id: t.gpus for t in targets}


# --- reading the devices --------------------------------------------------------------------


def _try(fn: Callable[[], Any]) -> Any:
    """One NVML query; None where it failed."""
    try:
        return fn()
    except Exception:
        return None


# NVML_ERROR_NOT_SUPPORTED: asked once; a device does not start supporting a query later
_NOT_SUPPORTED = 3


class _Queries:
    """The queries of one collection, skipping those a device said it does not support
    (``skip``: GPU index -> query names, kept by the source between collections: a
    query the device refuses costs a driver call each time otherwise)."""

    def __init__(self, skip: dict[int, set[str]]) -> None:
        self.skip = skip

    def ask(self, index: int, what: str, fn: Callable[[], Any]) -> Any:
        if what in self.skip.get(index, ()):
            return None
        try:
            return fn()
        except Exception as e:  # the value is absent, never zero
            if getattr(e, "value", None) == _NOT_SUPPORTED:
                self.skip.setdefault(index, set()).add(what)
            return None

    def unsupported(self, index: int, what: str) -> None:
        self.skip.setdefault(index, set()).add(what)


def _field_counters(
    nvml: ModuleType,
    handle: Any,
    index: int,
    q: _Queries,
    what: str,
    fields: Mapping[str, int],
    scopes: Sequence[Sequence[int]],
    scale: float,
) -> dict[str, float]:
    """Cumulative device counters read as NVML field values (``name -> field id``), summed
    over the scopes of the first scope set that answers (e.g. every NVLink), times
    ``scale``; nothing (and the query skipped from then on) where none answers."""
    if what in q.skip.get(index, ()):
        return {}
    names = list(fields)
    for scope_set in scopes:
        totals = [0.0] * len(names)
        seen = False
        for scope in scope_set:
            got = _try(
                lambda s=scope: nvml.nvmlDeviceGetFieldValues(
                    handle, [(fields[n], s) for n in names]
                )
            )
            for i, fv in enumerate(got or ()):
                if fv.nvmlReturn == 0:
                    totals[i] += float(fv.value.ullVal) * scale
                    seen = True
        if seen:
            return dict(zip(names, totals, strict=True))
    q.unsupported(index, what)
    return {}


def _nvlink_counters(nvml: ModuleType, handle: Any, index: int, q: _Queries) -> dict[str, float]:
    """NVLink data bytes sent/received since the driver loaded (every link; NVML counts
    KiB), or nothing on a GPU without NVLink."""
    fields = {
        GPU_NVLINK_TX: nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        GPU_NVLINK_RX: nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    }
    scopes = ((_ALL_LINKS,), tuple(range(_MAX_NVLINKS)))
    return _field_counters(nvml, handle, index, q, "nvlink", fields, scopes, 1024.0)


def _pcie_counters(nvml: ModuleType, handle: Any, index: int, q: _Queries) -> dict[str, float]:
    """PCIe bytes sent/received since the driver loaded (newer drivers), or nothing."""
    tx = getattr(nvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
    rx = getattr(nvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
    if tx is None or rx is None:
        return {}
    fields = {GPU_PCIE_TX: tx, GPU_PCIE_RX: rx}
    return _field_counters(nvml, handle, index, q, "pcie_counters", fields, ((0,),), 1.0)


def read_gpus(
    nvml: ModuleType, handles: Sequence[tuple[int, Any]], skip: dict[int, set[str]] | None = None
) -> list[GpuReading]:
    """Every GPU's reading (NVML must be initialised); ``skip`` remembers the queries a
    device does not support (see :class:`_Queries`)."""
    q = _Queries(skip if skip is not None else {})
    out = []
    for i, h in handles:
        values: dict[str, float] = {}
        util = q.ask(i, "util", lambda h=h: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            values[GPU_UTILIZATION] = float(util.gpu)
            values[GPU_MEMORY_BANDWIDTH] = float(util.memory)
        mem = q.ask(i, "memory", lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            values[GPU_MEMORY_USED] = float(mem.used)
            values[GPU_MEMORY_TOTAL] = float(mem.total)
        power = q.ask(i, "power", lambda h=h: nvml.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            values[GPU_POWER_DRAW] = float(power) / 1000.0  # mW
        for name, kind in (
            (GPU_ECC_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            (GPU_ECC_UNCORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            n = q.ask(
                i,
                name,
                lambda h=h, k=kind: nvml.nvmlDeviceGetTotalEccErrors(h, k, nvml.NVML_VOLATILE_ECC),
            )
            if n is not None:
                values[name] = float(n)
        counters = _nvlink_counters(nvml, h, i, q)
        pcie = _pcie_counters(nvml, h, i, q)
        counters.update(pcie)
        # without the PCIe byte counters: the driver's own rate, which samples for 20 ms
        # per direction (the collection runs in a worker thread, off the event loop)
        for name, which in (
            (GPU_PCIE_TX, nvml.NVML_PCIE_UTIL_TX_BYTES),
            (GPU_PCIE_RX, nvml.NVML_PCIE_UTIL_RX_BYTES),
        ):
            if pcie:
                break
            kbps = q.ask(i, name, lambda h=h, w=which: nvml.nvmlDeviceGetPcieThroughput(h, w))
            if kbps is not None:
                values[name] = float(kbps) * 1024.0  # KB/s
        temp = q.ask(
            i,
            "temperature",
            lambda h=h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
        )
        if temp is not None:
            values[GPU_TEMPERATURE] = float(temp)
        procs = q.ask(i, "processes", lambda h=h: nvml.nvmlDeviceGetComputeRunningProcesses(h))
        out.append(
            GpuReading(
                i,
                values=values,
                counters=counters,
                processes=tuple((int(p.pid), _memory_of(p)) for p in procs or ()),
            )
        )
    return out


def _memory_of(proc: Any) -> int | None:
    used = getattr(proc, "usedGpuMemory", None)
    # NVML_VALUE_NOT_AVAILABLE (all ones) where the driver cannot tell (e.g. under MIG)
    return int(used) if used is not None and used < (1 << 63) else None


# --- the source -----------------------------------------------------------------------------


class NvmlSource:
    """The ``nvml`` telemetry source (:class:`~lattice_agent.telemetry.samples.Source`).
    ``pids_of(target)`` answers the processes of an allocation (for GPUs several
    allocations claim); by default its scope's or its process groups' members."""

    name = "nvml"

    def __init__(
        self,
        nvml: ModuleType,
        *,
        pids_of: Callable[[Target], set[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = nvml
        self._pids_of = pids_of or (lambda t: set(target_pids(t, by_process_group())))
        self._clock = clock
        count = nvml.nvmlDeviceGetCount()
        self.handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        self._previous: dict[int, tuple[float, Mapping[str, float]]] = {}
        self._unsupported: dict[int, set[str]] = {}

    @property
    def gpu_count(self) -> int:
        return len(self.handles)

    def forget(self, alloc_id: str) -> None:
        """Nothing per allocation is kept: counters are per GPU."""

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        readings = read_gpus(self.nvml, self.handles, self._unsupported)
        claims = gpu_claims(targets)
        contested = {
            r.index
            for r in readings
            if sum(1 for mine in claims.values() if mine is None or r.index in mine) > 1
        }
        holders: dict[int, frozenset[str]] = {}
        if contested:
            owner_of_pid = {pid: t.alloc_id for t in targets for pid in self._pids_of(t)}
            for r in readings:
                if r.index in contested:
                    holders[r.index] = frozenset(
                        owner_of_pid[pid] for pid, _ in r.processes if pid in owner_of_pid
                    )
        owners = gpu_owners([r.index for r in readings], claims, holders)
        values, self._previous = attribute(readings, owners, self._previous, self._clock())
        return values

    def close(self) -> None:
        _try(self.nvml.nvmlShutdown)


def nvml_source(*, on_state: Callable[[bool, str], None] | None = None) -> NvmlSource | None:
    """The NVML source where the driver's library loads and there is at least one GPU,
    else None (the reason goes to the log once and to ``on_state``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no library, no driver, no device: the node has no NVML GPUs
        why = f"NVML unavailable: {type(e).__name__}: {e}"
        log.info("telemetry: %s", why)
        if on_state is not None:
            on_state(False, why)
        return None
    try:
        src = NvmlSource(pynvml)
    except Exception as e:
        why = f"NVML unavailable: {type(e).__name__}: {e}"
        log.warning("telemetry: %s", why)
        _try(pynvml.nvmlShutdown)
        if on_state is not None:
            on_state(False, why)
        return None
    if src.gpu_count == 0:
        src.close()
        if on_state is not None:
            on_state(False, "NVML found no GPU")
        return None
    if on_state is not None:
        on_state(True, f"{src.gpu_count} GPU(s)")
    return src
