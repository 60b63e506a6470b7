"""The one hard node filter (``filters.node_satisfies``): the ``Constraints`` fields.

The solver's flags (``require_unified_memory``, ``allow_cxl_memory``, ...) are covered
with the solver in test_solver.py (``test_hard_filter``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import AllocationSpec, Constraints
from lattice_scheduler.filters import (
    SOLVER_FLAGS,
    filter_kwargs,
    node_satisfies,
    signature_matches,
)
from lattice_scheduler.topology import Signature
from lattice_test_harness import builders as b


def spec(**constraints: Any) -> AllocationSpec:
    return b.spec(constraints=Constraints(**constraints))


# --- the hard constraints of Constraints -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraints", "expected"),
    [
        ({}, True),
        ({"gpu_type": "GH200"}, True),
        ({"gpu_type": "gh200"}, True),  # case-insensitive
        ({"gpu_type": "A100"}, False),
        ({"gpu_count": 4}, True),
        ({"gpu_count": 5}, False),
        ({"memory_gb": 512}, True),
        ({"memory_gb": 513}, False),
        ({"features": ["nvme"]}, True),
        ({"features": ["nvme", "ib"]}, True),
        ({"features": ["nvme", "fpga"]}, False),
        ({"gpu_type": "GH200", "gpu_count": 4, "memory_gb": 256, "features": ["ib"]}, True),
        ({"gpu_type": "GH200", "gpu_count": 8}, False),
        ({"topology": "tight"}, True),  # a packing hint, not a filter
    ],
)
def test_node_satisfies(constraints: dict[str, Any], expected: bool) -> None:
    n = b.node("x", gpu_type="GH200", gpu_count=4, memory_gb=512, features=["nvme", "ib"])
    assert node_satisfies(n, spec(**constraints)) is expected


def test_gpu_constraints_do_not_match_cpu_nodes() -> None:
    n = b.node("cpu")
    assert not node_satisfies(n, spec(gpu_count=1))
    assert not node_satisfies(n, spec(gpu_type="H100"))
    assert node_satisfies(n, spec())


@settings(max_examples=200, deadline=None)
@given(
    gpu_type=st.sampled_from(["", "GH200", "a100", "A100"]),
    gpu_count=st.integers(0, 8),
    memory_gb=st.sampled_from([0, 256, 512, 1024]),
    features=st.lists(
        st.sampled_from(["nvme", "ib", "unified_memory", "cxl_memory_gb=512", *SOLVER_FLAGS]),
        max_size=3,
    ),
    node_type=st.sampled_from(["", "GH200", "A100", "MI300A"]),
    node_features=st.lists(
        st.sampled_from(["nvme", "ib", "unified_memory", "cxl_memory_gb=512", "single_numa"]),
        max_size=3,
    ),
)
def test_the_direct_check_agrees_with_the_signature_match(
    gpu_type: str,
    gpu_count: int,
    memory_gb: int,
    features: list[str],
    node_type: str,
    node_features: list[str],
) -> None:
    n = b.node("x", gpu_type=node_type, gpu_count=4, memory_gb=512, features=node_features)
    s = spec(gpu_type=gpu_type, gpu_count=gpu_count, memory_gb=memory_gb, features=features)
    caps = n.capabilities
    sig = Signature.of(caps.gpu_type, caps.gpu_count, caps.memory_gb, caps.features)
    assert node_satisfies(n, s) is signature_matches(sig, **filter_kwargs(s))
