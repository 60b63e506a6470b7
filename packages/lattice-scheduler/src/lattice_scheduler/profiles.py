"""Named cost-function weight profiles (w1..w9 per vCluster type).

The five profiles are the specification's "Weight Profiles" table (Scheduling
Algorithm chapter), copied value for value; each column sums to 1.00. The balanced
HPC baseline (``CostWeights()`` in lattice_common) is not one of them: the spec says
it "is not identical to any named profile ... it is a general-purpose starting point".

Weight names are the ``CostWeights`` field names (:data:`WEIGHT_NAMES`, w1..w9 in
order); w8 is ``checkpoint_efficiency``. ``weights_from_mapping`` also reads the other
spellings of ``lattice_common.types.WEIGHT_ALIASES`` (the Performance Tuning Guide's
YAML writes ``checkpoint:``), so RM-Replay profile files and vCluster configs written
from the docs load as they are; ``weights_as_mapping`` writes the field names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
from lattice_common.types import WEIGHT_ALIASES, CostWeights

WEIGHT_NAMES: tuple[str, ...] = tuple(f.name for f in msgspec.structs.fields(CostWeights))
"""w1..w9 in order: the one name of each weight."""

# | Weight            | HPC Batch | ML Training | Service | Sensitive | Interactive |
# | w1 (priority)     | 0.15      | 0.10        | 0.15    | 0.90      | 0.10        |
# | w2 (wait_time)    | 0.20      | 0.10        | 0.05    | 0.00      | 0.30        |
# | w3 (fair_share)   | 0.20      | 0.10        | 0.10    | 0.00      | 0.10        |
# | w4 (topology)     | 0.15      | 0.25        | 0.05    | 0.00      | 0.00        |
# | w5 (data_ready)   | 0.10      | 0.15        | 0.10    | 0.00      | 0.05        |
# | w6 (backlog)      | 0.05      | 0.05        | 0.05    | 0.00      | 0.15        |
# | w7 (energy)       | 0.00      | 0.05        | 0.10    | 0.00      | 0.00        |
# | w8 (checkpoint)   | 0.05      | 0.10        | 0.10    | 0.00      | 0.00        |
# | w9 (conformance)  | 0.10      | 0.10        | 0.30    | 0.10      | 0.30        |
WEIGHT_PROFILES: dict[str, CostWeights] = {
    "hpc-batch": CostWeights(
        priority=0.15,
        wait_time=0.20,
        fair_share=0.20,
        topology=0.15,
        data_readiness=0.10,
        backlog=0.05,
        energy=0.00,
        checkpoint_efficiency=0.05,
        conformance=0.10,
    ),
    "ml-training": CostWeights(
        priority=0.10,
        wait_time=0.10,
        fair_share=0.10,
        topology=0.25,
        data_readiness=0.15,
        backlog=0.05,
        energy=0.05,
        checkpoint_efficiency=0.10,
        conformance=0.10,
    ),
    "service": CostWeights(
        priority=0.15,
        wait_time=0.05,
        fair_share=0.10,
        topology=0.05,
        data_readiness=0.10,
        backlog=0.05,
        energy=0.10,
        checkpoint_efficiency=0.10,
        conformance=0.30,
    ),
    # "Sensitive scheduler is degenerate: priority dominates because node claims are
    # non-negotiable (w1=0.90). Conformance (w9=0.10) acts as a tiebreaker".
    "sensitive": CostWeights(
        priority=0.90,
        wait_time=0.00,
        fair_share=0.00,
        topology=0.00,
        data_readiness=0.00,
        backlog=0.00,
        energy=0.00,
        checkpoint_efficiency=0.00,
        conformance=0.10,
    ),
    "interactive": CostWeights(
        priority=0.10,
        wait_time=0.30,
        fair_share=0.10,
        topology=0.00,
        data_readiness=0.05,
        backlog=0.15,
        energy=0.00,
        checkpoint_efficiency=0.00,
        conformance=0.30,
    ),
}

# The built-in scheduler types (``lattice admin vcluster create --scheduler=...``) and
# the profile each starts from. ML training has no scheduler type of its own (it runs
# on hpc-backfill); its profile is chosen by name.
SCHEDULER_TYPE_PROFILES: dict[str, str] = {
    "hpc-backfill": "hpc-batch",
    "service-binpack": "service",
    "sensitive-reservation": "sensitive",
    "interactive-fifo": "interactive",
}

# Accepted key (dashes read as underscores) -> CostWeights field: the field names and
# their aliases.
WEIGHT_KEYS: dict[str, str] = {**{n: n for n in WEIGHT_NAMES}, **WEIGHT_ALIASES}


def profile_for_scheduler_type(scheduler_type: str) -> CostWeights:
    """Starting weights for a vCluster: by scheduler type (``hpc-backfill``,
    ``service-binpack``, ``sensitive-reservation``, ``interactive-fifo``) or by profile
    name (``hpc-batch``, ``ml-training``, ...). Anything else gets the balanced HPC
    baseline ``CostWeights()``. Returns a copy, so callers may change it freely."""
    key = str(scheduler_type).strip().lower()
    profile = WEIGHT_PROFILES.get(SCHEDULER_TYPE_PROFILES.get(key, key))
    return CostWeights() if profile is None else msgspec.structs.replace(profile)


def weights_from_mapping(
    values: Mapping[str, float], *, base: CostWeights | None = None
) -> CostWeights:
    """CostWeights from a mapping of weight names (``{"priority": 0.2, ...,
    "checkpoint_efficiency": 0.0}``) or their aliases (the Tuning Guide's
    ``checkpoint``); keys may use dashes (``wait-time``). Missing keys keep
    ``base`` (default: the balanced baseline). Weights must be finite and >= 0; they
    need not sum to 1 (the spec's own tuning examples sum to 1.10)."""
    changes: dict[str, float] = {}
    for raw_key, raw_value in values.items():
        key = str(raw_key).strip().lower().replace("-", "_")
        field = WEIGHT_KEYS.get(key)
        if field is None:
            raise ValueError(
                f"unknown cost weight {raw_key!r}; known: {', '.join(sorted(WEIGHT_KEYS))}"
            )
        value = float(raw_value)
        if not math.isfinite(value) or value < 0.0:
            raise ValueError(
                f"cost weight {raw_key!r} must be a finite number >= 0, got {raw_value!r}"
            )
        changes[field] = value
    return msgspec.structs.replace(base if base is not None else CostWeights(), **changes)


def weights_as_mapping(w: CostWeights) -> dict[str, float]:
    """``w`` as a weights mapping (the YAML shape), keyed by the weight names."""
    return {n: getattr(w, n) for n in WEIGHT_NAMES}
