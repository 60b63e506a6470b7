"""Seeded workload generators: the seven regression traces, a synthetic benchmark trace,
and an SWF file.

Regression suite (Testing Strategy, Level 3), each a small cluster (128 nodes) and a
few hundred jobs, so a replay takes seconds:

=================  ==========================================================  ===========
trace              what it is                                                  key metric
=================  ==========================================================  ===========
steady-state       mixed HPC batch + ML training + services at ~100 % offered  utilization
                   load, a backlog from the first minute                       > 85 %
burst              60 % background load and, 8 h in, 200 short jobs within      p99 wait
                   15 minutes (about 2 cluster-hours of work)                  < 4 h
unfair             four tenants with equal targets; one submits 3x its share,  share dev.
                   the others a little under theirs                            < 10 %
sensitive-claim    HPC load on the shared pool; sensitive claims (class 10) on  sensitive
                   a 16-node pool reserved for the ``sensitive`` vCluster       wait = 0
preemption-heavy   long low-class (1-3) jobs fill the cluster; short           checkpoint
                   high-class (7-9) jobs keep arriving and preempt them         ok > 95 %
checkpoint-broker  reactive services (autoscaled from a load profile) and      lost work
                   long batch jobs, most of them checkpointing, preempted by    with vs
                   class-8 work; replayed with and without the broker           without
empty-to-full      an idle cluster; arrivals accelerate over 3 h and offer     ramp-up,
                   ~4x what the cluster can run in that time                   cycle time
=================  ==========================================================  ===========

Sensitive claims. The engine replays the scheduler's node pools, not claims: a
sensitive job is preemption class 10 in the ``sensitive`` vCluster
(``sensitive-reservation`` scheduler), whose *home pool* is 16 nodes that only it
may use. The other vClusters get ``allow_borrowing: false`` in that inventory, so the
pool is never lent out (a borrowed node would have to be reclaimed by preemption
first, and the claim would wait). The generator keeps the claims' concurrent node
count at most 12 of the 16 nodes at every instant (each claim held for its walltime),
so "sensitive wait = 0" is achievable: it fails only if the scheduler does not place
a claim in the cycle it arrives.

Every trace is written in the engine's JSON-lines format (``rm_replay.trace``: the
Performance Tuning Guide's ``{"ts", "type": "submit", "alloc": {...}}`` lines with
the outcome inline as ``runtime`` / ``exit``), behind one ``"type": "meta"`` line, with
``NAME.inventory.yaml`` and ``NAME.weights.yaml`` (the guide's weight-profile shape,
the specification's profiles) beside it. Times are whole seconds from
2026-03-01T00:00:00Z. Same seed -> byte-identical files.

``write_swf(path, n_jobs, seed)`` writes a Standard Workload Format file (header and
18 fields, daily arrival cycle, processors in cores of 64-core nodes).

``python -m rm_replay.generate OUT_DIR [--seed N] [--swf N]`` writes the suite.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from lattice_common.types import ScalingSpec
from lattice_scheduler.profiles import WEIGHT_PROFILES, weights_as_mapping

from rm_replay.model import SubmitEvent
from rm_replay.trace import dump_trace_line

T0 = 1_772_323_200  # 2026-03-01T00:00:00Z
HOUR = 3600
MINUTE = 60

REGRESSION_TRACES = (
    "steady-state",
    "burst",
    "unfair",
    "sensitive-claim",
    "preemption-heavy",
    "empty-to-full",
    "checkpoint-broker",
)

TENANTS = ("physics", "chemistry", "biology", "climate")
TARGETS = {"physics": 0.35, "chemistry": 0.25, "biology": 0.20, "climate": 0.20}
SENSITIVE_POOL = 16
SENSITIVE_MAX_CONCURRENT = 12


@dataclass
class Scenario:
    """A generated workload: trace events plus the inventory and weights (as the
    mappings their YAML files hold)."""

    name: str
    description: str
    events: list[SubmitEvent]
    inventory: dict[str, Any]
    weights: dict[str, Any]
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def trace_file(self) -> str:
        return f"{self.name}.trace"

    @property
    def inventory_file(self) -> str:
        return f"{self.name}.inventory.yaml"

    @property
    def weights_file(self) -> str:
        return f"{self.name}.weights.yaml"

    def trace_text(self) -> str:
        head = {
            "ts": T0,
            "type": "meta",
            "name": self.name,
            "description": self.description,
            "generator": "rm_replay.generate",
            "seed": self.seed,
            "jobs": len(self.events),
            **self.meta,
        }
        lines = [_json_line(head)]
        lines += [dump_trace_line(ev) for ev in self.events]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``NAME.trace``, ``NAME.inventory.yaml`` and ``NAME.weights.yaml``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "trace": out / self.trace_file,
            "inventory": out / self.inventory_file,
            "weights": out / self.weights_file,
        }
        paths["trace"].write_text(self.trace_text(), encoding="utf-8")
        paths["inventory"].write_text(_yaml(self.inventory), encoding="utf-8")
        paths["weights"].write_text(_yaml(self.weights), encoding="utf-8")
        return paths

    def inventory_obj(self):
        """The :class:`rm_replay.model.Inventory` of this scenario."""
        from rm_replay.inventory import inventory_from_mapping

        return inventory_from_mapping(self.inventory)

    def weights_obj(self):
        """vCluster -> ``CostWeights`` of this scenario."""
        from rm_replay.weights import weights_from_yaml_data

        return weights_from_yaml_data(self.weights)


def _json_line(obj: Any) -> str:
    import msgspec

    return msgspec.json.encode(obj).decode()


def _yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


# --------------------------------------------------------------------------- building blocks


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _round_up(x: float, step: int) -> int:
    return int(math.ceil(x / step) * step)


def _weighted(rng: random.Random, table: Sequence[tuple[Any, float]]) -> Any:
    total = sum(w for _, w in table)
    x = rng.random() * total
    for v, w in table:
        x -= w
        if x < 0:
            return v
    return table[-1][0]


@dataclass
class Job:
    """A job shape before it gets a submit time."""

    tenant: str
    nodes: int
    runtime: int
    walltime: int
    vcluster: str = "hpc-batch"
    preemption_class: int = 5
    gpus_per_node: int = 0
    gpu_type: str = ""
    topology: str = ""
    sensitive: bool = False
    exit: int = 0
    user: str = ""
    name: str = ""

    @property
    def work(self) -> float:
        """Node-seconds it will hold (runtime, capped at walltime)."""
        return self.nodes * min(self.runtime, self.walltime)


def _outcome(rng: random.Random, runtime: float, walltime_factor: tuple[float, float]):
    """(runtime, walltime, exit): users over-request 1.15-2.5x, 3 % run into their
    limit, 4 % fail early."""
    runtime = max(60, round(runtime / MINUTE) * MINUTE)
    walltime = _round_up(runtime * rng.uniform(*walltime_factor), 15 * MINUTE)
    r = rng.random()
    exit_code = 0
    if r < 0.03:
        runtime = walltime + int(rng.uniform(60, 1800))  # killed at its walltime
    elif r < 0.07:
        exit_code = 1
        runtime = max(60, int(runtime * rng.uniform(0.02, 0.5)))
    return runtime, walltime, exit_code


def hpc_job(rng: random.Random, tenant: str, *, max_nodes: int = 32, klass: int = 5) -> Job:
    nodes = _weighted(
        rng,
        [(1, 30), (2, 15), (4, 20), (8, 15), (16, 12), (32, 8)],
    )
    nodes = min(nodes, max_nodes)
    rt, wt, ex = _outcome(rng, _loguniform(rng, 10 * MINUTE, 6 * HOUR), (1.15, 2.5))
    return Job(tenant, nodes, rt, wt, "hpc-batch", klass, exit=ex)


def ml_job(rng: random.Random, tenant: str) -> Job:
    nodes = _weighted(rng, [(4, 45), (8, 35), (16, 20)])
    rt, wt, ex = _outcome(rng, _loguniform(rng, 1 * HOUR, 8 * HOUR), (1.1, 1.6))
    topo = "tight" if rng.random() < 0.3 else ""
    return Job(tenant, nodes, rt, wt, "ml-training", 5, gpus_per_node=4, topology=topo, exit=ex)


def service_job(rng: random.Random, tenant: str) -> Job:
    nodes = _weighted(rng, [(1, 60), (2, 40)])
    rt = int(rng.uniform(4, 12)) * HOUR
    return Job(tenant, nodes, rt, rt + 2 * HOUR, "service", 7)


def _tenant(rng: random.Random, weights: dict[str, float] | None = None) -> str:
    w = weights or TARGETS
    return _weighted(rng, list(w.items()))


def _times_for_load(
    rng: random.Random, jobs: Sequence[Job], nodes: int, load: float, start: float = 0.0
) -> list[int]:
    """Sorted uniform-random submit times over the window in which ``jobs`` offer
    ``load`` x the cluster's node-time (a Poisson-like stream of that rate)."""
    span = sum(j.work for j in jobs) / (load * nodes)
    return sorted(int(start + rng.uniform(0, span)) for _ in jobs)


