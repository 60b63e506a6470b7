"""GPU topology discovery (spec: GPU Topology): devices, GPU-to-GPU links, NIC affinity.

The parsers are pure functions over the text the vendor tools print, so they are
tested with recorded outputs and need no GPU:

* NVIDIA: ``nvidia-smi --query-gpu=...`` (devices), ``nvidia-smi topo -m`` (the link
  matrix, NIC affinity, NUMA affinity) and ``nvidia-smi nvlink -s`` (per-link speed);
* AMD: ``rocm-smi --showproductname`` / ``--showmeminfo vram`` (devices) and
  ``rocm-smi --showtopo`` (link types, hops, NUMA nodes).

Bandwidths are GB/s, like the spec's tables. NVLink bandwidth is the number of
bonded links times the per-link speed ``nvidia-smi nvlink -s`` reports (both
directions); without it, the per-link speed of the GPU generation. ``topo -m`` does not
say whether NVLinks go through an NVSwitch: a GPU whose links to its peers add up to
more than one GPU can have ports (:data:`MAX_NVLINK_PORTS`) must be switched, so such
a box reports ``NvSwitch`` links (8x H100 at NV18 each), a directly wired one
``NvLink`` (4x H100 at NV6). PCIe paths get the PCIe link bandwidth of the two GPUs,
scaled down by how far the path goes (:data:`PCIE_PATH_FACTOR`), so that the
selection algorithm prefers GPUs behind one switch over GPUs across sockets.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence

import msgspec
from lattice_common.types import GpuDevice, GpuLink, GpuLinkType

log = logging.getLogger("lattice.agent.discovery")

Runner = Callable[[Sequence[str]], str | None]
"""Runs a command and returns its stdout, or None when it cannot run or fails."""

MAX_NVLINK_PORTS = 18
"""NVLink ports of the largest GPU so far (H100, B200)."""

NVLINK_GBPS_PER_LINK = 50.0
"""One NVLink (gen 2-4), both directions: V100, A100, H100 (18 links -> 900 GB/s)."""
NVLINK5_GBPS_PER_LINK = 100.0
"""NVLink 5 (Blackwell)."""

PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}
"""Per-lane PCIe bandwidth: x16 Gen5 = 64 GB/s, Gen4 = 32 GB/s as in the spec."""
DEFAULT_PCIE_GBPS = 32.0  # Gen4 x16 when the tool does not say

PCIE_PATH_FACTOR = {"PIX": 1.0, "PXB": 0.9, "PHB": 0.75, "NODE": 0.6, "SYS": 0.4, "SOC": 0.4}
"""Share of the PCIe link bandwidth a peer-to-peer path keeps, by what it crosses:
one switch (PIX), several (PXB), the host bridge (PHB), host bridges of one NUMA node
(NODE), the socket interconnect (SYS; SOC in old drivers). An ordering, not a
measurement."""

PATH_RANK = {"X": 0, "NV": 1, "PIX": 2, "PXB": 3, "PHB": 4, "NODE": 5, "SYS": 6, "SOC": 6}

XGMI_GBPS_PER_LINK = 128.0
"""One xGMI link between two MI300X (64 GB/s each way; 7 links -> 896 GB/s)."""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NV = re.compile(r"^NV(\d+)$")


class NvidiaTopo(msgspec.Struct, kw_only=True):
    """What ``nvidia-smi topo -m`` says, per GPU index."""

    paths: dict[tuple[int, int], str] = msgspec.field(default_factory=dict)  # i < j
    nic_affinity: dict[int, str] = msgspec.field(default_factory=dict)
    numa_affinity: dict[int, int] = msgspec.field(default_factory=dict)
    gpu_numa_id: dict[int, int] = msgspec.field(default_factory=dict)  # GH200: HBM node


class GpuTopology(msgspec.Struct, kw_only=True):
    gpus: list[GpuDevice] = msgspec.field(default_factory=list)
    links: list[GpuLink] = msgspec.field(default_factory=list)
    gpu_memory_nodes: dict[int, int] = msgspec.field(default_factory=dict)  # gpu -> NUMA node
    driver_version: str = ""


# ------------------------------------------------------------------------- NVIDIA


def short_gpu_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'AMD Instinct MI300X OAM' -> 'MI300X'."""
    for word in name.replace("NVIDIA", "").replace("AMD", "").split():
        if any(ch.isdigit() for ch in word) and any(ch.isalpha() for ch in word):
            head = word.split("-")[0]  # 'A100-SXM4-40GB' -> 'A100'
            ok = any(ch.isdigit() for ch in head) and any(ch.isalpha() for ch in head)
            return (head if ok else word).upper()
    return name.strip()


