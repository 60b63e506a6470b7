"""``lattice dag`` against the real REST API (over a LocalQuorum, in a thread: the
``api`` fixture): submit a file, follow it, list, cancel, and the refusals as the user
sees them (the server's error with its hint, nothing stored)."""

from __future__ import annotations

import json
from pathlib import Path

from lattice_cli.commands.dag import dag_status_text, dag_table, member_counts
from lattice_cli.main import app, load_commands
from typer.testing import CliRunner

load_commands()

DIAMOND = """\
name: diamond
allocations:
  - name: prep
    entrypoint: ./prep.sh
    walltime: 1h
  - name: left
    entrypoint: ./left.sh
    walltime: 1h
    depends_on: [{prep: success}]
  - name: right
    entrypoint: ./right.sh
    walltime: 1h
    depends_on: [{prep: afterok}]
  - name: join
    entrypoint: ./join.sh
    walltime: 1h
    depends_on: [{left: success}, {right: any}]
"""

CYCLE = """\
dag:
  allocations:
    - {id: a, entrypoint: ./a.sh, walltime: 1h, depends_on: [{ref: b, condition: success}]}
    - {id: b, entrypoint: ./b.sh, walltime: 1h, depends_on: [{ref: a, condition: success}]}
"""


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def setup(api, monkeypatch, tmp_path: Path, text: str = DIAMOND) -> str:
    monkeypatch.setenv("LATTICE_TENANT", "physics")
    monkeypatch.setenv("LATTICE_VCLUSTER", "gpu-batch")
    monkeypatch.setenv("USER", "alice")
    api.names()
    api.nodes("nid001", "nid002")
    path = tmp_path / "dag.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_submit_status_list_cancel(api, monkeypatch, tmp_path):
    path = setup(api, monkeypatch, tmp_path)
    r = run("dag", "submit", path)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Submitted DAG ") and r.output.rstrip().endswith(
        "with 4 allocations"
    )
    dag_id = r.output.split()[2]
    (dag,) = api.quorum.state.dags.values()
    assert (
        dag.id == dag_id
        and dag.user == "alice"
        and list(dag.members)
        == [
            "prep",
            "left",
            "right",
            "join",
        ]
    )
    for alloc_id in dag.members.values():  # the configured tenant and vCluster
        spec = api.quorum.state.allocations[alloc_id].spec
        assert (spec.tenant, spec.vcluster) == ("physics", "gpu-batch")
    sent = api.last("POST")
    assert sent["path"] == "/api/v1/dags"

    r = run("dag", "status", dag_id)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"DAG {dag_id} (diamond): Running, submitted by alice"
    assert lines[1].split() == ["REF", "ALLOCATION", "STATE"]
    assert [(ln.split()[0], ln.split()[2]) for ln in lines[2:]] == [
        ("prep", "Pending"),
        ("left", "Blocked"),
        ("right", "Blocked"),
        ("join", "Blocked"),
    ]
    r = run("dag", "status", dag_id, "-o", "wide")
    assert "DEPENDS_ON" in r.output and "left:success,right:any" in r.output
    as_json = json.loads(run("dag", "status", dag_id, "-o", "json").output)
    assert as_json["id"] == dag_id and as_json["members"][1]["state"] == "Blocked"

    r = run("dag", "list")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].split() == [
        "ID",
        "NAME",
        "STATE",
        "ALLOCS",
        "MEMBERS",
        "USER",
    ]
    assert dag_id in r.output and "1 Pending, 3 Blocked" in r.output
    assert run("dag", "list", "--state", "completed").output.strip() == "No DAGs."
    assert run("-q", "dag", "list", "--all").output.split() == [dag_id]

    r = run("dag", "cancel", dag_id, "-r", "not needed")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"Cancelled DAG {dag_id}: 4 allocations cancelled; it is Cancelled"
    assert all(api.quorum.state.allocations[i].reason == "not needed" for i in dag.members.values())
    r = run("dag", "cancel", dag_id)
    assert r.exit_code == 1 and f"Error: DAG {dag_id} already ended (Cancelled)" in r.output
    assert "Hint:" in r.output


def test_submit_json_and_quiet(api, monkeypatch, tmp_path):
    path = setup(api, monkeypatch, tmp_path)
    out = json.loads(run("dag", "submit", path, "-o", "json").output)
    assert out["dag_id"] and len(out["allocation_ids"]) == 4
    assert out["dag"]["state"] == "Running"
    r = run("-q", "dag", "submit", path)
    assert r.exit_code == 0 and r.output.strip() in api.quorum.state.dags


def test_refusals_print_the_servers_error_and_store_nothing(api, monkeypatch, tmp_path):
    path = setup(api, monkeypatch, tmp_path, CYCLE)
    r = run("dag", "submit", path)
    assert r.exit_code == 1
    assert "Error: dependency cycle: a -> b -> a" in r.output
    assert "Hint: A DAG must be acyclic" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(DIAMOND.replace("walltime: 1h\n", "walltime: 1h\n    nodes: 0\n", 1))
    r = run("dag", "submit", str(bad))
    assert r.exit_code == 1 and "Error: member 'prep': nodes must be at least 1" in r.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("allocations: [x\n")
    r = run("dag", "submit", str(broken))
    assert r.exit_code == 1 and "is not valid YAML at line" in r.output
    assert api.allocation_ids() == [] and api.quorum.state.dags == {}

    r = run("dag", "submit", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2 and "no such DAG file" in r.output
    r = run("dag", "status", "nope")
    assert r.exit_code == 1 and "Error: DAG nope not found" in r.output
    assert "lattice dag list" in r.output
    r = run("dag", "list", "--state", "bogus")
    assert r.exit_code == 1 and "unknown DAG state 'bogus'" in r.output


def test_renderers():
    dag = {
        "id": "d1",
        "name": "",
        "state": "Running",
        "user": "bob",
        "members": [
            {"ref": "a", "allocation_id": "x1", "state": "Running"},
            {"ref": "b", "allocation_id": "", "state": "Blocked"},
        ],
        "edges": [{"upstream": "a", "downstream": "b", "condition": "failure"}],
    }
    text = dag_status_text(dag, wide=True)
    assert text.splitlines()[0] == "DAG d1: Running, submitted by bob"
    assert text.splitlines()[3].split() == ["b", "—", "Blocked", "a:failure"]
    assert member_counts(dag) == "1 Running, 1 Blocked"
    assert member_counts({"members": []}) == "—"
    assert dag_table([dag]).splitlines()[1].split() == [
        "d1",
        "—",
        "Running",
        "2",
        "1",
        "Running,",
        "1",
        "Blocked",
        "bob",
    ]
