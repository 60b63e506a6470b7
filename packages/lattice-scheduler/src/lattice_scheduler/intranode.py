"""Intra-node topology fitness: the node agents' GPU and memory topology reports turned
into the ``IntraNodeFit`` of f4 (spec: GPU Topology, Memory Topology).

Pure functions over ``Node`` records and an ``Allocation``; nothing here reads a clock
or does I/O. The formulas (gpu_link_fitness, memory_locality_fitness, α, β) live in
:mod:`lattice_scheduler.cost`; this module only chooses the GPUs and counts.

GPU selection (spec: Selection Algorithm), for a k-GPU allocation on a node with n GPUs:

1. build a graph of the GPUs weighted by link bandwidth (a pair the agent reported no
   link for has bandwidth 0);
2. find the k-GPU subgraph with the maximum minimum link bandwidth: the highest
   bandwidth threshold t at which the GPUs joined by links of at least t contain a
   k-clique (exact; cliques are searched depth-first with pruning, cheap for the 4-16
   GPUs of real nodes);
3. ties: prefer the set with the best NIC affinity (the most distinct closest NICs,
   so that a rail-optimised multi-node job gets a NIC per GPU), then the fewest
   memory domains, then the largest total link bandwidth, then the lowest indices.

How many GPUs: the allocation's ``constraints.gpu_count`` when it asks for fewer than
the node has, else all of them (full-node scheduling, ADR-007).

Memory locality of one node ("fraction of allocation's CPUs and GPUs in the same
memory domain"): the selected GPUs count in the domain they are attached to, and CPUs
follow them (the agent co-locates an allocation's CPUs with its GPUs): each domain
contributes its CPUs in proportion to how many of its GPUs were selected. An
allocation that takes the whole node counts every CPU of every domain; one without
GPUs (or on a node without GPUs) counts the CPUs alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import msgspec
from lattice_common.types import Allocation, Node

from lattice_scheduler.cost import (
    IntraNodeFit,
    beta_for,
    f4_topology_fitness,
    gpu_link_fitness,
    memory_locality_fitness,
    same_domain_fraction,
)

__all__ = [
    "GpuSelection",
    "best_gpu_subset",
    "gpu_link_fit",
    "intra_node_fit",
    "link_bandwidths",
    "memory_locality_fraction",
    "node_gpu_indexes",
    "requested_gpus",
    "select_gpus",
    "topology_fitness",
]

MAX_TIED_CANDIDATES = 2048
"""Tied k-GPU sets looked at for the tie-break before taking the best seen."""


class GpuSelection(msgspec.Struct, kw_only=True, frozen=True):
    """The GPUs chosen on one node.

    ``min_link_bandwidth``: the weakest link among the chosen GPUs (None with fewer
    than two: no link to lose); ``max_link_bandwidth``: the node's best link (0 when
    it reports none)."""

    gpus: tuple[int, ...]
    min_link_bandwidth: float | None
    max_link_bandwidth: float

    @property
    def gpu_link_fitness(self) -> float:
        if self.min_link_bandwidth is None:
            return 1.0
        return gpu_link_fitness(self.min_link_bandwidth, self.max_link_bandwidth)


# ------------------------------------------------------------------ node accessors


def node_gpu_indexes(node: Node) -> list[int]:
    """GPU indices the node reported in its topology ([] when none)."""
    return sorted({g.index for g in node.capabilities.gpus})


def link_bandwidths(node: Node) -> dict[tuple[int, int], float]:
    """(a, b) with a < b -> the best reported link bandwidth between GPUs a and b."""
    out: dict[tuple[int, int], float] = {}
    for link in node.capabilities.gpu_links:
        if link.gpu_a == link.gpu_b:
            continue
        key = (min(link.gpu_a, link.gpu_b), max(link.gpu_a, link.gpu_b))
        bw = max(0.0, float(link.bandwidth_gbps))
        if bw > out.get(key, -1.0):
            out[key] = bw
    return out


def requested_gpus(node: Node, allocation: Allocation) -> int:
    """k: ``constraints.gpu_count`` when below the node's GPU count, else all GPUs."""
    n = len(node_gpu_indexes(node)) or node.capabilities.gpu_count
    want = allocation.spec.constraints.gpu_count
    return n if want <= 0 or want >= n else want


# ------------------------------------------------------------------ selection