def _events(
    prefix: str, jobs: Sequence[Job], times: Sequence[float], rng: random.Random
) -> list[SubmitEvent]:
    out: list[SubmitEvent] = []
    for i, (j, t) in enumerate(zip(jobs, times, strict=True)):
        out.append(
            SubmitEvent(
                t=float(T0 + int(t)),
                id=f"{prefix}-{i:05d}",
                tenant=j.tenant,
                nodes=j.nodes,
                walltime=float(j.walltime),
                gpu_type=j.gpu_type,
                gpus_per_node=j.gpus_per_node,
                topology=j.topology,
                user=j.user or f"{j.tenant[:4]}{rng.randint(1, 6):02d}",
                vcluster=j.vcluster,
                preemption_class=10 if j.sensitive else j.preemption_class,
                sensitive=j.sensitive,
                runtime=float(j.runtime),
                exit=j.exit,
                name=j.name,
            )
        )
    return out


def _merge(*streams: Iterable[SubmitEvent]) -> list[SubmitEvent]:
    evs = [e for s in streams for e in s]
    evs.sort(key=lambda e: (e.t, e.id))
    return evs


def _inventory(
    name: str,
    nodes: int = 128,
    *,
    groups: int = 4,
    sensitive_pool: int = 0,
    tenants: dict[str, float] | None = None,
    no_borrowing: bool = False,
) -> dict[str, Any]:
    classes: list[dict[str, Any]] = [
        {
            "name": "gh200",
            "count": nodes - sensitive_pool,
            "gpu_type": "GH200",
            "gpus": 4,
            "cpu_cores": 288,
            "memory_gb": 480,
            "groups": groups,
            "conformance": {"gh-fw-a": 0.75, "gh-fw-b": 0.25},
        }
    ]
    if sensitive_pool:
        classes.append(
            {
                "name": "sensitive",
                "prefix": "sens",
                "count": sensitive_pool,
                "gpu_type": "GH200",
                "gpus": 4,
                "cpu_cores": 288,
                "memory_gb": 480,
                "groups": 1,
                "conformance": "gh-hardened",
                "vcluster": "sensitive",
            }
        )
    vclusters: dict[str, Any] = {
        "hpc-batch": {"scheduler_type": "hpc-backfill", "backfill_depth": 10},
        "ml-training": {"scheduler_type": "hpc-backfill", "backfill_depth": 10},
        "service": {"scheduler_type": "service-binpack"},
    }
    if sensitive_pool:
        vclusters["sensitive"] = {
            "scheduler_type": "sensitive-reservation",
            "allow_borrowing": False,
        }
    if no_borrowing:
        for v in vclusters.values():
            v["allow_borrowing"] = False
    return {
        "name": name,
        "node_classes": classes,
        "tenants": {t: {"fair_share_target": s} for t, s in (tenants or TARGETS).items()},
        "vclusters": vclusters,
    }


