"""The wire contract: proto messages carry the domain records field for field, and the
generated grpclib code (lattice_common.proto.lattice.v1) works over a real channel."""

from __future__ import annotations

import dataclasses
import enum
import socket
import types as pytypes
import typing
from collections.abc import AsyncIterator

import betterproto2
import grpclib
import msgspec
import pytest
from betterproto2 import Casing, OutputFormat
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.server import Server
from lattice_common import types
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.wire import from_message, to_message

# Domain record -> the message that carries it.
WIRE: dict[type[msgspec.Struct], type[betterproto2.Message]] = {
    types.Constraints: v1.AllocationSpecConstraints,
    types.AllocationSpec: v1.AllocationSpec,
    types.Allocation: v1.Allocation,
    types.StartEstimate: v1.StartEstimate,
    types.GpuDevice: v1.GpuDevice,
    types.GpuLink: v1.GpuLink,
    types.MemoryDomain: v1.MemoryDomain,
    types.MemoryInterconnect: v1.MemoryInterconnect,
    types.NodeCapabilities: v1.NodeCapabilities,
    types.Node: v1.Node,
    types.Tenant: v1.Tenant,
    types.LedgerDay: v1.LedgerDay,
    types.CostWeights: v1.CostWeights,
    types.VCluster: v1.VCluster,
    types.AllocationReport: v1.AllocationReport,
    types.Dependency: v1.Dependency,
    types.DagEdge: v1.DagEdge,
    types.LivenessProbeSpec: v1.LivenessProbeSpec,
    types.ExposedPort: v1.ExposedPort,
    types.ServiceEndpoint: v1.ServiceEndpoint,
    types.CheckpointRecord: v1.CheckpointRecord,
    types.CheckpointHint: v1.CheckpointHint,
    types.ScalingSpec: v1.ScalingSpec,
    types.ScalingStatus: v1.ScalingStatus,
}
# Records of types.py that deliberately never travel on their own (add with a reason).
NOT_ON_THE_WIRE: set[type[msgspec.Struct]] = {
    # the stored form (member ids by ref); the wire's Dag carries each member's state,
    # put together from the member allocations by the API
    types.Dag,
    # likewise: the wire's Session adds its allocation's state and nodes
    types.Session,
}

_INT_TYPES = {
    betterproto2.TYPE_INT32,
    betterproto2.TYPE_INT64,
    betterproto2.TYPE_UINT32,
    betterproto2.TYPE_UINT64,
    betterproto2.TYPE_SINT32,
    betterproto2.TYPE_SINT64,
}
_FLOAT_TYPES = {betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FLOAT}


def _constraints() -> types.Constraints:
    return types.Constraints(
        gpu_type="GH200",
        gpu_count=4,
        features=["nvme_scratch", "gpu"],
        memory_gb=512,
        topology="tight",
    )


def _spec() -> types.AllocationSpec:
    return types.AllocationSpec(
        entrypoint="torchrun --nproc_per_node=4 train.py",
        tenant="ml-team",
        vcluster="ml-training",
        nodes=64,
        walltime_seconds=72 * 3600,
        lifecycle=types.LifecycleType.UNBOUNDED,
        preemption_class=2,
        name="training-run",
        project="gpt-training",
        user="alice",
        constraints=_constraints(),
        env={"NCCL_DEBUG": "INFO"},
        submit_dir="/home/alice/run",
        uenv="prgenv-gnu/24.11:v1",
        requeue_policy=types.RequeuePolicy.ALWAYS,
        max_requeue=7,
        tags={"experiment": "run-42"},
        request_id="req-1",
        min_nodes=2,
        wait_for_capacity=True,
        depends_on=[types.Dependency(ref="a1b2c3d4", condition="success")],
        liveness_probe=_probe(),
        expose=[types.ExposedPort(name="api", port=8080, protocol="http")],
        view="default",
        image="registry.example/ml/pytorch:2.4",
        checkpoint="manual",
        checkpoint_protocol="grpc",
        scaling=_scaling(),
    )


