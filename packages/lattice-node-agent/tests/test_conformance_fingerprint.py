"""Conformance fingerprint: stable, order-independent, absent components left out; the
agent recomputes it and reports a change; --conformance-group overrides it."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.agent import Agent
from lattice_agent.conformance import (
    collect_components,
    fingerprint,
    is_fingerprint,
    normalize_cmdline,
    parse_ethtool_firmware,
)
from lattice_agent.main import parse_args
from lattice_common.rpc import Endpoints
from lattice_common.types import NodeCapabilities

COMPONENTS = {
    "gpu_driver": "550.54.15",
    "nic_firmware:hsn0": "1.5.41",
    "bios_version": "1.7.3",
    "kernel_version": "5.14.21-150500.55.39-default",
    "kernel_cmdline": "console=ttyS0 iommu=pt",
}


def test_fingerprint_is_sha256_of_sorted_lines() -> None:
    lines = sorted(f"{k}={v}" for k, v in COMPONENTS.items())
    assert fingerprint(COMPONENTS) == hashlib.sha256("\n".join(lines).encode()).hexdigest()
    assert is_fingerprint(fingerprint(COMPONENTS))
    assert not is_fingerprint("cg-a")


@given(st.permutations(list(COMPONENTS.items())))
def test_order_does_not_matter(items: list[tuple[str, str]]) -> None:
    assert fingerprint(dict(items)) == fingerprint(COMPONENTS)


@given(st.dictionaries(st.text(min_size=1), st.text(min_size=1), max_size=8))
def test_same_components_same_hash(components: dict[str, str]) -> None:
    assert fingerprint(components) == fingerprint(dict(components))
    assert fingerprint(dict(reversed(list(components.items())))) == fingerprint(components)


def test_any_component_change_changes_the_hash() -> None:
    base = fingerprint(COMPONENTS)
    for key in COMPONENTS:
        assert fingerprint({**COMPONENTS, key: COMPONENTS[key] + "x"}) != base
    assert fingerprint({**COMPONENTS, "uenv_base_image": "sha256:ab"}) != base
    # an empty value is the same as an absent component
    assert fingerprint({**COMPONENTS, "uenv_base_image": ""}) == base


def test_cmdline_drops_per_node_parameters() -> None:
    a = "BOOT_IMAGE=/vmlinuz root=live:img ip=10.1.0.7:::255.255.0.0 xname=x1000c0s0b0n0 iommu=pt"
    b = "BOOT_IMAGE=/vmlinuz root=live:img ip=10.1.0.8:::255.255.0.0 xname=x1000c0s0b0n1 iommu=pt"
    assert (
        normalize_cmdline(a) == normalize_cmdline(b) == "BOOT_IMAGE=/vmlinuz root=live:img iommu=pt"
    )


def test_ethtool_firmware() -> None:
    out = "driver: cxi_eth\nversion: 1.0\nfirmware-version: 1.5.41\nbus-info: 0000:41:00.0\n"
    assert parse_ethtool_firmware(out) == "1.5.41"
    assert parse_ethtool_firmware("driver: virtio_net\nfirmware-version: \n") == ""
    assert parse_ethtool_firmware("firmware-version: N/A\n") == ""


def _sys_tree(root: Path, *, bios: str | None = "2.3.1", ib_fw: str | None = "28.39.1002") -> Path:
    sys = root / "sys"
    if bios is not None:
        (sys / "class" / "dmi" / "id").mkdir(parents=True)
        (sys / "class" / "dmi" / "id" / "bios_version").write_text(bios + "\n")
    if ib_fw is not None:
        (sys / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
        (sys / "class" / "infiniband" / "mlx5_0" / "fw_ver").write_text(ib_fw + "\n")
    (sys / "class" / "net" / "hsn0" / "device").mkdir(parents=True)
    (sys / "class" / "net" / "lo").mkdir(parents=True)  # virtual: no device link
    (sys / "module" / "nvidia").mkdir(parents=True)
    (sys / "module" / "nvidia" / "version").write_text("550.54.15\n")
    proc = root / "proc"
    proc.mkdir()
    (proc / "cmdline").write_text("console=ttyS0 ip=10.0.0.1 iommu=pt\n")
    return root


def _ethtool(argv: Sequence[str]) -> str | None:
    if list(argv) == ["ethtool", "-i", "hsn0"]:
        return "driver: cxi_eth\nfirmware-version: 1.5.41\n"
    assert argv[-1] != "lo", "virtual interfaces are not asked"
    return None


def test_collect_components_from_a_fixture_tree(tmp_path: Path) -> None:
    root = _sys_tree(tmp_path)
    comps = collect_components(
        uenv_base_image_hash="sha256:feed",
        run=_ethtool,
        sys_root=root / "sys",
        proc_root=root / "proc",
        kernel_version="6.1.0",
    )
    assert comps == {
        "gpu_driver": "550.54.15",
        "nic_firmware:mlx5_0": "28.39.1002",
        "nic_firmware:hsn0": "1.5.41",
        "bios_version": "2.3.1",
        "kernel_version": "6.1.0",
        "kernel_cmdline": "console=ttyS0 iommu=pt",
        "uenv_base_image": "sha256:feed",
    }


def test_unavailable_components_are_absent(tmp_path: Path) -> None:
    root = _sys_tree(tmp_path, bios=None, ib_fw=None)
    comps = collect_components(
        run=lambda argv: None, sys_root=root / "sys", proc_root=root / "proc", kernel_version=""
    )
    assert set(comps) == {"gpu_driver", "kernel_cmdline"}


def test_two_nodes_with_equal_stacks_share_a_fingerprint(tmp_path: Path) -> None:
    def fp(root: Path, bios: str) -> str:
        _sys_tree(root, bios=bios)
        return fingerprint(
            collect_components(
                run=_ethtool, sys_root=root / "sys", proc_root=root / "proc", kernel_version="6.1"
            )
        )

    a = fp(tmp_path / "a", "2.3.1")
    b = fp(tmp_path / "b", "2.3.1")
    c = fp(tmp_path / "c", "2.4.0")  # a BIOS update the others missed
    assert a == b != c


def test_conformance_group_flag_stays_an_override() -> None:
    args = parse_args(["--conformance-group", "cg-a", "--conformance-interval", "60"])
    assert args.conformance_group == "cg-a" and args.conformance_interval == 60.0
    assert parse_args([]).conformance_group == ""


def _agent(tmp_path: Path, source) -> Agent:
    return Agent(
        node_id="n1",
        endpoints=Endpoints("127.0.0.1:1"),
        capabilities=NodeCapabilities(),
        hostname="n1",
        conformance_group="fp-1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "state.json",
        fingerprint_source=source,
        conformance_interval=0.01,
    )


async def test_agent_reports_a_changed_fingerprint(tmp_path: Path) -> None:
    values = iter(["fp-1", "fp-2"])
    agent = _agent(tmp_path, lambda: next(values))
    assert not await agent.refresh_conformance()  # unchanged
    assert not agent._beat_now.is_set()
    assert await agent.refresh_conformance()
    assert agent.conformance_group == "fp-2"
    assert agent._beat_now.is_set()  # reported with the next heartbeat, at once


async def test_agent_keeps_its_fingerprint_when_recomputing_fails(tmp_path: Path) -> None:
    def broken() -> str:
        raise OSError("nvidia-smi hung")

    agent = _agent(tmp_path, broken)
    assert not await agent.refresh_conformance()
    assert agent.conformance_group == "fp-1"


async def test_agent_recomputes_periodically(tmp_path: Path) -> None:
    calls: list[int] = []

    def source() -> str:
        calls.append(1)
        return f"fp-{len(calls) + 1}"

    agent = _agent(tmp_path, source)
    task = asyncio.create_task(agent._conformance_loop())
    try:
        for _ in range(200):
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert len(calls) >= 2 and agent.conformance_group == f"fp-{len(calls) + 1}"


async def test_override_has_no_recomputation(tmp_path: Path) -> None:
    agent = _agent(tmp_path, None)
    assert not await agent.refresh_conformance()
    assert agent.conformance_group == "fp-1"
