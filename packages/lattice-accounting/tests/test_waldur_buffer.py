"""The event buffer: memory, then the on-disk WAL, in order, across crashes and restarts."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from lattice_accounting.waldur.buffer import (
    EventBuffer,
    decode_records,
    encode_record,
)
from lattice_accounting.waldur.events import AccountingEvent, EventType, encode_event
from lattice_accounting.waldur.metrics import WaldurMetrics
from prometheus_client import CollectorRegistry


def ev(i: int, revision: int = 0) -> AccountingEvent:
    return AccountingEvent(
        event_id=f"e{i}",
        type=EventType.ALLOCATION_STARTED,
        timestamp=1000.0 + i,
        tenant="physics",
        allocation_id=f"a{i}",
        revision=revision,
    )


def ids(items: list[tuple[int, AccountingEvent]]) -> list[str]:
    return [e.event_id for _, e in items]


def drain(buf: EventBuffer) -> list[str]:
    out: list[str] = []
    while len(buf):
        batch = buf.peek(7)
        out += ids(batch)
        buf.ack(batch[-1][0])
    return out


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


# --- the record format ------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(1, 2**63), st.binary(max_size=64)), max_size=20))
def test_records_round_trip(records: list[tuple[int, bytes]]) -> None:
    data = b"".join(encode_record(s, p) for s, p in records)
    out, good, corrupt = decode_records(data)
    assert [(s, p) for s, p, _ in out] == records
    assert good == len(data) and not corrupt


@given(
    st.lists(st.tuples(st.integers(1, 1000), st.binary(min_size=1, max_size=32)), min_size=1),
    st.data(),
)
def test_a_torn_or_damaged_tail_is_detected(
    records: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    raw = b"".join(encode_record(s, p) for s, p in records)
    cut = data.draw(st.integers(0, len(raw) - 1))
    if data.draw(st.booleans()):
        boundaries = {0}
        for s, p in records:
            boundaries.add(max(boundaries) + len(encode_record(s, p)))
        assume(cut not in boundaries)  # a cut between records is a shorter, clean log
        damaged = raw[:cut]  # torn write
    else:
        damaged = raw[:cut] + bytes([raw[cut] ^ 0xFF]) + raw[cut + 1 :]  # flipped byte
    out, good, corrupt = decode_records(damaged)
    assert corrupt
    assert good <= cut
    # every record before the damage survives, none after it is invented
    assert [(s, p) for s, p, _ in out] == records[: len(out)]
    assert good == len(b"".join(encode_record(s, p) for s, p in records[: len(out)]))


# --- memory, disk, drop -------------------------------------------------------------


def test_memory_then_disk_then_drop_only_when_both_are_full(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    m = WaldurMetrics(reg)
    one = len(encode_record(1, b"x" * 60))  # about one event on disk
    buf = EventBuffer(
        tmp_path / "wal",
        memory_max=3,
        disk_max_bytes=4096,
        disk_alert_events=2,
        metrics=m,
    )
    assert one < 200
    r = buf.append([ev(i) for i in range(3)])
    assert (r.memory, r.disk, r.dropped) == (3, 0, 0)
    assert metric(reg, "lattice_accounting_disk_buffer_alert") == 0
    r = buf.append([ev(i) for i in range(3, 6)])
    assert (r.memory, r.disk, r.dropped) == (0, 3, 0)
    assert buf.wal_events == 3 and buf.disk_alert
    assert metric(reg, "lattice_accounting_disk_buffer_alert") == 1
    assert metric(reg, "lattice_accounting_events_buffered", where="memory") == 3
    assert metric(reg, "lattice_accounting_events_buffered", where="disk") == 3
    # fill the disk: the rest is dropped and counted
    r = buf.append([ev(i) for i in range(6, 200)])
    assert r.dropped > 0 and r.disk > 0
    assert buf.dropped == r.dropped
    assert metric(reg, "lattice_accounting_events_dropped_total") == r.dropped
    kept = 6 + r.disk
    assert drain(buf) == [f"e{i}" for i in range(kept)]
    assert len(buf) == 0 and not buf.disk_alert
    assert list((tmp_path / "wal").glob("*.wal")) == []  # fully acknowledged: deleted
    # empty again: new events go to memory
    assert buf.append([ev(500)]).memory == 1


def test_new_events_queue_behind_the_disk_to_keep_the_order(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    buf.append([ev(i) for i in range(4)])  # 2 in memory, 2 on disk
    batch = buf.peek(2)
    buf.ack(batch[-1][0])  # memory is empty again, disk is not
    r = buf.append([ev(4)])
    assert r.disk == 1  # behind e2, e3
    assert drain(buf) == ["e2", "e3", "e4"]


def test_crash_replays_the_disk_and_a_clean_close_keeps_memory_too(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    buf = EventBuffer(path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    buf.append([ev(i) for i in range(5)])
    del buf  # crash: memory (e0, e1) is gone, the disk (e2..e4) is not
    again = EventBuffer(path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    assert again.wal_events == 3
    first = again.peek(1)
    again.ack(first[0][0])  # e2 acknowledged, then a clean shutdown
    again.append([ev(5), ev(6)])
    again.close()
    third = EventBuffer(path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    assert drain(third) == ["e3", "e4", "e5", "e6"]
    # sequence numbers keep growing across restarts
    r = third.append([ev(7)])
    assert r.memory == 1 and third.peek(1)[0][0] > 7


def test_close_writes_memory_ahead_of_the_disk(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    buf.append([ev(i) for i in range(4)])
    buf.close()
    again = EventBuffer(tmp_path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    assert drain(again) == ["e0", "e1", "e2", "e3"]


def test_corrupt_tail_is_truncated_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    buf = EventBuffer(tmp_path, memory_max=1, disk_max_bytes=1 << 20, disk_alert_events=100)
    buf.append([ev(i) for i in range(4)])  # e0 in memory, e1..e3 on disk
    (seg,) = tmp_path.glob("*.wal")
    with open(seg, "ab") as f:
        f.write(b"\x00\x00\x01\x00garbage")  # a torn record
    reg = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="lattice.accounting.waldur.buffer"):
        again = EventBuffer(
            tmp_path,
            memory_max=1,
            disk_max_bytes=1 << 20,
            disk_alert_events=100,
            metrics=WaldurMetrics(reg),
        )
    assert "damaged record" in caplog.text and "truncating" in caplog.text
    assert metric(reg, "lattice_accounting_wal_corrupt_records_total") == 1
    assert drain(again) == ["e1", "e2", "e3"]
    # appends after the truncation land on a clean tail
    again.append([ev(9), ev(10)])
    third = EventBuffer(tmp_path, memory_max=1, disk_max_bytes=1 << 20, disk_alert_events=100)
    assert third.disk.corrupt_records == 0


def test_segments_roll_and_are_deleted_once_acknowledged(tmp_path: Path) -> None:
    buf = EventBuffer(
        tmp_path,
        memory_max=1,
        disk_max_bytes=1 << 20,
        disk_alert_events=1000,
        segment_bytes=300,
    )
    buf.append([ev(i) for i in range(30)])
    assert len(list(tmp_path.glob("*.wal"))) > 3
    batch = buf.peek(15)
    buf.ack(batch[-1][0])
    fewer = len(list(tmp_path.glob("*.wal")))
    again = EventBuffer(tmp_path, memory_max=1, disk_max_bytes=1 << 20, disk_alert_events=1000)
    assert drain(again) == [f"e{i}" for i in range(15, 30)]
    assert fewer < 10 and list(tmp_path.glob("*.wal")) == []


def test_durable_revision_stops_before_events_held_only_in_memory(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, memory_max=2, disk_max_bytes=1 << 20, disk_alert_events=100)
    assert buf.durable_revision(10) == 10
    buf.append([ev(1, revision=11), ev(2, revision=12), ev(3, revision=13)])
    assert buf.durable_revision(13) == 10  # 11 and 12 are only in memory
    buf.ack(buf.peek(2)[-1][0])
    assert buf.durable_revision(13) == 13  # 13 is on disk


# --- the property: any interleaving keeps the order and loses nothing that fits ------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 6)),
        st.tuples(st.just("ack"), st.integers(1, 8)),
        st.tuples(st.just("crash"), st.just(0)),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    max_size=30,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(OPS, st.integers(1, 4), st.integers(300, 1500), st.integers(120, 400))
def test_any_interleaving_keeps_order_and_loses_nothing_that_fits(
    ops: list[tuple[str, int]], memory_max: int, disk_bytes: int, segment_bytes: int
) -> None:
    path = Path(tempfile.mkdtemp(prefix="wal-prop-"))
    try:

        def open_buffer() -> EventBuffer:
            return EventBuffer(
                path,
                memory_max=memory_max,
                disk_max_bytes=disk_bytes,
                disk_alert_events=5,
                segment_bytes=segment_bytes,
            )

        buf = open_buffer()
        # the model: what must still be delivered, in order, and where each one is
        expected: list[tuple[str, str]] = []  # (event id, "memory" | "disk")
        delivered: list[str] = []
        n = 0
        for op, k in ops:
            if op == "append":
                events = [ev(n + i) for i in range(k)]
                n += k
                r = buf.append(events)
                first_drop = True
                for e, where in zip(events, r.placement, strict=True):
                    if where == "dropped":
                        # dropped only when memory is full (or behind the disk) and the
                        # disk has no room for it
                        assert len(buf._mem) == memory_max or buf.wal_events > 0
                        if first_drop:
                            rec = encode_record(2**40, encode_event(e))
                            assert buf.disk.bytes + len(rec) > disk_bytes
                        first_drop = False
                        continue
                    expected.append((e.event_id, where))
            elif op == "ack":
                batch = buf.peek(k)
                assert ids(batch) == [i for i, _ in expected[: len(batch)]]
                assert len(batch) == min(k, len(expected))
                if batch:
                    buf.ack(batch[-1][0])
                    delivered += ids(batch)
                    expected = expected[len(batch) :]
            elif op == "crash":
                del buf
                buf = open_buffer()
                expected = [(i, w) for i, w in expected if w == "disk"]
            else:
                dropped = buf.dropped
                buf.close()
                lost = buf.dropped - dropped
                buf = open_buffer()
                # a clean close writes the memory head to disk, as much as fits
                memory = [i for i, w in expected if w == "memory"]
                kept = len(memory) - lost
                disk = [i for i, w in expected if w == "disk"]
                expected = [(i, "disk") for i in memory[:kept] + disk]
            assert len(buf) == len(expected)
        # everything left comes out, in order, exactly once
        rest = drain(buf)
        assert rest == [i for i, _ in expected]
        out = delivered + rest
        assert out == sorted(out, key=lambda s: int(s[1:]))  # append order
        assert len(set(out)) == len(out)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_memory_never_drops_while_the_disk_has_room(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, memory_max=5, disk_max_bytes=1 << 20, disk_alert_events=10)
    r = buf.append([ev(i) for i in range(1000)])
    assert r.dropped == 0 and r.memory == 5 and r.disk == 995
    assert buf.dropped == 0
