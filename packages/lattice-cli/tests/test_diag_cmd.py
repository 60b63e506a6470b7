"""``lattice diag`` against the real REST API (over a LocalQuorum, in a thread; the
allocation's nodes have no agents here, so their storage lines say so), and its pure
renderers. The facts themselves (real agents, the TSDB, refusals, the limit) are tested
at the API in lattice-api's ``tests/test_diag_api.py``; a real cluster's job in the
acceptance suite's ``diagnostics.feature``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_cli import main as cli_main
from lattice_cli.commands.diag import MARKS, check_line, histogram_lines, render
from lattice_common.types import Allocation, AllocationSpec
from lattice_test_harness.local_api import LocalApi, ThreadedLocalApi
from typer.testing import CliRunner

cli_main.load_commands(["diag"])  # main() does this for `lattice diag`

pytestmark = pytest.mark.timeout(120)

SPEC = AllocationSpec(
    entrypoint="python train.py", tenant="physics", vcluster="batch", walltime_seconds=3600
)


def run(*args: str) -> Any:
    return CliRunner().invoke(cli_main.app, list(args), catch_exceptions=False)


@pytest.fixture
def job(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalApi, Allocation]]:
    """A job running on nid001 (group 3) and nid002 (group 7), whose agents are absent."""
    with ThreadedLocalApi() as api:
        monkeypatch.setenv("LATTICE_ENDPOINT", api.rest_url)
        api.add_tenant("physics")
        api.add_vcluster("batch")
        api.add_node("nid001", group=3)
        api.add_node("nid002", group=7)
        a = api.submit(msgspec.structs.replace(SPEC, nodes=2))
        a = api.start(a.id, ["nid001", "nid002"])
        yield api, a


def test_combined_view_with_marks(job: Any) -> None:
    _api, a = job
    res = run("diag", a.id)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == f"Diagnostics of allocation {a.id} (Running, 2 nodes)"
    assert lines[1] == "Network:"
    assert "  Group span: 2 groups (g3, g7) ✓" in lines
    assert any(ln.startswith("  CSIG congestion: no data") and ln.endswith("–") for ln in lines)
    assert "Storage:" in lines and "GPUs:" in lines
    for node in ("nid001", "nid002"):
        assert f"  {node} agent: no answer: node {node} has no agent address ✗ CRITICAL" in lines
    assert lines[-1].startswith("Overall: 2 critical") and lines[-1].endswith("✗ CRITICAL")


def test_sections_json_and_the_other_spelling(job: Any) -> None:
    _api, a = job
    res = run("diag", a.id, "--network")
    assert res.exit_code == 0, res.output
    assert "Storage:" not in res.output and "GPUs:" not in res.output
    assert "  nid001 agent: no answer: node nid001 has no agent address ✗ CRITICAL" in res.output
    assert res.output.splitlines()[-1].endswith("✗ CRITICAL")
    res = run("diag", a.id, "--storage", "-o", "json")
    assert res.exit_code == 0, res.output
    answer = json.loads(res.output)
    assert answer["allocation_id"] == a.id and answer["sections"] == ["storage"]
    assert {c["section"] for c in answer["checks"]} == {"storage"}
    res = run("diagnostics", a.id, "--storage")
    assert res.exit_code == 0 and "Storage:" in res.output


def test_refusals(job: Any) -> None:
    api, a = job
    res = run("diag", a.id, "--network", "--storage")
    assert res.exit_code == 2
    assert "Error: --network and --storage cannot be combined" in res.output
    assert "Hint: Leave both out" in res.output
    res = run("diag", "nope")
    assert res.exit_code == 1 and "Error: allocation nope not found" in res.output
    p = api.submit(SPEC)
    res = run("diag", p.id)
    assert res.exit_code == 1
    assert f"Error: allocation {p.id} is Pending: diagnostics need an allocation" in res.output
    assert "Hint: Wait until it runs" in res.output


# --- the renderers --------------------------------------------------------------------------

statuses = st.sampled_from(sorted(MARKS))
checks = st.lists(
    st.fixed_dictionaries(
        {
            "section": st.sampled_from(["network", "storage", "gpu"]),
            "name": st.sampled_from(["group_span", "mount", "io", "sm_occupancy", "custom"]),
            "node_id": st.sampled_from(["", "n1", "n2"]),
            "status": statuses,
            "message": st.text(
                st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30
            ),
            "details": st.just({"role": "scratch"}),
        }
    ),
    max_size=8,
)


@given(checks, st.sampled_from([["network", "storage", "gpu"], ["network"], ["storage"]]))
def test_every_shown_check_is_one_line_with_its_mark(
    cs: list[dict[str, Any]], sections: list[str]
) -> None:
    answer = {
        "allocation_id": "a1",
        "state": "Running",
        "sections": sections,
        "nodes": [],
        "checks": cs,
        "status": "ok",
        "summary": "all ok",
    }
    text = render(answer)
    lines = text.splitlines()
    shown = [c for c in cs if c["section"] in sections]
    for c in shown:
        line = "  " + check_line(c)
        assert line in lines
        assert line.endswith(MARKS[c["status"]])
        assert c["message"] in line
    assert len([ln for ln in lines if ln.startswith("  ")]) == len(shown)
    assert lines[-1] == "Overall: all ok ✓"


def test_check_lines() -> None:
    mount = {
        "name": "mount",
        "node_id": "n1",
        "status": "warning",
        "message": "/scratch/a1 (tmpfs on /scratch): 1.0 MB free of 100.0 MB (1 %)",
        "details": {"role": "scratch"},
    }
    assert check_line(mount) == (
        "n1 scratch: /scratch/a1 (tmpfs on /scratch): 1.0 MB free of 100.0 MB (1 %) ⚠ WARNING"
    )
    io = {"name": "io", "node_id": "n2", "status": "ok", "message": "p99 latency: 45 µs"}
    assert check_line(io) == "n2 I/O: p99 latency: 45 µs ✓"


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=12))
def test_histogram_bars_follow_the_counts(counts: list[int]) -> None:
    buckets = [
        {"low_us": float(2**k), "high_us": float(2 ** (k + 1)), "count": n}
        for k, n in enumerate(counts)
    ]
    lines = histogram_lines(buckets)
    assert len(lines) == len(counts)
    bars = [ln.count("█") for ln in lines]
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    assert [bars[i] for i in order] == sorted(bars)
    if max(counts):
        assert max(bars) == 30
    assert all(b == 0 for n, b in zip(counts, bars, strict=True) if n == 0)
