"""Cost function: each factor f1..f9 against the specification's formulas and examples,
the soft-quota penalty curve, the weight profiles table, score/breakdown and the
per-cycle context; then Hypothesis properties (the spec's "Cost function
monotonicity: increasing wait time always increases f2" and "Fair share bounds: f3
always in [0, 1]", plus bounds of every other factor, monotonicity of the score in
priority class and of the penalty in budget used)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import WEIGHT_ALIASES, AllocationState, CostWeights
from lattice_common.watch import StateDelta, StateMirror
from lattice_scheduler import cost
from lattice_scheduler.cost import (
    NEUTRAL,
    OVER_SHARE_MULTIPLIER,
    IntraNodeFit,
    ScoringContext,
    beta_for,
    breakdown,
    budget_penalty,
    build_context,
    energy_price_at,
    f1_priority_class,
    f2_wait_time,
    f3_fair_share_deficit,
    f4_topology_fitness,
    f5_data_readiness,
    f6_backlog_pressure,
    f7_energy_cost,
    f8_checkpoint_efficiency,
    f9_conformance_fitness,
    fair_share_deficit,
    gpu_hours,
    gpu_link_fitness,
    intra_node_fitness,
    memory_locality_fitness,
    raw_score,
    same_domain_fraction,
    score,
    wait_time_factor,
)
from lattice_scheduler.profiles import (
    WEIGHT_PROFILES,
    profile_for_scheduler_type,
    weights_as_mapping,
    weights_from_mapping,
)
from lattice_test_harness import builders as b

A = AllocationState
HOUR = 3600.0
DAY = 86400.0
# A Tuesday 00:00 UTC, so hour-of-day arithmetic in the energy tests is easy to read.
MIDNIGHT = 1_767_657_600.0
assert MIDNIGHT % DAY == 0

FIELDS = cost.FACTOR_NAMES


def ctx_(**kw: object) -> ScoringContext:
    kw.setdefault("now", MIDNIGHT)
    return ScoringContext(**kw)  # type: ignore[arg-type]


def alloc(**kw: object):
    kw.setdefault("submitted_at", MIDNIGHT)
    kw.setdefault("id", "job")
    return b.allocation(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- f1


@pytest.mark.parametrize(("cls", "expected"), [(0, 0.0), (1, 0.1), (5, 0.5), (7, 0.7), (10, 1.0)])
def test_f1_is_class_over_ten(cls: int, expected: float) -> None:
    assert f1_priority_class(alloc(preemption_class=cls)) == pytest.approx(expected)


def test_f1_sensitive_is_highest_and_out_of_range_is_clamped() -> None:
    assert f1_priority_class(alloc(preemption_class=10)) == 1.0
    assert f1_priority_class(alloc(preemption_class=11)) == 1.0
    assert f1_priority_class(alloc(preemption_class=-1)) == 0.0


# --------------------------------------------------------------------------- f2


def test_f2_is_log_of_one_plus_wait_over_reference() -> None:
    a = alloc(submitted_at=MIDNIGHT)
    assert f2_wait_time(a, ctx_(now=MIDNIGHT)) == 0.0
    assert f2_wait_time(a, ctx_(now=MIDNIGHT + HOUR)) == pytest.approx(math.log(2))
    assert f2_wait_time(a, ctx_(now=MIDNIGHT + (math.e - 1) * HOUR)) == pytest.approx(1.0)
    assert f2_wait_time(a, ctx_(now=MIDNIGHT + DAY)) == pytest.approx(math.log(25))
    # reference_wait is tunable
    assert f2_wait_time(a, ctx_(now=MIDNIGHT + 600, reference_wait_seconds=600)) == pytest.approx(
        math.log(2)
    )


def test_f2_is_not_capped_so_waiting_eventually_outweighs_priority() -> None:
    """Anti-starvation: with the balanced weights a class-0 job that waited a week
    outranks a class-10 job submitted now (f2 is unbounded, by design)."""
    now = MIDNIGHT + 7 * DAY
    old = alloc(id="old", preemption_class=0, submitted_at=MIDNIGHT)
    new = alloc(id="new", preemption_class=10, submitted_at=now)
    c = ctx_(now=now)
    assert f2_wait_time(old, c) > 5.0
    assert score(old, c, CostWeights()) > score(new, c, CostWeights())


def test_f2_negative_wait_and_bad_reference() -> None:
    assert wait_time_factor(-10.0, HOUR) == 0.0
    assert wait_time_factor(math.nan, HOUR) == 0.0
    assert wait_time_factor(HOUR, 0.0) == pytest.approx(math.log(2))  # falls back to 1 h
    assert wait_time_factor(HOUR, -5.0) == pytest.approx(math.log(2))


# --------------------------------------------------------------------------- f3


@pytest.mark.parametrize(
    ("target", "actual", "expected"),
    [
        (0.15, 0.0, 1.0),  # "1 (tenant has used nothing)"
        (0.15, 0.15, 0.0),  # "0 (tenant at or above share)"
        (0.15, 0.30, 0.0),  # above share (burst)
        (0.15, 0.075, 0.5),
        (0.20, 0.05, 0.75),
        (0.0, 0.1, 0.0),  # no contracted share
        (0.0, 0.0, 0.0),
    ],
)
def test_f3_examples(target: float, actual: float, expected: float) -> None:
    assert fair_share_deficit(target, actual) == pytest.approx(expected)


def test_f3_reads_tenant_shares_from_the_context() -> None:
    c = ctx_(tenant_target_share={"phys": 0.2, "bio": 0.1}, tenant_usage_share={"phys": 0.05})
    assert f3_fair_share_deficit(alloc(tenant="phys"), c) == pytest.approx(0.75)
    assert f3_fair_share_deficit(alloc(tenant="bio"), c) == 1.0  # no usage recorded
    assert f3_fair_share_deficit(alloc(tenant="chem"), c) == 0.0  # no target


# --------------------------------------------------------------------------- f4


@pytest.mark.parametrize(
    ("needed", "available", "expected"),
    [(1, 4, 0.75), (2, 4, 0.5), (4, 4, 0.0), (1, 10, 0.9), (5, 4, 0.0), (1, 0, 0.0)],
)
def test_f4_inter_node(needed: int, available: int, expected: float) -> None:
    assert f4_topology_fitness(needed, available) == pytest.approx(expected)


def test_f4_fewer_groups_score_higher() -> None:
    scores = [f4_topology_fitness(g, 8) for g in range(1, 9)]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == len(scores)


def test_gpu_link_fitness_uses_link_bandwidth_ratios() -> None:
    # NVSwitch node (900 GB/s): a set joined only by NVLink (450) or PCIe Gen5 (64)
    assert gpu_link_fitness(900, 900) == 1.0
    assert gpu_link_fitness(450, 900) == pytest.approx(0.5)
    assert gpu_link_fitness(64, 900) == pytest.approx(64 / 900)
    assert gpu_link_fitness(0, 0) == 1.0  # no GPU links at all: nothing to lose


def test_memory_locality_is_average_same_domain_fraction() -> None:
    # 16 CPUs + 2 GPUs all in domain 0 -> 1.0; split 9/9 over two NUMA domains -> 0.5
    assert same_domain_fraction([18]) == 1.0
    assert same_domain_fraction([9, 9]) == 0.5
    assert same_domain_fraction([12, 4, 0]) == 0.75
    assert same_domain_fraction([]) == 1.0
    assert memory_locality_fitness([1.0, 0.5]) == pytest.approx(0.75)
    assert memory_locality_fitness([]) == 1.0


def test_beta_values() -> None:
    assert beta_for("gpu-heavy") == 0.7
    assert beta_for("cpu-heavy") == 0.3
    assert beta_for(None) == beta_for("anything") == 0.5


def test_intra_node_fitness_combines_gpu_links_and_memory_locality() -> None:
    # intra = β·gpu_link + (1-β)·memory_locality
    assert intra_node_fitness(0.5, 1.0, 0.7) == pytest.approx(0.7 * 0.5 + 0.3 * 1.0)
    assert intra_node_fitness(0.5, 1.0, 0.3) == pytest.approx(0.3 * 0.5 + 0.7 * 1.0)
    assert intra_node_fitness(0.5, 1.0) == pytest.approx(0.75)
    assert intra_node_fitness(None, 0.6) == pytest.approx(0.6)  # CPU-only job
    assert intra_node_fitness(0.4, None) == pytest.approx(0.4)  # no memory topology
    assert intra_node_fitness(None, None) is None


def test_f4_multi_node_uses_alpha_07() -> None:
    intra = IntraNodeFit(single_node=False, gpu_link=0.5, memory_locality=1.0, beta=0.7)
    inter = 1 - 2 / 4
    expected = 0.7 * inter + 0.3 * (0.7 * 0.5 + 0.3 * 1.0)
    assert f4_topology_fitness(2, 4, intra_node=intra) == pytest.approx(expected)


def test_f4_single_node_is_intra_node_fitness() -> None:
    """Spec: "α = 1.0 for single-node jobs (intra-node only matters)" — implemented as
    the stated intent: a single-node job's f4 is its intra-node fitness."""
    good = IntraNodeFit(single_node=True, gpu_link=1.0, memory_locality=1.0)
    pcie = IntraNodeFit(single_node=True, gpu_link=64 / 900, memory_locality=0.5)
    assert f4_topology_fitness(1, 4, intra_node=good) == 1.0
    assert f4_topology_fitness(1, 4, intra_node=pcie) == pytest.approx(0.5 * 64 / 900 + 0.5 * 0.5)
    assert f4_topology_fitness(1, 4, intra_node=good) > f4_topology_fitness(1, 4, intra_node=pcie)


