"""The additive-only rule of the wire contract, on protos compiled by the real protoc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_common.wire_contract import breaking_changes, contract_of

ROOT = Path(__file__).resolve().parents[3]

OLD = """
syntax = "proto3";
package t.v1;
service Jobs {
  rpc Submit(Job) returns (Job);
  rpc Watch(Job) returns (stream Job);
}
enum State { STATE_UNSPECIFIED = 0; RUNNING = 1; DONE = 2; }
message Job {
  string id = 1;
  int32 nodes = 2;
  State state = 3;
  map<string, string> tags = 4;
  repeated string hosts = 5;
}
"""


def compile_proto(tmp: Path, text: str) -> dict:
    src = tmp / "p" / "t.proto"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(text)
    out = tmp / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{src.parent}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            str(src),
        ],
        check=True,
    )
    return contract_of(out.read_bytes())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("  int32 nodes = 2;", None),
        ("  int32 nodes = 2;\n  int64 gpus = 6;", None),  # a new field: additive
        ("  int32 nodes = 7;", "t.v1.Job.nodes was renumbered from 2 to 7"),
        ("  int64 nodes = 2;", "t.v1.Job.nodes (= 2) changed its type or label"),
        ("  repeated int32 nodes = 2;", "t.v1.Job.nodes (= 2) changed its type or label"),
        ("", "t.v1.Job.nodes (= 2) was removed"),
        ("  int32 node_count = 2;", "t.v1.Job.nodes (= 2) was renamed or replaced by node_count"),
    ],
)
def test_field_changes(tmp_path: Path, change: str, expected: str | None) -> None:
    old = compile_proto(tmp_path / "a", OLD)
    new = compile_proto(tmp_path / "b", OLD.replace("  int32 nodes = 2;", change))
    assert breaking_changes(old, new) == ([expected] if expected else [])


def test_services_and_enums(tmp_path: Path) -> None:
    old = compile_proto(tmp_path / "a", OLD)
    gone = OLD.replace("  rpc Watch(Job) returns (stream Job);\n", "")
    assert breaking_changes(old, compile_proto(tmp_path / "b", gone)) == [
        "rpc t.v1.Jobs.Watch was removed"
    ]
    unary = OLD.replace("returns (stream Job)", "returns (Job)")
    assert breaking_changes(old, compile_proto(tmp_path / "c", unary)) == [
        "rpc t.v1.Jobs.Watch changed its request, response or streaming"
    ]
    enum = OLD.replace("DONE = 2;", "DONE = 3;")
    assert breaking_changes(old, compile_proto(tmp_path / "d", enum)) == [
        "t.v1.State.DONE was renumbered from 2 to 3"
    ]
    more = OLD.replace("DONE = 2;", "DONE = 2; FAILED = 3;").replace(
        "rpc Submit(Job) returns (Job);",
        "rpc Submit(Job) returns (Job);\n  rpc Get(Job) returns (Job);",
    )
    assert breaking_changes(old, compile_proto(tmp_path / "e", more)) == []


def test_the_committed_contract_is_what_proto_compiles_to_or_a_subset_of_it(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *map(str, sorted((ROOT / "proto/lattice/v1").glob("*.proto"))),
        ],
        check=True,
    )
    committed = json.loads((ROOT / "proto/contract.json").read_text())
    assert breaking_changes(committed, contract_of(out.read_bytes())) == []


@given(st.data())
def test_taking_anything_away_is_caught_and_adding_never_is(data: st.DataObject) -> None:
    contract = {
        "messages": {
            f"m{i}": {f"f{j}": [j + 1, 9, 1, ""] for j in range(data.draw(st.integers(1, 4)))}
            for i in range(data.draw(st.integers(1, 4)))
        },
        "enums": {"e": {"A": 0, "B": 1}},
        "services": {"s": {"r": ["m0", "m0", False, False]}},
    }
    grown = json.loads(json.dumps(contract))
    grown["messages"]["m0"]["extra"] = [99, 9, 1, ""]
    grown["messages"]["new"] = {"x": [1, 9, 1, ""]}
    grown["enums"]["e"]["C"] = 2
    grown["services"]["s"]["r2"] = ["m0", "m0", False, True]
    assert breaking_changes(contract, grown) == []
    shrunk = json.loads(json.dumps(contract))
    msg = data.draw(st.sampled_from(sorted(shrunk["messages"])))
    field = data.draw(st.sampled_from(sorted(shrunk["messages"][msg])))
    del shrunk["messages"][msg][field]
    assert any(field in b for b in breaking_changes(contract, shrunk))
