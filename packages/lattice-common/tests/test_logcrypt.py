"""logcrypt.py: sealing (round trips, tampering, wrong keys) as pure properties, and the
encrypted store over the real backends (a directory, moto's S3 server): what lands on
disk or in the bucket is never the plaintext."""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.config import StorageConfig
from lattice_common.errors import ValidationError
from lattice_common.logcrypt import (
    EncryptedLogStore,
    LogKey,
    LogKeyError,
    open_sealed,
    open_sensitive_log_store,
    parse_key,
    seal,
)
from lattice_common.logstore import (
    AllocationLogs,
    FsLogStore,
    S3LogStore,
    StreamMeta,
)
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY

pytestmark = pytest.mark.timeout(120)

KEY = LogKey(b"k" * 32)
OTHER = LogKey(b"o" * 32)
SECRET_LINE = "patient 4711: genome sample GATTACA"


@settings(max_examples=100)
@given(st.binary(max_size=4096), st.text(min_size=1, max_size=80))
def test_seal_round_trip(data: bytes, name: str) -> None:
    sealed = seal(KEY, data, name)
    assert open_sealed([KEY], sealed, name) == data
    if len(data) >= 8:
        assert data not in sealed  # the plaintext is nowhere in the object


@settings(max_examples=150)
@given(st.binary(min_size=0, max_size=512), st.data())
def test_any_byte_flip_is_detected(data: bytes, draw: st.DataObject) -> None:
    sealed = bytearray(seal(KEY, data, "t/p/a/logs/metadata.json"))
    i = draw.draw(st.integers(0, len(sealed) - 1))
    bit = draw.draw(st.integers(0, 7))
    sealed[i] ^= 1 << bit
    with pytest.raises(LogKeyError):
        open_sealed([KEY], bytes(sealed), "t/p/a/logs/metadata.json")


@settings(max_examples=50)
@given(st.binary(max_size=256), st.integers(0, 200))
def test_truncation_is_detected(data: bytes, cut: int) -> None:
    sealed = seal(KEY, data, "k")
    short = sealed[: max(0, len(sealed) - 1 - cut)]
    with pytest.raises(LogKeyError):
        open_sealed([KEY], short, "k")


def test_nonce_is_fresh_per_object() -> None:
    assert seal(KEY, b"same", "k") != seal(KEY, b"same", "k")


def test_an_object_moved_to_another_key_fails() -> None:
    sealed = seal(KEY, b"output", "t/p/a1/logs/stdout/n1/chunk_000000.log.zst")
    with pytest.raises(LogKeyError, match="failed authentication"):
        open_sealed([KEY], sealed, "t/p/a2/logs/stdout/n1/chunk_000000.log.zst")


def test_wrong_key_names_both_key_ids() -> None:
    sealed = seal(KEY, b"x", "k")
    with pytest.raises(LogKeyError) as e:
        open_sealed([OTHER], sealed, "k")
    assert KEY.id in str(e.value) and OTHER.id in str(e.value)
    assert "storage.sensitive_log_key" in str(e.value)
    # an earlier key still opens what it sealed
    assert open_sealed([OTHER, KEY], sealed, "k") == b"x"


def test_plaintext_object_is_refused() -> None:
    with pytest.raises(LogKeyError, match="not an encrypted log object"):
        open_sealed([KEY], b'{"ts":1,"line":"hello"}', "k")


def test_parse_key_forms() -> None:
    raw = os.urandom(32)
    assert parse_key(raw.hex()).id == LogKey(raw).id
    assert parse_key(base64.b64encode(raw).decode()).id == LogKey(raw).id
    assert parse_key(base64.urlsafe_b64encode(raw).decode() + "\n").id == LogKey(raw).id
    for bad in ("", "short", base64.b64encode(b"x" * 16).decode(), "zz" * 32):
        with pytest.raises(ValueError, match="32 random bytes") as e:
            parse_key(bad)
        assert bad not in str(e.value) or not bad
    assert "k" * 10 not in repr(KEY)