def test_f4_without_intra_node_data_is_the_inter_node_formula() -> None:
    assert f4_topology_fitness(1, 4, intra_node=IntraNodeFit(single_node=True)) == 0.75
    assert f4_topology_fitness(2, 4, intra_node=IntraNodeFit(single_node=False)) == 0.5


# --------------------------------------------------------------------------- f5


def test_f5_hot_tier_fraction_with_unknown_neutral() -> None:
    a = alloc(id="j1")
    assert f5_data_readiness(a, ctx_()) == 0.5  # "defaults to 0.5 (neutral)"
    assert f5_data_readiness(a, ctx_(data_readiness={"j1": 0.8})) == 0.8
    assert f5_data_readiness(a, ctx_(data_readiness={"j1": 1.0})) == 1.0
    assert f5_data_readiness(a, ctx_(data_readiness={"j1": 0.0})) == 0.0
    assert f5_data_readiness(a, ctx_(data_readiness={"j1": math.nan})) == 0.5
    assert f5_data_readiness(a, ctx_(data_readiness={"j1": 7.0})) == 1.0


# --------------------------------------------------------------------------- f6


@pytest.mark.parametrize(
    ("queued", "running", "expected"),
    [(50, 100, 0.5), (100, 100, 1.0), (300, 100, 1.0), (0, 100, 0.0), (5, 0, 1.0), (0, 0, 0.0)],
)
def test_f6_backlog_pressure(queued: float, running: float, expected: float) -> None:
    c = ctx_(queued_gpu_hours=queued, running_gpu_hours=running)
    assert f6_backlog_pressure(c) == pytest.approx(expected)


