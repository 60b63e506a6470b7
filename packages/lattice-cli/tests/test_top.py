"""``lattice top`` against the real REST API (over a LocalQuorum, in a thread) reading a
real VictoriaMetrics into which the tests push what node agents push; its renderers; the
installed console script. The API side (scoping, modes, errors) is tested in
lattice-api's ``tests/test_metrics_api.py``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lattice_api.settings import ApiSettings
from lattice_cli import main as cli_main
from lattice_cli.output import (
    metric_cell,
    metric_value,
    metrics_caption,
    metrics_gpu_table,
    metrics_node_table,
    metrics_summary_table,
    no_metrics_text,
)
from lattice_common.types import Allocation, AllocationSpec
from lattice_test_harness import victoria
from lattice_test_harness.local_api import LocalApi, ThreadedLocalApi
from typer.testing import CliRunner

cli_main.load_commands(["top"])  # main() does this for `lattice top`; tests call `app`

pytestmark = pytest.mark.timeout(120)


def run(*args: str) -> Any:
    return CliRunner().invoke(cli_main.app, list(args), catch_exceptions=False)


# --- what agents push (the data contract) ------------------------------------------------

AGGS = {"mean": 1.0, "p50": 0.9, "p95": 1.1, "p99": 1.2, "max": 1.5, "count": None}


def agent_lines(a: Allocation, node: str, values: dict[str, Any], at: float) -> list[str]:
    """One prod-mode window of one node: mean/p50/p95/p99/max/count per metric (GPU
    metrics: one series per GPU index, label ``gpu``)."""
    lines = []
    for name, value in values.items():
        for index, v in enumerate(value if isinstance(value, list) else [value]):
            gpu = f',gpu="{index}"' if isinstance(value, list) else ""
            for agg, factor in AGGS.items():
                labels = (
                    f'alloc_id="{a.id}",node_id="{node}",tenant="{a.spec.tenant}",'
                    f'user="{a.spec.user}",vcluster="{a.spec.vcluster}",agg="{agg}"{gpu}'
                )
                shown = 30 if factor is None else v * factor
                lines.append(f"{name}{{{labels}}} {shown} {int(at * 1000)}")
    return lines


NID001 = {
    "cpu_utilization": 180.0,
    "memory_used": 256e9,
    "network_rx_bytes": 10e9,
    "network_tx_bytes": 8e9,
    "io_read_bytes": 2.5e9,
    "io_write_bytes": 0.5e9,
    "io_latency_p99": 45.0,
    "gpu_utilization": [90.0, 80.0, 85.0, 95.0],
    "gpu_memory_used": [70e9, 71e9, 72e9, 71.8e9],
    "gpu_power_draw": [600.0, 610.0, 620.0, 630.0],
}
NID002 = {
    "cpu_utilization": 20.0,
    "memory_used": 128e9,
    "network_rx_bytes": 2.4e9,
    "network_tx_bytes": 0.7e9,
    "io_read_bytes": 0.5e9,
    "io_write_bytes": 0.5e9,
    "io_latency_p99": 1500.0,
    "gpu_utilization": [80.0, 82.0, 84.0, 86.0],
    "gpu_memory_used": [70e9, 70e9, 70e9, 70e9],
    "gpu_power_draw": [500.0, 500.0, 500.0, 500.0],
}


@pytest.fixture(scope="module")
def vm() -> Iterator[victoria.VictoriaMetrics]:
    if not victoria.available():
        pytest.skip("victoria-metrics is not installed (apt-get install victoria-metrics)")
    with victoria.VictoriaMetrics() as server:
        yield server


class TopApi:
    """The served API's handles, with the little seeding these tests need: tenant physics,
    vCluster gpu-batch, alice's allocations."""

    def __init__(self, api: LocalApi) -> None:
        self.api = api
        self.rest_url = api.rest_url
        api.add_tenant("physics")
        api.add_vcluster("gpu-batch")

    def pending(self, nodes: int = 1) -> Allocation:
        spec = AllocationSpec(
            entrypoint="/bin/bash train.sh",
            tenant="physics",
            vcluster="gpu-batch",
            user="alice",
            nodes=nodes,
            walltime_seconds=86400,
        )
        return self.api.submit(spec, now=time.time() - 100)

    def running(self, nodes: list[str]) -> Allocation:
        for n in nodes:
            self.api.add_node(n)
        a = self.pending(len(nodes))
        return self.api.start(a.id, nodes, now=time.time() - 60)

    def last(self) -> dict[str, Any]:
        """The last GET the server received."""
        return [r for r in self.api.requests if r["method"] == "GET"][-1]


