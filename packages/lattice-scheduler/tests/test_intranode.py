"""intranode: GPU selection by max-min link bandwidth and the IntraNodeFit of f4."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import (
    Constraints,
    GpuDevice,
    GpuLink,
    GpuLinkType,
    MemoryDomain,
    MemoryDomainType,
    Node,
    NodeCapabilities,
)
from lattice_scheduler.cost import (
    BETA_DEFAULT,
    BETA_GPU_HEAVY,
    f4_topology_fitness,
    gpu_link_fitness,
)
from lattice_scheduler.intranode import (
    best_gpu_subset,
    intra_node_fit,
    link_bandwidths,
    memory_locality_fraction,
    requested_gpus,
    select_gpus,
    topology_fitness,
)
from lattice_test_harness import builders as b

L = GpuLinkType


def gpu_node(
    node_id: str,
    n: int,
    links: dict[tuple[int, int], tuple[GpuLinkType, float]],
    *,
    numa: dict[int, int] | None = None,
    nics: dict[int, str] | None = None,
    domains: list[MemoryDomain] | None = None,
) -> Node:
    numa = numa or {}
    nics = nics or {}
    return Node(
        id=node_id,
        capabilities=NodeCapabilities(
            gpu_type="H100",
            gpu_count=n,
            gpus=[
                GpuDevice(
                    index=i, model="H100", numa_node=numa.get(i), nic_affinity=nics.get(i, "")
                )
                for i in range(n)
            ],
            gpu_links=[
                GpuLink(gpu_a=a, gpu_b=bb, link_type=t, bandwidth_gbps=bw)
                for (a, bb), (t, bw) in links.items()
            ],
            memory_domains=domains or [],
        ),
    )


def nvswitch8() -> Node:
    links = {(a, c): (L.NVSWITCH, 900.0) for a, c in itertools.combinations(range(8), 2)}
    domains = [
        MemoryDomain(id=0, numa_node=0, cpu_count=56, attached_gpus=[0, 1, 2, 3]),
        MemoryDomain(id=1, numa_node=1, cpu_count=56, attached_gpus=[4, 5, 6, 7]),
    ]
    nics = {i: f"mlx5_{i}" for i in range(8)}
    return gpu_node("dgx", 8, links, nics=nics, domains=domains)


def pcie4() -> Node:
    """0-1 behind one switch, 2-3 behind a host bridge, sockets apart."""
    bw = {(0, 1): 32.0, (2, 3): 24.0, (0, 2): 12.8, (0, 3): 12.8, (1, 2): 12.8, (1, 3): 12.8}
    domains = [
        MemoryDomain(id=0, numa_node=0, cpu_count=16, attached_gpus=[0, 1]),
        MemoryDomain(id=1, numa_node=1, cpu_count=16, attached_gpus=[2, 3]),
    ]
    return gpu_node("pcie", 4, {k: (L.PCIE, v) for k, v in bw.items()}, domains=domains)


def alloc(gpu_count: int = 0, nodes: int = 1):
    return b.allocation(nodes=nodes, constraints=Constraints(gpu_count=gpu_count))


# ---------------------------------------------------------------------- examples


def test_nvswitch_box_fits_perfectly() -> None:
    node = nvswitch8()
    for k in (1, 2, 4, 8):
        sel = select_gpus(node, k)
        assert sel is not None and len(sel.gpus) == k
        assert sel.gpu_link_fitness == 1.0
    fit = intra_node_fit([node], alloc(gpu_count=4))
    assert fit is not None and fit.single_node and fit.gpu_link == 1.0
    # four of eight GPUs on one socket, CPUs following them: fully local
    assert fit.memory_locality == 1.0


def test_nvswitch_tie_break_spreads_over_nics_on_one_socket() -> None:
    sel = select_gpus(nvswitch8(), 4)
    assert sel is not None and sel.gpus == (0, 1, 2, 3)


def test_pcie_box_picks_the_shared_switch() -> None:
    node = pcie4()
    sel = select_gpus(node, 2)
    assert sel is not None and sel.gpus == (0, 1)
    assert sel.min_link_bandwidth == 32.0 and sel.gpu_link_fitness == 1.0
    sel3 = select_gpus(node, 3)
    assert sel3 is not None and sel3.min_link_bandwidth == 12.8
    assert sel3.gpu_link_fitness == pytest.approx(12.8 / 32.0)
    fit = intra_node_fit([node], alloc(gpu_count=2))
    assert fit is not None and fit.gpu_link == 1.0 and fit.memory_locality == 1.0
    # the whole node: crosses sockets
    whole = intra_node_fit([node], alloc())
    assert whole is not None
    assert whole.gpu_link == pytest.approx(12.8 / 32.0)
    assert whole.memory_locality == pytest.approx(0.5)


def test_requested_gpus() -> None:
    node = pcie4()
    assert requested_gpus(node, alloc()) == 4  # full node
    assert requested_gpus(node, alloc(gpu_count=2)) == 2
    assert requested_gpus(node, alloc(gpu_count=9)) == 4


def test_no_topology_reported_gives_none() -> None:
    node = b.node("n1", gpu_type="H100", gpu_count=4)
    assert select_gpus(node, 2) is None
    assert intra_node_fit([node], alloc(gpu_count=2)) is None
    # f4 stays the inter-node formula
    assert topology_fitness([node], alloc(), 1, 4) == f4_topology_fitness(1, 4)


def test_cpu_only_node_uses_memory_locality() -> None:
    domains = [
        MemoryDomain(id=0, numa_node=0, cpu_count=64),
        MemoryDomain(id=1, numa_node=1, cpu_count=64),
    ]
    node = Node(id="cpu", capabilities=NodeCapabilities(cpu_cores=128, memory_domains=domains))
    fit = intra_node_fit([node], alloc())
    assert fit is not None and fit.gpu_link is None and fit.memory_locality == 0.5
    single = Node(
        id="one", capabilities=NodeCapabilities(memory_domains=[MemoryDomain(id=0, cpu_count=8)])
    )
    assert memory_locality_fraction(single) == 1.0


def test_unified_gh200() -> None:
    d = MemoryDomain(
        id=0, domain_type=MemoryDomainType.UNIFIED, numa_node=0, cpu_count=72, attached_gpus=[0]
    )
    node = gpu_node("gh", 1, {}, numa={0: 0}, domains=[d])
    fit = intra_node_fit([node], alloc())
    assert fit is not None and fit.gpu_link == 1.0 and fit.memory_locality == 1.0


def test_multi_node_averages_and_alpha() -> None:
    fit = intra_node_fit([nvswitch8(), pcie4()], alloc(nodes=2), workload="gpu-heavy")
    assert fit is not None and not fit.single_node
    assert fit.beta == BETA_GPU_HEAVY
    assert fit.gpu_link == pytest.approx((1.0 + 12.8 / 32.0) / 2)
    f4 = topology_fitness([nvswitch8(), pcie4()], alloc(nodes=2), 1, 4, workload="gpu-heavy")
    assert f4 == pytest.approx(f4_topology_fitness(1, 4, intra_node=fit))
    assert intra_node_fit([pcie4()], alloc()).beta == BETA_DEFAULT  # type: ignore[union-attr]


def test_duplicate_and_reversed_links_take_the_best() -> None:
    node = gpu_node("d", 2, {(1, 0): (L.PCIE, 32.0)})
    node.capabilities.gpu_links.append(
        GpuLink(gpu_a=0, gpu_b=1, link_type=L.NVLINK, bandwidth_gbps=300)
    )
    assert link_bandwidths(node) == {(0, 1): 300.0}


def test_missing_link_counts_as_zero() -> None:
    sel = best_gpu_subset([0, 1, 2], {(0, 1): 100.0}, 3)
    assert sel is not None and sel.min_link_bandwidth == 0.0 and sel.gpu_link_fitness == 0.0
    assert best_gpu_subset([0, 1], {}, 3) is None
    assert best_gpu_subset([0, 1], {}, 0) is None


# ---------------------------------------------------------------------- properties


@st.composite
def graphs(draw: st.DrawFn) -> tuple[int, dict[tuple[int, int], float], int]:
    n = draw(st.integers(1, 7))
    bw: dict[tuple[int, int], float] = {}
    for a, c in itertools.combinations(range(n), 2):
        if draw(st.booleans()) or n <= 2:
            bw[(a, c)] = draw(st.sampled_from([0.0, 12.8, 24.0, 32.0, 64.0, 300.0, 900.0]))
    k = draw(st.integers(1, n))
    return n, bw, k


def _brute_force_best(n: int, bw: dict[tuple[int, int], float], k: int) -> float | None:
    if k < 2:
        return None
    return max(
        min(bw.get((a, c), 0.0) for a, c in itertools.combinations(sub, 2))
        for sub in itertools.combinations(range(n), k)
    )


@settings(max_examples=300, deadline=None)
@given(graphs(), st.dictionaries(st.integers(0, 6), st.sampled_from(["nic0", "nic1", "nic2"])))
def test_selection_is_the_max_min_subset(
    graph: tuple[int, dict[tuple[int, int], float], int], nics: dict[int, str]
) -> None:
    n, bw, k = graph
    sel = best_gpu_subset(range(n), bw, k, nic_affinity=nics)
    assert sel is not None
    assert len(sel.gpus) == k and len(set(sel.gpus)) == k
    assert set(sel.gpus) <= set(range(n))
    assert sel.min_link_bandwidth == _brute_force_best(n, bw, k)
    if k >= 2:  # the reported minimum is the chosen set's own
        own = min(bw.get((a, c), 0.0) for a, c in itertools.combinations(sel.gpus, 2))
        assert own == sel.min_link_bandwidth
    assert 0.0 <= sel.gpu_link_fitness <= 1.0
    assert sel.gpu_link_fitness == (
        1.0
        if sel.min_link_bandwidth is None
        else gpu_link_fitness(sel.min_link_bandwidth, max(bw.values(), default=0.0))
    )


@settings(max_examples=200, deadline=None)
@given(
    graphs(),
    st.integers(0, 8),
    st.integers(1, 3),
    st.sampled_from([None, "gpu-heavy", "cpu-heavy"]),
)
def test_fit_is_in_unit_interval(
    graph: tuple[int, dict[tuple[int, int], float], int],
    gpu_count: int,
    n_domains: int,
    workload: str | None,
) -> None:
    n, bw, _ = graph
    domains = [
        MemoryDomain(
            id=d,
            numa_node=d,
            cpu_count=8 * (d + 1),
            attached_gpus=[g for g in range(n) if g % n_domains == d],
        )
        for d in range(n_domains)
    ]
    node = gpu_node("x", n, {k: (L.PCIE, v) for k, v in bw.items()}, domains=domains)
    a = alloc(gpu_count=gpu_count)
    fit = intra_node_fit([node], a, workload=workload)
    assert fit is not None
    for v in (fit.gpu_link, fit.memory_locality):
        assert v is not None and 0.0 <= v <= 1.0
    sel = select_gpus(node, requested_gpus(node, a))
    assert sel is not None and len(sel.gpus) == requested_gpus(node, a)
    assert 0.0 <= topology_fitness([node], a, 1, 3, workload=workload) <= 1.0
