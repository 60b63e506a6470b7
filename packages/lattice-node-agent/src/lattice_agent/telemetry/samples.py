"""Plain data of node telemetry: metric names, labels, targets, readings, samples, and the
:class:`Source` interface every collector implements.

Series names are those of the specification's User Metrics Catalog; every sample carries
the labels ``alloc_id``, ``node_id``, ``tenant``, ``user``, ``vcluster`` and ``agg``
(``mean``/``p50``/``p95``/``p99``/``max``/``count`` in prod mode, ``raw`` in debug mode).
Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lattice_common.types import Allocation

    from lattice_agent.cgroups import Scope

__all__ = [
    "AGGS",
    "CATALOG",
    "CPU_UTILIZATION",
    "GPU_MEMORY_TOTAL",
    "GPU_MEMORY_USED",
    "GPU_POWER_DRAW",
    "GPU_UTILIZATION",
    "IO_READ_BYTES",
    "IO_WRITE_BYTES",
    "MEMORY_USED",
    "MODES",
    "MODE_AUDIT",
    "MODE_DEBUG",
    "MODE_PROD",
    "NETWORK_ERROR_RATE",
    "NETWORK_RX_BYTES",
    "NETWORK_TX_BYTES",
    "RAW",
    "AllocLabels",
    "Reading",
    "Sample",
    "Source",
    "Target",
    "series_key",
    "split_key",
]

# --- the User Metrics Catalog (what this agent may emit per allocation) -------------------
#: percent of ONE core, summed over the allocation's processes on the node (2 busy cores = 200)
CPU_UTILIZATION = "cpu_utilization"
#: bytes in use: the cgroup's memory usage, else the sum of the processes' RSS
MEMORY_USED = "memory_used"
#: storage throughput, bytes per second
IO_READ_BYTES = "io_read_bytes"
IO_WRITE_BYTES = "io_write_bytes"
#: network throughput, bytes per second (only where attributable to the allocation)
NETWORK_TX_BYTES = "network_tx_bytes"
NETWORK_RX_BYTES = "network_rx_bytes"
#: percent of the packets of the interval that failed (errors, drops; both ways), where
#: the network is attributable; the "network error rate > 0.1 %" alert's metric
NETWORK_ERROR_RATE = "network_error_rate"
#: GPU series (from the NVML source), one per GPU: label ``gpu`` (see :func:`series_key`)
GPU_UTILIZATION = "gpu_utilization"
GPU_MEMORY_USED = "gpu_memory_used"
GPU_POWER_DRAW = "gpu_power_draw"
GPU_MEMORY_TOTAL = "gpu_memory_total"

CATALOG = (
    GPU_UTILIZATION,
    GPU_MEMORY_USED,
    GPU_POWER_DRAW,
    CPU_UTILIZATION,
    MEMORY_USED,
    NETWORK_TX_BYTES,
    NETWORK_RX_BYTES,
    IO_READ_BYTES,
    IO_WRITE_BYTES,
)

#: the ``agg`` label values of a prod-mode window, in this order
AGGS = ("mean", "p50", "p95", "p99", "max", "count")
#: the ``agg`` label value of one debug-mode collection
RAW = "raw"

MODE_PROD = "prod"
MODE_DEBUG = "debug"
MODE_AUDIT = "audit"
MODES = (MODE_PROD, MODE_DEBUG, MODE_AUDIT)


@dataclass(frozen=True)
class AllocLabels:
    """Who a series belongs to: the labels every sample of one allocation carries."""

    alloc_id: str
    node_id: str
    tenant: str = ""
    user: str = ""
    vcluster: str = ""

    @classmethod
    def of(cls, alloc: Allocation, node_id: str) -> AllocLabels:
        spec = alloc.spec
        return cls(alloc.id, node_id, spec.tenant, spec.user, spec.vcluster)

    def pairs(
        self, agg: str, extra: tuple[tuple[str, str], ...] = ()
    ) -> tuple[tuple[str, str], ...]:
        """The label pairs of a sample (sorted by name), ``agg`` and ``extra`` (a series'
        own labels, e.g. ``gpu``) included."""
        base = (
            ("agg", agg),
            ("alloc_id", self.alloc_id),
            ("node_id", self.node_id),
            ("tenant", self.tenant),
            ("user", self.user),
            ("vcluster", self.vcluster),
        )
        return tuple(sorted(base + extra)) if extra else base


def series_key(name: str, gpu: int | str | None = None) -> str:
    """The key of a value in a reading: the catalog name, or ``name{gpu=N}`` for a series
    of one GPU (its TSDB series carries the label ``gpu="N"``)."""
    return name if gpu is None else f"{name}{{gpu={gpu}}}"


def split_key(key: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``series_key``'s inverse: ``(name, ((label, value), ...))``."""
    if not key.endswith("}") or "{" not in key:
        return key, ()
    name, inner = key[:-1].split("{", 1)
    pairs = tuple(sorted(tuple(p.split("=", 1)) for p in inner.split(",") if "=" in p))
    return name, pairs  # type: ignore[return-value]


@dataclass(frozen=True)
class Target:
    """One allocation to measure on this node: its labels and how its processes are found.

    ``scope`` (the allocation's cgroup) wins when it exists; else the processes are those
    whose process group is in ``pgids`` (the runtime's group; task launches may add theirs).
    ``gpus``: the node's GPU indices the allocation was given (None: every GPU).
    """

    labels: AllocLabels
    pgids: tuple[int, ...] = ()
    scope: Scope | None = None
    gpus: frozenset[int] | None = None

    @property
    def alloc_id(self) -> str:
        return self.labels.alloc_id


@dataclass(frozen=True)
class Reading:
    """One collection of one allocation: catalog name -> value, at wall time ``at`` (s)."""

    labels: AllocLabels
    at: float
    values: Mapping[str, float]

    @property
    def alloc_id(self) -> str:
        return self.labels.alloc_id


@dataclass(frozen=True)
class Sample:
    """One point for the TSDB: ``name{labels} value timestamp_ms``."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int


class Source(Protocol):
    """A collector of per-allocation values (the /proc + cgroup one here; eBPF and NVML
    later). ``collect`` is called once per collection interval from a worker thread, with
    every allocation running on the node, and answers ``alloc_id -> {catalog name: value}``
    for those it could measure (a metric it cannot attribute is left out, never zero).
    Rates (per second) are the source's business: it keeps what it needs between calls
    and drops it in ``forget`` when an allocation leaves. Values of several sources for
    one allocation are merged, later sources winning on the same name."""

    name: str

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]: ...

    def forget(self, alloc_id: str) -> None: ...
