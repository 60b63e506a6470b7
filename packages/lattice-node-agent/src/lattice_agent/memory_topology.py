"""Memory topology discovery (spec: Memory Topology): NUMA domains, unified CPU-GPU
memory, CXL-attached memory.

``read_numa_nodes`` is the thin reader of ``/sys/devices/system/node/node*/{meminfo,
cpulist,distance}``; everything else is pure:

* a NUMA node with CPUs is a ``Dram`` domain;
* on a superchip (GH200, GB200, MI300A: recognised by GPU model, as the spec says)
  the NUMA node of the GPU's memory (``GPU NUMA ID`` in ``nvidia-smi topo -m``; on
  GH200 a memory-only node) is merged into the CPU node the GPU is attached to, and
  the result is one ``Unified`` domain; MI300A's CPU nodes with an attached GPU are
  ``Unified`` too;
* a NUMA node with memory but no CPUs that is not GPU memory is ``CxlAttached``
  (CXL Type 3 expanders show up this way); on a superchip whose GPU memory nodes are
  not known, such nodes are taken as ``Hbm``;
* every pair of domains gets a ``MemoryInterconnect`` carrying the firmware's NUMA
  distance (``CxlSwitch`` when one side is CXL memory).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec
from lattice_common.types import (
    GpuDevice,
    MemoryDomain,
    MemoryDomainType,
    MemoryInterconnect,
    MemoryLinkType,
)

log = logging.getLogger("lattice.agent.discovery")

SYS_NODE_ROOT = Path("/sys/devices/system/node")

UNIFIED_MODELS = ("GH200", "GB200", "MI300A")
"""GPU models whose memory is one coherent pool with the CPU's."""


class NumaNode(msgspec.Struct, kw_only=True):
    id: int
    mem_bytes: int = 0
    cpulist: str = ""
    distances: list[int] = msgspec.field(default_factory=list)  # to node i, in order

    @property
    def cpus(self) -> list[int]:
        return parse_cpulist(self.cpulist)


class MemoryTopology(msgspec.Struct, kw_only=True):
    domains: list[MemoryDomain] = msgspec.field(default_factory=list)
    interconnects: list[MemoryInterconnect] = msgspec.field(default_factory=list)
    unified_memory: bool = False
    cxl_memory_gb: int = 0


# ------------------------------------------------------------------------- parsers


