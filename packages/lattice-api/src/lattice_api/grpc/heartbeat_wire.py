"""BatchHeartbeat straight from and to the protobuf wire format.

BatchHeartbeat is the leader's hottest call at scale (every node, every interval). The
generated messages decode and encode field by field through generic machinery, about
two thirds of the leader's CPU per heartbeat; here the request's bytes are walked once
into the :class:`~lattice_api.ops.nodes.Beat` records the operations take, and the
answer is written directly. Only the fields the quorum uses are read; any other field
(one added to the messages later included) is skipped, as protobuf requires. Field
numbers and types come from the generated classes, so they follow the .proto files.

:class:`BatchRequest` and :class:`BatchReply` stand in for the generated
``BatchHeartbeatRequest``/``BatchHeartbeatResponse`` in NodeService's handler table;
the bytes on the wire are the same.
"""

from __future__ import annotations

import struct
from typing import Any

from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationReport

from lattice_api.ops.nodes import Beat

_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_DOUBLE = struct.Struct("<d")


def _numbers(message: type, names: tuple[str, ...]) -> dict[str, int]:
    meta = message._betterproto.meta_by_field_name  # type: ignore[attr-defined]
    return {n: meta[n].number for n in names}


_BATCH = _numbers(v1.BatchHeartbeatRequest, ("heartbeats",))
_BEAT = _numbers(v1.HeartbeatRequest, ("node_id", "sequence", "allocations", "health"))
_HEALTH = _numbers(v1.HealthSummary, ("conformance_fingerprint", "telemetry_sources"))
_RESULT = _numbers(v1.NodeHeartbeatResult, ("node_id", "generation", "reregister", "error"))
_REPLY = _numbers(v1.BatchHeartbeatResponse, ("results", "leader_hint"))

_SIGNED = {"int32", "int64"}
_UNSIGNED = {"uint32", "uint64"}


def _report_fields() -> dict[int, tuple[str, str]]:
    """AllocationReport's field number -> (name, proto type), for the record's fields."""
    import msgspec

    meta = v1.AllocationReport._betterproto.meta_by_field_name  # type: ignore[attr-defined]
    out = {}
    for f in msgspec.structs.fields(AllocationReport):
        m = meta[f.name]
        if m.proto_type not in {"string", "double", "bool"} | _SIGNED | _UNSIGNED:
            raise TypeError(f"AllocationReport.{f.name}: {m.proto_type} has no fast decoding")
        out[m.number] = (f.name, m.proto_type)
    return out


_REPORT = _report_fields()


def _bad(what: str) -> ValidationError:
    return ValidationError(
        f"malformed BatchHeartbeat request: {what}",
        hint="Send a BatchHeartbeatRequest encoded as the NodeService proto defines it.",
    )


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise _bad("varint longer than 10 bytes")


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == _VARINT:
        return _varint(buf, pos)[1]
    if wire == _I64:
        return pos + 8
    if wire == _LEN:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire == _I32:
        return pos + 4
    raise _bad(f"wire type {wire}")


def _text(buf: bytes, start: int, end: int) -> str:
    try:
        return buf[start:end].decode()
    except UnicodeDecodeError:
        raise _bad("a string is not UTF-8") from None


def _report(buf: bytes, pos: int, end: int) -> AllocationReport:
    fields: dict[str, Any] = {}
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        spec = _REPORT.get(number)
        if spec is None:
            pos = _skip(buf, pos, wire)
            continue
        name, kind = spec
        if kind == "string" and wire == _LEN:
            n, pos = _varint(buf, pos)
            fields[name] = _text(buf, pos, pos + n)
            pos += n
        elif kind == "double" and wire == _I64:
            fields[name] = _DOUBLE.unpack_from(buf, pos)[0]
            pos += 8
        elif wire == _VARINT and kind != "string" and kind != "double":
            v, pos = _varint(buf, pos)
            if kind in _SIGNED and v >= 1 << 63:  # negative: two's complement
                v -= 1 << 64
            fields[name] = bool(v) if kind == "bool" else v
        else:
            raise _bad(f"AllocationReport.{name} has wire type {wire}")
    if pos != end:
        raise _bad("an allocation report runs past its end")
    if "allocation_id" not in fields:
        fields["allocation_id"] = ""
    if "phase" not in fields:
        fields["phase"] = ""
    return AllocationReport(**fields)


def _health(buf: bytes, pos: int, end: int) -> tuple[str, list[str]]:
    fingerprint, sources = "", []
    fp_key = _HEALTH["conformance_fingerprint"] << 3 | _LEN
    src_key = _HEALTH["telemetry_sources"] << 3 | _LEN
    while pos < end:
        key, pos = _varint(buf, pos)
        if key in (fp_key, src_key):
            n, pos = _varint(buf, pos)
            text = _text(buf, pos, pos + n)
            pos += n
            if key == fp_key:
                fingerprint = text
            else:
                sources.append(text)
        else:
            pos = _skip(buf, pos, key & 7)
    if pos != end:
        raise _bad("a health summary runs past its end")
    return fingerprint, sources


