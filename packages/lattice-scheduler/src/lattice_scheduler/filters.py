"""The hard node filter: whether a node's capabilities can serve an allocation.

One filter for every caller: the solver (per capability signature), victim selection
in preemption, the reasons of a cycle with nothing free, and RM-Replay's baselines and
cycle skipping. A second copy once treated the solver's flags below as node features,
so jobs asking for them never found preemption victims.

Hard constraints: ``gpu_type`` (case-insensitive), ``gpu_count``, ``memory_gb`` and
``features`` of ``Constraints``, plus the hard flags below.

Constraint flags. ``Constraints`` has no fields yet for the memory-topology and
conformance hints; they are read from ``constraints.features`` by
:func:`constraint_flags` and are *not* required as node features:

===========================  =========  ==================================================
flag in constraints.features kind       effect
===========================  =========  ==================================================
``require_unified_memory``   hard       only nodes with a unified CPU-GPU memory domain
                                        (node feature ``unified_memory``, or GH200/MI300A)
``allow_cxl_memory``         opt-in     ``memory_gb`` may be met with local + CXL memory
                                        (node feature ``cxl_memory_gb=<N>``)
``require_conformance``      hard       all nodes share one conformance fingerprint (nodes
                                        without one never qualify for multi-node jobs)
``prefer_same_numa``         soft       single-NUMA / unified nodes first within a chosen
``prefer_local_memory``                 group; reported as ``memory_locality``
===========================  =========  ==================================================

The soft and selection-rule flags (``require_conformance``, ``prefer_*``) never exclude
a node here: the solver applies them when it selects a node set.
"""

from __future__ import annotations

from lattice_common.types import AllocationSpec, Node

from lattice_scheduler.topology import Signature

FLAG_REQUIRE_UNIFIED_MEMORY = "require_unified_memory"
FLAG_ALLOW_CXL_MEMORY = "allow_cxl_memory"
FLAG_REQUIRE_CONFORMANCE = "require_conformance"
FLAG_PREFER_SAME_NUMA = "prefer_same_numa"
FLAG_PREFER_LOCAL_MEMORY = "prefer_local_memory"
SOLVER_FLAGS = frozenset(
    {
        FLAG_REQUIRE_UNIFIED_MEMORY,
        FLAG_ALLOW_CXL_MEMORY,
        FLAG_REQUIRE_CONFORMANCE,
        FLAG_PREFER_SAME_NUMA,
        FLAG_PREFER_LOCAL_MEMORY,
    }
)


def constraint_flags(spec: AllocationSpec) -> frozenset[str]:
    """The constraint flags an allocation asks for (see the module docstring); they live in
    ``constraints.features`` until ``Constraints`` has fields for them."""
    feats = spec.constraints.features
    if not feats:
        return frozenset()
    return frozenset(f for f in feats if f in SOLVER_FLAGS)


def signature_matches(
    sig: Signature,
    *,
    gpu_type: str = "",
    gpu_count: int = 0,
    memory_gb: int = 0,
    features: frozenset[str] = frozenset(),
    require_unified_memory: bool = False,
    allow_cxl_memory: bool = False,
) -> bool:
    """The hard filter, for one capability signature (``gpu_type`` lower-cased)."""
    if gpu_type and sig.gpu_type != gpu_type:
        return False
    if gpu_count and sig.gpu_count < gpu_count:
        return False
    if memory_gb:
        mem = sig.memory_gb + (sig.cxl_memory_gb if allow_cxl_memory else 0)
        if mem < memory_gb:
            return False
    if features and not features <= sig.features:
        return False
    return not (require_unified_memory and not sig.unified_memory)


def node_satisfies(node: Node, spec: AllocationSpec) -> bool:
    """Every hard constraint of ``spec`` holds on ``node`` (capabilities only).

    Called per node in scans (preemption, RM-Replay's baselines), so a request without
    features (hence without flags) is checked on the capabilities directly; anything
    else goes through the node's :class:`Signature` and :func:`signature_matches`."""
    c = spec.constraints
    caps = node.capabilities
    if c.gpu_type and caps.gpu_type.lower() != c.gpu_type.lower():
        return False
    if c.gpu_count and caps.gpu_count < c.gpu_count:
        return False
    if not c.features:
        return caps.memory_gb >= c.memory_gb
    return signature_matches(
        Signature.of(caps.gpu_type, caps.gpu_count, caps.memory_gb, caps.features),
        **filter_kwargs(spec),
    )


def filter_kwargs(spec: AllocationSpec) -> dict[str, object]:
    """``spec``'s hard constraints as :func:`signature_matches` keywords."""
    c = spec.constraints
    flags = constraint_flags(spec)
    return {
        "gpu_type": c.gpu_type.lower(),
        "gpu_count": c.gpu_count,
        "memory_gb": c.memory_gb,
        "features": frozenset(f for f in c.features if f not in SOLVER_FLAGS),
        "require_unified_memory": FLAG_REQUIRE_UNIFIED_MEMORY in flags,
        "allow_cxl_memory": FLAG_ALLOW_CXL_MEMORY in flags,
    }
