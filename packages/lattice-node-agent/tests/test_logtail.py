"""logtail.py: files tailed into the ring buffer, follow, and recovery of the last lines."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from lattice_agent import logtail
from lattice_agent.logtail import LogTail, check_stream, read_last_lines, tail_files

pytestmark = pytest.mark.timeout(30)


def files(tmp_path: Path) -> dict[str, Path]:
    return {"stdout": tmp_path / "stdout.log", "stderr": tmp_path / "stderr.log"}


def new_tail(tmp_path: Path, ring: int = 100, **kw: object) -> LogTail:
    return LogTail("a1", files(tmp_path), ring_lines=ring, clock=lambda: 7.0, **kw)  # type: ignore[arg-type]


def write(path: Path, text: str) -> None:
    with open(path, "ab") as f:
        f.write(text.encode())


def texts(records: list[logtail.LogRecord]) -> list[tuple[str, str]]:
    return [(r.stream, r.line) for r in records]


def test_check_stream() -> None:
    for ok in ("both", "stdout", "stderr"):
        check_stream(ok)
    with pytest.raises(ValueError, match="stdout, stderr or both"):
        check_stream("stdin")


def test_read_last_lines(tmp_path: Path) -> None:
    f = tmp_path / "f"
    assert read_last_lines(f, 3) == []
    f.write_bytes(b"one\r\ntwo\nthree\nfour\n")
    assert read_last_lines(f, None) == ["one", "two", "three", "four"]
    assert read_last_lines(f, 2) == ["three", "four"]
    assert read_last_lines(f, 0) == []
    # only the last 12 bytes are read: the first, cut line is left out
    assert read_last_lines(f, None, max_bytes=12) == ["three", "four"]


def test_tail_files_reads_both_streams_with_the_file_time(tmp_path: Path) -> None:
    p = files(tmp_path)
    p["stdout"].write_text("o1\no2\n")
    p["stderr"].write_text("e1\n")
    os.utime(p["stdout"], (100, 100))
    out = tail_files("a1", p, None, "both")
    assert texts(out) == [("stdout", "o1"), ("stdout", "o2"), ("stderr", "e1")]
    assert out[0].timestamp == 100
    assert texts(tail_files("a1", p, 1, "stdout")) == [("stdout", "o2")]
    assert tail_files("a1", files(tmp_path / "missing"), None, "both") == []


def test_read_keeps_partial_lines_until_their_newline(tmp_path: Path) -> None:
    t = new_tail(tmp_path)
    p = files(tmp_path)
    write(p["stdout"], "hello\nwor")
    write(p["stderr"], "oops\n")
    assert not t.read()
    assert texts(list(t.buf)) == [("stdout", "hello"), ("stderr", "oops")]
    assert t.buf[0].timestamp == 7.0
    write(p["stdout"], "ld\n")
    t.read()
    assert texts(t.buffered(1, "stdout")) == [("stdout", "world")]
    write(p["stdout"], "no newline")
    t.drain()
    assert t.drained
    assert texts(t.buffered(None, "stdout"))[-1] == ("stdout", "no newline")
    assert t.files == {}


def test_ring_buffer_is_bounded_and_counts_every_line(tmp_path: Path) -> None:
    t = new_tail(tmp_path, ring=3)
    write(files(tmp_path)["stdout"], "".join(f"{i}\n" for i in range(10)))
    t.drain()
    assert [r.line for r in t.buf] == ["7", "8", "9"]
    assert t.total == 10


def test_offsets_from_spawn_skip_earlier_output(tmp_path: Path) -> None:
    p = files(tmp_path)
    write(p["stdout"], "old run\n")
    t = new_tail(tmp_path, offsets={"stdout": len("old run\n"), "stderr": 0})
    write(p["stdout"], "new run\n")
    t.drain()
    assert [r.line for r in t.buf] == ["new run"]


def test_resume_starts_near_the_end_and_skips_the_cut_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logtail, "RECOVER_TAIL_BYTES", 10)
    write(files(tmp_path)["stdout"], "aaaa\nbbbb\ncccc\n")
    t = new_tail(tmp_path, resume=True)
    t.drain()
    assert [r.line for r in t.buf] == ["cccc"]


def test_truncated_file_is_read_from_the_start(tmp_path: Path) -> None:
    p = files(tmp_path)
    write(p["stdout"], "first line\n")
    t = new_tail(tmp_path)
    t.read()
    p["stdout"].write_text("x\n")
    t.read()
    assert [r.line for r in t.buf] == ["first line", "x"]


def test_very_long_lines_are_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logtail, "_MAX_LINE", 4)
    write(files(tmp_path)["stdout"], "abcdefghij")
    t = new_tail(tmp_path)
    t.read()
    assert [r.line for r in t.buf] == ["abcd", "efgh"]
    t.drain()
    assert [r.line for r in t.buf] == ["abcd", "efgh", "ij"]


async def test_run_tails_until_done_then_follow_ends(tmp_path: Path) -> None:
    p = files(tmp_path)
    t = new_tail(tmp_path)
    done = asyncio.Event()
    task = asyncio.create_task(t.run(done))
    write(p["stdout"], "one\n")

    async def collect(stream: str) -> list[tuple[str, str]]:
        return [(r.stream, r.line) async for r in t.follow(stream, None)]

    follower = asyncio.create_task(collect("both"))
    errs = asyncio.create_task(collect("stderr"))
    await asyncio.sleep(0.3)
    write(p["stderr"], "two\n")
    write(p["stdout"], "three")
    await asyncio.sleep(0.3)
    done.set()
    await asyncio.wait_for(task, 5)
    assert t.drained
    got = await asyncio.wait_for(follower, 5)
    assert got == [("stdout", "one"), ("stderr", "two"), ("stdout", "three")]
    assert await asyncio.wait_for(errs, 5) == [("stderr", "two")]
    # following a drained tail replays the last lines and ends
    assert [r.line async for r in t.follow("both", 1)] == ["three"]
    assert [r.line async for r in t.follow("both", 0)] == []