def _serve(monkeypatch: pytest.MonkeyPatch, **settings: Any) -> Iterator[TopApi]:
    with ThreadedLocalApi(settings=ApiSettings(**settings)) as server:
        monkeypatch.setenv("LATTICE_ENDPOINT", server.rest_url)
        yield TopApi(server)


@pytest.fixture
def top_api(clean_env: Path, monkeypatch: pytest.MonkeyPatch, vm: Any) -> Iterator[TopApi]:
    """The real API (development mode: the caller, alice, is a system admin) reading ``vm``."""
    yield from _serve(monkeypatch, tsdb_endpoint=vm.url)


def running_with_metrics(api: TopApi, vm: victoria.VictoriaMetrics) -> tuple[Allocation, float]:
    """alice's allocation on nid001+nid002 (4 GPUs each) with a window pushed 4 s ago."""
    a = api.running(["nid001", "nid002"])
    at = time.time() - 4
    vm.push("\n".join(agent_lines(a, "nid001", NID001, at) + agent_lines(a, "nid002", NID002, at)))
    vm.flush()
    return a, at


# --- the command against the served API ----------------------------------------------------


def test_summary_shows_the_numbers(top_api: TopApi, vm: Any) -> None:
    a, _ = running_with_metrics(top_api, vm)
    res = run("top", a.id)
    assert res.exit_code == 0, res.output
    caption, *table = res.output.splitlines()
    assert caption.startswith(f"{a.id} (Running) · 2 nodes reporting · 30 s resolution (prod mode)")
    assert table == [
        "METRIC            VALUE  UNIT",
        "gpu_utilization    85.2  %",
        "gpu_memory_used   564.8  GB",
        "cpu_utilization   100.0  %",
        "memory_used       384.0  GB",
        "network_rx_bytes   12.4  GB/s",
        "network_tx_bytes    8.7  GB/s",
    ]
    sent = top_api.last()
    assert sent["path"] == f"/api/v1/allocations/{a.id}/metrics"
    assert sent["query"] == {}


def test_wide_per_node_and_per_gpu(top_api: TopApi, vm: Any) -> None:
    a, _ = running_with_metrics(top_api, vm)
    res = run("top", a.id, "--wide")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()[1:]
    assert len(lines) == 11
    assert "gpu_power_draw    4460.0  W" in lines
    assert "io_read_bytes        3.0  GB/s" in lines
    assert "io_latency_p99       1.5  ms" in lines

    res = run("top", a.id, "--per-node")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[1:] == [
        "NODE    GPU_UTIL  GPU_MEM   CPU     MEMORY    NET_RX     NET_TX",
        "nid001  87.5%     284.8 GB  180.0%  256.0 GB  10.0 GB/s  8.0 GB/s",
        "nid002  83.0%     280.0 GB  20.0%   128.0 GB  2.4 GB/s   700.0 MB/s",
    ]
    assert top_api.last()["query"] == {"mode": "per-node"}

    res = run("top", a.id, "--per-node", "-o", "wide")
    assert res.exit_code == 0, res.output
    header, first, second = res.output.splitlines()[1:]
    assert header.split()[-3:] == ["IO_READ", "IO_WRITE", "IO_P99"] and "GPU_POWER" in header
    assert first.split()[-2:] == ["45.0", "µs"] and second.split()[-2:] == ["1.5", "ms"]

    res = run("top", a.id, "--per-gpu")
    assert res.exit_code == 0, res.output
    rows = res.output.splitlines()[1:]
    assert rows[0].split() == ["NODE", "GPU", "UTIL", "MEMORY", "POWER"]
    assert rows[1].split() == ["nid001", "0", "90.0%", "70.0", "GB", "600.0", "W"]
    assert rows[4].split() == ["nid001", "3", "95.0%", "71.8", "GB", "630.0", "W"]
    assert rows[8].split() == ["nid002", "3", "86.0%", "70.0", "GB", "500.0", "W"]
    assert len(rows) == 9