def weight_profiles(*vclusters: str) -> dict[str, dict[str, float]]:
    """The specification's weight profile of each vCluster (Tuning Guide YAML keys)."""
    by_vc = {
        "hpc-batch": "hpc-batch",
        "ml-training": "ml-training",
        "service": "service",
        "sensitive": "sensitive",
        "interactive": "interactive",
    }
    return {vc: weights_as_mapping(WEIGHT_PROFILES[by_vc[vc]]) for vc in vclusters}


_ALL_VC = ("hpc-batch", "ml-training", "service")


# --------------------------------------------------------------------------- the regression traces


def steady_state(seed: int = 0, n_jobs: int = 600, nodes: int = 128) -> Scenario:
    rng = random.Random(f"steady-state/{seed}")
    jobs: list[Job] = []
    for _ in range(n_jobs):
        r = rng.random()
        t = _tenant(rng)
        if r < 0.65:
            jobs.append(hpc_job(rng, t))
        elif r < 0.90:
            jobs.append(ml_job(rng, t))
        else:
            jobs.append(service_job(rng, t))
    # a backlog from the start: the first 10 % at t=0, the rest at 105 % load
    head = n_jobs // 10
    times = [0] * head + _times_for_load(rng, jobs[head:], nodes, 1.05, start=0)
    return Scenario(
        "steady-state",
        "Normal mixed workload (HPC + ML + services) at ~100% offered load",
        _events("ss", jobs, times, rng),
        _inventory("steady-state", nodes),
        weight_profiles(*_ALL_VC),
        seed,
    )


