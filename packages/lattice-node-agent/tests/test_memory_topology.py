"""Memory topology: /sys/devices/system/node parsing on fixture trees built in tmp_path."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.memory_topology import (
    build_memory_topology,
    discover_memory_topology,
    parse_cpulist,
    parse_distance,
    parse_node_meminfo,
    read_numa_nodes,
)
from lattice_common.types import GpuDevice, MemoryDomainType, MemoryLinkType

GiB = 2**30


def make_node_tree(
    root: Path, nodes: dict[int, tuple[int, str]], distance: list[list[int]]
) -> Path:
    """``nodes``: id -> (MemTotal in GiB, cpulist) like the kernel lays them out."""
    base = root / "node"
    base.mkdir(parents=True, exist_ok=True)
    (base / "online").write_text(",".join(str(i) for i in sorted(nodes)) + "\n")
    (base / "possible").write_text("0-63\n")
    for row, (nid, (mem_gib, cpulist)) in enumerate(sorted(nodes.items())):
        d = base / f"node{nid}"
        d.mkdir()
        kb = mem_gib * 1024 * 1024
        (d / "meminfo").write_text(
            f"Node {nid} MemTotal:       {kb} kB\n"
            f"Node {nid} MemFree:        {kb // 2} kB\n"
            f"Node {nid} MemUsed:        {kb // 2} kB\n"
        )
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "distance").write_text(" ".join(str(x) for x in distance[row]) + "\n")
    return base


def test_parsers() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert parse_cpulist("0-6:2") == [0, 2, 4, 6]
    assert (
        parse_node_meminfo("Node 1 MemTotal:  4679884 kB\nNode 1 MemFree: 1 kB\n") == 4679884 * 1024
    )
    assert parse_node_meminfo("") == 0
    assert parse_distance("10 21 \n") == [10, 21]


@given(st.sets(st.integers(0, 300), max_size=60))
def test_cpulist_round_trip(cpus: set[int]) -> None:
    # compress into the kernel's range format and parse back
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    assert parse_cpulist(",".join(parts)) == sorted(cpus)


def test_dual_socket_dram(tmp_path: Path) -> None:
    root = make_node_tree(
        tmp_path, {0: (256, "0-31,64-95"), 1: (256, "32-63,96-127")}, [[10, 21], [21, 10]]
    )
    gpus = [GpuDevice(index=i, model="H100", numa_node=i // 4) for i in range(8)]
    topo = discover_memory_topology(gpus, root=root)
    assert [d.domain_type for d in topo.domains] == [MemoryDomainType.DRAM] * 2
    assert topo.domains[0].capacity_bytes == 256 * GiB
    assert topo.domains[0].cpu_count == 64 and topo.domains[0].cpulist == "0-31,64-95"
    assert topo.domains[1].attached_gpus == [4, 5, 6, 7]
    assert len(topo.interconnects) == 1
    ic = topo.interconnects[0]
    assert (ic.domain_a, ic.domain_b, ic.distance, ic.link_type) == (
        0,
        1,
        21,
        MemoryLinkType.NUMA_LINK,
    )
    assert not topo.unified_memory and topo.cxl_memory_gb == 0


def test_single_socket(tmp_path: Path) -> None:
    root = make_node_tree(tmp_path, {0: (64, "0-15")}, [[10]])
    topo = discover_memory_topology(root=root)
    assert len(topo.domains) == 1 and topo.interconnects == []


def test_cxl_memory_only_node(tmp_path: Path) -> None:
    root = make_node_tree(
        tmp_path,
        {0: (512, "0-63"), 1: (512, "64-127"), 2: (2048, "")},
        [[10, 21, 24], [21, 10, 24], [24, 24, 10]],
    )
    topo = discover_memory_topology(root=root)
    kinds = {d.id: d.domain_type for d in topo.domains}
    assert kinds == {
        0: MemoryDomainType.DRAM,
        1: MemoryDomainType.DRAM,
        2: MemoryDomainType.CXL_ATTACHED,
    }
    assert topo.cxl_memory_gb == 2048
    cxl_links = [i for i in topo.interconnects if 2 in (i.domain_a, i.domain_b)]
    assert {i.link_type for i in cxl_links} == {MemoryLinkType.CXL_SWITCH}
    assert {i.distance for i in cxl_links} == {24}


def test_gh200_hbm_node_merges_into_one_unified_domain(tmp_path: Path) -> None:
    # GH200: Grace (node 0, LPDDR5X) + Hopper HBM (node 1, memory only), plus empty
    # placeholder nodes 2-9 (MIG) that the kernel lists without memory
    nodes = {0: (480, "0-71"), 1: (96, "")}
    nodes.update({i: (0, "") for i in range(2, 10)})
    dist = [[10 if i == j else 80 for j in range(10)] for i in range(10)]
    root = make_node_tree(tmp_path, nodes, dist)
    gpu = GpuDevice(index=0, model="GH200", numa_node=0)
    topo = build_memory_topology(read_numa_nodes(root), [gpu], {0: 1})
    assert len(topo.domains) == 1
    d = topo.domains[0]
    assert d.domain_type == MemoryDomainType.UNIFIED
    assert d.capacity_bytes == (480 + 96) * GiB
    assert d.attached_gpus == [0] and d.cpu_count == 72
    assert topo.unified_memory and topo.cxl_memory_gb == 0


def test_quad_gh200_node(tmp_path: Path) -> None:
    nodes = {i: (120, f"{i * 72}-{i * 72 + 71}") for i in range(4)}
    nodes.update({4 + 8 * i: (96, "") for i in range(4)})
    ids = sorted(nodes)  # 0-3, 4, 12, 20, 28: one distance per online node, in id order
    dist = [[10 if a == b else 40 for b in ids] for a in ids]
    root = make_node_tree(tmp_path, nodes, dist)
    gpus = [GpuDevice(index=i, model="GH200", numa_node=i) for i in range(4)]
    topo = build_memory_topology(read_numa_nodes(root), gpus, {i: 4 + 8 * i for i in range(4)})
    assert [d.domain_type for d in topo.domains] == [MemoryDomainType.UNIFIED] * 4
    assert [d.attached_gpus for d in topo.domains] == [[0], [1], [2], [3]]
    assert len(topo.interconnects) == 6 and {i.distance for i in topo.interconnects} == {40}


def test_mi300a_apu_nodes_are_unified(tmp_path: Path) -> None:
    root = make_node_tree(
        tmp_path,
        {i: (128, f"{i * 24}-{i * 24 + 23}") for i in range(4)},
        [[10 if a == b else 32 for b in range(4)] for a in range(4)],
    )
    gpus = [GpuDevice(index=i, model="MI300A", numa_node=i) for i in range(4)]
    topo = discover_memory_topology(gpus, root=root)
    assert all(d.domain_type == MemoryDomainType.UNIFIED for d in topo.domains)
    assert topo.unified_memory


def test_no_sysfs_means_no_domains(tmp_path: Path) -> None:
    assert discover_memory_topology(root=tmp_path / "absent").domains == []