def best_gpu_subset(
    gpus: Sequence[int],
    bandwidth: Mapping[tuple[int, int], float],
    k: int,
    *,
    nic_affinity: Mapping[int, str] | None = None,
    domain_of: Mapping[int, int] | None = None,
) -> GpuSelection | None:
    """The k GPUs of ``gpus`` whose weakest pairwise link is strongest (module doc).

    ``bandwidth`` maps (a, b), a < b, to GB/s; a missing pair is 0. ``nic_affinity``
    (GPU -> closest NIC) and ``domain_of`` (GPU -> memory domain) break ties. None when
    k < 1 or there are fewer than k GPUs."""
    indexes = tuple(sorted(set(gpus)))
    if k < 1 or k > len(indexes):
        return None
    links = tuple(
        sorted(
            (a, b, float(bw))
            for (a, b), bw in bandwidth.items()
            if a in indexes and b in indexes and a != b
        )
    )
    nics = tuple(sorted((nic_affinity or {}).items()))
    domains = tuple(sorted((domain_of or {}).items()))
    return _best_subset(indexes, links, k, nics, domains)


@functools.lru_cache(maxsize=4096)
def _best_subset(
    indexes: tuple[int, ...],
    links: tuple[tuple[int, int, float], ...],
    k: int,
    nics: tuple[tuple[int, str], ...],
    domains: tuple[tuple[int, int], ...],
) -> GpuSelection:
    bw: dict[tuple[int, int], float] = {}
    for a, b, v in links:
        key = (min(a, b), max(a, b))
        bw[key] = max(bw.get(key, 0.0), v)
    best_link = max(bw.values(), default=0.0)
    if k == 1:
        nic = dict(nics)
        # one GPU: no link to lose; prefer one that has a NIC close by
        pick = min(indexes, key=lambda g: (0 if nic.get(g) else 1, g))
        return GpuSelection(gpus=(pick,), min_link_bandwidth=None, max_link_bandwidth=best_link)

    def pair(a: int, b: int) -> float:
        return bw.get((a, b) if a < b else (b, a), 0.0)

    thresholds = [*sorted({v for v in bw.values() if v > 0.0}, reverse=True), 0.0]
    nic = dict(nics)
    dom = dict(domains)
    for t in thresholds:
        adj = {g: {h for h in indexes if h != g and pair(g, h) >= t} for g in indexes}
        best: tuple[int, ...] | None = None
        best_key: tuple[float, ...] | None = None
        for n_seen, clique in enumerate(_cliques(indexes, adj, k)):
            key = _tie_key(clique, pair, nic, dom)
            if best_key is None or key > best_key:
                best, best_key = clique, key
            if n_seen + 1 >= MAX_TIED_CANDIDATES:
                break
        if best is not None:
            weakest = min(pair(a, b) for i, a in enumerate(best) for b in best[i + 1 :])
            return GpuSelection(gpus=best, min_link_bandwidth=weakest, max_link_bandwidth=best_link)
    raise AssertionError("unreachable: at threshold 0 every k-subset is a clique")


def _cliques(
    indexes: tuple[int, ...], adj: dict[int, set[int]], k: int
) -> Iterator[tuple[int, ...]]:
    """k-cliques of the graph, in lexicographic order of their sorted members."""

    def grow(chosen: list[int], candidates: list[int]) -> Iterator[tuple[int, ...]]:
        if len(chosen) == k:
            yield tuple(chosen)
            return
        need = k - len(chosen)
        for i, g in enumerate(candidates):
            if len(candidates) - i < need:
                return
            rest = [h for h in candidates[i + 1 :] if h in adj[g]]
            if len(rest) < need - 1:
                continue
            chosen.append(g)
            yield from grow(chosen, rest)
            chosen.pop()

    yield from grow([], list(indexes))


def _tie_key(
    clique: tuple[int, ...],
    pair: Callable[[int, int], float],
    nic: Mapping[int, str],
    dom: Mapping[int, int],
) -> tuple[float, ...]:
    nics = len({nic[g] for g in clique if nic.get(g)})
    doms = len({dom[g] for g in clique if g in dom})
    total = sum(pair(a, b) for i, a in enumerate(clique) for b in clique[i + 1 :])
    # larger is better; lexicographic order of the clique itself decides the rest
    # (enumeration is in lexicographic order and only a strictly better key replaces)
    return (float(nics), float(-doms), float(total))


def _domain_of_gpus(node: Node) -> dict[int, int]:
    """GPU index -> id of the memory domain it is attached to."""
    out: dict[int, int] = {}
    by_numa = {
        d.numa_node: d.id for d in node.capabilities.memory_domains if d.numa_node is not None
    }
    for d in node.capabilities.memory_domains:
        for g in d.attached_gpus:
            out.setdefault(g, d.id)
    for g in node.capabilities.gpus:
        if g.index not in out and g.numa_node is not None and g.numa_node in by_numa:
            out[g.index] = by_numa[g.numa_node]
    return out