def burst(seed: int = 0, n_background: int = 250, n_burst: int = 200, nodes: int = 128) -> Scenario:
    rng = random.Random(f"burst/{seed}")
    bg = [hpc_job(rng, _tenant(rng)) for _ in range(n_background)]
    bg_times = _times_for_load(rng, bg, nodes, 0.6)
    at = 8 * HOUR
    spike: list[Job] = []
    for _ in range(n_burst):
        n = _weighted(rng, [(1, 40), (2, 25), (4, 20), (8, 10), (16, 5)])
        rt, wt, ex = _outcome(rng, _loguniform(rng, 5 * MINUTE, 60 * MINUTE), (1.2, 2.0))
        spike.append(Job(_tenant(rng), n, rt, wt, "hpc-batch", 5, exit=ex))
    spike_times = sorted(at + int(rng.uniform(0, 15 * MINUTE)) for _ in spike)
    return Scenario(
        "burst",
        "60% background load; a sudden spike of short jobs 8 h in",
        _merge(_events("bg", bg, bg_times, rng), _events("burst", spike, spike_times, rng)),
        _inventory("burst", nodes),
        weight_profiles(*_ALL_VC),
        seed,
        {"burst_at_s": at, "burst_jobs": n_burst},
    )


def unfair(seed: int = 0, n_jobs: int = 1200, nodes: int = 128, hours: float = 48.0) -> Scenario:
    """Equal targets (25 % each); ``physics`` offers 3x its share (75 % of the cluster),
    each other tenant 90 % of its share (22.5 %), all over the same window.

    Two days, because shares are a long-run property: jobs run up to 6 h (walltimes up
    to 15 h), so whatever starts in the first hours, before the queue builds up, holds
    its nodes for a good part of a one-day window whatever the scheduler does."""
    rng = random.Random(f"unfair/{seed}")
    targets = dict.fromkeys(TENANTS, 0.25)
    offered = {"physics": 0.75, "chemistry": 0.225, "biology": 0.225, "climate": 0.225}
    span = hours * HOUR
    streams = []
    total_load = sum(offered.values())
    for k, tenant in enumerate(TENANTS):
        want = nodes * span * offered[tenant]
        jobs: list[Job] = []
        work = 0.0
        while work < want and len(jobs) < n_jobs * offered[tenant] / total_load * 2:
            j = hpc_job(rng, tenant, max_nodes=16)
            jobs.append(j)
            work += j.work
        times = sorted(int(rng.uniform(0, span)) for _ in jobs)
        streams.append(_events(f"{tenant[:4]}{k}", jobs, times, rng))
    return Scenario(
        "unfair",
        "One tenant (physics) submits 3x its fair share; the others slightly under theirs",
        _merge(*streams),
        _inventory("unfair", nodes, tenants=targets),
        weight_profiles(*_ALL_VC),
        seed,
        {"offered_share": offered},
    )