def _scaling() -> types.ScalingSpec:
    return types.ScalingSpec(
        metric='queue_depth{job="inference"}',
        target=100.0,
        evaluation_interval=30.0,
        scale_up_window=90.0,
        scale_down_window=600.0,
        scale_down_threshold=0.25,
        cooldown=0.0,  # an explicit zero survives the wire (optional)
    )


def _scaling_status() -> types.ScalingStatus:
    return types.ScalingStatus(
        target=3,
        last_decision="up",
        reason="cpu_utilization 0.91 >= 0.80 for 120 s",
        at=1_700_000_456.5,
        blocked="tenant ml-team holds 3 of max_nodes 3",
        releasing=["x1000c0s0b0n2"],
        release_at=1_700_000_460.0,
        release_by=1_700_001_060.0,
    )


def _checkpoint() -> types.CheckpointRecord:
    return types.CheckpointRecord(
        id="ckpt-2",
        path="/ck/ml-team/gpt-training/a1b2c3d4/checkpoints/ckpt-2/",
        size_bytes=2**35 + 3,
        duration_seconds=12.5,
        at=1_700_000_123.25,
    )


def _hint() -> types.CheckpointHint:
    return types.CheckpointHint(
        id="hint-3",
        epoch=3,
        at=1_700_000_200.5,
        run=2,
        reason="recompute_saved",
        done_at=1_700_000_210.25,
        outcome="ok",
    )


def _probe() -> types.LivenessProbeSpec:
    return types.LivenessProbeSpec(
        probe_type="http",
        port=8080,
        path="/healthz",
        period_secs=7,
        initial_delay_secs=0,  # an explicit 0 survives (optional on the wire)
        failure_threshold=2,
        timeout_secs=1,
    )


def _allocation() -> types.Allocation:
    return types.Allocation(
        id="a-12345",
        spec=_spec(),
        state=types.AllocationState.RUNNING,
        assigned_nodes=["x1000c0s0b0n0", "x1000c0s0b0n1"],
        submitted_at=1_700_000_000.25,
        started_at=1_700_000_010.5,
        finished_at=1_700_000_020.75,
        exit_code=3,
        reason="node_failure",
        requeue_count=1,
        preempted_count=2,
        preempted_by="b2c3d4e5",
        resume_from_checkpoint=True,
        task_group_id="c0ffee01",
        task_index=7,
        task_group_concurrency=20,
        pending_reason="waiting for quota headroom",
        estimated_start=1_700_000_900.25,
        estimate_basis=types.ESTIMATE_SIMULATION,
        dag_id="d0000001",
        dag_ref="train",
        held=True,
        checkpoint_hint_at=1700000060.5,
        staged_nodes=["x1000c0s0b0n0"],
        excluded_nodes=["x1000c0s0b0n9"],
        prologue_failures=1,
        uenv_sha256="ab" * 32,
        image_digest="sha256:" + "cd" * 32,
        peak_memory_bytes=2**33 + 5,
        revision=2**40 + 7,  # beyond 32 bits on purpose
        last_checkpoint=_checkpoint(),
        scaling_status=_scaling_status(),
        checkpoint_hint=_hint(),
        checkpoint_hints=3,
        checkpoint_minutes=0.0,  # an explicit 0 survives (optional on the wire)
    )


def _gpu() -> types.GpuDevice:
    return types.GpuDevice(
        index=3,
        vendor="Nvidia",
        model="GH200",
        memory_bytes=96 * 2**30,
        compute_capability="9.0",
        numa_node=0,  # an explicit 0 survives (optional)
        nic_affinity="hsn3",
    )


def _gpu_link() -> types.GpuLink:
    return types.GpuLink(
        gpu_a=1, gpu_b=2, link_type=types.GpuLinkType.NVSWITCH, bandwidth_gbps=900.0
    )


def _memory_domain() -> types.MemoryDomain:
    return types.MemoryDomain(
        id=1,
        domain_type=types.MemoryDomainType.UNIFIED,
        capacity_bytes=576 * 2**30,
        numa_node=1,
        cpulist="72-143",
        cpu_count=72,
        attached_gpus=[1],
    )