def test_config_requires_a_key_and_a_dedicated_pool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sensitive_log_key is not"):
        StorageConfig(sensitive_log_store="fs", sensitive_log_store_dir=str(tmp_path / "s"))
    with pytest.raises(ValueError, match="must differ"):
        StorageConfig(
            log_store_dir=str(tmp_path / "same"),
            sensitive_log_store="fs",
            sensitive_log_store_dir=str(tmp_path / "same"),
            sensitive_log_key="00" * 32,  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="must differ"):
        StorageConfig(
            log_store="s3",
            log_bucket="b",
            sensitive_log_store="s3",
            sensitive_log_bucket="b",
            sensitive_log_key="00" * 32,  # type: ignore[arg-type]
        )
    bad = StorageConfig(
        sensitive_log_store="fs",
        sensitive_log_store_dir=str(tmp_path / "s"),
        sensitive_log_key="not-a-key",  # type: ignore[arg-type]
    )
    with pytest.raises(ValidationError, match="32 random bytes") as e:
        open_sensitive_log_store(bad)
    assert "not-a-key" not in str(e.value)
    assert open_sensitive_log_store(StorageConfig()) is None


# --------------------------------------------------------------------------- backends


@pytest.fixture(params=["fs", "s3"])
async def raw_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "fs":
        yield FsLogStore(tmp_path / "sensitive")
        return
    server = request.getfixturevalue("s3_server")
    s3 = S3LogStore(
        bucket=f"sensitive-{uuid.uuid4().hex[:12]}",
        endpoint_url=server.endpoint,
        access_key_id=ACCESS_KEY_ID,
        secret_access_key=SECRET_ACCESS_KEY,
        server_side_encryption=True,
    )
    await s3.create_bucket()
    try:
        yield s3
    finally:
        await s3.close()


async def test_encrypted_store_keeps_no_plaintext(raw_store: Any) -> None:
    enc = EncryptedLogStore(raw_store, KEY)
    logs = AllocationLogs(enc, "clinic", "genomics", "a1")
    info = await logs.write_chunk("stdout", "n1", 0, [(1.0, SECRET_LINE), (2.0, "done")])
    meta = StreamMeta()
    meta.add(info, 100)
    meta.complete = True
    await logs.publish("n1", {"stdout": meta})
    # read back through the wrapper: the lines
    got = await logs.read()
    assert [ln.line for ln in got.lines] == [SECRET_LINE, "done"] and got.complete
    # the raw objects: sealed, no trace of the output, names only in the keys
    keys = await raw_store.list("")
    assert sorted(keys) == [
        "clinic/genomics/a1/logs/metadata.json",
        "clinic/genomics/a1/logs/stdout/n1/chunk_000000.log.zst",
    ]
    for k in keys:
        raw = await raw_store.get(k)
        assert raw is not None and raw.startswith(b"LLE1")
        assert SECRET_LINE.encode() not in raw and b"GATTACA" not in raw
        assert b'"lines"' not in raw  # the metadata too
    # a process with another key: a clear error, never garbage
    wrong = AllocationLogs(EncryptedLogStore(raw_store, OTHER), "clinic", "genomics", "a1")
    with pytest.raises(LogKeyError, match=f"key id {KEY.id}"):
        await wrong.read()


async def test_fs_bytes_on_disk_are_not_plaintext(tmp_path: Path) -> None:
    enc = EncryptedLogStore(FsLogStore(tmp_path / "pool"), KEY)
    await AllocationLogs(enc, "t", "p", "a").write_chunk("stderr", "n", 0, [(1.0, SECRET_LINE)])
    blobs = [p.read_bytes() for p in (tmp_path / "pool").rglob("*") if p.is_file()]
    assert blobs and all(b"GATTACA" not in b for b in blobs)


async def test_delete_removes_a_prefix_only(raw_store: Any) -> None:
    enc = EncryptedLogStore(raw_store, KEY)
    for alloc in ("a1", "a2"):
        logs = AllocationLogs(enc, "t", "p", alloc)
        await logs.write_chunk("stdout", "n1", 0, [(1.0, "x")])
        await logs.write_chunk("stdout", "n1", 1, [(2.0, "y")])
    assert await enc.delete("t/p/a1/logs/") == 2
    assert await raw_store.list("t/p/a1/") == []
    assert len(await raw_store.list("t/p/a2/")) == 2
    assert await enc.delete("t/p/a1/logs/") == 0
