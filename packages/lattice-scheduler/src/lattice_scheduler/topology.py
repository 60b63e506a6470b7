"""The scheduler's model of the Slingshot dragonfly: groups, neighbours, conformance.

Built once per scheduling cycle from the nodes in a StateMirror (pure, no I/O) and
shared by every vCluster loop of the process. It answers the questions node
selection asks over and over, without rescanning all nodes:

* which dragonfly groups exist, how big they are and which are *adjacent*;
* which conformance groups (driver/firmware fingerprints) each group holds;
* which nodes are free (Ready, unowned, enabled), by group;
* each node's *capability signature* (GPU type/count, memory, features), so that a
  job's hard constraints are matched once per distinct signature (a few dozen on a
  real system) instead of once per node.

Adjacency. A dragonfly wires every group to every other with global (optical)
links, so "adjacent" is a placement preference, not reachability. Until agents
report real inter-group distances the model treats groups ``g`` and ``g ± 1`` as
adjacent (neighbouring cabinets share the shortest global cables and, on
Slingshot, the same global-link bundles); there is no wrap-around from the last
group to the first. :func:`fewest_groups` uses it to prefer a run of consecutive
groups when a job needs several.

Node capability flags read here (until ``NodeCapabilities`` grows real fields):

==========================  ========================================================
node feature                meaning
==========================  ========================================================
``unified_memory``          unified CPU-GPU memory domain (also implied by
                            ``gpu_type`` GH200 or MI300A, the superchips the spec
                            names)
``cxl_memory_gb=<N>``       ``N`` GB of CXL-attached memory (``:`` also accepted);
                            implies ``cxl_memory``. A bare ``cxl_memory`` means CXL
                            present but of unknown size: it adds 0 GB.
``single_numa``             one NUMA domain (memory-local for ``prefer_same_numa``;
                            unified nodes count as local too)
==========================  ========================================================
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from lattice_common.types import Node, NodeState

UNIFIED_GPU_TYPES = frozenset({"gh200", "mi300a"})
FEATURE_UNIFIED = "unified_memory"
FEATURE_CXL = "cxl_memory"
FEATURE_CXL_GB = "cxl_memory_gb"
FEATURE_SINGLE_NUMA = "single_numa"

# States whose nodes may come back into service without an operator (used for
# "all suitable nodes occupied" vs "no nodes matching constraints", as placement.py).
UNUSABLE_STATES = frozenset({NodeState.DOWN, NodeState.FAILED})


class Signature(NamedTuple):
    """A node's schedulable capabilities; nodes with equal signatures are interchangeable
    for every hard constraint the solver checks."""

    gpu_type: str  # lower-cased
    gpu_count: int
    memory_gb: int
    features: frozenset[str]
    unified_memory: bool
    cxl_memory_gb: int
    numa_local: bool  # single NUMA domain or unified memory

    @classmethod
    def of(
        cls, gpu_type: str, gpu_count: int, memory_gb: int, features: Iterable[str]
    ) -> Signature:
        fs = frozenset(features)
        gt = gpu_type.lower()
        unified = FEATURE_UNIFIED in fs or gt in UNIFIED_GPU_TYPES
        cxl = 0
        for f in fs:
            if f.startswith(FEATURE_CXL_GB) and len(f) > len(FEATURE_CXL_GB):
                sep, value = f[len(FEATURE_CXL_GB)], f[len(FEATURE_CXL_GB) + 1 :]
                if sep in "=:" and value.isdigit():
                    cxl = max(cxl, int(value))
        return cls(gt, gpu_count, memory_gb, fs, unified, cxl, unified or FEATURE_SINGLE_NUMA in fs)

    @property
    def has_cxl(self) -> bool:
        return self.cxl_memory_gb > 0 or FEATURE_CXL in self.features

    def sort_key(self) -> tuple[object, ...]:
        """Least capable first: nodes with rarer resources are kept for jobs that need them."""
        return (
            self.gpu_count,
            self.memory_gb,
            self.cxl_memory_gb,
            self.unified_memory,
            len(self.features),
            self.gpu_type,
            tuple(sorted(self.features)),
        )


def is_free(node: Node) -> bool:
    """Ready, not owned by any allocation, not administratively disabled, not claimed
    for sensitive use (the sensitive scheduler hands a user's claimed nodes to the
    solver as unclaimed copies)."""
    return (
        node.state == NodeState.READY
        and not node.owner
        and not node.disabled
        and not node.claimed_by
    )


@dataclass(slots=True)
class TopologyModel:
    """Dragonfly groups, their neighbours and conformance make-up, free nodes by group,
    and capability signatures. Read-only once built; rebuild it every cycle (or at
    least whenever a node's state, home, claim or enabled flag changes: owners are
    the only thing the solver reads live)."""

    nodes: dict[str, Node]
    groups: tuple[int, ...]  # sorted
    group_size: dict[int, int]  # all nodes, any state
    nodes_by_group: dict[int, tuple[str, ...]]  # sorted node ids
    free_by_group: dict[int, tuple[str, ...]]  # sorted ids of free nodes (is_free)
    conformance_by_group: dict[int, dict[str, int]]  # group -> fingerprint -> node count
    signatures: tuple[Signature, ...]  # index = signature id
    node_signature: dict[str, int]  # node id -> signature id
    _group_set: frozenset[int] = field(default=frozenset(), repr=False)
    # memo of data derived from the nodes as they were when first asked (the solver's
    # usable nodes per vCluster: homes, states, claims, enabled flags); a model is a
    # snapshot, so it is valid for the model's life
    derived: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_nodes(cls, nodes: Mapping[str, Node] | Iterable[Node]) -> TopologyModel:
        items = list(nodes.values()) if isinstance(nodes, Mapping) else list(nodes)
        items.sort(key=_node_id)
        by_id: dict[str, Node] = {}
        by_group: dict[int, list[str]] = {}
        free: dict[int, list[str]] = {}
        conf: dict[int, Counter[str]] = {}
        sig_cache: dict[tuple[object, ...], int] = {}
        sig_ids: dict[Signature, int] = {}
        sigs: list[Signature] = []
        node_sig: dict[str, int] = {}
        ready = NodeState.READY
        for n in items:
            nid = n.id
            by_id[nid] = n
            g = n.group
            ids = by_group.get(g)
            if ids is None:
                ids = by_group[g] = []
                free[g] = []
                conf[g] = Counter()
            ids.append(nid)
            if n.state == ready and not n.owner and not n.disabled and not n.claimed_by:
                free[g].append(nid)
            conf[g][n.conformance_group] += 1
            caps = n.capabilities
            key = (caps.gpu_type, caps.gpu_count, caps.memory_gb, *caps.features)
            sid = sig_cache.get(key)
            if sid is None:  # same capabilities, features in another order: same signature
                sig = Signature.of(caps.gpu_type, caps.gpu_count, caps.memory_gb, caps.features)
                sid = sig_ids.get(sig)
                if sid is None:
                    sid = sig_ids[sig] = len(sigs)
                    sigs.append(sig)
                sig_cache[key] = sid
            node_sig[nid] = sid
        groups = tuple(sorted(by_group))
        return cls(
            nodes=by_id,
            groups=groups,
            group_size={g: len(by_group[g]) for g in groups},
            nodes_by_group={g: tuple(by_group[g]) for g in groups},
            free_by_group={g: tuple(free[g]) for g in groups},
            conformance_by_group={g: dict(sorted(conf[g].items())) for g in groups},
            signatures=tuple(sigs),
            node_signature=node_sig,
            _group_set=frozenset(groups),
        )

    # --- queries ------------------------------------------------------------------------

    def adjacent(self, a: int, b: int) -> bool:
        """Groups ``g`` and ``g ± 1`` are adjacent (see the module docstring)."""
        return abs(a - b) == 1 and a in self._group_set and b in self._group_set

    def neighbours(self, g: int) -> tuple[int, ...]:
        return tuple(x for x in (g - 1, g + 1) if x in self._group_set)

    def free_count(self, g: int) -> int:
        return len(self.free_by_group.get(g, ()))

    def largest_conformance_group(self, g: int) -> tuple[str, int]:
        """The most common fingerprint in group ``g`` (nodes without one excluded) and
        its size; ("", 0) when none."""
        best = ("", 0)
        for fp, cnt in self.conformance_by_group.get(g, {}).items():
            if fp and cnt > best[1]:
                best = (fp, cnt)
        return best

    def signature(self, node_id: str) -> Signature:
        return self.signatures[self.node_signature[node_id]]


def _node_id(n: Node) -> str:
    return n.id


# --- group-set selection ----------------------------------------------------------------


def min_groups(counts: Mapping[int, int], k: int) -> int | None:
    """The fewest groups whose counts add up to ``k`` (largest groups first), or None
    when all of them together hold fewer than ``k``."""
    if k <= 0:
        return 0
    acc = 0
    for i, c in enumerate(sorted(counts.values(), reverse=True), 1):
        acc += c
        if acc >= k:
            return i
    return None


def fewest_groups(
    counts: Mapping[int, int], k: int, *, max_span: int | None = None
) -> list[int] | None:
    """The groups to take ``k`` nodes from, given free candidates per group.

    * One group when one holds ``k``: the tightest such group (best fit, then lowest id),
      so that big free groups stay whole for big jobs.
    * Otherwise the minimum number ``m`` of groups (largest first decides ``m``); among
      the runs of ``m`` adjacent groups (consecutive ids) that hold ``k`` the tightest
      (then lowest first id); failing any, the ``m`` largest groups (ties: lower id).
    * None when the groups hold fewer than ``k`` in total or ``m`` exceeds ``max_span``.

    The result is ordered by how many nodes to take from each (most first), so filling
    them in order uses every one of them.
    """
    if k <= 0:
        return []
    live = {g: c for g, c in counts.items() if c > 0}
    if not live:
        return None
    best_single: tuple[int, int] | None = None
    for g, c in live.items():
        if c >= k and (best_single is None or (c, g) < best_single):
            best_single = (c, g)
    if best_single is not None:
        return [best_single[1]]
    ranked = sorted(live, key=lambda g: (-live[g], g))
    acc = 0
    m = 0
    for g in ranked:
        acc += live[g]
        m += 1
        if acc >= k:
            break
    if acc < k or (max_span is not None and m > max_span):
        return None
    best_run: tuple[int, int] | None = None
    ids = sorted(live)
    for i in range(len(ids) - m + 1):
        start = ids[i]
        if ids[i + m - 1] != start + m - 1:  # not m consecutive ids
            continue
        total = 0
        for j in range(i, i + m):
            total += live[ids[j]]
        if total >= k and (best_run is None or (total, start) < best_run):
            best_run = (total, start)
    if best_run is not None:
        run = range(best_run[1], best_run[1] + m)
        return sorted(run, key=lambda g: (-live[g], g))
    return ranked[:m]
