"""Admission as the CLI shows it, against the real REST API (over a LocalQuorum, in a
thread: the ``api`` fixture): refusals at submit with nothing stored,
``--wait-for-capacity``, ``--test-only`` and ``lattice queue``. On a real cluster with a
scheduler: lattice-acceptance's ``admission.feature``."""

from __future__ import annotations

import json

from lattice_cli.main import app, load_commands
from typer.testing import CliRunner

load_commands()


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def setup(api, monkeypatch, nodes: int = 2) -> None:
    monkeypatch.setenv("LATTICE_TENANT", "physics")
    monkeypatch.setenv("LATTICE_VCLUSTER", "gpu-batch")
    monkeypatch.setenv("USER", "alice")
    api.names()
    api.nodes(*(f"nid{i:03d}" for i in range(1, nodes + 1)))


def test_more_nodes_than_the_vcluster_has_is_refused_and_nothing_is_stored(api, monkeypatch):
    setup(api, monkeypatch)
    r = run("submit", "-N", "8", "-t", "1h", "--", "hostname")
    assert r.exit_code != 0
    assert (
        'Error: allocation rejected: needs 8 nodes, vCluster "gpu-batch" could offer at most 2'
        in r.output
    )
    assert "Hint:" in r.output and "--wait-for-capacity" in r.output
    assert api.allocation_ids() == []


def test_wait_for_capacity_accepts_what_the_cluster_cannot_run_yet(api, monkeypatch):
    setup(api, monkeypatch)
    r = run("-q", "submit", "-N", "8", "--wait-for-capacity", "-t", "1h", "--", "hostname")
    assert r.exit_code == 0, r.output
    (alloc_id,) = api.allocation_ids()
    assert api.quorum.state.allocations[alloc_id].spec.wait_for_capacity is True


def test_an_unknown_gpu_type_is_refused_listing_what_exists(api, monkeypatch):
    setup(api, monkeypatch, nodes=0)
    api.nodes("gpu001", capabilities={"gpu_type": "A100", "gpu_count": 4, "memory_gb": 512})
    r = run("submit", "-C", "gpu_type=H100", "-t", "1h", "--", "hostname")
    assert r.exit_code != 0
    assert 'no registered node has gpu_type "H100"' in r.output
    assert "A100 (1)" in r.output  # what exists, with how many nodes
    assert api.allocation_ids() == []


def test_test_only_says_when_and_stores_nothing(api, monkeypatch):
    setup(api, monkeypatch)
    r = run("submit", "--test-only", "-N", "2", "-t", "1h", "--", "hostname")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Would start now on 2 nodes")
    assert "Nothing was submitted." in r.output
    assert api.allocation_ids() == []
    out = run("submit", "--test-only", "-o", "json", "-t", "5m", "--", "true").output
    as_json = json.loads(out)
    assert as_json["estimate_basis"] == "now" and as_json["nodes"] == 1
    assert api.allocation_ids() == []


def test_queue_lists_the_pending_allocations_in_order_with_their_factors(api, monkeypatch):
    setup(api, monkeypatch, nodes=0)
    first = api.pending(age=300, user="alice", preemption_class=7)
    second = api.pending(age=100, user="alice")
    api.pending(age=50, user="bob")
    r = run("queue")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("vCluster gpu-batch: 3 pending, 2 shown")
    assert lines[1].split()[:4] == ["POS", "ID", "USER", "NODES"]
    ids = [ln.split()[1] for ln in lines[2:]]
    assert ids == [first.id, second.id]  # bob's entry is counted, not shown
    data = json.loads(run("queue", "-o", "json").output)
    assert [e["position"] for e in data["entries"]] == [1, 2]
    assert "c1_priority" in data["entries"][0]["breakdown"]
    assert data["entries"][0]["score"] > data["entries"][1]["score"]


def test_queue_of_an_unknown_vcluster_says_how_to_list_them(api, monkeypatch):
    setup(api, monkeypatch)
    r = run("queue", "nope")
    assert r.exit_code != 0
    assert 'vCluster "nope" not found' in r.output and "lattice admin vcluster list" in r.output


def test_test_only_on_a_full_cluster_says_when_and_where_in_the_queue(api, monkeypatch):
    setup(api, monkeypatch, nodes=0)
    api.running(["nid001"], ran=600.0)  # 24 h walltime: the node frees in ~23 h 50 min
    api.pending(age=50)  # one job already waiting, ahead of a newcomer
    before = api.allocation_ids()
    r = run("submit", "--test-only", "-t", "1h", "--", "hostname")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Would start at ")
    # the running job frees the node in 23 h 50 min, then the waiting job runs its 24 h
    assert "(in 47:4" in r.output or "(in 47:5" in r.output, r.output
    assert "Queue position: 2" in r.output
    assert "Pending reason: all suitable nodes occupied" in r.output
    assert api.allocation_ids() == before