def _memory_interconnect() -> types.MemoryInterconnect:
    return types.MemoryInterconnect(
        domain_a=2,
        domain_b=1,
        link_type=types.MemoryLinkType.COHERENT_FABRIC,
        distance=40,
        bandwidth_gbps=900.0,
    )


def _capabilities() -> types.NodeCapabilities:
    return types.NodeCapabilities(
        cpu_cores=288,
        memory_gb=896,
        gpu_type="GH200",
        gpu_count=4,
        features=["nvme_scratch"],
        gpus=[_gpu()],
        gpu_links=[_gpu_link()],
        memory_domains=[_memory_domain()],
        memory_interconnects=[_memory_interconnect()],
        unified_memory=True,
        cxl_memory_gb=2048,
    )


def _node() -> types.Node:
    return types.Node(
        id="x1000c0s0b0n0",
        hostname="nid000001",
        state=types.NodeState.DRAINING,
        capabilities=_capabilities(),
        group=3,
        conformance_group="cg-7f3a",
        agent_address="10.0.0.1:50053",
        owner="a-12345",
        owner_tenant="ml-team",
        owner_vcluster="ml-training",
        home_vcluster="hpc-batch",
        disabled=True,
        drain_requested=True,
        claimed_by="alice",
        agent_identity="quorum-ca (serial 1A2B3C4D5E6F7081, expires 2026-11-28T22:08:05Z)",
        telemetry="ebpf, proc",
        next_allocation="a-67890",
        claimed_at=1700000100.0,
        expected_conformance="cg-0001",
        conformance_drift=True,
        state_reason="maintenance",
        registered_at=1_699_000_000.0,
        revision=99,
    )


def _tenant() -> types.Tenant:
    return types.Tenant(
        name="ml-team",
        max_nodes=128,
        max_concurrent_allocations=20,
        fair_share_target=0.3,
        burst_allowance=0.1,
        gpu_hours_budget=50_000.0,
        node_hours_budget=12_500.5,
        isolation="strict",
        max_preemption_class=0,  # an explicit 0 survives (optional on the wire)
        created_at=1_690_000_000.0,
        revision=5,
        retired_usage={19_700: _ledger_day()},
    )


def _ledger_day() -> types.LedgerDay:
    return types.LedgerDay(node_seconds=7200.5, gpu_seconds=28_802.0, allocations=3)


def _weights() -> types.CostWeights:
    return types.CostWeights(
        priority=0.1,
        wait_time=0.15,
        fair_share=0.25,
        topology=0.05,
        data_readiness=0.05,
        backlog=0.1,
        energy=0.1,
        checkpoint_efficiency=0.1,
        conformance=0.1,
    )


def _vcluster() -> types.VCluster:
    return types.VCluster(
        name="ml-training",
        scheduler_type=types.SchedulerType.SERVICE_BINPACK,
        tenant="ml-team",
        weights=_weights(),
        cycle_interval_seconds=2.5,
        backfill_depth=20,
        allow_borrowing=False,
        allow_user_suspend=False,
        created_at=1_690_000_000.0,
        revision=11,
    )


def _report() -> types.AllocationReport:
    return types.AllocationReport(
        allocation_id="a-12345",
        phase="exited",
        pid=4242,
        exit_code=0,
        reason="walltime_exceeded",
        started_at=1_700_000_010.5,
        finished_at=1_700_000_020.75,
        peak_memory_bytes=3 << 30,
    )