# --------------------------------------------------------------------------- f7

TOU = [(22.0, 6.0, 0.10), (6.0, 18.0, 0.30), (18.0, 22.0, 0.20)]


@pytest.mark.parametrize(
    ("hour", "expected"),
    [(2, 1.0), (23, 1.0), (0, 1.0), (6, 0.0), (12, 0.0), (17.99, 0.0), (18, 0.5), (21.5, 0.5)],
)
def test_f7_one_minus_normalised_price(hour: float, expected: float) -> None:
    c = ctx_(now=MIDNIGHT + hour * HOUR, energy_prices=TOU)
    assert c.energy_price_min == 0.10 and c.energy_price_max == 0.30
    assert f7_energy_cost(c) == pytest.approx(expected)


def test_f7_explicit_normalisation_bounds_and_neutral_cases() -> None:
    c = ctx_(
        now=MIDNIGHT + 12 * HOUR,
        energy_prices=[(0.0, 24.0, 0.30)],
        energy_price_min=0.0,
        energy_price_max=0.60,
    )
    assert f7_energy_cost(c) == pytest.approx(0.5)
    assert f7_energy_cost(ctx_()) == NEUTRAL  # no time-of-use pricing
    flat = ctx_(energy_prices=[(0.0, 0.0, 0.2)])  # start == end: whole day, one price
    assert f7_energy_cost(flat) == NEUTRAL
    gap = ctx_(now=MIDNIGHT + 3 * HOUR, energy_prices=[(6.0, 18.0, 0.3), (18.0, 22.0, 0.1)])
    assert f7_energy_cost(gap) == NEUTRAL  # 03:00 is in no window


def test_energy_price_at_wraps_midnight_and_takes_first_match() -> None:
    assert energy_price_at(TOU, MIDNIGHT + 1 * HOUR) == 0.10
    assert energy_price_at(TOU, MIDNIGHT + 22 * HOUR) == 0.10
    assert energy_price_at(TOU, MIDNIGHT + 7 * DAY + 9 * HOUR) == 0.30
    assert energy_price_at([(0, 24, 1.0), (0, 24, 2.0)], MIDNIGHT) == 1.0
    assert energy_price_at([], MIDNIGHT) is None


# --------------------------------------------------------------------------- f8


@pytest.mark.parametrize(
    ("minutes", "expected"), [(0.0, 1.0), (1.0, 0.5), (3.0, 0.25), (9.0, 0.1), (math.inf, 0.0)]
)
def test_f8_one_over_one_plus_minutes(minutes: float, expected: float) -> None:
    a = alloc(id="ck")
    assert f8_checkpoint_efficiency(a, ctx_(checkpoint_minutes={"ck": minutes})) == pytest.approx(
        expected
    )


def test_f8_default_estimate_is_the_checkpoint_timeout() -> None:
    a = alloc(id="ck")
    assert f8_checkpoint_efficiency(a, ctx_()) == pytest.approx(1 / 11)
    assert f8_checkpoint_efficiency(a, ctx_(default_checkpoint_minutes=1.0)) == 0.5
    assert f8_checkpoint_efficiency(a, ctx_(checkpoint_minutes={"ck": -3.0})) == 1.0
    assert f8_checkpoint_efficiency(a, ctx_(checkpoint_minutes={"ck": math.nan})) == (
        pytest.approx(1 / 11)
    )


# --------------------------------------------------------------------------- f9


@pytest.mark.parametrize(
    ("largest", "requested", "expected"),
    [(8, 8, 1.0), (6, 8, 0.75), (1, 8, 0.125), (16, 8, 1.0), (0, 8, 0.0), (3, 0, 1.0)],
)
def test_f9_conformance(largest: int, requested: int, expected: float) -> None:
    assert f9_conformance_fitness(largest, requested) == pytest.approx(expected)


# --------------------------------------------------------------------------- budget


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (None, 1.0),
        (0.0, 1.0),
        (0.5, 1.0),
        (0.79, 1.0),
        (0.8, 1.0),
        (0.875, 0.8125),  # the spec's example: 87,500 of 100,000 GPU-hours used
        (0.9, 0.75),
        (0.999, 1.0 - 0.5 * 0.199 / 0.2),
        (1.0, 0.01),
        (1.5, 0.01),
        (math.inf, 0.01),
        (-1.0, 1.0),
        (math.nan, 1.0),
    ],
)
def test_budget_penalty_curve(fraction: float | None, expected: float) -> None:
    assert budget_penalty(fraction) == pytest.approx(expected)


