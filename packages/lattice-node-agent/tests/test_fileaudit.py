"""The pure parts of file-access auditing: open flags as an audit reads them, the
deduplication window (a hot loop opening one file a million times does not flood; every
open is counted exactly once), the per-allocation cap, the bounded buffer; and the
/proc-sampled fallback against a real process holding files open (labelled as sampled)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent.telemetry.fileaudit import (
    O_APPEND,
    O_CREAT,
    O_DIRECTORY,
    O_PATH,
    O_RDWR,
    O_TRUNC,
    O_WRONLY,
    SOURCE_SAMPLED,
    Dedup,
    FileAudit,
    FileEvent,
    Outbox,
    decode_flags,
)
from lattice_agent.telemetry.samples import MODE_AUDIT, AllocLabels, Target

O_CLOEXEC = 0o2000000


def ev(
    path: str = "/data/x",
    *,
    pid: int = 10,
    alloc: str = "a1",
    result: int = 3,
    t: float = 0.0,
    flags: str = "r",
) -> FileEvent:
    return FileEvent(
        time=t,
        allocation_id=alloc,
        node_id="n1",
        user="alice",
        uid=1000,
        pid=pid,
        tid=pid,
        comm="python",
        path=path,
        flags=flags,
        result=result,
    )


# --------------------------------------------------------------------------- flags


def test_flags_examples() -> None:
    assert decode_flags(0) == "r"
    assert decode_flags(O_CLOEXEC) == "r"
    assert decode_flags(O_WRONLY | O_CREAT | O_TRUNC) == "w,create,trunc"
    assert decode_flags(O_RDWR | O_APPEND) == "rw,append"
    assert decode_flags(O_DIRECTORY | O_CLOEXEC) == "r,directory"
    assert decode_flags(O_PATH | O_CLOEXEC) == "path"


@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_flags_say_each_bit(flags: int) -> None:
    parts = decode_flags(flags).split(",")
    access = parts[0]
    if flags & O_PATH:
        assert access == "path"
    else:
        assert access == {0: "r", 1: "w", 2: "rw", 3: "rw"}[flags & 3]
    assert ("create" in parts) == bool(flags & O_CREAT)
    assert ("trunc" in parts) == bool(flags & O_TRUNC)
    assert ("append" in parts) == bool(flags & O_APPEND)
    assert ("directory" in parts) == bool(flags & O_DIRECTORY)


# --------------------------------------------------------------------------- dedup


def test_hot_loop_is_one_record_and_one_count_per_window() -> None:
    d = Dedup(window=10.0, max_keys=100)
    out: list[FileEvent] = []
    for i in range(100_000):
        out += d.offer(ev(t=i * 1e-5), now=i * 1e-5)
    assert len(out) == 1 and out[0].count == 1  # the first open goes out at once
    out += d.flush(5.0)
    assert len(out) == 1  # the window has not ended
    out += d.flush(10.0)
    assert [r.count for r in out] == [1, 99_999]
    assert out[1].path == "/data/x" and out[1].time == 99_999 * 1e-5  # the last repeat's time


def test_failed_and_successful_opens_are_told_apart() -> None:
    d = Dedup(window=10.0)
    out = d.offer(ev(result=3), 0.0) + d.offer(ev(result=-13), 0.1) + d.offer(ev(result=4), 0.2)
    assert [r.result for r in out] == [3, -13]
    assert [r.count for r in d.flush(0.0, force=True)] == [1]


def test_cap_summarises_the_rest_of_a_window() -> None:
    d = Dedup(window=10.0, max_keys=3)
    out: list[FileEvent] = []
    for i in range(10):
        out += d.offer(ev(f"/f{i}"), 0.0)
    out += d.offer(ev("/other", alloc="a2"), 0.0)  # another allocation has its own cap
    assert [r.path for r in out] == ["/f0", "/f1", "/f2", "/other"]
    summary = d.flush(10.0)
    assert len(summary) == 1 and summary[0].suppressed and summary[0].count == 7
    assert summary[0].allocation_id == "a1" and summary[0].path == ""


events = st.lists(
    st.tuples(
        st.sampled_from(["a1", "a2"]),
        st.integers(1, 3),
        st.sampled_from(["/a", "/b", "/c", "/d"]),
        st.sampled_from(["r", "w,create"]),
        st.sampled_from([3, -2]),
        st.floats(0, 2.0),
    ),
    max_size=200,
)


@given(events, st.floats(0.5, 5.0), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_every_open_is_counted_exactly_once(raw, window: float, max_keys: int) -> None:
    d = Dedup(window=window, max_keys=max_keys)
    now = 0.0
    out: list[FileEvent] = []
    for alloc, pid, path, flags, result, dt in raw:
        now += dt
        out += d.offer(ev(path, pid=pid, alloc=alloc, result=result, flags=flags, t=now), now)
        out += d.flush(now)
    out += d.flush(now, force=True)
    assert sum(r.count for r in out) == len(raw)
    for alloc in ("a1", "a2"):  # what each allocation sent is what it is counted for
        assert sum(r.count for r in out if r.allocation_id == alloc) == sum(
            1 for e in raw if e[0] == alloc
        )
    assert all(r.count >= 1 for r in out)


@given(events, st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_a_window_ships_at_most_twice_the_cap_per_allocation(raw, max_keys: int) -> None:
    d = Dedup(window=1e9, max_keys=max_keys)  # one window
    out: list[FileEvent] = []
    for alloc, pid, path, flags, result, _ in raw:
        out += d.offer(ev(path, pid=pid, alloc=alloc, result=result, flags=flags), 0.0)
    out += d.flush(0.0, force=True)
    for alloc in ("a1", "a2"):
        mine = [r for r in out if r.allocation_id == alloc]
        assert len(mine) <= 2 * max_keys + 1  # firsts, their repeat counts, one summary


# --------------------------------------------------------------------------- the buffer


@given(st.integers(1, 50), st.integers(0, 200))
def test_outbox_keeps_the_newest_and_counts_the_rest(limit: int, n: int) -> None:
    box = Outbox(limit)
    lost = box.put(ev(f"/{i}") for i in range(n))
    assert len(box) == min(n, limit) and lost == box.dropped == max(0, n - limit)
    kept = box.peek(limit)
    assert [r.path for r in kept] == [f"/{i}" for i in range(max(0, n - limit), n)]
    box.done(len(kept))
    assert len(box) == 0


# --------------------------------------------------------------------------- /proc sampling


def test_without_ebpf_files_are_sampled_and_labelled(tmp_path: Path) -> None:
    data = tmp_path / "secret.csv"
    data.write_text("x")
    out = tmp_path / "result.bin"
    code = (
        f"import time; a = open({str(data)!r}); b = open({str(out)!r}, 'w'); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    other = subprocess.Popen(
        [sys.executable, "-c", f"import time; a = open({str(data)!r}); time.sleep(60)"],
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        modes = {"a1": MODE_AUDIT}
        target = Target(AllocLabels("a1", "n1", "t", "alice"), (proc.pid,))
        fa = FileAudit(
            "n1",
            mode_of=lambda aid: modes.get(aid, "prod"),
            set_audit=lambda aid: modes.__setitem__(aid, MODE_AUDIT),
            assigned=lambda: ["a1"],
            targets=lambda: [target],
            report=None,
            use_ebpf=False,
        )
        got = fa.step(now=time.time())
        mine = {r.path: r for r in got}
        assert set(mine) >= {str(data), str(out)}
        assert all(r.source == SOURCE_SAMPLED and r.allocation_id == "a1" for r in got)
        assert mine[str(data)].flags == "r" and mine[str(out)].flags == "w"
        assert mine[str(out)].uid == os.getuid() and mine[str(out)].user == "alice"
        assert all(r.pid == proc.pid for r in got)  # not the other process's open file
        assert fa.notes() == ["file-access:proc-sampled"]
        assert fa.step(now=time.time()) == []  # still open: not new
        modes.clear()  # audit mode ended: nothing audited, nothing said
        assert fa.step(now=time.time()) == [] and fa.notes() == []
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()
