"""logstore.py: chunks and metadata (pure round trips), and the file-system and S3
backends behaving the same (S3 = moto's real HTTP server, through aiobotocore)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_common.config import StorageConfig
from lattice_common.logstore import (
    AllocationLogs,
    ChunkInfo,
    FsLogStore,
    LogMetadata,
    LogStoreError,
    S3LogStore,
    SeqEnd,
    StreamMeta,
    after,
    decode_chunk,
    encode_chunk,
    open_log_store,
)
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY

pytestmark = pytest.mark.timeout(120)

# --------------------------------------------------------------------------- pure

TIMESTAMPS = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
LINES = st.one_of(
    st.text(),  # any unicode, empty included
    st.just(""),
    st.sampled_from(["\r", "a\rb", "tab\there", "nul\x00byte", '"quoted" \\ back', "\u2028"]),
    st.text(min_size=1, max_size=3).map(lambda s: s * 40_000),  # very long lines
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(TIMESTAMPS, LINES), max_size=40))
def test_chunk_round_trip(lines: list[tuple[float, str]]) -> None:
    data = encode_chunk(lines)
    assert decode_chunk(data) == lines
    # a chunk is plain zstd: any zstd tool reads it, one JSON object per line
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    assert raw.count(b"\n") == len(lines)


def test_chunk_text_is_json_lines() -> None:
    raw = zstandard.ZstdDecompressor().decompress(encode_chunk([(1.5, "hello")]))
    assert raw == b'{"ts":1.5,"line":"hello"}\n'


def test_not_a_chunk_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a log chunk"):
        decode_chunk(b"garbage")
    with pytest.raises(ValueError, match="not a log chunk"):
        decode_chunk(zstandard.ZstdCompressor().compress(b"[1,2]\n"))


CHUNK_INFOS = st.builds(
    ChunkInfo,
    n=st.integers(0, 10**6),
    lines=st.integers(0, 10**9),
    bytes=st.integers(0, 10**12),
    first_ts=st.none() | TIMESTAMPS,
    last_ts=st.none() | TIMESTAMPS,
)
STREAM_METAS = st.builds(
    StreamMeta,
    chunks=st.integers(0, 10**6),
    bytes=st.integers(0, 10**12),
    lines=st.integers(0, 10**9),
    first_ts=st.none() | TIMESTAMPS,
    last_ts=st.none() | TIMESTAMPS,
    complete=st.booleans(),
    offset=st.integers(0, 10**12),
    index=st.lists(CHUNK_INFOS, max_size=5),
)


@settings(max_examples=60)
@given(
    st.builds(
        LogMetadata,
        allocation_id=st.text(max_size=20),
        tenant=st.text(max_size=20),
        project=st.text(max_size=20),
        updated_at=TIMESTAMPS,
        streams=st.dictionaries(
            st.sampled_from(["stdout", "stderr"]),
            st.dictionaries(st.text(min_size=1, max_size=10), STREAM_METAS, max_size=3),
        ),
    )
)
def test_metadata_round_trip(meta: LogMetadata) -> None:
    assert msgspec.json.decode(msgspec.json.encode(meta), type=LogMetadata) == meta


def test_metadata_chunk_index_is_compact() -> None:
    info = ChunkInfo(n=3, lines=10, bytes=99, first_ts=1.0, last_ts=2.0)
    assert msgspec.json.encode(info) == b"[3,10,99,1.0,2.0]"


def test_after_joins_on_timestamp_and_count() -> None:
    end = SeqEnd(lines=5, last_ts=10.0, at_last_ts=2)
    assert not after(end, 9.0, 1)
    assert not after(end, 10.0, 1) and not after(end, 10.0, 2)
    assert after(end, 10.0, 3)
    assert after(end, 11.0, 1)
    assert after(None, 0.0, 1) and after(SeqEnd(0, None, 0), 0.0, 1)


def test_layout_and_key_components(tmp_path: Path) -> None:
    logs = AllocationLogs(FsLogStore(tmp_path), "physics", "", "a-1")
    assert logs.prefix == "physics/default/a-1/logs"
    assert logs.metadata_key == "physics/default/a-1/logs/metadata.json"
    assert (
        logs.chunk_key("stderr", "node-001", 7)
        == "physics/default/a-1/logs/stderr/node-001/chunk_000007.log.zst"
    )
    # a name cannot leave its folder
    odd = AllocationLogs(FsLogStore(tmp_path), "a/b", "p q", "x")
    assert odd.prefix == "a%2Fb/p%20q/x/logs"
    with pytest.raises(ValueError, match="cannot name a folder"):
        AllocationLogs(FsLogStore(tmp_path), "..", "p", "x")
    with pytest.raises(ValueError, match="stream"):
        logs.chunk_key("stdin", "n", 0)


def test_open_log_store_from_config(tmp_path: Path) -> None:
    fs = open_log_store(StorageConfig(log_store_dir=str(tmp_path)))
    assert isinstance(fs, FsLogStore) and fs.root == tmp_path
    assert open_log_store(StorageConfig(log_store="none")) is None
    s3 = open_log_store(
        StorageConfig(
            log_store="s3",
            log_bucket="logs",
            s3_endpoint="http://127.0.0.1:9",
            s3_access_key_id="AKIDSECRET1",  # type: ignore[arg-type]
            s3_secret_access_key="SECRETVALUE2",  # type: ignore[arg-type]
        )
    )
    assert isinstance(s3, S3LogStore) and s3.bucket == "logs"
    assert s3.name == "s3://logs at http://127.0.0.1:9"  # no credential in messages
    assert "SECRETVALUE2" not in repr(s3)
    with pytest.raises(ValueError, match="log_bucket is empty"):
        StorageConfig(log_store="s3")


# --------------------------------------------------------------------------- backends


@pytest.fixture(params=["fs", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "fs":
        yield FsLogStore(tmp_path / "store")
        return
    server = request.getfixturevalue("s3_server")
    s3 = S3LogStore(
        bucket=f"logs-{uuid.uuid4().hex[:12]}",
        endpoint_url=server.endpoint,
        access_key_id=ACCESS_KEY_ID,
        secret_access_key=SECRET_ACCESS_KEY,
    )
    await s3.create_bucket()
    try:
        yield s3
    finally:
        await s3.close()


async def test_objects_put_get_list_update(store: Any) -> None:
    assert await store.get("a/b/c") is None
    assert await store.list("a/") == []
    await store.put("a/b/c", b"one")
    await store.put("a/b/d", b"two")
    await store.put("a/x", b"three")
    await store.put("ab/y", b"four")
    assert await store.get("a/b/c") == b"one"
    assert await store.list("a/") == ["a/b/c", "a/b/d", "a/x"]
    assert await store.list("a/b/") == ["a/b/c", "a/b/d"]
    assert await store.list("a") == ["a/b/c", "a/b/d", "a/x", "ab/y"]
    await store.put("a/b/c", b"replaced")
    assert await store.get("a/b/c") == b"replaced"
    await store.update("a/n", lambda old: (old or b"") + b"1")
    await store.update("a/n", lambda old: (old or b"") + b"2")
    assert await store.get("a/n") == b"12"


async def write_run(logs: AllocationLogs, node: str, stream: str, batches: list[list[Any]]) -> None:
    """Chunks from ``batches`` (lists of (ts, line)) and this node's metadata, as an
    agent writes them; complete after the last."""
    sm = StreamMeta()
    for batch in batches:
        info = await logs.write_chunk(stream, node, sm.chunks, batch)
        sm.add(info, sum(len(t.encode()) + 1 for _, t in batch))
    sm.complete = True
    await logs.publish(node, {stream: sm})


async def test_read_merges_filters_and_tails(store: Any) -> None:
    logs = AllocationLogs(store, "t1", "proj", "alloc-1")
    out = [[(1.0, "o1"), (3.0, "o3")], [(5.0, "o5"), (5.0, "o5b")]]
    await write_run(logs, "n1", "stdout", out)
    await write_run(logs, "n1", "stderr", [[(2.0, "e2"), (4.0, "e4")]])
    await write_run(logs, "n2", "stdout", [[(2.5, "m2")]])

    r = await logs.read()
    assert r.found and r.complete
    assert [(ln.stream, ln.node_id, ln.line) for ln in r.lines] == [
        ("stdout", "n1", "o1"),
        ("stderr", "n1", "e2"),
        ("stdout", "n2", "m2"),
        ("stdout", "n1", "o3"),
        ("stderr", "n1", "e4"),
        ("stdout", "n1", "o5"),
        ("stdout", "n1", "o5b"),
    ]
    # offsets are line numbers per stream and node
    assert [ln.offset for ln in r.lines if ln.stream == "stdout" and ln.node_id == "n1"] == [
        0,
        1,
        2,
        3,
    ]
    assert r.ends[("stdout", "n1")] == SeqEnd(lines=4, last_ts=5.0, at_last_ts=2)
    assert r.ends[("stderr", "n1")] == SeqEnd(lines=2, last_ts=4.0, at_last_ts=1)

    assert [ln.line for ln in (await logs.read(stream="stderr")).lines] == ["e2", "e4"]
    assert [ln.line for ln in (await logs.read(node="n2")).lines] == ["m2"]
    assert [ln.line for ln in (await logs.read(since=2.5, until=4.0)).lines] == [
        "m2",
        "o3",
        "e4",
    ]
    assert [ln.line for ln in (await logs.read(tail=3)).lines] == ["e4", "o5", "o5b"]
    assert [ln.line for ln in (await logs.read(tail=2, stream="stdout", node="n1")).lines] == [
        "o5",
        "o5b",
    ]
    tailed = (await logs.read(tail=1, until=3.5)).lines
    assert [(ln.line, ln.offset) for ln in tailed] == [("o3", 1)]
    assert (await logs.read(tail=0)).lines == []
    assert [ln.line for ln in (await logs.read(from_ts={("stdout", "n1"): 5.0})).lines] == [
        "e2",
        "m2",
        "e4",
        "o5",
        "o5b",
    ]
    # the wire form
    assert r.lines[0].to_dict("alloc-1") == {
        "allocation_id": "alloc-1",
        "node_id": "n1",
        "stream": "stdout",
        "line": "o1",
        "timestamp": 1.0,
    }


async def test_layout_on_the_backend(store: Any) -> None:
    logs = AllocationLogs(store, "t1", "", "alloc-2")
    await write_run(logs, "node-001", "stdout", [[(1.0, "a")], [(2.0, "b")]])
    assert await store.list("t1/") == [
        "t1/default/alloc-2/logs/metadata.json",
        "t1/default/alloc-2/logs/stdout/node-001/chunk_000000.log.zst",
        "t1/default/alloc-2/logs/stdout/node-001/chunk_000001.log.zst",
    ]
    meta = await logs.metadata()
    assert meta is not None and meta.tenant == "t1" and meta.project == "default"
    sm = meta.streams["stdout"]["node-001"]
    assert (sm.chunks, sm.lines, sm.bytes, sm.first_ts, sm.last_ts, sm.complete) == (
        2,
        2,
        4,
        1.0,
        2.0,
        True,
    )
    assert [c.n for c in sm.index] == [0, 1]


async def test_incomplete_and_missing_metadata(store: Any) -> None:
    logs = AllocationLogs(store, "t1", "p", "alloc-3")
    assert not (await logs.read()).found
    # chunks without metadata (a writer that died before publishing): still read
    await logs.write_chunk("stdout", "n1", 0, [(1.0, "x")])
    r = await logs.read()
    assert r.found and not r.complete and [ln.line for ln in r.lines] == ["x"]
    # an unreadable metadata file is ignored, the listing still answers
    await store.put(logs.metadata_key, b"{not json")
    assert [ln.line for ln in (await logs.read()).lines] == ["x"]
    # a corrupt chunk is an error naming it
    await store.put(logs.chunk_key("stdout", "n1", 1), b"garbage")
    with pytest.raises(LogStoreError, match="chunk_000001"):
        await logs.read()


async def test_nodes_keep_each_others_metadata(store: Any) -> None:
    logs = AllocationLogs(store, "t1", "p", "alloc-4")
    for i in range(4):
        await logs.publish(f"n{i}", {"stdout": StreamMeta(lines=i, complete=i % 2 == 0)})
    meta = await logs.metadata()
    assert meta is not None
    assert {n: sm.lines for n, sm in meta.streams["stdout"].items()} == {
        "n0": 0,
        "n1": 1,
        "n2": 2,
        "n3": 3,
    }
    r = await logs.read()
    assert r.found and not r.complete  # n1 and n3 have not finished


async def test_windowed_reads_skip_chunks_by_the_index(store: Any) -> None:
    logs = AllocationLogs(store, "t1", "p", "alloc-5")
    await write_run(logs, "n1", "stdout", [[(float(i), f"l{i}")] for i in range(6)])
    # chunk 0 is broken, but the index says it lies before the window: never read
    await store.put(logs.chunk_key("stdout", "n1", 0), b"garbage")
    r = await logs.read(since=2.0, until=3.0)
    assert [(ln.line, ln.offset) for ln in r.lines] == [("l2", 2), ("l3", 3)]
    assert [ln.line for ln in (await logs.read(tail=2)).lines] == ["l4", "l5"]


def test_fs_update_is_exclusive_across_threads(tmp_path: Path) -> None:
    """Concurrent read-merge-writes of metadata.json lose nothing on the file system."""
    store = FsLogStore(tmp_path)
    logs = AllocationLogs(store, "t", "p", "a")

    def writer(node: str) -> None:
        async def run() -> None:
            for i in range(10):
                await logs.publish(node, {"stdout": StreamMeta(lines=i)})

        asyncio.run(run())

    threads = [threading.Thread(target=writer, args=(f"n{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meta = asyncio.run(logs.metadata())
    assert meta is not None
    assert {n: sm.lines for n, sm in meta.streams["stdout"].items()} == {
        f"n{i}": 9 for i in range(4)
    }
    # no temporary file is left behind
    assert not [p for p in tmp_path.rglob(".*")]


async def test_s3_unreachable_is_a_log_store_error() -> None:
    s3 = S3LogStore(
        bucket="b",
        endpoint_url="http://127.0.0.1:9",  # nothing listens on the discard port
        access_key_id="k",
        secret_access_key="s",
        connect_timeout=0.5,
    )
    try:
        with pytest.raises(LogStoreError, match=r"s3://b at http://127.0.0.1:9: cannot read"):
            await s3.get("k")
    finally:
        await s3.close()


async def test_fs_unwritable_is_a_log_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    store = FsLogStore(tmp_path / "file" / "below")
    with pytest.raises(LogStoreError, match="cannot write"):
        await store.put("a/b", b"x")
