"""The seeded generators: determinism, sizes, loadability, the sensitive pool, SWF."""

from __future__ import annotations

from pathlib import Path

import pytest
from rm_replay import generate
from rm_replay.inventory import build_nodes, load_inventory
from rm_replay.model import SubmitEvent
from rm_replay.swf import SWF_FIELDS, parse_swf
from rm_replay.trace import load_trace
from rm_replay.weights import load_weights


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_suite_is_deterministic_by_seed(tmp_path: Path):
    generate.write_regression_suite(tmp_path / "a", seed=7)
    generate.write_regression_suite(tmp_path / "b", seed=7)
    generate.write_regression_suite(tmp_path / "c", seed=8)
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert len(a) == 3 * len(generate.REGRESSION_TRACES)
    assert a == b
    for name in generate.REGRESSION_TRACES:
        assert a[f"{name}.trace"] != c[f"{name}.trace"], name


@pytest.mark.parametrize("name", generate.REGRESSION_TRACES)
def test_traces_load_and_are_ci_sized(tmp_path: Path, name: str):
    s = generate.SCENARIOS[name](0)
    paths = s.write(tmp_path)
    assert paths["trace"].name == f"{name}.trace"
    events = load_trace(paths["trace"])
    # checkpoint-broker is the smallest (64 jobs on 40 nodes): it is replayed twice
    assert 60 <= len(events) <= 1500
    assert all(isinstance(e, SubmitEvent) and e.runtime is not None for e in events)
    assert [e.t for e in events] == sorted(e.t for e in events)
    inv = load_inventory(paths["inventory"])
    assert 40 <= len(build_nodes(inv)) <= 256
    weights = load_weights(paths["weights"])
    assert {"hpc-batch", "ml-training", "service"} <= set(weights)
    assert weights["hpc-batch"].fair_share == pytest.approx(0.20)  # the spec's HPC batch profile
    first = paths["trace"].read_text().splitlines()[0]
    assert '"type":"meta"' in first and f'"name":"{name}"' in first
    # every job fits the cluster
    assert max(e.nodes for e in events) <= len(build_nodes(inv))


def test_sensitive_claims_fit_their_reserved_pool():
    s = generate.sensitive_claim(0)
    claims = [e for e in s.events if e.sensitive]
    assert len(claims) == 40
    assert all(e.preemption_class == 10 and e.vcluster == "sensitive" for e in claims)
    # concurrent claim nodes (each held for its walltime) never exceed the margin
    points = sorted({e.t for e in claims})
    for t in points:
        busy = sum(e.nodes for e in claims if e.t <= t < e.t + e.walltime)
        assert busy <= generate.SENSITIVE_MAX_CONCURRENT
    inv = s.inventory_obj()
    pool = [n for n in build_nodes(inv).values() if n.home_vcluster == "sensitive"]
    assert len(pool) == generate.SENSITIVE_POOL
    assert all(not v.allow_borrowing for v in inv.vclusters)


def test_unfair_trace_has_one_heavy_tenant():
    s = generate.unfair(0)
    work: dict[str, float] = {}
    for e in s.events:
        work[e.tenant] = work.get(e.tenant, 0.0) + e.nodes * min(e.runtime, e.walltime)
    heavy = work.pop("physics")
    assert heavy > 2.5 * max(work.values())
    assert s.inventory["tenants"]["physics"]["fair_share_target"] == 0.25


def test_synthetic_benchmark_trace():
    a = generate.synthetic(10_000, 1_000, seed=1)
    assert len(a.events) == 10_000
    assert a.inventory["node_classes"][0]["count"] == 1_000
    assert max(e.nodes for e in a.events) <= 1_000 // 8
    b = generate.synthetic(10_000, 1_000, seed=1)
    assert a.trace_text() == b.trace_text()
    assert (
        generate.synthetic(500, 128, seed=2).trace_text()
        != generate.synthetic(500, 128, seed=3).trace_text()
    )


def test_swf_writer(tmp_path: Path):
    p = generate.write_swf(tmp_path / "a.swf", 300, seed=4)
    q = generate.write_swf(tmp_path / "b.swf", 300, seed=4)
    assert p.read_bytes() == q.read_bytes()
    assert generate.write_swf(tmp_path / "c.swf", 300, seed=5).read_bytes() != p.read_bytes()
    lines = p.read_text().splitlines()
    header = [ln for ln in lines if ln.startswith(";")]
    body = [ln for ln in lines if not ln.startswith(";")]
    assert f"; UnixStartTime: {generate.T0}" in header
    assert len(body) == 300
    assert all(len(ln.split()) == len(SWF_FIELDS) == 18 for ln in body)
    submits = [int(ln.split()[1]) for ln in body]
    assert submits == sorted(submits)
    parsed = parse_swf(lines, cores_per_node=generate.SWF_CORES_PER_NODE)
    assert len(parsed.events) + len(parsed.skipped) == 300
    assert all(reason == "cancelled before it started" for _, _, reason in parsed.skipped)
    assert parsed.unix_start_time == generate.T0
    assert max(e.nodes for e in parsed.events) <= generate.SWF_NODES
    statuses = {int(ln.split()[10]) for ln in body}
    assert {0, 1, 5} <= statuses


def test_cli_writes_suite_and_swf(tmp_path: Path, capsys):
    assert (
        generate.main([str(tmp_path), "--seed", "1", "--swf", "50", "--synthetic", "300x64"]) == 0
    )
    names = {p.name for p in tmp_path.iterdir()}
    assert "workload.swf" in names and "workload.inventory.yaml" in names
    assert "synthetic-300x64.trace" in names
    assert "steady-state.trace" in capsys.readouterr().out