def sensitive_claim(
    seed: int = 0, n_jobs: int = 450, n_claims: int = 40, nodes: int = 128
) -> Scenario:
    rng = random.Random(f"sensitive-claim/{seed}")
    shared = nodes - SENSITIVE_POOL
    hpc = [hpc_job(rng, _tenant(rng)) for _ in range(n_jobs)]
    head = n_jobs // 10
    hpc_times = [0] * head + _times_for_load(rng, hpc[head:], shared, 1.0)
    span = max(hpc_times)
    # claims: held for their walltime at most; keep <= SENSITIVE_MAX_CONCURRENT nodes busy
    claims: list[Job] = []
    claim_times: list[int] = []
    held: list[tuple[int, int, int]] = []  # (start, end, nodes)
    tries = 0
    while len(claims) < n_claims and tries < 100 * n_claims:
        tries += 1
        t = int(rng.uniform(0, span))
        n = _weighted(rng, [(1, 40), (2, 30), (4, 30)])
        rt = int(_loguniform(rng, 30 * MINUTE, 6 * HOUR) / MINUTE) * MINUTE
        wt = _round_up(rt * 1.25, 15 * MINUTE)
        # wipe after release is not modelled by the engine; leave 30 min of slack
        end = t + wt + 30 * MINUTE
        peak = max(
            (
                sum(k for s, e, k in held if s <= x < e)
                for x in [t, *[s for s, _, _ in held if t <= s < end]]
            ),
            default=0,
        )
        if peak + n > SENSITIVE_MAX_CONCURRENT:
            continue
        held.append((t, end, n))
        claims.append(
            Job(
                "physics" if rng.random() < 0.5 else "biology",
                n,
                rt,
                wt,
                "sensitive",
                10,
                gpus_per_node=4,
                sensitive=True,
            )
        )
        claim_times.append(t)
    order = sorted(range(len(claims)), key=lambda i: claim_times[i])
    claims = [claims[i] for i in order]
    claim_times = [claim_times[i] for i in order]
    return Scenario(
        "sensitive-claim",
        "Sensitive claims (class 10, a reserved 16-node pool) interleaved with HPC batch",
        _merge(_events("hpc", hpc, hpc_times, rng), _events("claim", claims, claim_times, rng)),
        _inventory("sensitive-claim", nodes, sensitive_pool=SENSITIVE_POOL, no_borrowing=True),
        weight_profiles("hpc-batch", "ml-training", "service", "sensitive"),
        seed,
        {
            "sensitive_pool_nodes": SENSITIVE_POOL,
            "max_concurrent_claim_nodes": SENSITIVE_MAX_CONCURRENT,
        },
    )


def preemption_heavy(
    seed: int = 0, n_low: int = 220, n_high: int = 260, nodes: int = 128
) -> Scenario:
    rng = random.Random(f"preemption-heavy/{seed}")
    low: list[Job] = []
    for _ in range(n_low):
        n = _weighted(rng, [(2, 25), (4, 35), (8, 25), (16, 15)])
        rt, wt, ex = _outcome(rng, _loguniform(rng, 2 * HOUR, 8 * HOUR), (1.1, 1.5))
        low.append(Job(_tenant(rng), n, rt, wt, "hpc-batch", rng.choice((1, 2, 3)), exit=ex))
    high: list[Job] = []
    for _ in range(n_high):
        n = _weighted(rng, [(1, 25), (2, 30), (4, 30), (8, 15)])
        rt, wt, ex = _outcome(rng, _loguniform(rng, 20 * MINUTE, 2 * HOUR), (1.2, 2.0))
        high.append(Job(_tenant(rng), n, rt, wt, "hpc-batch", rng.choice((7, 8, 9)), exit=ex))
    head = n_low // 8
    low_times = [0] * head + _times_for_load(rng, low[head:], nodes, 0.95)
    span = max(low_times)
    high_times = sorted(int(rng.uniform(HOUR, span)) for _ in high)
    return Scenario(
        "preemption-heavy",
        "Long low-class jobs fill the cluster; short high-class jobs keep preempting them",
        _merge(_events("low", low, low_times, rng), _events("high", high, high_times, rng)),
        _inventory("preemption-heavy", nodes),
        weight_profiles(*_ALL_VC),
        seed,
    )


