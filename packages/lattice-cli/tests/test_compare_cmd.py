"""``lattice compare`` against the real REST API (over a LocalQuorum, in a thread) reading
a real VictoriaMetrics into which the tests push what node agents push; its pure
renderers. Scoping, alignment and refusals are tested at the API in lattice-api's
``tests/test_compare_api.py``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lattice_api.settings import ApiSettings
from lattice_cli import main as cli_main
from lattice_cli.commands.compare import (
    caption,
    compare_table,
    delta_cell,
    series_tables,
    sparkline,
)
from lattice_common.types import Allocation, AllocationSpec, AllocationState
from lattice_test_harness import victoria
from lattice_test_harness.local_api import LocalApi, ThreadedLocalApi
from typer.testing import CliRunner

cli_main.load_commands(["compare"])  # main() does this for `lattice compare`

pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> Any:
    return CliRunner().invoke(cli_main.app, list(args), catch_exceptions=False)


def agent_lines(a: Allocation, node: str, values: dict[str, Any], at: float) -> list[str]:
    """One prod window of one node as agents push it (only ``mean`` is compared; the other
    aggregation kinds are there to be ignored)."""
    lines = []
    for name, value in values.items():
        for index, v in enumerate(value if isinstance(value, list) else [value]):
            gpu = f',gpu="{index}"' if isinstance(value, list) else ""
            for agg, factor in (("mean", 1.0), ("p99", 3.0), ("max", 4.0)):
                labels = (
                    f'alloc_id="{a.id}",node_id="{node}",tenant="{a.spec.tenant}",'
                    f'user="{a.spec.user}",vcluster="{a.spec.vcluster}",agg="{agg}"{gpu}'
                )
                lines.append(f"{name}{{{labels}}} {v * factor} {int(at * 1000)}")
    return lines


def push(vm: victoria.VictoriaMetrics, a: Allocation, gpu: Any, memory: float) -> None:
    """Windows 1..10 from the start (stamped 5 s before each 30 s step): GPU utilization
    ``gpu(k)`` on every GPU, CPU 100 % and 50 % on the two nodes, memory ``memory * k``
    per node."""
    assert a.started_at is not None
    lines = []
    for k in range(1, 11):
        at = a.started_at + 30 * k - 5
        for node, cpu in (("nid001", 100.0), ("nid002", 50.0)):
            values = {
                "gpu_utilization": [gpu(k)] * 4,
                "cpu_utilization": cpu,
                "memory_used": memory * k,
            }
            lines += agent_lines(a, node, values, at)
    vm.push("\n".join(lines) + "\n")
    vm.flush()


@pytest.fixture(scope="module")
def vm() -> Iterator[victoria.VictoriaMetrics]:
    if not victoria.available():
        pytest.skip("victoria-metrics is not installed (apt-get install victoria-metrics)")
    with victoria.VictoriaMetrics() as server:
        yield server


SPEC = AllocationSpec(
    entrypoint="/bin/bash train.sh",
    tenant="physics",
    vcluster="gpu-batch",
    user="alice",
    nodes=2,
    walltime_seconds=86400,
)


def last_get(api: LocalApi) -> dict[str, Any]:
    """The last GET the server received."""
    return [r for r in api.requests if r["method"] == "GET"][-1]


@pytest.fixture
def runs(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, vm: victoria.VictoriaMetrics
) -> Iterator[tuple[LocalApi, Allocation, Allocation]]:
    """The real API reading ``vm`` (development mode: the caller is a system admin);
    alice's ``a`` ran 5 minutes a day ago, ``b`` started 400 s ago, the same shape 5
    points lower on the GPUs and twice the memory."""
    with ThreadedLocalApi(settings=ApiSettings(tsdb_endpoint=vm.url)) as api:
        monkeypatch.setenv("LATTICE_ENDPOINT", api.rest_url)
        api.add_tenant("physics")
        api.add_vcluster("gpu-batch")
        api.add_node("nid001")
        api.add_node("nid002")
        now = time.time()
        a = api.submit(SPEC, now=now - 86500)
        api.start(a.id, ["nid001", "nid002"], now=now - 86400)
        a = api.set_state(a.id, AllocationState.COMPLETED, exit_code=0, now=now - 86100)
        b = api.submit(SPEC, now=now - 500)
        b = api.start(b.id, ["nid001", "nid002"], now=now - 400)
        push(vm, a, lambda k: 10.0 * k, 1e9)
        push(vm, b, lambda k: 10.0 * k - 5, 2e9)
        yield api, a, b


# --- the command against the served API -------------------------------------------------


def test_table(runs: Any) -> None:
    api, a, b = runs
    res = run("compare", a.id, b.id, "--duration", "5m", "--step", "30s")
    assert res.exit_code == 0, res.output
    first, header, *rows = res.output.splitlines()
    assert first == (
        "2 allocations aligned at their starts (t=0) · offsets 00:00:00 to 00:05:00 every 30 s"
    )
    assert header.split() == ["METRIC", "ALLOCATION", "MEAN", "MAX", "FINAL", "Δ_VS_FIRST", "TREND"]
    cells = [r.split() for r in rows]
    assert cells[0][:6] == ["gpu_utilization", a.id, "55.0%", "100.0%", "100.0%", "baseline"]
    assert cells[1][:6] == [b.id, "50.0%", "95.0%", "95.0%", "-5.0%", "(×0.91)"]
    assert cells[2][:6] == ["cpu_utilization", a.id, "75.0%", "75.0%", "75.0%", "baseline"]
    assert cells[3][:6] == [b.id, "75.0%", "75.0%", "75.0%", "+0.0%", "(×1.00)"]
    assert cells[4][:5] == ["memory_used", a.id, "11.0", "GB", "20.0"]
    assert cells[5][-3:-1] == ["GB", "(×2.00)"] and cells[5][:3] == [b.id, "22.0", "GB"]
    # the sparklines: one character per offset, the same offsets and scale for both
    assert cells[0][-1] == "▁▂▃▃▄▅▆▇██" and cells[1][-1] == "▁▁▂▃▄▅▆▆▇█"
    assert last_get(api)["path"] == "/api/v1/compare"
    assert last_get(api)["query"] == {
        "ids": f"{a.id},{b.id}",
        "duration": "5m",
        "step": "30s",
    }


def test_json_yaml_metric_and_series(runs: Any) -> None:
    api, a, b = runs
    res = run(
        "-o", "json", "compare", a.id, b.id, "--metric", "gpu_utilization", "--duration", "5m"
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["align"] == "relative" and data["step_seconds"] == 30
    [gpu] = data["comparisons"]
    offsets = [30.0 * k for k in range(1, 11)]
    assert gpu["series"][0]["points"] == [[t, t / 3] for t in offsets]
    assert gpu["series"][1]["points"] == [[t, t / 3 - 5] for t in offsets]
    assert [s["allocation_id"] for s in gpu["series"]] == [a.id, b.id]
    assert last_get(api)["query"]["metrics"] == "gpu_utilization"

    res = run("compare", a.id, b.id, "--metric", "cpu_utilization,memory_used", "-o", "yaml")
    data = yaml.safe_load(res.output)
    assert [c["metric"] for c in data["comparisons"]] == ["cpu_utilization", "memory_used"]

    res = run("compare", a.id, b.id, "--metric", "gpu_utilization", "--duration", "2m", "--series")
    assert res.exit_code == 0, res.output
    tail = res.output.split("\n\n", 1)[1].splitlines()
    assert tail[0] == "gpu_utilization (percent, mean across nodes and GPUs)"
    assert tail[1].split() == ["OFFSET", a.id, b.id]
    assert [r.split() for r in tail[2:]] == [
        ["00:00:30", "10.0%", "5.0%"],
        ["00:01:00", "20.0%", "15.0%"],
        ["00:01:30", "30.0%", "25.0%"],
        ["00:02:00", "40.0%", "35.0%"],
    ]


def test_refusals(runs: Any) -> None:
    api, a, b = runs
    res = run("compare", a.id)
    assert res.exit_code == 1 and "Error: compare needs at least two allocations" in res.output
    res = run("compare", a.id, "nope")
    assert res.exit_code == 1 and "Error: allocation nope not found" in res.output
    p = api.submit(SPEC, now=time.time())
    res = run("compare", a.id, p.id)
    assert res.exit_code == 1
    assert f"Error: allocation {p.id} has not started (Pending)" in res.output
    assert "Hint: Compare allocations once they have started" in res.output
    res = run("compare", a.id, b.id, "--step", "5s")
    assert res.exit_code == 1 and "finer than the telemetry's 30 s windows" in res.output
    res = run("compare", a.id, b.id, "--metric", "gpu_temperature")
    assert res.exit_code == 1 and "unknown metric: gpu_temperature" in res.output


# --- the renderers --------------------------------------------------------------------------


def test_sparkline() -> None:
    points = [[30.0 * k, float(k)] for k in range(1, 9)]
    assert sparkline(points, 30, 240, 1, 8) == "▁▂▃▄▅▆▇█"
    # a gap stays a gap; offsets past the last point are not drawn
    assert sparkline([[30.0, 1.0], [90.0, 8.0]], 30, 240, 1, 8) == "▁ █"
    # 48 steps in 24 characters: two points each
    wide = [[30.0 * k, float(k)] for k in range(1, 49)]
    assert len(sparkline(wide, 30, 1440, 1, 48)) == 24
    assert sparkline([[30.0, 5.0]], 30, 30, 5, 5) == "▅"  # one value: mid-scale


def test_cells_caption_and_empty_series() -> None:
    row = {"delta": -5.0, "ratio": 0.9}
    assert delta_cell(row, "percent", False) == "-5.0% (×0.90)"
    assert delta_cell({"delta": 2e9, "ratio": None}, "bytes", False) == "+2.0 GB"
    assert delta_cell({"delta": None}, "bytes", False) == "—"
    assert delta_cell(row, "percent", True) == "baseline"
    answer = {
        "duration_seconds": 3600.0,
        "step_seconds": 60.0,
        "allocations": [{"allocation_id": "a"}, {"allocation_id": "b"}],
        "comparisons": [
            {
                "metric": "gpu_utilization",
                "unit": "percent",
                "combine": "avg",
                "series": [
                    {"allocation_id": "a", "points": [], "mean": None},
                    {"allocation_id": "b", "points": [[60.0, 1.0]], "mean": 1.0, "max": 1.0},
                ],
            }
        ],
    }
    assert caption(answer) == (
        "2 allocations aligned at their starts (t=0) · offsets 00:00:00 to 01:00:00 every 60 s"
    )
    rows = compare_table(answer).splitlines()
    assert rows[1].split() == ["gpu_utilization", "a", "—", "—", "—", "baseline", "no", "data"]
    assert rows[2].split()[:5] == ["b", "1.0%", "1.0%", "—", "—"]
    [series] = series_tables(answer)
    assert series.splitlines()[1:] == ["OFFSET    a  b", "00:01:00  —  1.0%"]