# Every field of every record set to a value other than its default.
SAMPLES: dict[type[msgspec.Struct], typing.Callable[[], msgspec.Struct]] = {
    types.Constraints: _constraints,
    types.AllocationSpec: _spec,
    types.Allocation: _allocation,
    types.GpuDevice: _gpu,
    types.GpuLink: _gpu_link,
    types.MemoryDomain: _memory_domain,
    types.MemoryInterconnect: _memory_interconnect,
    types.NodeCapabilities: _capabilities,
    types.Node: _node,
    types.Tenant: _tenant,
    types.LedgerDay: _ledger_day,
    types.StartEstimate: lambda: types.StartEstimate(
        estimated_start=1_700_000_600.5,
        estimate_basis=types.ESTIMATE_RESERVATION,
        nodes=2,
        node_ids=["n1", "n2"],
        position=3,
        pending_reason="all suitable nodes occupied",
    ),
    types.CostWeights: _weights,
    types.VCluster: _vcluster,
    types.AllocationReport: _report,
    types.Dependency: lambda: types.Dependency(ref="train", condition="failure"),
    types.DagEdge: lambda: types.DagEdge(upstream="train", downstream="eval", condition="any"),
    types.LivenessProbeSpec: _probe,
    types.ExposedPort: lambda: types.ExposedPort(name="api", port=8080, protocol="http"),
    types.CheckpointRecord: _checkpoint,
    types.CheckpointHint: _hint,
    types.ScalingSpec: _scaling,
    types.ScalingStatus: _scaling_status,
    types.ServiceEndpoint: lambda: types.ServiceEndpoint(
        allocation_id="a1b2c3d4", node_id="x1000c0s0b0n0", address="nid001", port=8080, tenant="t"
    ),
}


def _domain_structs() -> set[type[msgspec.Struct]]:
    return {
        obj
        for obj in vars(types).values()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == types.__name__
    }


def _meta(message_cls: type[betterproto2.Message]) -> dict[str, betterproto2.FieldMetadata]:
    return {f.name: betterproto2.FieldMetadata.get(f) for f in dataclasses.fields(message_cls)}


def _snake_dict(message: betterproto2.Message) -> dict[str, typing.Any]:
    return message.to_dict(output_format=OutputFormat.PYTHON, casing=Casing.SNAKE)


# ---------------------------------------------------------------- contract shape


def test_every_domain_record_has_a_message():
    missing = _domain_structs() - set(WIRE) - NOT_ON_THE_WIRE
    assert not missing, (
        f"records in lattice_common.types without a proto message: {sorted(c.__name__ for c in missing)}; "
        "add a message to proto/lattice/v1/common.proto (same field names), run scripts/codegen "
        "and list it in WIRE (or in NOT_ON_THE_WIRE with a reason)"
    )
    assert set(SAMPLES) == set(WIRE)


