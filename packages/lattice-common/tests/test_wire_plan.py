"""to_message builds messages directly from a plan; the dict path through
Message.from_dict is the reference. Both must give the same message, and the same bytes
on the wire, for any record."""

from __future__ import annotations

import pytest
from betterproto2 import Casing, OutputFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_common import types as t
from lattice_common.proto.lattice import v1
from lattice_common.wire import message_to_dict, to_message, to_message_via_dict
from lattice_test_harness import builders as b

text = st.text(max_size=12)
small = st.integers(min_value=0, max_value=2**31 - 1)
maybe_small = st.none() | small
moment = st.floats(min_value=0, max_value=4e9, allow_nan=False) | st.integers(0, 4_000_000_000)
maybe_moment = st.none() | moment


@st.composite
def allocations(draw: st.DrawFn) -> t.Allocation:
    a = b.allocation(
        id=draw(text),
        state=draw(st.sampled_from(list(t.AllocationState))),
        entrypoint=draw(text),
        tenant=draw(text),
        user=draw(text),
        nodes=draw(st.integers(1, 64)),
        env=draw(st.dictionaries(text, text, max_size=3)),
        tags=draw(st.dictionaries(text, text, max_size=3)),
    )
    a.assigned_nodes = draw(st.lists(text, max_size=4))
    a.submitted_at = draw(moment)
    a.started_at = draw(maybe_moment)
    a.finished_at = draw(maybe_moment)
    a.exit_code = draw(st.none() | st.integers(-255, 255))
    a.requeue_count = draw(small)
    a.task_index = draw(maybe_small)
    a.reason = draw(text)
    a.spec.constraints.features = draw(st.lists(text, max_size=3))
    a.spec.depends_on = [
        t.Dependency(ref=r, condition=cond)
        for r, cond in draw(
            st.lists(st.tuples(text, st.sampled_from(["success", "failure", "any"])), max_size=3)
        )
    ]
    if draw(st.booleans()):
        a.last_checkpoint = t.CheckpointRecord(
            id=draw(text), path=draw(text), size_bytes=draw(small), duration_seconds=1, at=2
        )
    if draw(st.booleans()):
        a.spec.scaling = t.ScalingSpec(metric=draw(text), target=draw(st.floats(0, 1)))
    return a


def _same(record: object, cls: type) -> None:
    fast, ref = to_message(record, cls), to_message_via_dict(record, cls)  # type: ignore[arg-type]
    assert fast == ref
    assert bytes(fast) == bytes(ref)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(allocations())
def test_an_allocation_is_the_same_message_by_either_path(a: t.Allocation) -> None:
    _same(a, v1.Allocation)
    _same(a.spec, v1.AllocationSpec)


@pytest.mark.parametrize(
    ("record", "cls"),
    [
        (b.node("n1", gpu_type="GH200", gpu_count=4, features=["nvme"]), v1.Node),
        (b.tenant("physics", max_nodes=10), v1.Tenant),
        (b.vcluster("hpc", tenant="physics"), v1.VCluster),
    ],
)
def test_other_records_are_the_same_message_by_either_path(record: object, cls: type) -> None:
    _same(record, cls)


def test_a_record_field_the_message_lacks_is_a_contract_error() -> None:
    with pytest.raises(
        TypeError,
        match="Tenant does not fit Dependency: Unknown field 'name' in message Dependency",
    ):
        to_message(b.tenant("x"), v1.Dependency)
    with pytest.raises(
        TypeError,
        match="Tenant does not fit Dependency: Unknown field 'name' in message Dependency",
    ):
        to_message_via_dict(b.tenant("x"), v1.Dependency)


def _same_dict(message: object) -> None:
    assert message_to_dict(message) == message.to_dict(  # type: ignore[attr-defined]
        output_format=OutputFormat.PYTHON, casing=Casing.SNAKE
    )


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(allocations())
def test_a_message_reads_back_as_the_same_dict_by_either_path(a: t.Allocation) -> None:
    _same_dict(to_message(a, v1.Allocation))
    _same_dict(v1.SubmitRequest(allocation=to_message(a.spec, v1.AllocationSpec)))
    _same_dict(v1.SubmitRequest())


@pytest.mark.parametrize("cls", [v1.Node, v1.Tenant, v1.VCluster, v1.HeartbeatRequest])
def test_other_messages_read_back_as_the_same_dict(cls: type) -> None:
    _same_dict(cls())
    if cls is v1.Node:
        _same_dict(to_message(b.node("n1", gpu_type="GH200", gpu_count=4), v1.Node))


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(allocations())
def test_messages_round_trip_through_their_bytes(a: t.Allocation) -> None:
    m = to_message(a, v1.Allocation)
    assert v1.Allocation().parse(bytes(m)) == m


def test_field_defaults_shared_for_comparison_are_never_a_messages_own() -> None:
    # the defaults betterproto2 compares with are built once per class and field
    assert bytes(v1.Allocation()) == b""
    m = v1.Allocation()
    m.assigned_nodes.append("n1")
    m.spec = v1.AllocationSpec()
    m.spec.env["A"] = "1"
    # spec (2): env (12) entry {key (1): "A", value (2): "1"}; assigned_nodes (4): "n1"
    assert bytes(m) == b"\x12\x08" + b"\x62\x06\x0a\x01A\x12\x011" + b"\x22\x02n1"
    assert bytes(v1.Allocation()) == b""
    assert v1.Allocation().assigned_nodes == [] and v1.AllocationSpec().env == {}