def empty_to_full(seed: int = 0, n_jobs: int = 260, nodes: int = 128) -> Scenario:
    rng = random.Random(f"empty-to-full/{seed}")
    jobs: list[Job] = []
    for _ in range(n_jobs):
        t = _tenant(rng)
        if rng.random() < 0.8:
            n = _weighted(rng, [(1, 30), (2, 15), (4, 20), (8, 15), (16, 12), (32, 8)])
            rt, wt, ex = _outcome(rng, _loguniform(rng, 10 * MINUTE, 2 * HOUR), (1.15, 2.5))
            jobs.append(Job(t, n, rt, wt, "hpc-batch", 5, exit=ex))
        else:
            n = _weighted(rng, [(4, 50), (8, 35), (16, 15)])
            rt, wt, ex = _outcome(rng, _loguniform(rng, 30 * MINUTE, 3 * HOUR), (1.1, 1.6))
            jobs.append(Job(t, n, rt, wt, "ml-training", 5, gpus_per_node=4, exit=ex))
    ramp = 3 * HOUR
    # accelerating arrivals: the rate grows linearly from 0 over the ramp (t = T sqrt(u))
    times = sorted(int(ramp * math.sqrt(rng.random())) for _ in jobs)
    work = sum(j.work for j in jobs) / HOUR
    return Scenario(
        "empty-to-full",
        "An idle cluster; arrivals accelerate over 3 h, offering ~4x what it can run then",
        _events("e2f", jobs, times, rng),
        _inventory("empty-to-full", nodes),
        weight_profiles(*_ALL_VC),
        seed,
        {
            "ramp_s": ramp,
            "offered_node_hours": round(work, 1),
            "cluster_node_hours_in_ramp": nodes * 3,
        },
    )