_K_NODE = _BEAT["node_id"] << 3 | _LEN
_K_SEQ = _BEAT["sequence"] << 3 | _VARINT
_K_REPORT = _BEAT["allocations"] << 3 | _LEN
_K_HEALTH = _BEAT["health"] << 3 | _LEN
_K_BEAT = _BATCH["heartbeats"] << 3 | _LEN


def _beat(buf: bytes, pos: int, end: int) -> Beat:
    node_id, sequence = "", 0
    reports: list[AllocationReport] = []
    health: tuple[str, list[str]] | None = None
    while pos < end:
        key, pos = _varint(buf, pos)
        if key == _K_SEQ:
            sequence, pos = _varint(buf, pos)
            continue
        if key in (_K_NODE, _K_REPORT, _K_HEALTH):
            n, pos = _varint(buf, pos)
            stop = pos + n
            if stop > end:
                raise _bad("a field runs past its heartbeat")
            if key == _K_NODE:
                node_id = _text(buf, pos, stop)
            elif key == _K_REPORT:
                reports.append(_report(buf, pos, stop))
            else:
                health = _health(buf, pos, stop)
            pos = stop
            continue
        pos = _skip(buf, pos, key & 7)
    if pos != end:
        raise _bad("a heartbeat runs past its end")
    return Beat(
        node_id=node_id,
        sequence=sequence,
        reports=reports,
        fingerprint=health[0] if health is not None else "",
        telemetry_sources=health[1] if health is not None else None,
    )


def decode_batch(data: bytes) -> list[Beat]:
    """The heartbeats of a BatchHeartbeatRequest's bytes; ValidationError when they are
    not one."""
    buf = bytes(data)
    beats: list[Beat] = []
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key, pos = _varint(buf, pos)
            if key == _K_BEAT:
                n, pos = _varint(buf, pos)
                if pos + n > end:
                    raise _bad("a heartbeat runs past the message")
                beats.append(_beat(buf, pos, pos + n))
                pos += n
            else:
                pos = _skip(buf, pos, key & 7)
    except (IndexError, struct.error):
        raise _bad("the message ends early") from None
    if pos != end:
        raise _bad("the message ends early")
    return beats


class BatchRequest:
    """A BatchHeartbeatRequest as decoded by :func:`decode_batch` (grpclib calls
    ``FromString`` with the request's bytes)."""

    __slots__ = ("beats",)

    def __init__(self, beats: list[Beat]) -> None:
        self.beats = beats

    @classmethod
    def FromString(cls, data: bytes) -> BatchRequest:  # grpclib calls it so
        return cls(decode_batch(data))


def _put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _put_bytes(out: bytearray, key: int, data: bytes) -> None:
    _put_varint(out, key)
    _put_varint(out, len(data))
    out += data


class BatchReply:
    """A BatchHeartbeatResponse written directly: one result per heartbeat (the dicts
    of ``NodeOps.heartbeats``), or only ``leader_hint``."""

    __slots__ = ("leader_hint", "results")

    def __init__(
        self, results: list[dict[str, Any]] | None = None, leader_hint: str | None = None
    ) -> None:
        self.results = results or []
        self.leader_hint = leader_hint

    def SerializeToString(self) -> bytes:  # grpclib calls it so
        out = bytearray()
        item = bytearray()
        k_node = _RESULT["node_id"] << 3 | _LEN
        k_gen = _RESULT["generation"] << 3 | _VARINT
        k_rereg = _RESULT["reregister"] << 3 | _VARINT
        k_err = _RESULT["error"] << 3 | _LEN
        k_result = _REPLY["results"] << 3 | _LEN
        for r in self.results:
            item.clear()
            _put_bytes(item, k_node, r["node_id"].encode())
            if r.get("generation"):
                _put_varint(item, k_gen)
                _put_varint(item, r["generation"])
            if r.get("reregister"):
                _put_varint(item, k_rereg)
                item.append(1)
            err = r.get("error")
            if err:
                detail = v1.ErrorDetail(
                    code=err.get("code", ""),
                    message=err.get("message", ""),
                    details={k: str(v) for k, v in (err.get("details") or {}).items()},
                    hint=err.get("hint", ""),
                )
                _put_bytes(item, k_err, bytes(detail))
            _put_bytes(out, k_result, bytes(item))
        if self.leader_hint is not None:
            _put_bytes(out, _REPLY["leader_hint"] << 3 | _LEN, self.leader_hint.encode())
        return bytes(out)


__all__ = ["BatchReply", "BatchRequest", "decode_batch"]
