"""The NVML source against a real GPU and driver: a process group keeping the GPU busy is
seen with its utilization, memory and power, per GPU, attributed to its allocation.

Skipped where there is no NVIDIA driver and GPU, or no CUDA-enabled PyTorch to make the
load with. ``LATTICE_NVML_REPORT`` names a file for what was measured (JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from lattice_agent.telemetry import nvml as nv
from lattice_agent.telemetry.samples import AllocLabels, Target

GIB = 1 << 30

LOAD = """
import sys, time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
keep = torch.empty(8 * (1 << 30), dtype=torch.uint8, device="cuda")  # 8 GiB held
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
"""


def _driver() -> object:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as e:
        pytest.skip(f"no NVIDIA driver: {e}")
    if count == 0:
        pytest.skip("NVML sees no GPU")
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
        capture_output=True,
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip("no CUDA-enabled PyTorch to load the GPU with")
    return pynvml


def _target(aid: str, pgid: int) -> Target:
    return Target(AllocLabels(aid, "gpu-node", "t", "u", "vc"), (pgid,))


def _report(**figures: object) -> None:
    path = os.environ.get("LATTICE_NVML_REPORT")
    print(json.dumps(figures))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


def test_a_busy_gpu_is_seen_and_attributed_to_its_allocation() -> None:
    _driver()
    src = nv.nvml_source()
    assert src is not None and src.gpu_count >= 1
    load = subprocess.Popen(
        [sys.executable, "-c", LOAD, "60"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as the agent starts jobs
    )
    idle = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        assert load.stdout is not None and load.stdout.readline().strip() == "ready"
        busy, quiet = _target("busy", load.pid), _target("quiet", idle.pid)
        best: dict[str, float] = {}
        costs = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            got = src.collect([busy])
            costs.append(time.perf_counter() - t0)
            best = got.get("busy", {})
            if best.get("gpu_utilization{gpu=0}", 0) > 50 and len(costs) > 3:
                break
            time.sleep(0.5)
        assert best.get("gpu_utilization{gpu=0}", 0) > 50, best
        assert best["gpu_memory_used{gpu=0}"] >= 8 * GIB
        assert best["gpu_memory_total{gpu=0}"] > best["gpu_memory_used{gpu=0}"]
        assert best["gpu_power_draw{gpu=0}"] > 50  # watts under a bf16 matmul loop
        assert "gpu_pcie_rx_bytes{gpu=0}" in best  # a counter's rate, or the driver's rate
        # the same GPU claimed by a second allocation on the node: its processes decide
        contested = src.collect([busy, quiet])
        procs = nv.read_gpus(src.nvml, src.handles)[0].processes
        if procs:  # the driver names the compute processes (not in every sandbox)
            assert "gpu_utilization{gpu=0}" in contested.get("busy", {})
            assert "quiet" not in contested or not any(
                k.endswith("{gpu=0}") for k in contested["quiet"]
            )
        else:
            assert "busy" not in contested and "quiet" not in contested  # nobody's: not split
        _report(
            gpu=src.nvml.nvmlDeviceGetName(src.handles[0][1]),
            values={k: round(v, 1) for k, v in sorted(best.items())},
            compute_processes=len(procs),
            contested_owner=sorted(contested),
            unsupported={str(k): sorted(v) for k, v in src._unsupported.items()},
            collect_ms_median=round(sorted(costs)[len(costs) // 2] * 1000, 2),
        )
    finally:
        load.kill()
        idle.kill()
        load.wait()
        idle.wait()
        src.close()
