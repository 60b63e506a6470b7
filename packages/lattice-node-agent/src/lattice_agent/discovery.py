"""What this machine offers: CPU cores, memory, hostname, GPUs and the intra-node
topology (GPU links, memory domains).

GPUs and their links come from ``nvidia-smi`` / ``rocm-smi`` (see ``gpu_topology``),
with NVML (nvidia-ml-py) as a fallback for the GPU model and count; NUMA domains from
``/sys/devices/system/node`` (see ``memory_topology``). A machine without GPUs
reports none and an empty GPU topology. Operators may override any value with agent
flags (useful for test nodes and partial hardware); overriding the GPU type or count
also drops the discovered GPU topology, which would contradict it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from pathlib import Path

from lattice_common.types import NodeCapabilities

from lattice_agent.gpu_topology import GpuTopology, Runner, discover_gpu_topology, run_tool
from lattice_agent.gpu_topology import short_gpu_name as short_gpu_name
from lattice_agent.memory_topology import SYS_NODE_ROOT, MemoryTopology, discover_memory_topology

log = logging.getLogger("lattice.agent.discovery")


def memory_gb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // (1024 * 1024)
    except OSError:
        pass
    return 0


def nvidia_gpus() -> tuple[str, int]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver / library: not an NVIDIA node
        return "", 0
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return "", 0
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else str(name)
        return short_gpu_name(name), count
    finally:
        pynvml.nvmlShutdown()


def amd_gpus() -> tuple[str, int]:
    if not shutil.which("rocm-smi"):
        return "", 0
    try:
        out = subprocess.run(
            ["rocm-smi", "--showproductname"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "", 0
    names = [ln.split(":")[-1].strip() for ln in out.splitlines() if "Card series" in ln]
    return (short_gpu_name(names[0]), len(names)) if names else ("", 0)


def discover(
    *,
    cpu_cores: int | None = None,
    memory: int | None = None,
    gpu_type: str | None = None,
    gpu_count: int | None = None,
    features: list[str] | None = None,
    topology: bool = True,
    run: Runner = run_tool,
    numa_root: Path = SYS_NODE_ROOT,
) -> NodeCapabilities:
    gtype, gcount = ("", 0)
    gtopo = GpuTopology()
    if gpu_count is None or gpu_type is None:
        if topology:
            gtopo = discover_gpu_topology(run)
        if gtopo.gpus:
            gtype, gcount = gtopo.gpus[0].model, len(gtopo.gpus)
        else:
            gtype, gcount = nvidia_gpus()
            if not gcount:
                gtype, gcount = amd_gpus()
    mtopo = (
        discover_memory_topology(gtopo.gpus, gtopo.gpu_memory_nodes, numa_root)
        if topology
        else MemoryTopology()
    )
    return NodeCapabilities(
        cpu_cores=cpu_cores if cpu_cores is not None else (os.cpu_count() or 1),
        memory_gb=memory if memory is not None else memory_gb(),
        gpu_type=gpu_type if gpu_type is not None else gtype,
        gpu_count=gpu_count if gpu_count is not None else gcount,
        features=sorted(set(features or [])),
        gpus=gtopo.gpus,
        gpu_links=gtopo.links,
        memory_domains=mtopo.domains,
        memory_interconnects=mtopo.interconnects,
        unified_memory=mtopo.unified_memory,
        cxl_memory_gb=mtopo.cxl_memory_gb,
    )


def hostname() -> str:
    return socket.gethostname()