def _scalar_kind(annotation: typing.Any) -> tuple[str, bool]:
    """('str'|'int'|'float'|'bool'|'struct'|'list'|'dict', allows None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, pytypes.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(args) == 1, annotation
        return _scalar_kind(args[0])[0], True
    if origin is list:
        return "list", False
    if origin is dict:
        return "dict", False
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return "struct", False
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "str", False
    for kind in (bool, int, float, str):  # bool before int: bool is an int
        if annotation is kind:
            return kind.__name__, False
    raise AssertionError(f"unexpected annotation {annotation!r}")


@pytest.mark.parametrize("struct_cls", list(WIRE), ids=lambda c: c.__name__)
def test_message_fields_match_record_fields(struct_cls):
    message_cls = WIRE[struct_cls]
    meta = _meta(message_cls)
    for field in msgspec.structs.fields(struct_cls):
        where = f"{struct_cls.__name__}.{field.name} -> {message_cls.__name__}"
        assert field.name in meta, f"{where}: no such message field"
        m = meta[field.name]
        kind, nullable = _scalar_kind(field.type)
        if kind == "str":
            assert m.proto_type == betterproto2.TYPE_STRING, where
        elif kind == "int":
            assert m.proto_type in _INT_TYPES, where
        elif kind == "float":
            assert m.proto_type in _FLOAT_TYPES, where
        elif kind == "bool":
            assert m.proto_type == betterproto2.TYPE_BOOL, where
        elif kind == "struct":
            assert m.proto_type == betterproto2.TYPE_MESSAGE, where
        elif kind == "list":
            assert m.repeated, where
        elif kind == "dict":
            assert m.proto_type == betterproto2.TYPE_MAP, where
        if kind in ("int", "float", "bool"):
            default = field.default if field.default is not msgspec.NODEFAULT else None
            # Absent values and non-zero defaults need presence on the wire, or an
            # explicit 0/False would come back as the default.
            if nullable or (default is not None and default != 0):
                assert m.optional, f"{where}: must be proto3 `optional`"


# ---------------------------------------------------------------- (a) plain dict round trip


@pytest.mark.parametrize("struct_cls", list(WIRE), ids=lambda c: c.__name__)
def test_record_round_trips_through_its_message_via_dicts(struct_cls):
    record = SAMPLES[struct_cls]()
    builtins = msgspec.to_builtins(record)
    message = WIRE[struct_cls].from_dict(builtins)
    # ... and through the wire bytes, so 64-bit ints, doubles and maps are encoded for real.
    message = WIRE[struct_cls].parse(bytes(message))
    back = _snake_dict(message)
    for name, value in builtins.items():
        assert back[name] == value, f"{struct_cls.__name__}.{name}"
    assert msgspec.convert(back, struct_cls) == record


def test_default_to_dict_is_proto_json_not_python():
    """Why wire.py passes OutputFormat.PYTHON and Casing.SNAKE: the defaults differ."""
    message = v1.Allocation(id="a", submitted_at=1.5, revision=2**40, assigned_nodes=["n1"])
    assert message.to_dict() == {
        "id": "a",
        "assignedNodes": ["n1"],
        "submittedAt": 1.5,
        "revision": str(2**40),
    }
    assert _snake_dict(message) == {
        "id": "a",
        "assigned_nodes": ["n1"],
        "submitted_at": 1.5,
        "revision": 2**40,
    }


# ---------------------------------------------------------------- wire.py


@pytest.mark.parametrize("struct_cls", list(WIRE), ids=lambda c: c.__name__)
def test_wire_round_trip_populated(struct_cls):
    record = SAMPLES[struct_cls]()
    message = to_message(record, WIRE[struct_cls])
    assert isinstance(message, WIRE[struct_cls])
    again = WIRE[struct_cls].parse(bytes(message))
    assert from_message(again, struct_cls) == record


@pytest.mark.parametrize(
    "record",
    [
        types.Constraints(),
        types.AllocationSpec(entrypoint="true", tenant="t", vcluster="v"),
        types.Allocation(
            id="a", spec=types.AllocationSpec(entrypoint="x", tenant="t", vcluster="v")
        ),
        types.NodeCapabilities(),
        types.Node(id="n1"),
        types.Tenant(name="t"),
        types.CostWeights(),
        types.VCluster(name="v"),
        types.AllocationReport(allocation_id="a", phase="running"),
    ],
    ids=lambda r: type(r).__name__,
)
def test_wire_round_trip_defaults(record):
    message = to_message(record, WIRE[type(record)])
    assert from_message(WIRE[type(record)].parse(bytes(message)), type(record)) == record


def test_wire_writes_defaults_explicitly():
    message = to_message(
        types.AllocationSpec(entrypoint="x", tenant="t", vcluster="v"), v1.AllocationSpec
    )
    assert message.nodes == 1
    assert message.preemption_class == 5
    assert message.max_requeue == 3
    assert message.lifecycle == "bounded"
    assert message.requeue_policy == "on_node_failure"
    assert message.constraints == v1.AllocationSpecConstraints()


def test_wire_enums_travel_as_their_string_values():
    alloc = _allocation()
    message = to_message(alloc, v1.Allocation)
    assert message.state == "Running"
    assert message.spec.lifecycle == "unbounded"
    assert message.spec.requeue_policy == "always"
    assert to_message(_vcluster(), v1.VCluster).scheduler_type == "service-binpack"
    assert to_message(_node(), v1.Node).state == "Draining"
    back = from_message(message, types.Allocation)
    assert back.state is types.AllocationState.RUNNING
    assert back.spec.lifecycle is types.LifecycleType.UNBOUNDED


def test_wire_none_leaves_optional_fields_unset():
    alloc = types.Allocation(id="a", spec=_spec())
    message = to_message(alloc, v1.Allocation)
    assert message.started_at is None
    assert message.finished_at is None
    assert message.exit_code is None
    back = from_message(v1.Allocation.parse(bytes(message)), types.Allocation)
    assert back.started_at is None and back.exit_code is None
    tenant = from_message(to_message(types.Tenant(name="t"), v1.Tenant), types.Tenant)
    assert tenant.max_nodes is None and tenant.gpu_hours_budget is None


def test_wire_explicit_zeros_survive():
    spec = types.AllocationSpec(
        entrypoint="x", tenant="t", vcluster="v", preemption_class=0, max_requeue=0
    )
    assert (
        from_message(
            v1.AllocationSpec.parse(bytes(to_message(spec, v1.AllocationSpec))),
            types.AllocationSpec,
        )
        == spec
    )
    alloc = types.Allocation(id="a", spec=spec, started_at=0.0, exit_code=0)
    back = from_message(
        v1.Allocation.parse(bytes(to_message(alloc, v1.Allocation))), types.Allocation
    )
    assert back.exit_code == 0 and back.started_at == 0.0
    vc = types.VCluster(
        name="v", backfill_depth=0, allow_borrowing=False, weights=types.CostWeights(priority=0.0)
    )
    assert from_message(v1.VCluster.parse(bytes(to_message(vc, v1.VCluster))), types.VCluster) == vc
    tenant = types.Tenant(name="t", max_nodes=0, gpu_hours_budget=0.0)
    assert from_message(to_message(tenant, v1.Tenant), types.Tenant) == tenant


def test_wire_unset_message_fields_take_domain_defaults():
    spec = from_message(
        v1.AllocationSpec(entrypoint="x", tenant="t", vcluster="v"), types.AllocationSpec
    )
    assert spec == types.AllocationSpec(entrypoint="x", tenant="t", vcluster="v")
    assert spec.nodes == 1 and spec.preemption_class == 5
    assert spec.lifecycle is types.LifecycleType.BOUNDED
    vc = from_message(v1.VCluster(name="v"), types.VCluster)
    assert vc.weights == types.CostWeights()
    assert vc.allow_borrowing is True and vc.cycle_interval_seconds == 5.0


def test_wire_empty_required_fields_decode_as_empty_for_validation_to_report():
    spec = from_message(v1.AllocationSpec(), types.AllocationSpec)
    assert (spec.entrypoint, spec.tenant, spec.vcluster) == ("", "", "")
    alloc = from_message(v1.Allocation(spec=v1.AllocationSpec()), types.Allocation)
    assert alloc.id == "" and alloc.spec.entrypoint == ""


def test_wire_request_only_fields_are_ignored_by_the_record():
    message = to_message(_spec(), v1.AllocationSpec)
    message.walltime = "72h"
    assert from_message(message, types.AllocationSpec) == _spec()


def test_wire_liveness_probe_defaults_are_the_specifications():
    spec = from_message(
        v1.AllocationSpec(
            entrypoint="x",
            tenant="t",
            vcluster="v",
            liveness_probe=v1.LivenessProbeSpec(probe_type="http", port=8080, path="/healthz"),
        ),
        types.AllocationSpec,
    )
    assert spec.liveness_probe == types.LivenessProbeSpec(
        probe_type="http", port=8080, path="/healthz"
    )
    p = spec.liveness_probe
    assert (p.period_secs, p.initial_delay_secs, p.failure_threshold, p.timeout_secs) == (
        30,
        10,
        3,
        5,
    )


def test_wire_rejects_values_that_do_not_fit_the_record():
    with pytest.raises(ValidationError) as err:
        from_message(
            v1.Allocation(id="a", spec=v1.AllocationSpec(), state="Bogus"), types.Allocation
        )
    assert err.value.details["message"] == "Allocation"
    assert "state" in err.value.details["error"]
    with pytest.raises(ValidationError):
        from_message(v1.Allocation(id="a"), types.Allocation)  # no spec at all


def test_wire_to_message_refuses_fields_the_message_lacks():
    class Drifted(msgspec.Struct, kw_only=True):
        id: str
        not_in_proto: int = 0

    with pytest.raises(TypeError, match="not_in_proto"):
        to_message(Drifted(id="n1"), v1.Node)
    assert to_message(Drifted(id="n1"), v1.Node, ignore_unknown_fields=True).id == "n1"


class _Desired(msgspec.Struct, kw_only=True):
    node_id: str
    generation: int = 0
    allocations: list[types.Allocation] = msgspec.field(default_factory=list)


def test_wire_lists_of_records_and_nested_required_fields():
    desired = _Desired(
        node_id="n1",
        generation=4,
        allocations=[
            _allocation(),
            types.Allocation(
                id="b", spec=types.AllocationSpec(entrypoint="", tenant="", vcluster="")
            ),
        ],
    )
    message = to_message(desired, v1.DesiredState)
    assert [a.id for a in message.allocations] == ["a-12345", "b"]
    assert from_message(v1.DesiredState.parse(bytes(message)), _Desired) == desired


class _Proposal(msgspec.Struct):
    command: bytes


def test_wire_bytes_fields():
    blob = msgspec.msgpack.encode({"kind": "SubmitAllocation", "id": "a-1"}) + b"\x00\xff"
    message = to_message(_Proposal(blob), v1.ProposeRequest)
    assert message.command == blob
    assert from_message(v1.ProposeRequest.parse(bytes(message)), _Proposal).command == blob


# ---------------------------------------------------------------- betterproto2 behaviours we rely on


def test_oneof_submit_request():
    request = v1.SubmitRequest(allocation=to_message(_spec(), v1.AllocationSpec))
    parsed = v1.SubmitRequest.parse(bytes(request))
    kind, value = betterproto2.which_one_of(parsed, "kind")
    assert kind == "allocation"
    assert from_message(value, types.AllocationSpec) == _spec()
    assert betterproto2.which_one_of(v1.SubmitRequest(), "kind") == ("", None)
    group = v1.SubmitRequest(
        task_group=v1.TaskGroupSpec(range_start=0, range_end=99, concurrency=20)
    )
    assert (
        betterproto2.which_one_of(v1.SubmitRequest.parse(bytes(group)), "kind")[0] == "task_group"
    )


def test_error_detail_map():
    detail = v1.ErrorDetail(
        code="quota_exceeded", message="no", details={"current": "120", "limit": "128"}, hint="wait"
    )
    assert v1.ErrorDetail.parse(bytes(detail)) == detail


# ---------------------------------------------------------------- (b) real grpclib server


class _Allocations(v1.AllocationServiceBase):
    def __init__(self, store: dict[str, types.Allocation]):
        self.store = store

    async def get(self, message: v1.GetAllocationRequest) -> v1.Allocation:
        alloc = self.store.get(message.id)
        if alloc is None:
            raise grpclib.GRPCError(Status.NOT_FOUND, f"allocation {message.id} not found")
        return to_message(alloc, v1.Allocation)

    async def watch(self, message: v1.WatchAllocationsRequest) -> AsyncIterator[v1.AllocationEvent]:
        for alloc in self.store.values():
            yield v1.AllocationEvent(
                revision=alloc.revision, allocation=to_message(alloc, v1.Allocation)
            )


@pytest.fixture
async def stub():
    alloc = _allocation()
    server = Server([_Allocations({alloc.id: alloc})])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await server.start(sock=sock)
    channel = Channel("127.0.0.1", port)
    try:
        yield v1.AllocationServiceStub(channel, timeout=5)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_get_over_a_real_channel(stub):
    reply = await stub.get(v1.GetAllocationRequest(id="a-12345"))
    assert isinstance(reply, v1.Allocation)
    assert from_message(reply, types.Allocation) == _allocation()


async def test_errors_and_unimplemented_over_a_real_channel(stub):
    with pytest.raises(grpclib.GRPCError) as err:
        await stub.get(v1.GetAllocationRequest(id="nope"))
    assert err.value.status is Status.NOT_FOUND
    assert "nope" in (err.value.message or "")
    with pytest.raises(grpclib.GRPCError) as err:
        await stub.checkpoint(v1.CheckpointRequest(id="a-12345"))
    assert err.value.status is Status.UNIMPLEMENTED


async def test_server_stream_over_a_real_channel(stub):
    events = [event async for event in stub.watch(v1.WatchAllocationsRequest())]
    assert [e.revision for e in events] == [2**40 + 7]
    assert from_message(events[0].allocation, types.Allocation) == _allocation()
