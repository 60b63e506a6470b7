"""Same trace + inventory + weights + seed -> byte-identical result.json."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from lattice_common.types import CostWeights
from rm_replay.engine import simulate
from rm_replay.model import RESULT_FILE, dump_result, dump_timing, load_result
from rm_replay.trace import write_trace
from rmr_helpers import H, inventory, submit

INVENTORY_YAML = """
name: det
node_classes:
  - {name: cpu, count: 12, groups: 3, memory_gb: 256, conformance: {a: 0.7, b: 0.3}}
  - {name: gh, count: 6, gpu_type: GH200, gpus: 4, groups: 2, conformance: [g1, g2]}
  - {name: pool, count: 4, vcluster: ml}
tenants:
  a: {fair_share_target: 0.5}
"""
WEIGHTS_YAML = "hpc:\n  priority: 0.3\n  wait_time: 0.3\nml: ml-training\n"


def _trace(seed: int = 5, n: int = 150):
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(1 / 300)
        wall = rng.choice([0.5, 1, 2, 6]) * H
        out.append(
            submit(
                f"j{i:03d}",
                round(t, 3),
                nodes=rng.choice([1, 1, 2, 4, 6]),
                walltime=wall,
                runtime=round(wall * rng.uniform(0.1, 1.3), 3),
                tenant=rng.choice("abc"),
                vcluster=rng.choice(["hpc", "hpc", "ml"]),
                preemption_class=rng.choice([1, 5, 5, 8]),
                gpu_type=rng.choice(["", "", "GH200"]),
                exit=rng.choice([0, 0, 0, 1]),
            )
        )
    return out


def _run(**kw):
    inv = inventory(
        12,
        groups=3,
        extra=[
            {"name": "gh", "count": 6, "gpu_type": "GH200", "gpus": 4, "groups": 2},
            {"name": "pool", "count": 4, "vcluster": "ml"},
        ],
    )
    weights = {"hpc": CostWeights(priority=0.3, wait_time=0.3)}
    return simulate(_trace(), inv, weights_by_vcluster=weights, checkpoint_success_rate=0.7, **kw)


@pytest.mark.parametrize("policy", ["lattice", "easy", "fcfs"])
def test_two_runs_give_identical_bytes(policy: str) -> None:
    a, b = _run(policy=policy, seed=1), _run(policy=policy, seed=1)
    assert dump_result(a) == dump_result(b)
    assert a.cycles and a.wall_time_s > 0


def test_the_seed_matters_only_through_checkpoints() -> None:
    a, b = _run(seed=1), _run(seed=2)
    if sum(j.checkpoints_attempted for j in a.jobs) == 0:
        pytest.skip("no preemption in this trace")
    assert dump_result(a) != dump_result(b)
    assert a.sim_config["seed"] == 1 and b.seed == 2


def test_result_json_leaves_wall_clock_figures_out(tmp_path: Path) -> None:
    r = _run()
    raw = dump_result(r)
    assert b"duration_s" not in raw and b"wall_time_s" not in raw
    data = msgspec.json.decode(raw)
    assert list(data) == sorted(data)  # keys sorted: stable diffs
    (tmp_path / RESULT_FILE).write_bytes(raw)
    (tmp_path / "timing.json").write_bytes(dump_timing(r))
    back = load_result(tmp_path)
    assert back.wall_time_s == r.wall_time_s
    assert [c.duration_s for c in back.cycles] == [c.duration_s for c in r.cycles]
    assert dump_result(back) == raw
    assert back.jobs == r.jobs


def _cli_run(tmp: Path, out: str, hashseed: str, policy: str) -> bytes:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    cmd = [
        sys.executable,
        "-m",
        "rm_replay.cli",
        "run",
        "--trace",
        str(tmp / "t.jsonl"),
        "--inventory",
        str(tmp / "inv.yaml"),
        "--weights",
        str(tmp / "w.yaml"),
        "--policy",
        policy,
        "--seed",
        "3",
        "--checkpoint-success-rate",
        "0.6",
        "--no-report",
        "--quiet",
        "--out",
        str(tmp / out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return (tmp / out / RESULT_FILE).read_bytes()


@pytest.mark.parametrize("policy", ["lattice", "easy"])
def test_identical_across_processes_and_hash_seeds(tmp_path: Path, policy: str) -> None:
    """Set and dict iteration orders differ between processes with different
    PYTHONHASHSEEDs; the result must not."""
    write_trace(tmp_path / "t.jsonl", _trace(7, 120))
    (tmp_path / "inv.yaml").write_text(INVENTORY_YAML)
    (tmp_path / "w.yaml").write_text(WEIGHTS_YAML)
    one = _cli_run(tmp_path, "a", "1", policy)
    two = _cli_run(tmp_path, "b", "4242", policy)
    assert one == two
    assert b'"jobs":[' in one