def parse_cpulist(text: str) -> list[int]:
    """Linux list format: ``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]; ``""`` -> []."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, _, hi = part.partition("-")
            hi, _, step = hi.partition(":")  # "0-15:2" (rare stride form)
            cpus.extend(range(int(lo), int(hi) + 1, int(step) if step else 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


def parse_node_meminfo(text: str) -> int:
    """``Node 0 MemTotal:  4679884 kB`` -> bytes (0 when absent)."""
    for ln in text.splitlines():
        m = re.match(r"^\s*Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB", ln)
        if m:
            return int(m.group(1)) * 1024
    return 0


def parse_distance(text: str) -> list[int]:
    """``10 21`` -> [10, 21]."""
    return [int(x) for x in text.split() if x.lstrip("-").isdigit()]


def read_numa_nodes(root: Path = SYS_NODE_ROOT) -> list[NumaNode]:
    """The NUMA nodes under ``root`` (``/sys/devices/system/node``); [] when absent."""
    nodes: list[NumaNode] = []
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    for d in entries:
        m = re.fullmatch(r"node(\d+)", d.name)
        if not m or not d.is_dir():
            continue
        nodes.append(
            NumaNode(
                id=int(m.group(1)),
                mem_bytes=parse_node_meminfo(_read(d / "meminfo")),
                cpulist=_read(d / "cpulist").strip(),
                distances=parse_distance(_read(d / "distance")),
            )
        )
    return sorted(nodes, key=lambda n: n.id)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ----------------------------------------------------------------------- building


def build_memory_topology(
    numa_nodes: Sequence[NumaNode],
    gpus: Sequence[GpuDevice] = (),
    gpu_memory_nodes: dict[int, int] | None = None,
) -> MemoryTopology:
    """Memory domains and interconnects of a node (rules in the module doc)."""
    gpu_memory_nodes = dict(gpu_memory_nodes or {})
    superchip = any(g.model.upper() in UNIFIED_MODELS for g in gpus)
    by_id = {n.id: n for n in numa_nodes}
    # GPU memory nodes merged into the node the GPU is attached to (superchips only)
    merged_into: dict[int, int] = {}
    if superchip:
        for g in gpus:
            mem_node = gpu_memory_nodes.get(g.index)
            if (
                mem_node is not None
                and g.numa_node is not None
                and mem_node != g.numa_node
                and mem_node in by_id
                and g.numa_node in by_id
            ):
                merged_into[mem_node] = g.numa_node
    gpu_mem_ids = set(gpu_memory_nodes.values())

    domains: list[MemoryDomain] = []
    domain_of_node: dict[int, int] = {}
    for n in numa_nodes:
        if n.id in merged_into:
            continue
        cpus = n.cpus
        if not cpus and n.mem_bytes <= 0:
            continue  # nothing there (e.g. GH200 MIG placeholder nodes)
        capacity = n.mem_bytes + sum(
            by_id[src].mem_bytes for src, dst in merged_into.items() if dst == n.id
        )
        attached = sorted(
            {g.index for g in gpus if g.numa_node == n.id}
            | {g for g, mem in gpu_memory_nodes.items() if mem == n.id}
        )
        if cpus:
            unified = superchip and bool(attached)
            kind = MemoryDomainType.UNIFIED if unified else MemoryDomainType.DRAM
        elif n.id in gpu_mem_ids or superchip:
            kind = MemoryDomainType.HBM
        else:
            kind = MemoryDomainType.CXL_ATTACHED
        domain_of_node[n.id] = len(domains)
        domains.append(
            MemoryDomain(
                id=n.id,
                domain_type=kind,
                capacity_bytes=capacity,
                numa_node=n.id,
                cpulist=n.cpulist,
                cpu_count=len(cpus),
                attached_gpus=attached,
            )
        )

    # a node's distance file lists one value per online node, in node id order
    position = {nid: i for i, nid in enumerate(sorted(by_id))}
    interconnects: list[MemoryInterconnect] = []
    for i, a in enumerate(domains):
        for b in domains[i + 1 :]:
            assert a.numa_node is not None and b.numa_node is not None
            dist = by_id[a.numa_node].distances
            pos = position[b.numa_node]
            distance = dist[pos] if pos < len(dist) else 0
            cxl = MemoryDomainType.CXL_ATTACHED in (a.domain_type, b.domain_type)
            interconnects.append(
                MemoryInterconnect(
                    domain_a=a.id,
                    domain_b=b.id,
                    link_type=MemoryLinkType.CXL_SWITCH if cxl else MemoryLinkType.NUMA_LINK,
                    distance=distance,
                )
            )
    cxl_bytes = sum(
        d.capacity_bytes for d in domains if d.domain_type == MemoryDomainType.CXL_ATTACHED
    )
    return MemoryTopology(
        domains=domains,
        interconnects=interconnects,
        unified_memory=any(d.domain_type == MemoryDomainType.UNIFIED for d in domains),
        cxl_memory_gb=cxl_bytes // 2**30,
    )


def discover_memory_topology(
    gpus: Sequence[GpuDevice] = (),
    gpu_memory_nodes: dict[int, int] | None = None,
    root: Path = SYS_NODE_ROOT,
) -> MemoryTopology:
    try:
        return build_memory_topology(read_numa_nodes(root), gpus, gpu_memory_nodes)
    except Exception:  # discovery must never keep an agent from starting
        log.exception("memory topology discovery failed; reporting none")
        return MemoryTopology()