NVIDIA_QUERY_FIELDS = (
    "index",
    "name",
    "memory.total",
    "compute_cap",
    "pcie.link.gen.max",
    "pcie.link.width.max",
)


def parse_nvidia_query_gpu(text: str) -> tuple[list[GpuDevice], dict[int, float]]:
    """``nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pcie.link.gen.max,
    pcie.link.width.max --format=csv,noheader,nounits`` -> devices, and each GPU's PCIe
    link bandwidth (GB/s) where the generation and width are known."""
    gpus: list[GpuDevice] = []
    pcie: dict[int, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        index = int(cells[0])
        mem_mib = _int(cells[2]) if len(cells) > 2 else None
        cc = cells[3] if len(cells) > 3 and _known(cells[3]) else ""
        gpus.append(
            GpuDevice(
                index=index,
                vendor="Nvidia",
                model=short_gpu_name(cells[1]),
                memory_bytes=(mem_mib or 0) * 2**20,
                compute_capability=cc,
            )
        )
        gen = _int(cells[4]) if len(cells) > 4 else None
        width = _int(cells[5]) if len(cells) > 5 else None
        if gen in PCIE_GBPS_PER_LANE and width:
            pcie[index] = PCIE_GBPS_PER_LANE[gen] * width
    return gpus, pcie


def parse_nvidia_topo(text: str) -> NvidiaTopo:
    """Parse the matrix of ``nvidia-smi topo -m``.

    Header: a tab-separated row of column names (GPU0.., NIC0.. or mlx5_0.., then
    "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"); one row per GPU and NIC with
    ``X`` (self), ``NV#`` (# bonded NVLinks) or a PCIe path (PIX, PXB, PHB, NODE,
    SYS). NIC names come from the "NIC Legend" when there is one."""
    lines = [_ANSI.sub("", ln).rstrip("\n") for ln in text.splitlines()]
    legend: dict[str, str] = {}
    for ln in lines:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", ln)
        if m:
            legend[m.group(1)] = m.group(2)
    header: list[str] | None = None
    topo = NvidiaTopo()
    for ln in lines:
        if not ln.strip():
            continue
        cells = _cells(ln)
        if header is None:
            if cells and cells[0] == "" and any(re.fullmatch(r"GPU\d+", c) for c in cells):
                header = [c for c in cells[1:] if c]
            continue
        label = cells[0].strip()
        m = re.fullmatch(r"GPU(\d+)", label)
        if not m:
            if label.startswith("Legend"):
                break
            continue
        gi = int(m.group(1))
        values = cells[1:]
        device_cols = [h for h in header if not _is_trailing(h)]
        best: tuple[int, str] | None = None  # (path rank, NIC name) of the closest NIC
        for col, val in zip(device_cols, values, strict=False):
            val = val.strip()
            cm = re.fullmatch(r"GPU(\d+)", col)
            if cm:
                gj = int(cm.group(1))
                if gj != gi and val != "X":
                    topo.paths[(min(gi, gj), max(gi, gj))] = val
            elif val in PATH_RANK and (best is None or PATH_RANK[val] < best[0]):
                best = (PATH_RANK[val], legend.get(col, col))
        if best is not None:
            topo.nic_affinity[gi] = best[1]
        trailing = [v.strip() for v in values[len(device_cols) :] if v.strip()]
        trailing_cols = [h for h in header if _is_trailing(h)]
        named = dict(zip(trailing_cols, trailing, strict=False))
        numa = _int(named.get("NUMA Affinity", ""))
        if numa is not None:
            topo.numa_affinity[gi] = numa
        gpu_numa = _int(named.get("GPU NUMA ID", ""))
        if gpu_numa is not None:
            topo.gpu_numa_id[gi] = gpu_numa
    return topo


def _is_trailing(col: str) -> bool:
    return "Affinity" in col or "NUMA" in col


def _cells(line: str) -> list[str]:
    if "\t" in line:
        return line.split("\t")
    # space-aligned output: columns are separated by two or more spaces
    parts = re.split(r"\s{2,}", line)
    return parts


def parse_nvlink_status(text: str) -> dict[int, float]:
    """``nvidia-smi nvlink -s`` -> per GPU, the mean speed of its active links, both
    directions (GB/s per link). Lines: ``GPU 0: NVIDIA H100 ...`` then
    ``Link 0: 26.562 GB/s`` (one direction) or ``Link 3: <inactive>``."""
    speeds: dict[int, list[float]] = {}
    gpu: int | None = None
    for raw in text.splitlines():
        ln = _ANSI.sub("", raw).strip()
        m = re.match(r"^GPU (\d+):", ln)
        if m:
            gpu = int(m.group(1))
            continue
        m = re.match(r"^Link \d+:\s*([\d.]+)\s*GB/s", ln)
        if m and gpu is not None:
            speeds.setdefault(gpu, []).append(float(m.group(1)))
    return {g: 2.0 * sum(v) / len(v) for g, v in speeds.items() if v}


def nvidia_links(
    gpus: Sequence[GpuDevice],
    topo: NvidiaTopo,
    *,
    pcie_gbps: dict[int, float] | None = None,
    nvlink_gbps: dict[int, float] | None = None,
) -> list[GpuLink]:
    """One link per GPU pair from the ``topo -m`` matrix (see the module doc)."""
    pcie_gbps = pcie_gbps or {}
    nvlink_gbps = nvlink_gbps or {}
    model = {g.index: g.model for g in gpus}
    indexes = sorted(model) or sorted({i for pair in topo.paths for i in pair})
    ports: dict[int, int] = {}
    for (a, b), path in topo.paths.items():
        m = _NV.match(path)
        if m:
            ports[a] = ports.get(a, 0) + int(m.group(1))
            ports[b] = ports.get(b, 0) + int(m.group(1))
    switched = any(n > MAX_NVLINK_PORTS for n in ports.values())
    links: list[GpuLink] = []
    for ai, a in enumerate(indexes):
        for b in indexes[ai + 1 :]:
            path = topo.paths.get((a, b))
            if path is None:
                continue
            m = _NV.match(path)
            if m:
                per_link = min(
                    nvlink_gbps.get(a) or _nvlink_default(model.get(a, "")),
                    nvlink_gbps.get(b) or _nvlink_default(model.get(b, "")),
                )
                links.append(
                    GpuLink(
                        gpu_a=a,
                        gpu_b=b,
                        link_type=GpuLinkType.NVSWITCH if switched else GpuLinkType.NVLINK,
                        bandwidth_gbps=round(int(m.group(1)) * per_link, 3),
                    )
                )
            elif path in PCIE_PATH_FACTOR:
                base = min(pcie_gbps.get(a, DEFAULT_PCIE_GBPS), pcie_gbps.get(b, DEFAULT_PCIE_GBPS))
                links.append(
                    GpuLink(
                        gpu_a=a,
                        gpu_b=b,
                        link_type=GpuLinkType.PCIE,
                        bandwidth_gbps=round(base * PCIE_PATH_FACTOR[path], 3),
                    )
                )
    return links


def _nvlink_default(model: str) -> float:
    m = model.upper()
    if m.startswith(("B1", "B2", "GB")):
        return NVLINK5_GBPS_PER_LINK
    return NVLINK_GBPS_PER_LINK


def nvidia_topology(run: Runner) -> GpuTopology:
    """Everything ``nvidia-smi`` tells; an empty topology when it is absent or fails."""
    out = run(
        [
            "nvidia-smi",
            f"--query-gpu={','.join(NVIDIA_QUERY_FIELDS)}",
            "--format=csv,noheader,nounits",
        ]
    )
    if out is None:  # an old driver without compute_cap: ask for less
        out = run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
        )
    if not out:
        return GpuTopology()
    gpus, pcie = parse_nvidia_query_gpu(out)
    if not gpus:
        return GpuTopology()
    topo = parse_nvidia_topo(run(["nvidia-smi", "topo", "-m"]) or "")
    nvlink = parse_nvlink_status(run(["nvidia-smi", "nvlink", "-s"]) or "")
    for g in gpus:
        g.numa_node = topo.numa_affinity.get(g.index)
        g.nic_affinity = topo.nic_affinity.get(g.index, "")
    driver = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or ""
    return GpuTopology(
        gpus=gpus,
        links=nvidia_links(gpus, topo, pcie_gbps=pcie, nvlink_gbps=nvlink),
        gpu_memory_nodes=dict(topo.gpu_numa_id),
        driver_version=driver.strip().splitlines()[0].strip() if driver.strip() else "",
    )