def select_gpus(node: Node, k: int) -> GpuSelection | None:
    """The best k GPUs of ``node`` (None when it reported no GPUs or has fewer than k)."""
    gpus = node_gpu_indexes(node)
    if not gpus:
        return None
    return best_gpu_subset(
        gpus,
        link_bandwidths(node),
        k,
        nic_affinity={g.index: g.nic_affinity for g in node.capabilities.gpus if g.nic_affinity},
        domain_of=_domain_of_gpus(node),
    )


# ------------------------------------------------------------------ per-node fitness


def gpu_link_fit(node: Node, allocation: Allocation) -> float | None:
    """gpu_link_fitness of the best GPU set for ``allocation`` on ``node``; None when
    the node reported no GPU topology."""
    sel = select_gpus(node, requested_gpus(node, allocation))
    return None if sel is None else sel.gpu_link_fitness


def memory_locality_fraction(node: Node, gpus: Sequence[int] | None = None) -> float | None:
    """Fraction of the allocation's CPUs and GPUs in one memory domain of ``node``
    (module doc). ``gpus``: the selected GPUs; None or all of the node's GPUs = the
    whole node. None when the node reported no memory domains."""
    domains = node.capabilities.memory_domains
    if not domains:
        return None
    all_gpus = set(node_gpu_indexes(node))
    selected = set(gpus) & all_gpus if gpus is not None else set(all_gpus)
    whole_node = not all_gpus or selected == all_gpus
    dom = _domain_of_gpus(node)
    attached: dict[int, int] = {}
    chosen: dict[int, int] = {}
    for g in all_gpus:
        d = dom.get(g)
        if d is None:
            continue
        attached[d] = attached.get(d, 0) + 1
        if g in selected:
            chosen[d] = chosen.get(d, 0) + 1
    counts: list[float] = []
    unplaced = sum(1 for g in selected if g not in dom)
    for d in domains:
        n_gpus = chosen.get(d.id, 0)
        if whole_node:
            cpus = float(d.cpu_count)
        elif attached.get(d.id):
            cpus = d.cpu_count * n_gpus / attached[d.id]
        else:
            cpus = 0.0
        counts.append(n_gpus + cpus)
    if unplaced:  # GPUs the topology does not place: a domain of their own
        counts.append(float(unplaced))
    return _fraction(counts)


def _fraction(counts: Sequence[float]) -> float:
    # same_domain_fraction takes integer counts; scale fractional CPU shares
    total = sum(c for c in counts if c > 0)
    if total <= 0:
        return 1.0
    scaled = [round(c * 1000) for c in counts]
    return same_domain_fraction(scaled)


# ------------------------------------------------------------------ allocation-level


def intra_node_fit(
    nodes: Sequence[Node], allocation: Allocation, *, workload: str | None = None
) -> IntraNodeFit | None:
    """The IntraNodeFit of placing ``allocation`` on ``nodes``: gpu_link averaged over
    the nodes that reported GPU topology, memory_locality over those that reported
    memory domains (memory_locality_fitness), β from ``workload`` (beta_for:
    "gpu-heavy", "cpu-heavy" or None = default). None when no node reported either,
    so f4 stays the inter-node formula."""
    links: list[float] = []
    fractions: list[float] = []
    for node in nodes:
        sel = select_gpus(node, requested_gpus(node, allocation))
        if sel is not None:
            links.append(sel.gpu_link_fitness)
        frac = memory_locality_fraction(node, sel.gpus if sel is not None else None)
        if frac is not None:
            fractions.append(frac)
    if not links and not fractions:
        return None
    return IntraNodeFit(
        single_node=len(nodes) <= 1,
        gpu_link=sum(links) / len(links) if links else None,
        memory_locality=memory_locality_fitness(fractions) if fractions else None,
        beta=beta_for(workload),
    )


def topology_fitness(
    nodes: Sequence[Node],
    allocation: Allocation,
    groups_needed: int,
    max_groups_available: int,
    *,
    workload: str | None = None,
) -> float:
    """f4 with the intra-node term: f4_topology_fitness(groups_needed,
    max_groups_available, intra_node=intra_node_fit(nodes, allocation))."""
    return f4_topology_fitness(
        groups_needed,
        max_groups_available,
        intra_node=intra_node_fit(nodes, allocation, workload=workload),
    )
