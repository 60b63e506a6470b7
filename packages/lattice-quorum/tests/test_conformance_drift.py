"""Conformance drift in GlobalState: the first fingerprint is the baseline, a different
one later is drift (recorded, work undisturbed), a matching one clears it, an
operator's undrain accepts the current one; topology reports are stored as sent."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import (
    AllocationSpec,
    AllocationState,
    GpuDevice,
    GpuLink,
    GpuLinkType,
    MemoryDomain,
    MemoryDomainType,
    Node,
    NodeCapabilities,
    NodeState,
    Tenant,
    VCluster,
)
from lattice_quorum.state import GlobalState, apply

FP_A = "a" * 64
FP_B = "b" * 64


def run(state: GlobalState, cmd: c.Command) -> c.CommandResult:
    res = apply(state, c.decode_command(c.encode_command(cmd)))
    assert res.error is None, res.error
    return res


def register(state: GlobalState, fp: str = FP_A, **kw) -> Node:
    res = run(state, c.RegisterNode(node_id="n1", conformance_group=fp, now=1.0, **kw))
    assert res.node is not None
    return res.node


def report(state: GlobalState, fp: str) -> c.CommandResult:
    return run(state, c.ReportConformance(node_id="n1", fingerprint=fp, now=2.0))


def test_first_registration_sets_the_baseline() -> None:
    s = GlobalState()
    n = register(s)
    assert n.conformance_group == FP_A
    assert n.expected_conformance == FP_A
    assert not n.conformance_drift and n.state_reason == ""


def test_topology_is_stored_with_the_capabilities() -> None:
    s = GlobalState()
    caps = NodeCapabilities(
        gpu_type="H100",
        gpu_count=2,
        gpus=[GpuDevice(index=0, model="H100"), GpuDevice(index=1, model="H100")],
        gpu_links=[GpuLink(gpu_a=0, gpu_b=1, link_type=GpuLinkType.NVLINK, bandwidth_gbps=900)],
        memory_domains=[MemoryDomain(id=0, domain_type=MemoryDomainType.DRAM, cpu_count=64)],
        unified_memory=False,
        cxl_memory_gb=0,
    )
    n = register(s, capabilities=caps)
    assert n.capabilities == caps
    assert s.nodes["n1"].capabilities.gpu_links[0].bandwidth_gbps == 900


def test_drift_is_recorded_and_running_work_continues() -> None:
    s = GlobalState()
    register(s)
    run(s, c.CreateTenant(tenant=Tenant(name="t")))
    run(s, c.CreateVCluster(vcluster=VCluster(name="v")))
    a = run(s, c.SubmitAllocation(spec=AllocationSpec(entrypoint="x", tenant="t", vcluster="v")))
    assert a.allocation is not None
    run(s, c.AssignNodes(allocation_id=a.allocation.id, node_ids=["n1"]))
    rev = s.revision
    res = report(s, FP_B)
    assert res.revision == rev + 1
    n = s.nodes["n1"]
    assert n.conformance_group == FP_B  # a group of its own now: lower f9
    assert n.expected_conformance == FP_A
    assert n.conformance_drift
    assert n.state_reason == f"conformance_drift: expected={FP_A}, actual={FP_B}"
    assert n.state == NodeState.READY and n.owner == a.allocation.id
    assert s.allocations[a.allocation.id].state == AllocationState.RUNNING


def test_matching_report_clears_the_drift() -> None:
    s = GlobalState()
    register(s)
    report(s, FP_B)
    report(s, FP_A)  # remediated
    n = s.nodes["n1"]
    assert not n.conformance_drift and n.state_reason == ""
    assert n.conformance_group == n.expected_conformance == FP_A


def test_unchanged_report_is_a_no_op() -> None:
    s = GlobalState()
    register(s)
    rev = s.revision
    res = report(s, FP_A)
    assert res.revision == rev and s.nodes["n1"].revision == rev
    assert report(s, "").revision == rev  # "" = nothing reported


def test_reregistration_with_another_fingerprint_is_drift_too() -> None:
    s = GlobalState()
    register(s)
    n = register(s, FP_B)  # agent restarted on a node that missed an update
    assert n.conformance_drift and n.expected_conformance == FP_A
    n = register(s, FP_A)  # rebooted into the right image
    assert not n.conformance_drift and n.state_reason == ""


def test_registration_without_a_fingerprint_keeps_the_known_one() -> None:
    s = GlobalState()
    register(s)
    n = register(s, "")
    assert n.conformance_group == FP_A and not n.conformance_drift


def test_drift_does_not_hide_an_operator_reason() -> None:
    s = GlobalState()
    register(s)
    run(s, c.DrainNode(node_id="n1", reason="maintenance"))
    report(s, FP_B)
    n = s.nodes["n1"]
    assert n.conformance_drift and n.state_reason == "maintenance"
    assert n.state == NodeState.DRAINED


def test_undrain_accepts_the_current_fingerprint_as_the_baseline() -> None:
    # rolling upgrade: drain, upgrade the driver, agent re-registers, operator undrains
    s = GlobalState()
    register(s)
    run(s, c.DrainNode(node_id="n1", reason="upgrade"))
    n = register(s, FP_B)
    assert n.conformance_drift and n.state == NodeState.DRAINED
    run(s, c.UndrainNode(node_id="n1"))
    n = s.nodes["n1"]
    assert n.state == NodeState.READY
    assert n.expected_conformance == FP_B and not n.conformance_drift


def test_drift_survives_a_health_round_trip() -> None:
    s = GlobalState()
    register(s)
    report(s, FP_B)
    run(s, c.SetNodeHealth(node_id="n1", state=NodeState.DEGRADED, reason="no heartbeat for 31s"))
    assert s.nodes["n1"].state_reason == "no heartbeat for 31s"
    run(s, c.SetNodeHealth(node_id="n1", state=NodeState.READY))
    n = s.nodes["n1"]
    assert n.conformance_drift and n.state_reason.startswith("conformance_drift:")


def test_unknown_node() -> None:
    s = GlobalState()
    res = apply(s, c.ReportConformance(node_id="nope", fingerprint=FP_A))
    assert res.error is not None and res.error["code"] == "not_found"


def test_old_node_records_load_without_the_new_fields() -> None:
    old = {"id": "n1", "capabilities": {"cpu_cores": 4, "gpu_count": 0}, "conformance_group": "g"}
    n = msgspec.convert(old, Node)
    assert n.expected_conformance == "" and not n.conformance_drift
    assert n.capabilities.gpus == [] and n.capabilities.memory_domains == []


@given(st.lists(st.sampled_from(["", FP_A, FP_B, "c" * 64]), max_size=12))
def test_drift_flag_always_matches_the_fingerprints(reports: list[str]) -> None:
    s1, s2 = GlobalState(), GlobalState()
    for s in (s1, s2):
        register(s)
        for fp in reports:
            report(s, fp)
    n = s1.nodes["n1"]
    assert n.conformance_drift == (n.conformance_group != n.expected_conformance)
    assert n.expected_conformance == FP_A
    assert msgspec.msgpack.encode(s1) == msgspec.msgpack.encode(s2)  # deterministic