# ---------------------------------------------------------------------------- AMD


def parse_rocm_devices(product_text: str, meminfo_text: str = "") -> list[GpuDevice]:
    """``rocm-smi --showproductname`` (``GPU[0] : Card Series: AMD Instinct MI300X OAM``,
    ``GPU[0] : GFX Version: gfx942``) and ``rocm-smi --showmeminfo vram``
    (``GPU[0] : VRAM Total Memory (B): 206141652992``) -> devices."""
    names: dict[int, str] = {}
    arch: dict[int, str] = {}
    mem: dict[int, int] = {}
    for ln in product_text.splitlines():
        m = re.match(r"^\s*GPU\[(\d+)\]\s*:\s*([^:]+):\s*(.*)$", ln)
        if not m:
            continue
        idx, key, value = int(m.group(1)), m.group(2).strip().lower(), m.group(3).strip()
        if key == "card series" and value:
            names[idx] = value
        elif key == "gfx version" and value:
            arch[idx] = value
    for ln in meminfo_text.splitlines():
        m = re.match(r"^\s*GPU\[(\d+)\]\s*:\s*VRAM Total Memory \(B\):\s*(\d+)", ln)
        if m:
            mem[int(m.group(1))] = int(m.group(2))
    return [
        GpuDevice(
            index=i,
            vendor="Amd",
            model=short_gpu_name(names[i]),
            memory_bytes=mem.get(i, 0),
            compute_capability=arch.get(i, ""),
        )
        for i in sorted(names)
    ]


