"""``cost.score`` writes f1..f9 out for speed; it must stay equal, bit for bit, to the
composition of the factor functions (``raw_score`` + the soft-quota penalties), edge cases
included, or a replay would order the queue differently from the formulas."""

from __future__ import annotations

import math
import random

from lattice_common.types import Allocation, AllocationSpec, Constraints, CostWeights
from lattice_scheduler import cost

NAN = math.nan
INF = math.inf


def _reference(a: Allocation, ctx: cost.ScoringContext, w: CostWeights, **kw: float) -> float:
    raw = cost.raw_score(a, ctx, w, **kw)
    t = a.spec.tenant
    multiplier = cost.budget_penalty(ctx.budget_fraction_used.get(t)) * cost.share_penalty(
        ctx.tenant_target_share.get(t, 0.0),
        ctx.tenant_usage_share.get(t, 0.0),
        ctx.tenant_burst_allowance.get(t, 0.0),
    )
    return raw if multiplier == 1.0 else cost._penalise(raw, multiplier)


def _same(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or (
        x == y and math.copysign(1, x) == math.copysign(1, y)
    )


def _alloc(rng: random.Random, i: int) -> Allocation:
    return Allocation(
        id=f"a{i}",
        spec=AllocationSpec(
            entrypoint="x",
            vcluster="v",
            tenant=rng.choice(["t0", "t1", "t2", "t3", "nobody"]),
            nodes=rng.randint(1, 64),
            walltime_seconds=rng.choice([0, 600, 3600, 86400]),
            preemption_class=rng.choice([-3, 0, 1, 5, 9, 10, 12]),
            constraints=Constraints(gpu_count=rng.choice([0, 4, 8])),
        ),
        submitted_at=rng.choice([0.0, 1e6, 1.7e9, 1.7e9 + rng.random() * 1e5, 2e9, NAN]),
    )


def _context(rng: random.Random) -> cost.ScoringContext:
    def share() -> float:
        return rng.choice([0.0, -0.1, 0.1, 0.25, 0.5, 1.0, 1.5, NAN, INF, rng.random()])

    prices = rng.choice([[], [(0.0, 6.0, 0.1), (6.0, 22.0, 0.3), (22.0, 0.0, 0.1)], [(0, 0, 1)]])
    return cost.ScoringContext(
        now=rng.choice([1.7e9 + 5e4, 1.7e9 + rng.random() * 1e6, 0.0]),
        reference_wait_seconds=rng.choice([3600.0, 0.0, -1.0, 60.0, NAN]),
        tenant_usage_share={t: share() for t in ("t0", "t1", "t2") if rng.random() < 0.8},
        tenant_target_share={t: share() for t in ("t0", "t1", "t2", "t3") if rng.random() < 0.8},
        tenant_burst_allowance={t: rng.choice([0.5, 1.0, 1.5, 3.0]) for t in ("t0", "t2")},
        queued_gpu_hours=rng.choice([0.0, 10.0, 1e4, NAN, -1.0]),
        running_gpu_hours=rng.choice([0.0, 5.0, 1e5, NAN]),
        energy_prices=prices,
        budget_fraction_used=rng.choice([{}, {"t0": 0.5, "t1": 0.9, "t2": 1.2, "t3": NAN}]),
        data_readiness=rng.choice([{}, {"a1": 0.9, "a2": NAN, "a3": 2.0, "a4": -1.0}]),
        checkpoint_minutes=rng.choice([{}, {"a1": 0.0, "a2": INF, "a3": NAN, "a5": -2.0}]),
        default_checkpoint_minutes=rng.choice([10.0, 0.0, NAN, INF]),
    )


def test_score_matches_the_factor_functions_bit_for_bit() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        ctx = _context(rng)
        w = CostWeights(
            **{name: rng.choice([0.0, 0.1, 0.2, 1.0, -0.5, 3]) for name in cost.FACTOR_NAMES}
        )
        for i in range(20):
            a = _alloc(rng, i)
            kw = {}
            if rng.random() < 0.3:
                kw = {"f4": rng.random(), "f9": rng.choice([0.0, 1.0, rng.random()])}
            got = cost.score(a, ctx, w, **kw)
            want = _reference(a, ctx, w, **kw)
            assert _same(got, want), (a, ctx, w, kw, got, want)
            checked += 1
    assert checked == 6000


def test_score_with_contexts_and_weights_interleaved() -> None:
    # score keeps what depends only on (context, weights) for the last pair it saw;
    # switching pairs back and forth must not mix them up
    rng = random.Random(11)
    pairs = [
        (_context(rng), CostWeights(**{n: rng.random() for n in cost.FACTOR_NAMES}))
        for _ in range(4)
    ]
    pairs.append((pairs[0][0], pairs[1][1]))  # same context, other weights
    allocs = [_alloc(rng, i) for i in range(30)]
    for _ in range(5):
        for a in allocs:
            ctx, w = rng.choice(pairs)
            assert _same(cost.score(a, ctx, w), _reference(a, ctx, w))
