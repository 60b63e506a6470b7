"""BatchHeartbeat's direct wire decoding and encoding (lattice_api.grpc.heartbeat_wire)
against the generated messages: the same heartbeats out of the same bytes, the same
answer into bytes the generated client reads, and bad bytes refused with a clear error,
never anything else."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_api.grpc.heartbeat_wire import BatchReply, decode_batch
from lattice_api.grpc.node_service import _beat
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
U64 = st.integers(0, 2**64 - 1)
FLOATS = st.floats(allow_nan=False)
TEXT = st.text(max_size=12)

reports = st.builds(
    v1.AllocationReport,
    allocation_id=TEXT,
    phase=st.sampled_from(["running", "exited", "staged", "checkpointed", ""]),
    pid=I32,
    exit_code=st.none() | I32,
    reason=TEXT,
    started_at=st.none() | FLOATS,
    finished_at=st.none() | FLOATS,
    peak_memory_bytes=st.none() | I64,
    attempt=I32,
    image_digest=TEXT,
    checkpoint_id=TEXT,
    checkpoint_path=TEXT,
    checkpoint_size_bytes=U64,
    checkpoint_duration_seconds=FLOATS,
    hint_id=TEXT,
)
healths = st.builds(
    v1.HealthSummary,
    status=TEXT,  # fields the quorum does not read are skipped
    issues=st.lists(TEXT, max_size=2),
    cpu_utilization=FLOATS,
    healthy_gpus=I32,
    conformance_fingerprint=TEXT,
    telemetry_sources=st.lists(TEXT, max_size=3),
)
beats = st.builds(
    v1.HeartbeatRequest,
    node_id=TEXT,
    sequence=U64,
    allocations=st.lists(reports, max_size=3),
    health=st.none() | healths,
    generation=U64,
    timestamp=FLOATS,
)


def batch_bytes(heartbeats: list[v1.HeartbeatRequest]) -> bytes:
    return bytes(v1.BatchHeartbeatRequest(heartbeats=heartbeats))


@settings(max_examples=200, deadline=None)
@given(st.lists(beats, max_size=5))
def test_decodes_as_the_generated_message_does(heartbeats: list[v1.HeartbeatRequest]) -> None:
    raw = batch_bytes(heartbeats)
    expected = [_beat(h) for h in v1.BatchHeartbeatRequest.parse(raw).heartbeats]
    assert decode_batch(raw) == expected


results = st.fixed_dictionaries(
    {
        "node_id": TEXT,
        "generation": U64,
        "reregister": st.booleans(),
        "error": st.none()
        | st.fixed_dictionaries(
            {
                "code": st.sampled_from(["stale_revision", "rate_limited"]),
                "message": TEXT,
                "details": st.dictionaries(TEXT, st.integers() | TEXT, max_size=2),
                "hint": TEXT,
            }
        ),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(results, max_size=5), st.none() | TEXT)
def test_the_answer_reads_back_with_the_generated_message(
    res: list[dict[str, Any]], hint: str | None
) -> None:
    got = v1.BatchHeartbeatResponse.parse(BatchReply(res, leader_hint=hint).SerializeToString())
    assert got.leader_hint == hint
    assert [(r.node_id, r.generation, r.reregister) for r in got.results] == [
        (r["node_id"], r["generation"], r["reregister"]) for r in res
    ]
    for r, back in zip(res, got.results, strict=True):
        err = r["error"]
        if err is None:
            assert back.error is None
        else:
            assert back.error is not None
            assert (back.error.code, back.error.message, back.error.hint) == (
                err["code"],
                err["message"],
                err["hint"],
            )
            assert back.error.details == {k: str(v) for k, v in err["details"].items()}


@settings(max_examples=200, deadline=None)
@given(st.lists(beats, min_size=1, max_size=3), st.data())
def test_cut_short_bytes_are_refused_clearly(
    heartbeats: list[v1.HeartbeatRequest], data: st.DataObject
) -> None:
    raw = batch_bytes(heartbeats)
    cut = data.draw(st.integers(1, len(raw) - 1))
    try:
        decode_batch(raw[:cut])  # a cut between two heartbeats is a shorter batch
    except ValidationError as e:
        assert "malformed BatchHeartbeat" in e.message and e.hint


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_are_refused(raw: bytes) -> None:
    try:
        out = decode_batch(raw)
    except ValidationError as e:
        assert e.hint
    else:
        assert all(isinstance(b.sequence, int) for b in out)