def _rocm_sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        ln = _ANSI.sub("", raw).rstrip()
        m = re.match(r"^=+\s*(.*?)\s*=+$", ln.strip())
        if m:
            title = m.group(1).strip().lower()
            current = sections.setdefault(title, []) if title else None
            continue
        if current is not None and ln.strip():
            current.append(ln)
    return sections


def _rocm_matrix(lines: list[str]) -> dict[tuple[int, int], str]:
    header: list[int] | None = None
    out: dict[tuple[int, int], str] = {}
    for ln in lines:
        cells = ln.split()
        if header is None:
            if cells and all(re.fullmatch(r"GPU\d+", c) for c in cells):
                header = [int(c[3:]) for c in cells]
            continue
        m = re.fullmatch(r"GPU(\d+)", cells[0]) if cells else None
        if not m:
            continue
        gi = int(m.group(1))
        for gj, val in zip(header, cells[1:], strict=False):
            if gi != gj:
                out[(min(gi, gj), max(gi, gj))] = val
    return out


def parse_rocm_topo(text: str) -> tuple[list[GpuLink], dict[int, int]]:
    """``rocm-smi --showtopo`` -> links and each GPU's NUMA node.

    Sections "Link Type between two GPUs" (``XGMI`` / ``PCIE``), "Hops between two
    GPUs", "Weight between two GPUs" and "Numa Nodes" (``GPU[0] : (Topology) Numa
    Node: 0``). An xGMI link gets :data:`XGMI_GBPS_PER_LINK` divided by its hops; a
    PCIe path the PCIe Gen5 x16 bandwidth scaled like NVIDIA's ``SYS``/``PHB`` paths by
    its hops."""
    sections = _rocm_sections(text)
    types_ = _rocm_matrix(_section(sections, "link type"))
    hops = _rocm_matrix(_section(sections, "hops"))
    links: list[GpuLink] = []
    for (a, b), kind in sorted(types_.items()):
        h = max(1, _int(hops.get((a, b), "1")) or 1)
        k = kind.upper()
        if k == "XGMI":
            links.append(
                GpuLink(
                    gpu_a=a,
                    gpu_b=b,
                    link_type=GpuLinkType.XGMI,
                    bandwidth_gbps=round(XGMI_GBPS_PER_LINK / h, 3),
                )
            )
        elif k == "PCIE":
            factor = (
                PCIE_PATH_FACTOR["PIX"]
                if h <= 1
                else PCIE_PATH_FACTOR["PHB"]
                if h == 2
                else PCIE_PATH_FACTOR["SYS"]
            )
            links.append(
                GpuLink(
                    gpu_a=a,
                    gpu_b=b,
                    link_type=GpuLinkType.PCIE,
                    bandwidth_gbps=round(PCIE_GBPS_PER_LANE[5] * 16 * factor, 3),
                )
            )
    numa: dict[int, int] = {}
    for ln in _section(sections, "numa nodes"):
        m = re.match(r"^\s*GPU\[(\d+)\]\s*:\s*\(Topology\) Numa Node:\s*(-?\d+)", ln)
        if m and int(m.group(2)) >= 0:
            numa[int(m.group(1))] = int(m.group(2))
    return links, numa