def test_exhausted_budget_is_very_low_but_not_rejected() -> None:
    a = alloc(tenant="phys", preemption_class=10)
    fine = ctx_(budget_fraction_used={"phys": 0.5})
    broke = ctx_(budget_fraction_used={"phys": 1.2})
    w = CostWeights()
    assert score(a, fine, w) == pytest.approx(raw_score(a, fine, w))
    assert 0 < score(a, broke, w) == pytest.approx(0.01 * raw_score(a, broke, w))
    other = alloc(id="other", tenant="bio", preemption_class=0)
    assert score(other, broke, w) > score(a, broke, w)  # effective starvation


# --------------------------------------------------------------------------- profiles

SPEC_TABLE = {
    #               w1    w2    w3    w4    w5    w6    w7    w8    w9
    "hpc-batch": (0.15, 0.20, 0.20, 0.15, 0.10, 0.05, 0.00, 0.05, 0.10),
    "ml-training": (0.10, 0.10, 0.10, 0.25, 0.15, 0.05, 0.05, 0.10, 0.10),
    "service": (0.15, 0.05, 0.10, 0.05, 0.10, 0.05, 0.10, 0.10, 0.30),
    "sensitive": (0.90, 0.00, 0.00, 0.00, 0.00, 0.00, 0.00, 0.00, 0.10),
    "interactive": (0.10, 0.30, 0.10, 0.00, 0.05, 0.15, 0.00, 0.00, 0.30),
}


def test_profiles_are_the_spec_table() -> None:
    assert set(WEIGHT_PROFILES) == set(SPEC_TABLE)
    for name, column in SPEC_TABLE.items():
        w = WEIGHT_PROFILES[name]
        assert tuple(getattr(w, f) for f in FIELDS) == column, name


@pytest.mark.parametrize("name", sorted(SPEC_TABLE))
def test_every_profile_sums_to_one(name: str) -> None:
    # Checked against the table: every column of the spec's table sums to 1.00.
    assert math.fsum(getattr(WEIGHT_PROFILES[name], f) for f in FIELDS) == pytest.approx(1.0)


def test_balanced_default_is_the_spec_baseline_and_sums_to_one() -> None:
    w = CostWeights()
    assert tuple(getattr(w, f) for f in FIELDS) == (
        0.20,
        0.20,
        0.20,
        0.15,
        0.10,
        0.05,
        0.00,
        0.00,
        0.10,
    )
    assert math.fsum(getattr(w, f) for f in FIELDS) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("scheduler_type", "profile"),
    [
        ("hpc-backfill", "hpc-batch"),
        ("service-binpack", "service"),
        ("sensitive-reservation", "sensitive"),
        ("interactive-fifo", "interactive"),
        ("ml-training", "ml-training"),
        ("HPC-Batch", "hpc-batch"),
    ],
)
def test_profile_for_scheduler_type(scheduler_type: str, profile: str) -> None:
    got = profile_for_scheduler_type(scheduler_type)
    assert got == WEIGHT_PROFILES[profile]
    got.priority = 0.99  # a copy: the table is not changed
    assert WEIGHT_PROFILES[profile].priority != 0.99


def test_unknown_scheduler_type_gets_balanced_default() -> None:
    assert profile_for_scheduler_type("something-else") == CostWeights()


