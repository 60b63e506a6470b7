"""GPU topology parsers over recorded vendor-tool output (no GPU needed)."""

from __future__ import annotations

from collections.abc import Sequence

from lattice_agent.discovery import discover
from lattice_agent.gpu_topology import (
    GpuTopology,
    discover_gpu_topology,
    nvidia_links,
    nvidia_topology,
    parse_nvidia_query_gpu,
    parse_nvidia_topo,
    parse_nvlink_status,
    parse_rocm_devices,
    parse_rocm_topo,
    short_gpu_name,
)
from lattice_common.types import GpuLinkType


def _dgx_h100_topo() -> str:
    """``nvidia-smi topo -m`` of an 8x H100 SXM box (NVSwitch), 8 NICs, two sockets."""
    nics = [f"NIC{i}" for i in range(8)]
    head = "\t" + "\t".join([f"GPU{i}" for i in range(8)] + nics)
    head += "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    rows = [head]
    for g in range(8):
        cells = [" X " if h == g else "NV18" for h in range(8)]
        for n in range(8):
            same_socket = (n // 4) == (g // 4)
            cells.append("PXB" if n == g else "NODE" if same_socket else "SYS")
        socket = g // 4
        cpus = "0-55,112-167" if socket == 0 else "56-111,168-223"
        rows.append(f"GPU{g}\t" + "\t".join(cells) + f"\t{cpus}\t{socket}\t\tN/A")
    for n in range(8):
        cells = []
        for g in range(8):
            same_socket = (n // 4) == (g // 4)
            cells.append("PXB" if n == g else "NODE" if same_socket else "SYS")
        cells += [" X " if m == n else "NODE" if m // 4 == n // 4 else "SYS" for m in range(8)]
        rows.append(f"NIC{n}\t" + "\t".join(cells))
    legend = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

""" + "\n".join(f"  NIC{i}: mlx5_{i}" for i in range(8))
    return "\n".join(rows) + "\n" + legend + "\n"


DGX_H100_QUERY = "\n".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 9.0, 5, 16" for i in range(8))

DGX_H100_NVLINK = "\n".join(
    f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd)\n"
    + "\n".join(f"\t Link {link}: 26.562 GB/s" for link in range(18))
    for i in range(8)
)

PCIE_BOX_TOPO = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tPIX\tSYS\tSYS\t0-15\t0\t\tN/A
GPU1\tPIX\t X \tSYS\tSYS\t0-15\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tPHB\t16-31\t1\t\tN/A
GPU3\tSYS\tSYS\tPHB\t X \t16-31\t1\t\tN/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

PCIE_BOX_QUERY = """\
0, NVIDIA L40S, 46068, 8.9, 4, 16
1, NVIDIA L40S, 46068, 8.9, 4, 16
2, NVIDIA L40S, 46068, 8.9, 4, 16
3, NVIDIA L40S, 46068, 8.9, 4, 16
"""

# 4x H100 SXM (HGX 4-GPU board): NVLink wired directly, 6 links per pair
HGX4_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV6\tNV6\tNV6\t0-31\t0\t\tN/A
GPU1\tNV6\t X \tNV6\tNV6\t0-31\t0\t\tN/A
GPU2\tNV6\tNV6\t X \tNV6\t32-63\t1\t\tN/A
GPU3\tNV6\tNV6\tNV6\t X \t32-63\t1\t\tN/A
"""

# GH200 superchip: the GPU's HBM is NUMA node 1 (memory only)
GH200_TOPO = """\
\tGPU0\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tSYS\t0-71\t0\t\t1
NIC0\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)

NIC Legend:

  NIC0: hsn0
"""


def _rocm_matrix(title: str, cell) -> list[str]:
    lines = [f"{'=' * 30} {title} {'=' * 30}"]
    lines.append("       " + "".join(f"{'GPU' + str(j):<13}" for j in range(8)))
    for i in range(8):
        lines.append(f"{'GPU' + str(i):<7}" + "".join(f"{cell(i, j):<13}" for j in range(8)))
    return lines


def _mi300x_showtopo() -> str:
    lines = ["=" * 28 + " ROCm System Management Interface " + "=" * 28]
    lines += _rocm_matrix("Weight between two GPUs", lambda i, j: "0" if i == j else "15")
    lines += _rocm_matrix("Hops between two GPUs", lambda i, j: "0" if i == j else "1")
    lines += _rocm_matrix("Link Type between two GPUs", lambda i, j: "0" if i == j else "XGMI")
    lines.append("=" * 34 + " Numa Nodes " + "=" * 34)
    for i in range(8):
        lines.append(f"GPU[{i}]\t\t: (Topology) Numa Node: {i // 4}")
        lines.append(f"GPU[{i}]\t\t: (Topology) Numa Affinity: {i // 4}")
    lines.append("=" * 30 + " End of ROCm SMI Log " + "=" * 30)
    return "\n".join(lines) + "\n"


MI300X_PRODUCT = (
    "=" * 28
    + " ROCm System Management Interface "
    + "=" * 28
    + "\n"
    + "=" * 38
    + " Product Info "
    + "=" * 38
    + "\n"
    + "\n".join(
        f"GPU[{i}]\t\t: Card Series: \t\tAMD Instinct MI300X OAM\n"
        f"GPU[{i}]\t\t: Card Model: \t\t0x74a1\n"
        f"GPU[{i}]\t\t: Card Vendor: \t\tAdvanced Micro Devices, Inc. [AMD/ATI]\n"
        f"GPU[{i}]\t\t: GFX Version: \t\tgfx942"
        for i in range(8)
    )
    + "\n"
)
MI300X_VRAM = "\n".join(f"GPU[{i}]\t\t: VRAM Total Memory (B): 206141652992" for i in range(8))


# ---------------------------------------------------------------------- NVIDIA


def test_query_gpu_gives_devices_and_pcie_bandwidth() -> None:
    gpus, pcie = parse_nvidia_query_gpu(DGX_H100_QUERY)
    assert [g.index for g in gpus] == list(range(8))
    assert {g.model for g in gpus} == {"H100"}
    assert gpus[0].memory_bytes == 81559 * 2**20
    assert gpus[0].compute_capability == "9.0"
    assert gpus[0].vendor == "Nvidia"
    assert pcie[0] == 64.0  # Gen5 x16, the spec's number


def test_query_gpu_tolerates_missing_fields() -> None:
    gpus, pcie = parse_nvidia_query_gpu("0, NVIDIA A100-SXM4-40GB, 40960, [N/A], [N/A], [N/A]\n")
    assert gpus[0].model == "A100"
    assert gpus[0].compute_capability == ""
    assert pcie == {}


def test_dgx_h100_is_all_nvswitch_at_900() -> None:
    gpus, pcie = parse_nvidia_query_gpu(DGX_H100_QUERY)
    topo = parse_nvidia_topo(_dgx_h100_topo())
    assert len(topo.paths) == 28 and set(topo.paths.values()) == {"NV18"}
    links = nvidia_links(gpus, topo, pcie_gbps=pcie)
    assert len(links) == 28
    assert {link.link_type for link in links} == {GpuLinkType.NVSWITCH}
    assert {link.bandwidth_gbps for link in links} == {900.0}
    # measured per-link speed (nvidia-smi nvlink -s) wins over the generation default
    measured = nvidia_links(gpus, topo, nvlink_gbps=parse_nvlink_status(DGX_H100_NVLINK))
    assert {round(link.bandwidth_gbps) for link in measured} == {956}


def test_dgx_nic_and_numa_affinity() -> None:
    topo = parse_nvidia_topo(_dgx_h100_topo())
    assert topo.nic_affinity == {i: f"mlx5_{i}" for i in range(8)}
    assert topo.numa_affinity == {i: i // 4 for i in range(8)}
    assert topo.gpu_numa_id == {}


def test_directly_wired_nvlink_is_not_a_switch() -> None:
    gpus = [g for g in parse_nvidia_query_gpu(DGX_H100_QUERY)[0] if g.index < 4]
    links = nvidia_links(gpus, parse_nvidia_topo(HGX4_TOPO))
    assert {link.link_type for link in links} == {GpuLinkType.NVLINK}
    assert {link.bandwidth_gbps for link in links} == {300.0}


def test_pcie_box_prefers_the_shared_switch() -> None:
    gpus, pcie = parse_nvidia_query_gpu(PCIE_BOX_QUERY)
    topo = parse_nvidia_topo(PCIE_BOX_TOPO)  # the header carries ANSI underline codes
    assert topo.paths == {
        (0, 1): "PIX",
        (0, 2): "SYS",
        (0, 3): "SYS",
        (1, 2): "SYS",
        (1, 3): "SYS",
        (2, 3): "PHB",
    }
    bw = {
        (link.gpu_a, link.gpu_b): link.bandwidth_gbps
        for link in nvidia_links(gpus, topo, pcie_gbps=pcie)
    }
    assert bw[(0, 1)] == 32.0  # Gen4 x16 behind one switch
    assert bw[(2, 3)] < bw[(0, 1)]
    assert bw[(0, 2)] < bw[(2, 3)]
    assert topo.numa_affinity == {0: 0, 1: 0, 2: 1, 3: 1}
    assert topo.nic_affinity == {}


def test_gh200_reports_the_gpu_memory_numa_node() -> None:
    topo = parse_nvidia_topo(GH200_TOPO)
    assert topo.paths == {}
    assert topo.numa_affinity == {0: 0}
    assert topo.gpu_numa_id == {0: 1}
    assert topo.nic_affinity == {0: "hsn0"}


def test_space_aligned_matrix_parses_too() -> None:
    text = (
        "        GPU0    GPU1    CPU Affinity    NUMA Affinity\n"
        "GPU0     X      NV12    0-63            0\n"
        "GPU1    NV12     X      0-63            0\n"
    )
    topo = parse_nvidia_topo(text)
    assert topo.paths == {(0, 1): "NV12"}
    assert topo.numa_affinity == {0: 0, 1: 0}


def test_nvidia_topology_end_to_end_with_a_fake_tool() -> None:
    outputs = {
        "--query-gpu=index": DGX_H100_QUERY,
        "topo": _dgx_h100_topo(),
        "nvlink": DGX_H100_NVLINK,
        "--query-gpu=driver_version": "550.54.15\n" * 8,
    }

    def run(argv: Sequence[str]) -> str | None:
        if argv[0] != "nvidia-smi":
            return None
        for key, out in outputs.items():
            if any(a.startswith(key) or a == key for a in argv[1:]):
                return out
        return None

    topo = nvidia_topology(run)
    assert len(topo.gpus) == 8 and len(topo.links) == 28
    assert topo.driver_version == "550.54.15"
    assert topo.gpus[5].numa_node == 1 and topo.gpus[5].nic_affinity == "mlx5_5"


# ---------------------------------------------------------------------- AMD


def test_rocm_devices() -> None:
    gpus = parse_rocm_devices(MI300X_PRODUCT, MI300X_VRAM)
    assert [g.index for g in gpus] == list(range(8))
    assert {g.model for g in gpus} == {"MI300X"}
    assert gpus[3].vendor == "Amd"
    assert gpus[3].memory_bytes == 206141652992
    assert gpus[3].compute_capability == "gfx942"


def test_mi300x_is_all_xgmi() -> None:
    links, numa = parse_rocm_topo(_mi300x_showtopo())
    assert len(links) == 28
    assert {link.link_type for link in links} == {GpuLinkType.XGMI}
    assert {link.bandwidth_gbps for link in links} == {128.0}
    assert numa == {i: i // 4 for i in range(8)}


def test_rocm_pcie_links_rank_by_hops() -> None:
    lines = ["=" * 10 + " Hops between two GPUs " + "=" * 10]
    lines += ["       GPU0         GPU1         GPU2", "GPU0   0            1            3"]
    lines += ["GPU1   1            0            3", "GPU2   3            3            0"]
    lines += ["=" * 10 + " Link Type between two GPUs " + "=" * 10]
    lines += ["       GPU0         GPU1         GPU2", "GPU0   0            PCIE         PCIE"]
    lines += ["GPU1   PCIE         0            PCIE", "GPU2   PCIE         PCIE         0"]
    links, _ = parse_rocm_topo("\n".join(lines))
    bw = {(link.gpu_a, link.gpu_b): link.bandwidth_gbps for link in links}
    assert bw[(0, 1)] == 64.0 and bw[(0, 2)] < bw[(0, 1)]


# ---------------------------------------------------------------------- glue


def test_no_gpu_tools_means_an_empty_topology(tmp_path) -> None:
    assert discover_gpu_topology(lambda argv: None) == GpuTopology()
    caps = discover(gpu_type=None, gpu_count=None, run=lambda argv: None, numa_root=tmp_path)
    assert caps.gpus == [] and caps.gpu_links == [] and caps.memory_domains == []


def test_discovery_fills_capabilities_from_the_topology(tmp_path) -> None:
    def run(argv: Sequence[str]) -> str | None:
        if argv[:2] == ["rocm-smi", "--showproductname"]:
            return MI300X_PRODUCT
        if argv[:2] == ["rocm-smi", "--showmeminfo"]:
            return MI300X_VRAM
        if argv[:2] == ["rocm-smi", "--showtopo"]:
            return _mi300x_showtopo()
        return None

    caps = discover(run=run, numa_root=tmp_path)
    assert caps.gpu_type == "MI300X" and caps.gpu_count == 8
    assert len(caps.gpus) == 8 and len(caps.gpu_links) == 28
    # an operator override of the GPUs drops the discovered topology
    caps = discover(gpu_type="H100", gpu_count=4, run=run, numa_root=tmp_path)
    assert caps.gpu_count == 4 and caps.gpus == []


def test_short_names() -> None:
    assert short_gpu_name("NVIDIA H100 80GB HBM3") == "H100"
    assert short_gpu_name("NVIDIA GH200 480GB") == "GH200"
    assert short_gpu_name("AMD Instinct MI300X OAM") == "MI300X"