def _section(sections: dict[str, list[str]], key: str) -> list[str]:
    for title, lines in sections.items():
        if key in title:
            return lines
    return []


def amd_topology(run: Runner) -> GpuTopology:
    product = run(["rocm-smi", "--showproductname"])
    if not product:
        return GpuTopology()
    gpus = parse_rocm_devices(product, run(["rocm-smi", "--showmeminfo", "vram"]) or "")
    if not gpus:
        return GpuTopology()
    links, numa = parse_rocm_topo(run(["rocm-smi", "--showtopo"]) or "")
    for g in gpus:
        g.numa_node = numa.get(g.index)
    driver = run(["rocm-smi", "--showdriverversion"]) or ""
    m = re.search(r"Driver version:\s*(\S+)", driver)
    return GpuTopology(gpus=gpus, links=links, driver_version=m.group(1) if m else "")


# ------------------------------------------------------------------------- glue


def run_tool(argv: Sequence[str], timeout: float = 20.0) -> str | None:
    """The default Runner: stdout of a successful run, None otherwise."""
    if not shutil.which(argv[0]):
        return None
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("%s failed: %s", argv[0], e)
        return None
    if proc.returncode != 0:
        log.debug("%s exited %s: %s", " ".join(argv), proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


def discover_gpu_topology(run: Runner = run_tool) -> GpuTopology:
    """NVIDIA first, then AMD; a node with neither reports an empty topology."""
    try:
        topo = nvidia_topology(run)
        if not topo.gpus:
            topo = amd_topology(run)
    except Exception:  # discovery must never keep an agent from starting
        log.exception("GPU topology discovery failed; reporting none")
        return GpuTopology()
    return topo


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    t = text.strip()
    try:
        return int(t)
    except ValueError:
        try:
            return int(float(t))
        except ValueError:
            return None


def _known(text: str) -> bool:
    return bool(text) and not text.startswith("[") and text.upper() not in ("N/A", "[N/A]")