def test_weights_from_tuning_guide_yaml_shape() -> None:
    # profiles/baseline.yaml from the Performance Tuning Guide. Note: the guide's own
    # examples sum to 1.10, not 1.00; weights are taken as given, not rescaled.
    baseline = {
        "priority": 0.20,
        "wait_time": 0.25,
        "fair_share": 0.25,
        "topology": 0.15,
        "data_readiness": 0.10,
        "backlog": 0.05,
        "energy": 0.00,
        "checkpoint": 0.00,
        "conformance": 0.10,
    }
    w = weights_from_mapping(baseline)
    assert w.wait_time == 0.25 and w.checkpoint_efficiency == 0.0
    assert math.fsum(getattr(w, f) for f in FIELDS) == pytest.approx(1.10)
    # written back with the one name of w8, CostWeights' own
    written = weights_as_mapping(w)
    assert list(written) == list(FIELDS)
    assert written == {WEIGHT_ALIASES.get(k, k): v for k, v in baseline.items()}
    assert weights_from_mapping(written) == w
    assert weights_from_mapping({"fair-share": 0.35}).fair_share == 0.35
    with pytest.raises(ValueError, match="unknown cost weight"):
        weights_from_mapping({"speed": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        weights_from_mapping({"priority": -0.1})


# --------------------------------------------------------------------------- score


def _full_ctx(a_id: str = "job") -> ScoringContext:
    return ctx_(
        now=MIDNIGHT + HOUR,
        tenant_target_share={"phys": 0.15},
        queued_gpu_hours=50,
        running_gpu_hours=100,
        data_readiness={},
        max_groups_available=4,
    )


def test_score_balanced_example_by_hand() -> None:
    a = alloc(tenant="phys", preemption_class=10, submitted_at=MIDNIGHT)
    # f1=1, f2=ln2, f3=1 (used nothing), f4=0.75, f5=0.5 (unknown), f6=0.5, f7=0.5
    # (no pricing), f8=1/11 (default), f9=1.0
    expected = (
        0.20 * 1
        + 0.20 * math.log(2)
        + 0.20 * 1
        + 0.15 * 0.75
        + 0.10 * 0.5
        + 0.05 * 0.5
        + 0.0
        + 0.0
        + 0.10 * 1.0
    )
    assert score(a, _full_ctx(), CostWeights(), f4=0.75, f9=1.0) == pytest.approx(expected)


def test_score_uses_neutral_f4_f9_until_nodes_are_chosen() -> None:
    a = alloc(tenant="phys")
    c = _full_ctx()
    w = CostWeights()
    assert score(a, c, w) == pytest.approx(score(a, c, w, f4=NEUTRAL, f9=NEUTRAL))
    assert score(a, c, w, f4=1.0, f9=1.0) > score(a, c, w)


def test_sensitive_profile_is_priority_dominated() -> None:
    w = WEIGHT_PROFILES["sensitive"]
    c = _full_ctx()
    claim = alloc(id="claim", preemption_class=10, submitted_at=c.now)
    old = alloc(id="old", preemption_class=9, submitted_at=c.now - 30 * DAY, tenant="phys")
    assert score(claim, c, w, f9=1.0) == pytest.approx(1.0)
    # waiting, fair share, topology, ... carry no weight: class decides, w9 breaks ties
    assert score(claim, c, w) > score(old, c, w)
    assert score(old, c, w) == pytest.approx(0.9 * 0.9 + 0.1 * NEUTRAL)
    assert score(claim, c, w, f9=1.0) > score(claim, c, w, f9=0.8)


def test_breakdown_lists_every_factor_and_weight_and_sums_to_raw_score() -> None:
    a = alloc(tenant="phys", preemption_class=3, submitted_at=MIDNIGHT - 2 * HOUR)
    c = msgspec.structs.replace(_full_ctx(), budget_fraction_used={"phys": 0.9})
    w = WEIGHT_PROFILES["ml-training"]
    bd = breakdown(a, c, w, f4=0.6, f9=0.75)
    names = [f.name for f in msgspec.structs.fields(CostWeights)]
    assert names[7] == "checkpoint_efficiency"  # w8 has one name
    for i, n in enumerate(names, start=1):
        assert f"f{i}_{n}" in bd and f"w{i}_{n}" in bd and f"c{i}_{n}" in bd
        assert bd[f"c{i}_{n}"] == pytest.approx(bd[f"f{i}_{n}"] * bd[f"w{i}_{n}"])
    assert bd["f4_topology"] == 0.6 and bd["f9_conformance"] == 0.75
    assert bd["w4_topology"] == 0.25
    total = math.fsum(bd[f"c{i}_{n}"] for i, n in enumerate(names, start=1))
    assert bd["raw_score"] == pytest.approx(total)
    assert bd["raw_score"] == pytest.approx(raw_score(a, c, w, f4=0.6, f9=0.75))
    assert bd["budget_fraction"] == 0.9 and bd["budget_penalty"] == pytest.approx(0.75)
    assert bd["score"] == pytest.approx(score(a, c, w, f4=0.6, f9=0.75))
    assert bd["score"] == pytest.approx(0.75 * total)
    assert breakdown(alloc(tenant="bio"), c, w)["budget_fraction"] == -1.0


def test_context_round_trips_through_msgspec() -> None:
    c = ctx_(energy_prices=TOU, budget_fraction_used={"t": 0.5}, checkpoint_minutes={"a": 2.0})
    back = msgspec.json.decode(msgspec.json.encode(c), type=ScoringContext)
    assert back == c
    assert back.energy_prices[0] == (22.0, 6.0, 0.10)


# --------------------------------------------------------------------------- context


def test_gpu_hours() -> None:
    assert gpu_hours(alloc(nodes=4, walltime_seconds=7200, constraints={"gpu_count": 4})) == 32
    assert gpu_hours(alloc(nodes=4, walltime_seconds=7200)) == 8  # unknown GPUs count 1
    assert gpu_hours(alloc(nodes=4, walltime_seconds=0)) == 0  # unbounded service
    inv = {"n1": b.node("n1", gpu_count=8), "n2": b.node("n2", gpu_count=0)}
    a = alloc(nodes=3, walltime_seconds=3600)
    a.assigned_nodes = ["n1", "n2", "gone"]
    assert gpu_hours(a, inv) == 8 + 1 + 1


def _cluster() -> tuple[dict, dict, dict, float]:
    now = MIDNIGHT + 12 * HOUR
    nodes = b.inventory(8, groups=4, gpu_count=4)  # n0000 g0, n0001 g1, ... n0004 g0, ...
    nodes["n0003"].home_vcluster = "other"  # g3
    nodes["n0007"].home_vcluster = "other"  # g3: group 3 is not usable by "v"
    run = b.allocation(id="run", state=A.RUNNING, tenant="phys", nodes=2, walltime_seconds=7200)
    run.assigned_nodes = ["n0000", "n0004"]  # all of group 0
    run.started_at = now - HOUR
    for nid in run.assigned_nodes:
        nodes[nid].owner = run.id
        nodes[nid].owner_tenant = "phys"
    p1 = b.allocation(id="p1", tenant="bio", nodes=2, walltime_seconds=3600, submitted_at=now)
    p2 = b.allocation(
        id="p2",
        tenant="phys",
        nodes=1,
        walltime_seconds=7200,
        constraints={"gpu_count": 4},
        submitted_at=now,
    )
    done = b.allocation(id="done", state=A.COMPLETED, tenant="bio", nodes=1)
    allocations = {a.id: a for a in (run, p1, p2, done)}
    tenants = {
        "phys": b.tenant("phys", fair_share_target=0.15, gpu_hours_budget=9.0),
        "bio": b.tenant("bio", fair_share_target=0.30),
    }
    return allocations, nodes, tenants, now


def test_build_context_from_plain_mappings() -> None:
    allocations, nodes, tenants, now = _cluster()
    view = SimpleNamespace(allocations=allocations, nodes=nodes, tenants=tenants)
    c = build_context(view, now, vcluster="v")
    assert c.now == now
    assert c.running_gpu_hours == pytest.approx(2 * 4 * 2)  # 2 nodes x 4 GPUs x 2 h
    assert c.queued_gpu_hours == pytest.approx(2 * 1 * 1 + 1 * 4 * 2)
    assert f6_backlog_pressure(c) == pytest.approx(10 / 16)
    assert c.tenant_usage_share == {"phys": pytest.approx(2 / 8)}
    assert c.tenant_target_share == {"phys": 0.15, "bio": 0.30}
    assert f3_fair_share_deficit(allocations["p2"], c) == 0.0  # phys above its share
    assert f3_fair_share_deficit(allocations["p1"], c) == 1.0  # bio used nothing
    assert c.max_groups_available == 2  # g0 all taken, g3 belongs to "other"
    assert build_context(view, now).max_groups_available == 3
    # internal ledger: 1 h on 2 nodes x 4 GPUs = 8 of 9 GPU-hours
    assert c.budget_fraction_used == {"phys": pytest.approx(8 / 9)}
    assert score(allocations["p2"], c, CostWeights()) == pytest.approx(
        budget_penalty(8 / 9)
        * OVER_SHARE_MULTIPLIER
        * raw_score(allocations["p2"], c, CostWeights())
    )  # phys is over its budget's 80% and above its fair share


def test_build_context_from_a_state_mirror_matches_plain_mappings() -> None:
    allocations, nodes, tenants, now = _cluster()
    mirror = StateMirror()
    mirror.apply(
        StateDelta(
            revision=1,
            snapshot=True,
            allocations=list(allocations.values()),
            nodes=list(nodes.values()),
            tenants=list(tenants.values()),
        )
    )
    plain = SimpleNamespace(allocations=allocations, nodes=nodes, tenants=tenants)
    assert build_context(mirror, now, vcluster="v") == build_context(plain, now, vcluster="v")


def test_build_context_passes_external_inputs_through() -> None:
    allocations, nodes, tenants, now = _cluster()
    view = SimpleNamespace(allocations=allocations, nodes=nodes, tenants=tenants)
    c = build_context(
        view,
        now,
        reference_wait_seconds=600,
        energy_prices=TOU,
        data_readiness={"p1": 0.9},
        checkpoint_minutes={"p1": 1.0},
        budget_fraction_used={"phys": 1.5},  # e.g. from Waldur: overrides the ledger
    )
    assert c.reference_wait_seconds == 600
    assert c.energy_price_min == 0.10 and c.energy_price_max == 0.30
    assert f7_energy_cost(c) == 0.0  # noon: peak price
    assert f5_data_readiness(allocations["p1"], c) == 0.9
    assert f8_checkpoint_efficiency(allocations["p1"], c) == 0.5
    assert c.budget_fraction_used == {"phys": 1.5}


def test_build_context_empty_cluster() -> None:
    view = SimpleNamespace(allocations={}, nodes={}, tenants={})
    c = build_context(view, MIDNIGHT)
    assert c.queued_gpu_hours == c.running_gpu_hours == 0
    assert c.max_groups_available == 0
    assert c.tenant_usage_share == {} and c.budget_fraction_used == {}


# --------------------------------------------------------------------------- properties

any_float = st.floats(allow_nan=True, allow_infinity=True)
finite = st.floats(allow_nan=False, allow_infinity=False)
unit = st.floats(min_value=0.0, max_value=1.0)
weights_st = st.builds(CostWeights, **{f: st.floats(min_value=0.0, max_value=1.0) for f in FIELDS})


def _in01(x: float) -> bool:
    return 0.0 <= x <= 1.0


@settings(max_examples=300)
@given(
    w1=st.integers(min_value=0, max_value=10 * 365 * 86400),
    dw=st.integers(min_value=1, max_value=10 * 365 * 86400),
    ref=st.floats(min_value=1.0, max_value=30 * 86400.0),
)
def test_f2_strictly_increasing_in_wait_seconds(w1: int, dw: int, ref: float) -> None:
    assert wait_time_factor(w1 + dw, ref) > wait_time_factor(w1, ref) >= 0.0


@settings(max_examples=300)
@given(
    w1=st.floats(min_value=0.0, max_value=1e9),
    gap=st.floats(min_value=1e-3, max_value=1e9),
)
def test_f2_strictly_increasing_through_the_allocation(w1: float, gap: float) -> None:
    c1 = ctx_(now=MIDNIGHT + w1)
    c2 = ctx_(now=MIDNIGHT + w1 + gap)
    a = alloc(submitted_at=MIDNIGHT)
    assert f2_wait_time(a, c2) > f2_wait_time(a, c1) >= 0.0


@settings(max_examples=500)
@given(target=any_float, actual=any_float)
def test_f3_always_in_unit_interval(target: float, actual: float) -> None:
    assert _in01(fair_share_deficit(target, actual))
    c = ctx_(tenant_target_share={"t": target}, tenant_usage_share={"t": actual})
    assert _in01(f3_fair_share_deficit(alloc(tenant="t"), c))


@given(target=st.floats(min_value=1e-6, max_value=1.0), a1=unit, a2=unit)
def test_f3_non_increasing_in_usage(target: float, a1: float, a2: float) -> None:
    lo, hi = sorted((a1, a2))
    assert fair_share_deficit(target, lo) >= fair_share_deficit(target, hi)


@settings(max_examples=300)
@given(cls=st.integers(min_value=-100, max_value=100))
def test_f1_bounded(cls: int) -> None:
    assert _in01(f1_priority_class(alloc(preemption_class=cls)))


@settings(max_examples=300)
@given(
    needed=st.integers(min_value=-10, max_value=10_000),
    available=st.integers(min_value=-10, max_value=10_000),
    single=st.booleans(),
    gpu_link=st.none() | any_float,
    mem=st.none() | any_float,
    beta=any_float,
)
def test_f4_bounded(
    needed: int,
    available: int,
    single: bool,
    gpu_link: float | None,
    mem: float | None,
    beta: float,
) -> None:
    assert _in01(f4_topology_fitness(needed, available))
    intra = IntraNodeFit(single_node=single, gpu_link=gpu_link, memory_locality=mem, beta=beta)
    assert _in01(f4_topology_fitness(needed, available, intra_node=intra))


@given(lo=finite, hi=finite)
def test_gpu_link_fitness_bounded(lo: float, hi: float) -> None:
    assert _in01(gpu_link_fitness(lo, hi))


@given(counts=st.lists(st.integers(min_value=0, max_value=512), max_size=8))
def test_same_domain_fraction_bounded(counts: list[int]) -> None:
    assert _in01(same_domain_fraction(counts))


@settings(max_examples=300)
@given(v=st.none() | any_float)
def test_f5_bounded(v: float | None) -> None:
    c = ctx_(data_readiness={} if v is None else {"job": v})
    assert _in01(f5_data_readiness(alloc(), c))


@settings(max_examples=300)
@given(queued=any_float, running=any_float)
def test_f6_bounded(queued: float, running: float) -> None:
    assert _in01(f6_backlog_pressure(ctx_(queued_gpu_hours=queued, running_gpu_hours=running)))


@settings(max_examples=300)
@given(
    now=finite,
    windows=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=24.0, exclude_max=True),
            st.floats(min_value=0.0, max_value=24.0, exclude_max=True),
            any_float,
        ),
        max_size=5,
    ),
)
def test_f7_bounded(now: float, windows: list[tuple[float, float, float]]) -> None:
    assert _in01(f7_energy_cost(ctx_(now=now, energy_prices=windows)))


