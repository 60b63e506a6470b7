"""logship.py: output flushed into the log store with the ring buffer's timestamps, and a
restarted agent resuming exactly where the shipper got to (real files, real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent import logtail
from lattice_agent.logship import LogShipper, state_path_for
from lattice_agent.logtail import LogTail, split_lines
from lattice_agent.persist import PERSIST_LATER_SECONDS
from lattice_agent.runtime import ProcessRuntime
from lattice_common.logstore import AllocationLogs, FsLogStore, LogStoreError
from lattice_common.types import Allocation, AllocationReport, AllocationSpec

pytestmark = pytest.mark.timeout(60)


def make_alloc(aid: str, entrypoint: str = "true", project: str = "") -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(entrypoint=entrypoint, tenant="physics", vcluster="v", project=project),
    )


# --------------------------------------------------------------------------- split_lines


@settings(max_examples=200)
@given(
    data=st.lists(
        st.sampled_from([b"a", b"bc", b"\n", b"\r\n", b"\xff", "é".encode(), b"xyzw" * 3]),
        max_size=40,
    ).map(b"".join),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    limit=st.integers(1, 9),
)
def test_split_lines_does_not_depend_on_how_the_bytes_were_read(
    data: bytes, cuts: list[int], limit: int
) -> None:
    whole, ends, rest = split_lines(data, final=True, max_line=limit)
    assert rest == b""
    # every line's end points just after it (and its newline)
    start = 0
    for line, end in zip(whole, ends, strict=True):
        assert data[start : start + len(line)] == line
        assert len(line) <= limit
        start = end
    assert start == len(data)
    # read in arbitrary pieces, carrying the rest: the same lines
    pieces, prev = [], 0
    for c in sorted(set(c for c in cuts if c < len(data))):
        pieces.append(data[prev:c])
        prev = c
    pieces.append(data[prev:])
    got: list[bytes] = []
    carry = b""
    for i, p in enumerate(pieces):
        lines, _, carry = split_lines(carry + p, final=i == len(pieces) - 1, max_line=limit)
        got += lines
    assert got == whole


# --------------------------------------------------------------------------- shipper alone


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def files(d: Path) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    return {"stdout": d / "stdout.log", "stderr": d / "stderr.log"}


def append(path: Path, text: str) -> None:
    with open(path, "ab") as f:
        f.write(text.encode())


async def stored(store: FsLogStore, aid: str, project: str = "default") -> list[tuple]:
    r = await AllocationLogs(store, "physics", project, aid).read()
    return [(ln.stream, ln.line, ln.timestamp) for ln in r.lines]


async def test_flush_ships_the_ring_buffers_lines_with_its_timestamps(tmp_path: Path) -> None:
    clock = Clock()
    store = FsLogStore(tmp_path / "store")
    paths = files(tmp_path / "logs")
    tail = LogTail("a1", paths, ring_lines=100, clock=clock)
    sh = LogShipper(store, node_id="n1", state_path=tmp_path / "ship.json", interval=60)
    sh.track(make_alloc("a1", project="proj"), tail)
    append(paths["stdout"], "one\ntwo\n")
    append(paths["stderr"], "err\n")
    tail.read()
    append(paths["stdout"], "three\nunfinished")
    tail.read()
    await sh.flush()
    ring = [(r.stream, r.line, r.timestamp) for r in tail.buf]
    got = await stored(store, "a1", "proj")
    assert sorted(got, key=lambda x: x[2]) == sorted(ring, key=lambda x: x[2])
    assert ("stdout", "unfinished") not in [(s, ln) for s, ln, _ in got]  # no newline yet
    # the end: the unterminated last line is shipped, and the logs are complete
    tail.drain()
    assert await sh.finish("a1") is True
    r = await AllocationLogs(store, "physics", "proj", "a1").read(stream="stdout")
    assert [ln.line for ln in r.lines] == ["one", "two", "three", "unfinished"]
    assert r.complete
    assert r.lines[-1].timestamp == tail.buf[-1].timestamp
    await sh.close()


async def test_long_lines_and_big_output_match_the_ring_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logtail, "_MAX_LINE", 7)
    monkeypatch.setattr("lattice_agent.logship.CHUNK_MAX_BYTES", 50)
    clock = Clock()
    store = FsLogStore(tmp_path / "store")
    paths = files(tmp_path / "logs")
    tail = LogTail("a1", paths, ring_lines=10_000, clock=clock)
    sh = LogShipper(store, node_id="n1", state_path=tmp_path / "ship.json", interval=60)
    sh.track(make_alloc("a1"), tail)
    text = "".join(f"line {i} " + "x" * (i % 23) + "\n" for i in range(60))
    for i in range(0, len(text), 37):  # written and read in odd pieces
        append(paths["stdout"], text[i : i + 37])
        tail.read()
    tail.drain()
    assert await sh.finish("a1")
    ring = [(r.line, r.timestamp) for r in tail.buf]
    r = await AllocationLogs(store, "physics", "default", "a1").read()
    assert [(ln.line, ln.timestamp) for ln in r.lines] == ring
    chunks = await AllocationLogs(store, "physics", "default", "a1").chunks()
    assert len(chunks[("stdout", "n1")]) > 5  # many small chunks
    await sh.close()


async def test_store_outage_keeps_the_backlog_in_the_files(tmp_path: Path) -> None:
    clock = Clock()
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the store's folder should be")
    paths = files(tmp_path / "logs")
    tail = LogTail("a1", paths, ring_lines=100, clock=clock)
    bad = LogShipper(
        FsLogStore(blocker / "store"), node_id="n1", state_path=tmp_path / "s.json", interval=60
    )
    bad.track(make_alloc("a1"), tail)
    append(paths["stdout"], "kept\n")
    tail.read()
    await bad.flush()  # fails, logged, retried later
    tail.drain()
    assert await bad.finish("a1") is False
    assert bad.tracking("a1")
    with pytest.raises(LogStoreError):
        await bad.store.put("x/y", b"")
    await bad.close()


@pytest.mark.parametrize("crash", ["after_chunk", "after_publish"])
async def test_restart_resumes_without_duplicates_or_gaps(tmp_path: Path, crash: str) -> None:
    """Three agent lifetimes over one allocation's files, one of them ending in a crash
    right after a chunk was written (the state file and the metadata not yet updated), or
    with a state file older than the published metadata."""
    clock = Clock()
    store = FsLogStore(tmp_path / "store")
    state = tmp_path / "ship.json"
    paths = files(tmp_path / "logs")

    def agent(offsets: dict[str, int] | None) -> tuple[LogTail, LogShipper]:
        tail = LogTail("a1", paths, ring_lines=5, clock=clock, offsets=offsets)
        return tail, LogShipper(store, node_id="n1", state_path=state, interval=60)

    # first agent: lines 0..9 shipped
    tail, sh = agent(None)
    sh.track(make_alloc("a1"), tail)
    append(paths["stdout"], "".join(f"{i}\n" for i in range(10)))
    tail.read()
    await sh.flush()
    await sh.close()
    # written while no agent runs
    append(paths["stdout"], "".join(f"{i}\n" for i in range(10, 20)))

    # second agent: resumes at the shipped offset, ships 10..19, then "crashes" after
    # the chunk of 20..24 was written but before its state was saved
    sh2 = LogShipper(store, node_id="n1", state_path=state, interval=60)
    offsets = sh2.offsets("a1")
    assert offsets == {"stdout": len("".join(f"{i}\n" for i in range(10))), "stderr": 0}
    tail2 = LogTail("a1", paths, ring_lines=5, clock=clock, offsets=offsets)
    sh2.resume("a1", tail2, ended=False)
    tail2.read()
    await sh2.flush()
    saved = state.read_bytes()
    meta_key = AllocationLogs(store, "physics", "default", "a1").metadata_key
    saved_meta = await store.get(meta_key)
    append(paths["stdout"], "".join(f"{i}\n" for i in range(20, 25)))
    tail2.read()
    await sh2.flush()
    state.write_bytes(saved)  # the crash: the last chunk is in the store, not in the state
    if crash == "after_chunk":
        assert saved_meta is not None
        await store.put(meta_key, saved_meta)  # ... nor in the metadata

    # third agent: ends the allocation
    sh3 = LogShipper(store, node_id="n1", state_path=state, interval=60)
    tail3 = LogTail("a1", paths, ring_lines=5, clock=clock, offsets=sh3.offsets("a1"))
    append(paths["stdout"], "".join(f"{i}\n" for i in range(25, 30)) + "last")
    tail3.drain()
    sh3.resume("a1", tail3, ended=True)
    await sh3.flush()
    r = await AllocationLogs(store, "physics", "default", "a1").read()
    assert [ln.line for ln in r.lines] == [str(i) for i in range(30)] + ["last"]
    assert [ln.offset for ln in r.lines] == list(range(31))
    assert r.complete
    meta = await AllocationLogs(store, "physics", "default", "a1").metadata()
    assert meta is not None
    sm = meta.streams["stdout"]["n1"]
    assert sm.lines == 31 and sm.offset == paths["stdout"].stat().st_size
    assert not sh3.tracking("a1")
    assert sh3.offsets("a1") is None  # complete: a later agent ships nothing more
    await sh3.close()


async def test_requeued_run_continues_the_chunk_numbers(tmp_path: Path) -> None:
    clock = Clock()
    store = FsLogStore(tmp_path / "store")
    paths = files(tmp_path / "logs")
    for run in range(2):
        # a fresh state file each time: the chunk numbers come from the store
        sh = LogShipper(store, node_id="n1", state_path=tmp_path / f"s{run}.json", interval=60)
        offsets = {"stdout": paths["stdout"].stat().st_size if run else 0, "stderr": 0}
        tail = LogTail("a1", paths, ring_lines=10, clock=clock, offsets=offsets)
        sh.track(make_alloc("a1"), tail)
        append(paths["stdout"], f"run {run}\n")
        tail.drain()
        assert await sh.finish("a1")
        await sh.close()
    logs = AllocationLogs(store, "physics", "default", "a1")
    assert (await logs.chunks())[("stdout", "n1")] == [0, 1]
    assert [ln.line for ln in (await logs.read()).lines] == ["run 0", "run 1"]


# --------------------------------------------------------------------------- in the runtime


async def wait_exited(rt: ProcessRuntime, aid: str, timeout: float = 10.0) -> AllocationReport:
    deadline = time.monotonic() + timeout
    while True:
        for r in rt.reports():
            if r.allocation_id == aid and r.phase == "exited":
                return r
        assert time.monotonic() < deadline, f"{aid} did not exit: {rt.reports()}"
        await asyncio.sleep(0.02)


async def test_runtime_flushes_before_it_reports_the_end(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    logs = AllocationLogs(FsLogStore(store_dir), "physics", "default", "r1")
    at_report: list[dict] = []

    def on_change(report: AllocationReport) -> None:
        if report.phase == "exited":  # what the store holds when the end is reported
            meta = store_dir / "physics/default/r1/logs/metadata.json"
            at_report.append(json.loads(meta.read_text()))

    rt = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "agent-state.json",
        on_change=on_change,
        log_store=FsLogStore(store_dir),
        log_flush_interval=30,  # no periodic flush during the test: only the final one
    )
    try:
        await rt.start(
            make_alloc("r1", "for i in $(seq 1 200); do echo line $i; done; printf bye >&2"),
            nodelist=["n1"],
        )
        await wait_exited(rt, "r1")
        (meta,) = at_report
        assert meta["streams"]["stdout"]["n1"]["complete"] is True
        assert meta["streams"]["stdout"]["n1"]["lines"] == 200
        assert meta["streams"]["stderr"]["n1"]["lines"] == 1
        r = await logs.read()
        assert r.complete
        assert [ln.line for ln in r.lines if ln.stream == "stdout"] == [
            f"line {i}" for i in range(1, 201)
        ]
        assert [ln.line for ln in r.lines if ln.stream == "stderr"] == ["bye"]
        # the live view and the stored one carry the same timestamps
        ring = [(x.stream, x.line, x.timestamp) for x in rt.tail("r1")]
        assert sorted(ring) == sorted((ln.stream, ln.line, ln.timestamp) for ln in r.lines)
        state = json.loads(state_path_for(tmp_path / "agent-state.json").read_text())
        assert state["allocations"]["r1"]["complete"] is True
        rt.forget("r1")
        # the complete entry leaves with the next write, at most PERSIST_LATER_SECONDS on
        await asyncio.sleep(PERSIST_LATER_SECONDS + 0.3)
        state = json.loads(state_path_for(tmp_path / "agent-state.json").read_text())
        assert state["allocations"] == {}
    finally:
        await rt.close()


async def test_runtime_restart_mid_run_ships_every_line_once(tmp_path: Path) -> None:
    """The agent restarts while the job writes; the store ends up with every line once."""

    def runtime() -> ProcessRuntime:
        return ProcessRuntime(
            node_id="n1",
            work_dir=tmp_path / "work",
            log_dir=tmp_path / "logs",
            state_file=tmp_path / "agent-state.json",
            log_store=FsLogStore(tmp_path / "store"),
            log_flush_interval=0.2,
        )

    n = 60
    alloc = make_alloc("r2", f"for i in $(seq 1 {n}); do echo line $i; sleep 0.03; done")
    a = runtime()
    pid = 0
    try:
        await a.recover()
        await a.start(alloc, nodelist=["n1"])
        pid = a.reports()[0].pid
        await asyncio.sleep(0.7)  # some lines shipped, the job goes on
        await a.close()
        await asyncio.sleep(0.4)  # lines written while no agent runs
        b = runtime()
        try:
            assert await b.recover() == ["r2"]
            await wait_exited(b, "r2")
            r = await AllocationLogs(
                FsLogStore(tmp_path / "store"), "physics", "default", "r2"
            ).read()
            assert [ln.line for ln in r.lines] == [f"line {i}" for i in range(1, n + 1)]
            assert r.complete
            assert (
                len(
                    (
                        await AllocationLogs(
                            FsLogStore(tmp_path / "store"), "physics", "default", "r2"
                        ).chunks()
                    )[("stdout", "n1")]
                )
                >= 3
            )
        finally:
            await b.close()
    finally:
        if pid:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