def test_json_yaml_duration_metric_and_node(top_api: TopApi, vm: Any) -> None:
    a, at = running_with_metrics(top_api, vm)
    res = run("-o", "json", "top", a.id, "--duration", "1h", "--metric", "cpu_utilization")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["allocation_id"] == a.id and data["duration_seconds"] == 3600
    assert data["samples"] == [
        {
            "name": "cpu_utilization",
            "node_id": "",
            "value": 100.0,
            "unit": "percent",
            "timestamp": pytest.approx(at, abs=0.002),
            "labels": {},
        }
    ]
    assert top_api.last()["query"] == {"duration": "1h", "metrics": "cpu_utilization"}

    res = run("top", a.id, "--per-node", "--node", "nid002", "-o", "yaml")
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(res.output)
    assert data["node_ids"] == ["nid002"] and {s["node_id"] for s in data["samples"]} == {"nid002"}

    res = run("top", a.id, "--metric", "io_latency_p99,gpu_power_draw")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[1:] == [
        "METRIC           VALUE  UNIT",
        "gpu_power_draw  4460.0  W",
        "io_latency_p99     1.5  ms",
    ]


def test_no_data_yet(top_api: TopApi, vm: Any) -> None:
    a = top_api.running(["nid003"])
    res = run("top", a.id)
    assert res.exit_code == 0
    assert res.output == f"no metrics for {a.id} yet: agents push every 30 s (prod mode)\n"
    p = top_api.pending()
    res = run("top", p.id, "--per-gpu")
    assert res.output.startswith(f"no metrics for {p.id} yet: it is Pending")
    assert json.loads(run("-o", "json", "top", a.id).output)["samples"] == []


def test_refusals(top_api: TopApi, vm: Any) -> None:
    a, _ = running_with_metrics(top_api, vm)
    res = run("top", "nope")
    assert res.exit_code == 1 and "Error: allocation nope not found" in res.output
    res = run("top", a.id, "--per-node", "--per-gpu")
    assert res.exit_code == 2 and "exclude each other" in res.output
    res = run("top", a.id, "--metric", "gpu_temperature")
    assert res.exit_code == 1
    assert "Error: unknown metric: gpu_temperature" in res.output
    assert "Available: gpu_utilization, gpu_memory_used" in res.output
    res = run("top", a.id, "--duration", "soon")
    assert res.exit_code == 1 and "invalid duration 'soon'" in res.output