@settings(max_examples=300)
@given(minutes=st.none() | any_float)
def test_f8_bounded(minutes: float | None) -> None:
    c = ctx_(checkpoint_minutes={} if minutes is None else {"job": minutes})
    assert _in01(f8_checkpoint_efficiency(alloc(), c))


@given(m1=st.floats(min_value=0.0, max_value=1e6), m2=st.floats(min_value=0.0, max_value=1e6))
def test_f8_non_increasing_in_minutes(m1: float, m2: float) -> None:
    lo, hi = sorted((m1, m2))
    assert cost.checkpoint_factor(lo) >= cost.checkpoint_factor(hi)


@given(
    largest=st.integers(min_value=-5, max_value=10_000),
    requested=st.integers(min_value=-5, max_value=10_000),
)
def test_f9_bounded(largest: int, requested: int) -> None:
    assert _in01(f9_conformance_fitness(largest, requested))


@settings(max_examples=500)
@given(f1=st.floats(allow_nan=False), f2=st.floats(allow_nan=False))
def test_budget_penalty_non_increasing_never_zero(f1: float, f2: float) -> None:
    lo, hi = sorted((f1, f2))
    assert budget_penalty(lo) >= budget_penalty(hi) > 0.0
    assert budget_penalty(hi) <= 1.0
    if lo < 0.8:
        assert budget_penalty(lo) == 1.0


