"""Conformance fingerprint (spec: Node Conformance & Configuration Drift).

The fingerprint is the SHA-256 of the node's sorted component list, one
``name=value`` line per component:

* ``gpu_driver``: NVIDIA (``nvidia-smi``, else ``/sys/module/nvidia/version``) or
  AMD (``/sys/module/amdgpu/version``) driver version;
* ``nic_firmware:<device>``: firmware of each RDMA device
  (``/sys/class/infiniband/*/fw_ver``) and of each physical network interface that
  reports one (``ethtool -i``: Slingshot / Ultra Ethernet adapters, NICs);
* ``bios_version``: ``/sys/class/dmi/id/bios_version``;
* ``kernel_version`` and ``kernel_cmdline`` (``/proc/cmdline`` without parameters
  that differ per node by design: :data:`PER_NODE_CMDLINE_KEYS`);
* ``uenv_base_image``: the configured uenv base image hash.

A component that cannot be read on this node is simply absent. Nodes with identical
components have identical fingerprints, whatever order they were collected in, and
so form one conformance group.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from lattice_agent.gpu_topology import Runner, run_tool

log = logging.getLogger("lattice.agent.conformance")

DEFAULT_INTERVAL_SECONDS = 6 * 3600.0
"""Spec: "Periodically (default: every 6 hours)"."""

PER_NODE_CMDLINE_KEYS = frozenset(
    {"BOOTIF", "bootif", "ip", "hostname", "xname", "nid", "macaddr", "ifname", "ds"}
)
"""Boot parameters that name the node itself (address, identity) rather than its
configuration; leaving them out keeps identically configured nodes in one group."""

Reader = Callable[[Path], str | None]


def fingerprint(components: Mapping[str, str]) -> str:
    """SHA-256 (hex) of the sorted ``name=value`` lines; empty values are left out."""
    lines = sorted(f"{k}={v.strip()}" for k, v in components.items() if v and v.strip())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def normalize_cmdline(cmdline: str) -> str:
    kept = [p for p in cmdline.split() if p.split("=", 1)[0] not in PER_NODE_CMDLINE_KEYS]
    return " ".join(kept)


def parse_ethtool_firmware(text: str) -> str:
    """``ethtool -i`` output -> the ``firmware-version`` value ("" when none/N/A)."""
    for ln in text.splitlines():
        key, _, value = ln.partition(":")
        if key.strip() == "firmware-version":
            v = value.strip()
            return "" if v.upper() in ("", "N/A") else v
    return ""


def _read_file(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def collect_components(
    *,
    uenv_base_image_hash: str = "",
    gpu_driver: str = "",
    run: Runner = run_tool,
    read: Reader = _read_file,
    sys_root: Path = Path("/sys"),
    proc_root: Path = Path("/proc"),
    kernel_version: str | None = None,
) -> dict[str, str]:
    """What goes into the fingerprint on this node (absent components left out)."""
    comps: dict[str, str] = {}

    driver = gpu_driver or _gpu_driver(run, read, sys_root)
    if driver:
        comps["gpu_driver"] = driver

    ib = sys_root / "class" / "infiniband"
    for dev in _listdir(ib):
        fw = (read(ib / dev / "fw_ver") or "").strip()
        if fw:
            comps[f"nic_firmware:{dev}"] = fw
    net = sys_root / "class" / "net"
    for iface in _listdir(net):
        if not (net / iface / "device").exists():
            continue  # virtual interface (lo, bridges, veth): no firmware
        fw = parse_ethtool_firmware(run(["ethtool", "-i", iface]) or "")
        if fw:
            comps[f"nic_firmware:{iface}"] = fw

    bios = (read(sys_root / "class" / "dmi" / "id" / "bios_version") or "").strip()
    if bios:
        comps["bios_version"] = bios
    kernel = kernel_version if kernel_version is not None else platform.release()
    if kernel:
        comps["kernel_version"] = kernel
    cmdline = normalize_cmdline(read(proc_root / "cmdline") or "")
    if cmdline:
        comps["kernel_cmdline"] = cmdline
    if uenv_base_image_hash:
        comps["uenv_base_image"] = uenv_base_image_hash
    return comps


def _gpu_driver(run: Runner, read: Reader, sys_root: Path) -> str:
    out = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out and out.strip():
        return out.strip().splitlines()[0].strip()
    for module in ("nvidia", "amdgpu"):
        v = (read(sys_root / "module" / module / "version") or "").strip()
        if v:
            return v
    return ""


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError:
        return []


def compute_fingerprint(*, uenv_base_image_hash: str = "", gpu_driver: str = "") -> str:
    """The fingerprint of this node now (the agent's default source)."""
    comps = collect_components(uenv_base_image_hash=uenv_base_image_hash, gpu_driver=gpu_driver)
    log.debug("conformance components: %s", comps)
    return fingerprint(comps)


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def is_fingerprint(text: str) -> bool:
    """A computed fingerprint (64 hex digits), as opposed to a named group override."""
    return bool(_HEX64.match(text))
