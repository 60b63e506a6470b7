"""What this machine offers: CPU cores, memory, hostname and GPUs.

GPUs come from NVML (nvidia-ml-py) when libnvidia-ml loads, else from ``rocm-smi``
when present; a machine with neither reports none. Operators may override any value
with agent flags (useful for test nodes and partial hardware).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess

from lattice_common.types import NodeCapabilities

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


def short_gpu_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA GH200 480GB' -> 'GH200'."""
    for word in name.replace("NVIDIA", "").replace("AMD", "").split():
        if any(ch.isdigit() for ch in word) and any(ch.isalpha() for ch in word):
            return word.upper()
    return name.strip()


def discover(
    *,
    cpu_cores: int | None = None,
    memory: int | None = None,
    gpu_type: str | None = None,
    gpu_count: int | None = None,
    features: list[str] | None = None,
) -> NodeCapabilities:
    gtype, gcount = ("", 0)
    if gpu_count is None or gpu_type is None:
        gtype, gcount = nvidia_gpus()
        if not gcount:
            gtype, gcount = amd_gpus()
    return NodeCapabilities(
        cpu_cores=cpu_cores if cpu_cores is not None else (os.cpu_count() or 1),
        memory_gb=memory if memory is not None else memory_gb(),
        gpu_type=gpu_type if gpu_type is not None else gtype,
        gpu_count=gpu_count if gpu_count is not None else gcount,
        features=sorted(set(features or [])),
    )


def hostname() -> str:
    return socket.gethostname()