@settings(max_examples=300)
@given(
    weights=weights_st,
    c1=st.integers(min_value=0, max_value=10),
    c2=st.integers(min_value=0, max_value=10),
    wait=st.floats(min_value=0.0, max_value=365 * DAY),
    fraction=st.none() | st.floats(min_value=0.0, max_value=10.0),
    f4=st.none() | unit,
    f9=st.none() | unit,
)
def test_score_monotone_in_priority_class(
    weights: CostWeights,
    c1: int,
    c2: int,
    wait: float,
    fraction: float | None,
    f4: float | None,
    f9: float | None,
) -> None:
    lo, hi = sorted((c1, c2))
    c = ctx_(
        now=MIDNIGHT + wait,
        tenant_target_share={"t": 0.2},
        tenant_usage_share={"t": 0.1},
        queued_gpu_hours=10,
        running_gpu_hours=40,
        budget_fraction_used={} if fraction is None else {"t": fraction},
    )
    a_lo = alloc(tenant="t", preemption_class=lo)
    a_hi = alloc(tenant="t", preemption_class=hi)
    s_lo = score(a_lo, c, weights, f4=f4, f9=f9)
    s_hi = score(a_hi, c, weights, f4=f4, f9=f9)
    assert s_hi >= s_lo
    if hi > lo and weights.priority >= 1e-3:
        assert s_hi > s_lo