def test_no_tsdb_configured(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for api in _serve(monkeypatch):
        a = api.running(["nid001"])
        res = run("top", a.id)
        assert res.exit_code == 1
        assert res.output.splitlines()[0] == (
            "Error: metrics are not available: no TSDB configured"
        )
        assert "Hint: The cluster's telemetry.tsdb_endpoint is empty" in res.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tsdb_down(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for api in _serve(monkeypatch, tsdb_endpoint=f"http://127.0.0.1:{_closed_port()}"):
        a = api.running(["nid001"])
        res = run("top", a.id)
        assert res.exit_code == 1
        assert res.output.startswith(
            "Error: metrics are not available: the TSDB cannot be reached (connection refused)"
        )
        assert "Hint: The TSDB (VictoriaMetrics, telemetry.tsdb_endpoint) is down" in res.output


def test_console_script(top_api: TopApi, vm: Any, clean_env: Path) -> None:
    """The installed `lattice top` in a process of its own."""
    a, _ = running_with_metrics(top_api, vm)
    exe = shutil.which("lattice", path=os.path.dirname(sys.executable))
    argv = [exe] if exe else [sys.executable, "-m", "lattice_cli.main"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env["LATTICE_ENDPOINT"] = top_api.rest_url
    proc = subprocess.run(
        [*argv, "top", a.id, "--per-node"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2].startswith("nid001  87.5%")


# --- the renderers ----------------------------------------------------------------------


def test_values_are_humanised() -> None:
    assert metric_value(87.34, "percent") == ("87.3", "%")
    assert metric_value(71.2e9, "bytes") == ("71.2", "GB")
    assert metric_value(512, "bytes") == ("512", "B")
    assert metric_value(3.2e15, "bytes") == ("3.2", "PB")
    assert metric_value(12.4e6, "bytes_per_second") == ("12.4", "MB/s")
    assert metric_value(0, "bytes_per_second") == ("0", "B/s")
    assert metric_value(350, "watts") == ("350.0", "W")
    assert metric_value(179_200, "watts") == ("179.2", "kW")
    assert metric_value(45, "microseconds") == ("45.0", "µs")
    assert metric_value(2500, "microseconds") == ("2.5", "ms")
    assert metric_value(3_000_000, "microseconds") == ("3.00", "s")
    assert metric_value(7, "widgets") == ("7", "widgets")
    assert metric_value(None, "percent") == ("—", "")
    assert metric_value(float("nan"), "bytes") == ("—", "")
    assert metric_cell(87.3, "percent") == "87.3%"
    assert metric_cell(2e9, "bytes") == "2.0 GB"
    assert metric_cell(None, "bytes") == "—"


SNAP = {
    "allocation_id": "a1b2",
    "state": "Running",
    "mode": "summary",
    "duration_seconds": 300.0,
    "timestamp": 1000.0,
    "resolution_seconds": 1.0,
    "telemetry_mode": "debug",
    "node_ids": ["x1"],
    "samples": [],
    "alerts": [],
}


def test_caption_and_messages() -> None:
    assert metrics_caption(SNAP, 1012) == (
        "a1b2 (Running) · 1 node reporting · 1 s resolution (debug mode) · updated 12 s ago"
    )
    assert metrics_caption({**SNAP, "node_ids": ["a", "b"]}, 1000 + 600).endswith(
        "2 nodes reporting · 1 s resolution (debug mode) · updated 10 min ago"
    )
    prod = {**SNAP, "resolution_seconds": 30.0, "telemetry_mode": "prod", "timestamp": None}
    assert no_metrics_text(prod, "a1b2") == (
        "no metrics for a1b2 yet: agents push every 30 s (prod mode)"
    )
    assert "it is Completed" in no_metrics_text({**prod, "state": "Completed"}, "a1b2")
    assert "try a longer --duration" in no_metrics_text({**prod, "duration_seconds": 10}, "a1b2")


def test_tables_from_records() -> None:
    samples = [
        {"name": "cpu_utilization", "node_id": "b", "value": 5.0, "unit": "percent", "labels": {}},
        {"name": "memory_used", "node_id": "a", "value": 1e9, "unit": "bytes", "labels": {}},
    ]
    assert metrics_node_table({**SNAP, "samples": samples}) == (
        "NODE  CPU   MEMORY\na     —     1.0 GB\nb     5.0%  —"
    )
    gpus = [
        {
            "name": "gpu_utilization",
            "node_id": "a",
            "value": v,
            "unit": "percent",
            "labels": {"gpu": g},
        }
        for g, v in (("10", 1.0), ("2", 2.0))
    ]
    assert metrics_gpu_table({**SNAP, "samples": gpus}).splitlines()[1:] == [
        "a     2    2.0%",
        "a     10   1.0%",
    ]
    summary = [{"name": "io_latency_p99", "value": 45.0, "unit": "microseconds"}]
    assert metrics_summary_table({**SNAP, "samples": summary}) == "METRIC  VALUE  UNIT"
    assert metrics_summary_table({**SNAP, "samples": summary}, wide=True).splitlines()[1] == (
        "io_latency_p99   45.0  µs"
    )