def checkpoint_broker(
    seed: int = 0, n_low: int = 24, n_high: int = 36, nodes: int = 40
) -> Scenario:
    """Long low-class batch jobs (80 % of them checkpoint through a protocol, the rest
    declare ``checkpoint: none``) and four reactive services (class 3, checkpointing,
    2..8 nodes, busy and quiet in turns of a few hours) share the cluster; short
    class-8 jobs keep arriving and preempt them. ``meta.compare`` asks the suite to
    replay it a second time without the checkpoint broker."""
    rng = random.Random(f"checkpoint-broker/{seed}")
    low: list[Job] = []
    for _ in range(n_low):
        n = _weighted(rng, [(2, 30), (4, 40), (8, 30)])
        rt, wt, ex = _outcome(rng, _loguniform(rng, 2 * HOUR, 6 * HOUR), (1.1, 1.5))
        low.append(Job(_tenant(rng), n, rt, wt, "hpc-batch", rng.choice((2, 3)), exit=ex))
    high: list[Job] = []
    for _ in range(n_high):
        n = _weighted(rng, [(2, 35), (4, 40), (8, 25)])
        rt, wt, ex = _outcome(rng, _loguniform(rng, 20 * MINUTE, 90 * MINUTE), (1.2, 2.0))
        high.append(Job(_tenant(rng), n, rt, wt, "hpc-batch", 8, exit=ex))
    low_times = [0] * (n_low // 4) + _times_for_load(rng, low[n_low // 4 :], nodes, 0.8)
    span = max(low_times)
    high_times = sorted(int(rng.uniform(HOUR, span)) for _ in high)
    events = _events("batch", low, low_times, rng) + _events("urgent", high, high_times, rng)
    checkpoints = ("signal", "shmem", "grpc", "auto")
    events = [
        msgspec.structs.replace(
            e, checkpoint="none" if rng.random() < 0.2 else rng.choice(checkpoints)
        )
        if e.id.startswith("batch")
        else e
        for e in events
    ]
    scaling = ScalingSpec(
        target=0.8,
        scale_down_threshold=0.25,
        evaluation_interval=120,
        scale_up_window=240,
        scale_down_window=600,
        cooldown=300,
    )
    services = []
    for i in range(4):
        turn = int(rng.uniform(2, 4) * HOUR)  # busy, then quiet, in turns
        load = tuple(
            (float(k * turn), 0.9 if k % 2 == 0 else 0.1) for k in range(int(span // turn) + 1)
        )
        services.append(
            SubmitEvent(
                t=float(T0 + i * 15 * MINUTE),
                id=f"service-{i}",
                tenant=TENANTS[i],
                nodes=8,
                min_nodes=2,
                vcluster="service",
                preemption_class=3,
                runtime=float(span),
                checkpoint="signal",
                reactive=True,
                load=load,
                scaling=scaling,
                user=f"{TENANTS[i][:4]}01",
            )
        )
    return Scenario(
        "checkpoint-broker",
        "Reactive services and batch jobs, most checkpointing, preempted by class-8 work",
        _merge(events, services),
        _inventory("checkpoint-broker", nodes),
        weight_profiles(*_ALL_VC),
        seed,
        {"compare": "checkpoint_broker"},
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "steady-state": steady_state,
    "burst": burst,
    "unfair": unfair,
    "sensitive-claim": sensitive_claim,
    "preemption-heavy": preemption_heavy,
    "empty-to-full": empty_to_full,
    "checkpoint-broker": checkpoint_broker,
}


def regression_suite(seed: int = 0) -> list[Scenario]:
    """The regression scenarios, in the specification's order (then checkpoint-broker)."""
    return [SCENARIOS[name](seed) for name in REGRESSION_TRACES]


def write_regression_suite(out_dir: str | Path, seed: int = 0) -> dict[str, dict[str, Path]]:
    """Write the regression traces with their inventories and weights into ``out_dir``."""
    return {s.name: s.write(out_dir) for s in regression_suite(seed)}


# --------------------------------------------------------------------------- benchmark


def synthetic(n_jobs: int, n_nodes: int, seed: int = 0) -> Scenario:
    """A large mixed workload for benchmarking (e.g. 10,000 jobs on 1,000 nodes):
    HPC 70 % / ML 20 % / services 10 %, job sizes scaled to the cluster (up to 1/8 of
    it), offered at 100 % load with a backlog of 5 % of the jobs at t=0."""
    rng = random.Random(f"synthetic/{n_jobs}/{n_nodes}/{seed}")
    scale = max(1, n_nodes // 256)
    cap = max(1, n_nodes // 8)
    jobs: list[Job] = []
    for _ in range(n_jobs):
        t = _tenant(rng)
        r = rng.random()
        j = hpc_job(rng, t) if r < 0.7 else ml_job(rng, t) if r < 0.9 else service_job(rng, t)
        j.nodes = max(1, min(cap, j.nodes * scale))
        jobs.append(j)
    head = n_jobs // 20
    times = [0] * head + _times_for_load(rng, jobs[head:], n_nodes, 1.0)
    groups = max(1, n_nodes // 128)
    return Scenario(
        f"synthetic-{n_jobs}x{n_nodes}",
        f"Synthetic mixed workload: {n_jobs} jobs on {n_nodes} nodes at 100% offered load",
        _events("syn", jobs, times, rng),
        _inventory(f"synthetic-{n_nodes}", n_nodes, groups=groups),
        weight_profiles(*_ALL_VC),
        seed,
    )


# --------------------------------------------------------------------------- SWF


SWF_CORES_PER_NODE = 64
SWF_NODES = 128


def write_swf(
    path: str | Path,
    n_jobs: int,
    seed: int = 0,
    *,
    nodes: int = SWF_NODES,
    cores_per_node: int = SWF_CORES_PER_NODE,
    load: float = 0.95,
) -> Path:
    """A Standard Workload Format file of ``n_jobs`` jobs on a ``nodes`` x
    ``cores_per_node`` machine: daily arrival cycle (busier 08:00-18:00), power-of-two
    heavy job sizes in processors (a few not multiples of a node), log-uniform run
    times, requested times over-estimated and rounded like users do, ~5 % failed and
    ~2 % cancelled jobs, 40 users in 8 groups, 3 queues. Wait-time field: -1 (the
    replay decides); ``; UnixStartTime`` = 2026-03-01T00:00:00Z.
    Replay with ``--cores-per-node 64``."""
    rng = random.Random(f"swf/{n_jobs}/{seed}")
    rows: list[list[float]] = []
    shapes = []
    for _ in range(n_jobs):
        nn = _weighted(rng, [(1, 35), (2, 15), (4, 18), (8, 14), (16, 10), (32, 6), (64, 2)])
        procs = nn * cores_per_node
        if nn == 1 and rng.random() < 0.4:
            procs = rng.choice((8, 16, 32, 48))  # sub-node jobs: still one whole node
        run = int(_loguniform(rng, 2 * MINUTE, 12 * HOUR))
        req = _round_up(run * rng.uniform(1.1, 3.0), 30 * MINUTE)
        req = min(req, 24 * HOUR)
        status = 1
        r = rng.random()
        if r < 0.05:
            status = 0
            run = max(5, int(run * rng.uniform(0.01, 0.6)))
        elif r < 0.07:
            status = 5
            run = 0 if rng.random() < 0.5 else max(5, int(run * rng.uniform(0.01, 0.3)))
        elif run > req:
            run = req
        shapes.append((procs, nn, run, req, status))
    work = sum(max(1, math.ceil(p / cores_per_node)) * r for p, _, r, _, _ in shapes)
    span = work / (load * nodes)

    # daily cycle: thinning of a uniform stream, 3x more submissions in working hours
    def day_weight(t: float) -> float:
        h = (t % 86400) / 3600
        return 3.0 if 8 <= h < 18 else 1.0

    times: list[int] = []
    while len(times) < n_jobs:
        t = rng.uniform(0, span * 1.25)
        if rng.random() < day_weight(t) / 3.0:
            times.append(int(t))
    times.sort()
    for i, ((procs, _nn, run, req, status), t) in enumerate(zip(shapes, times, strict=True)):
        user = rng.randint(1, 40)
        group = 1 + (user - 1) % 8
        queue = 1 if run < HOUR else 2 if run < 6 * HOUR else 3
        rows.append(
            [
                i + 1,  # 1 job number
                t,  # 2 submit time
                -1,  # 3 wait time
                run,  # 4 run time
                procs,  # 5 allocated processors
                -1 if status != 1 else round(run * rng.uniform(0.5, 0.98), 0),  # 6 avg CPU
                -1,  # 7 used memory
                procs,  # 8 requested processors
                req,  # 9 requested time
                -1,  # 10 requested memory
                status,  # 11 status
                user,  # 12 user id
                group,  # 13 group id
                rng.randint(1, 25),  # 14 executable
                queue,  # 15 queue
                1,  # 16 partition
                -1,  # 17 preceding job
                -1,  # 18 think time
            ]
        )
    header = [
        "; Version: 2.2",
        "; Computer: Lattice RM-Replay synthetic GH200 cluster",
        "; Installation: generated by rm_replay.generate.write_swf",
        f"; Acknowledge: synthetic data, seed {seed}",
        "; Information: https://www.cs.huji.ac.il/labs/parallel/workload/swf.html",
        "; Conversion: none (generated directly in SWF)",
        f"; MaxJobs: {n_jobs}",
        f"; MaxRecords: {n_jobs}",
        "; Preemption: No",
        f"; UnixStartTime: {T0}",
        "; TimeZoneString: UTC",
        "; StartTime: Sun Mar  1 00:00:00 UTC 2026",
        f"; MaxNodes: {nodes}",
        f"; MaxProcs: {nodes * cores_per_node}",
        f"; Note: {cores_per_node} cores per node; replay with --cores-per-node {cores_per_node}",
        "; MaxQueues: 3",
        "; Queue: 1 short (< 1 h), 2 medium (< 6 h), 3 long",
        "; MaxPartitions: 1",
        "; Partition: 1 gh200",
    ]
    body = [" ".join(f"{int(v):d}" for v in row) for row in rows]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(header + body) + "\n", encoding="utf-8")
    return p


def swf_inventory(nodes: int = SWF_NODES) -> dict[str, Any]:
    """An inventory matching :func:`write_swf`'s machine (tenants are the SWF groups,
    sharing equally)."""
    inv = _inventory("swf-gh200", nodes)
    inv["tenants"] = {}
    return inv


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rm_replay.generate",
        description="Write the seven RM-Replay regression traces (+ inventories, weights).",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--swf", type=int, default=0, metavar="N", help="also write N-job SWF")
    p.add_argument(
        "--synthetic",
        type=str,
        default="",
        metavar="JOBSxNODES",
        help="also write a synthetic benchmark trace, e.g. 10000x1000",
    )
    args = p.parse_args(argv)
    for name, paths in write_regression_suite(args.out, args.seed).items():
        print(f"{name}: {paths['trace']}")
    if args.swf:
        path = write_swf(args.out / "workload.swf", args.swf, args.seed)
        (args.out / "workload.inventory.yaml").write_text(_yaml(swf_inventory()), encoding="utf-8")
        (args.out / "workload.weights.yaml").write_text(
            _yaml(weight_profiles(*_ALL_VC)), encoding="utf-8"
        )
        print(f"swf: {path}")
    if args.synthetic:
        try:
            j, n = (int(x) for x in args.synthetic.lower().split("x"))
        except ValueError:
            print("--synthetic wants JOBSxNODES, e.g. 10000x1000", file=sys.stderr)
            return 2
        paths = synthetic(j, n, args.seed).write(args.out)
        print(f"synthetic: {paths['trace']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