@settings(max_examples=300)
@given(
    weights=weights_st,
    cls=st.integers(min_value=0, max_value=10),
    wait=st.floats(min_value=0.0, max_value=365 * DAY),
    target=unit,
    usage=unit,
    queued=st.floats(min_value=0.0, max_value=1e6),
    running=st.floats(min_value=0.0, max_value=1e6),
    ready=st.none() | unit,
    minutes=st.none() | st.floats(min_value=0.0, max_value=1e4),
    fraction=st.none() | st.floats(min_value=0.0, max_value=3.0),
    f4=st.none() | unit,
    f9=st.none() | unit,
)
def test_breakdown_sums_to_score_before_penalty(
    weights: CostWeights,
    cls: int,
    wait: float,
    target: float,
    usage: float,
    queued: float,
    running: float,
    ready: float | None,
    minutes: float | None,
    fraction: float | None,
    f4: float | None,
    f9: float | None,
) -> None:
    a = alloc(id="j", tenant="t", preemption_class=cls)
    c = ctx_(
        now=MIDNIGHT + wait,
        tenant_target_share={"t": target},
        tenant_usage_share={"t": usage},
        queued_gpu_hours=queued,
        running_gpu_hours=running,
        energy_prices=TOU,
        data_readiness={} if ready is None else {"j": ready},
        checkpoint_minutes={} if minutes is None else {"j": minutes},
        budget_fraction_used={} if fraction is None else {"t": fraction},
    )
    bd = breakdown(a, c, weights, f4=f4, f9=f9)
    contributions = [bd[k] for k in bd if k[0] == "c" and k[1].isdigit()]
    assert len(contributions) == 9
    raw = raw_score(a, c, weights, f4=f4, f9=f9)
    assert bd["raw_score"] == pytest.approx(raw, rel=1e-12, abs=1e-12)
    assert math.fsum(contributions) == pytest.approx(raw, rel=1e-12, abs=1e-12)
    assert bd["score"] == pytest.approx(score(a, c, weights, f4=f4, f9=f9), rel=1e-12, abs=1e-12)
    penalty = bd["budget_penalty"] * bd["share_penalty"]
    assert bd["score"] == pytest.approx(penalty * raw, rel=1e-12, abs=1e-12)
    assert bd["share_penalty"] == (OVER_SHARE_MULTIPLIER if 0 < target <= usage else 1.0)
    for k, v in bd.items():
        if k[0] == "f" and k != "f2_wait_time":
            assert _in01(v), k


@pytest.mark.parametrize(
    ("target", "usage", "burst", "expected"),
    [
        (0.25, 0.10, 0.0, 1.0),  # below its share
        (0.25, 0.25, 0.0, cost.OVER_SHARE_MULTIPLIER),  # at it: f3 = 0, deprioritized
        (0.25, 0.90, 0.0, cost.OVER_SHARE_MULTIPLIER),  # no burst allowance: no second step
        (0.25, 0.30, 1.5, cost.OVER_SHARE_MULTIPLIER),  # bursting within the allowance
        (0.25, 0.375, 1.5, cost.OVER_BURST_MULTIPLIER),  # 150% of 25%: beyond
        (0.25, 0.25, 0.5, cost.OVER_BURST_MULTIPLIER),  # an allowance < 1 leaves no headroom
        (0.0, 0.90, 1.5, 1.0),  # no target: nothing to be above of
        (math.nan, 0.5, 0.0, 1.0),
        (0.25, math.nan, 0.0, 1.0),
    ],
)
def test_share_penalty_steps(target: float, usage: float, burst: float, expected: float) -> None:
    assert cost.share_penalty(target, usage, burst) == expected


@settings(max_examples=300, deadline=None)
@given(
    target=st.floats(min_value=0.01, max_value=1.0),
    u1=st.floats(min_value=0.0, max_value=1.0),
    u2=st.floats(min_value=0.0, max_value=1.0),
    burst=st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]),
    fraction=st.none() | st.floats(min_value=0.0, max_value=2.0),
)
def test_soft_quota_multiplier_non_increasing_in_usage_never_zero(
    target: float, u1: float, u2: float, burst: float, fraction: float | None
) -> None:
    lo, hi = sorted((u1, u2))
    a = cost.soft_quota_multiplier(fraction, target, lo, burst)
    z = cost.soft_quota_multiplier(fraction, target, hi, burst)
    assert 1.0 >= a >= z > 0.0
    assert cost.share_penalty(target, lo, burst) == 1.0 or lo >= target


def test_over_share_tenants_are_those_at_or_above_their_target() -> None:
    ctx = ScoringContext(
        now=0.0,
        tenant_usage_share={"phys": 0.5, "bio": 0.1, "chem": 0.3, "guest": 0.2},
        tenant_target_share={"phys": 0.25, "bio": 0.25, "chem": 0.3},
    )
    assert cost.over_share_tenants(ctx) == {"phys", "chem"}  # guest has no target
