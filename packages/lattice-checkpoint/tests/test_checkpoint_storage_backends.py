"""Checkpoint storage backends against real storage: a directory, and a real S3-compatible
HTTP server (moto's server mode, through aiobotocore). The same tests run on both; the
outage test kills a moto_server process and starts it again."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_checkpoint.storage import (
    STORAGE_UNAVAILABLE,
    AllocationKey,
    CheckpointStorageError,
    CheckpointStore,
    LocalCheckpointStore,
    S3CheckpointStore,
    StorageOutageTracker,
    Transition,
    open_checkpoint_store,
    store_from_config,
    sweep_expired_checkpoints,
)
from lattice_common.config import StorageConfig, load_config
from lattice_common.types import Allocation, AllocationSpec, AllocationState
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, MotoS3Process
from prometheus_client import REGISTRY

KEY = AllocationKey("physics", "lhc", "a-1")
DAY = 86400.0


def _s3_config(endpoint: str) -> StorageConfig:
    return StorageConfig(
        s3_endpoint=endpoint,
        s3_access_key_id=ACCESS_KEY_ID,
        s3_secret_access_key=SECRET_ACCESS_KEY,
    )


def _gauge() -> float | None:
    return REGISTRY.get_sample_value("lattice_checkpoint_storage_unavailable")


@pytest.fixture(params=["fs", "s3"])
async def store(request: Any, tmp_path: Path) -> AsyncIterator[CheckpointStore]:
    if request.param == "fs":
        root = tmp_path / "checkpoints"
        root.mkdir()
        s: CheckpointStore = open_checkpoint_store(str(root), probe_bytes=256 << 10)
    else:
        server = request.getfixturevalue("s3_server")
        bucket = f"ckpt-{uuid.uuid4().hex[:10]}"
        s = open_checkpoint_store(
            f"s3://{bucket}/site-a", _s3_config(server.endpoint), probe_bytes=256 << 10
        )
        assert isinstance(s, S3CheckpointStore)
        s.part_bytes = 5 << 20  # the smallest S3 allows, so a small file goes multipart
        await s.create_bucket()
    try:
        yield s
    finally:
        await s.close()


def _write_checkpoint(d: Path, big: int = 0) -> dict[str, bytes]:
    files = {
        "state.bin": os.urandom(300_000),
        "meta.json": b'{"step": 4200}',
        "shards/rank-0.pt": os.urandom(70_000),
        "shards/rank-1.pt": os.urandom(70_000),
        "empty": b"",
    }
    if big:
        files["shards/optimizer.pt"] = os.urandom(big)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return files


async def test_probe_writes_reads_back_and_deletes(store: CheckpointStore) -> None:
    result = await store.probe()
    assert result.ok, result.error
    assert result.error is None
    assert result.write_bandwidth_bytes_per_s > 0
    # the probe leaves nothing behind that looks like an allocation
    assert await store.list_allocations() == []


async def test_upload_list_size_download_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    app_dir = tmp_path / "node-local" / "ckpt"
    files = _write_checkpoint(app_dir, big=11 << 20)  # 11 MiB: three parts on S3
    total = sum(len(b) for b in files.values())

    assert await store.upload(app_dir, KEY, "c1") == total
    assert await store.upload(app_dir, KEY, "c2") == total
    assert await store.list_checkpoints(KEY) == ["c1", "c2"]
    assert await store.list_allocations() == [KEY]
    assert await store.checkpoint_size(KEY, "c1") == total
    assert await store.checkpoint_size(KEY, "nope") == 0
    assert await store.list_checkpoints(AllocationKey("physics", "lhc", "other")) == []

    back = tmp_path / "resume"
    assert await store.download(KEY, "c1", back) == total
    for rel, data in files.items():
        assert (back / rel).read_bytes() == data, rel

    assert await store.delete_checkpoint(KEY, "c2") == len(files)
    assert await store.list_checkpoints(KEY) == ["c1"]
    assert await store.delete_checkpoint(KEY, "c2") == 0
    with pytest.raises(CheckpointStorageError):
        await store.download(KEY, "c2", tmp_path / "gone")


async def test_upload_of_a_missing_directory_is_refused(
    store: CheckpointStore, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointStorageError) as e:
        await store.upload(tmp_path / "never-written", KEY, "c1")
    assert "no checkpoint directory" in e.value.message
    assert await store.list_checkpoints(KEY) == []


async def test_delete_allocation_removes_only_checkpoints(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "c"
    _write_checkpoint(src)
    await store.upload(src, KEY, "c1")
    await store.upload(src, KEY, "c2")
    other = AllocationKey("physics", "lhc", "a-2")
    await store.upload(src, other, "c1")
    output = await _put_output(store, KEY)  # the user's output beside checkpoints/

    assert await store.delete_allocation(KEY) == 10
    assert await store.list_checkpoints(KEY) == []
    assert await store.list_checkpoints(other) == ["c1"]
    assert await _output_still_there(store, output)


async def test_retention_sweep_deletes_only_expired_checkpoints_of_ended_allocations(
    store: CheckpointStore, tmp_path: Path
) -> None:
    now = 50 * DAY
    allocs = {
        "done-8d": (AllocationState.COMPLETED, now - 8 * DAY),
        "failed-30d": (AllocationState.FAILED, now - 30 * DAY),
        "done-1d": (AllocationState.COMPLETED, now - 1 * DAY),
        "suspended": (AllocationState.SUSPENDED, now - 20 * DAY),
        "running": (AllocationState.RUNNING, None),
        "unknown": None,  # checkpoints of an allocation no one knows of: kept
    }
    src = tmp_path / "c"
    _write_checkpoint(src)
    known: list[Allocation] = []
    for aid, what in allocs.items():
        await store.upload(src, AllocationKey("physics", "lhc", aid), "c1")
        if what is not None:
            spec = AllocationSpec(entrypoint="x", tenant="physics", vcluster="ml", project="lhc")
            known.append(Allocation(id=aid, spec=spec, state=what[0], finished_at=what[1]))

    asked: list[list[str]] = []

    async def lookup(ids: list[str]) -> list[Allocation]:
        asked.append(ids)  # the quorum's live state and the history store, in the broker
        return [a for a in known if a.id in ids]

    report = await sweep_expired_checkpoints(store, lookup, now=now, retention_seconds=7 * DAY)
    assert asked == [sorted(allocs)]
    assert sorted(k.alloc for k in report.deleted) == ["done-8d", "failed-30d"]
    assert report.objects_deleted == 10 and report.errors == []
    left = {k.alloc for k in await store.list_allocations()}
    assert left == {"done-1d", "suspended", "running", "unknown"}

    # a second sweep finds nothing more; a day later "done-1d" is still kept (2 days < 7)
    again = await sweep_expired_checkpoints(store, known, now=now + DAY, retention_seconds=7 * DAY)
    assert again.deleted == []
    later = await sweep_expired_checkpoints(
        store, known, now=now + 6 * DAY, retention_seconds=7 * DAY
    )
    assert [k.alloc for k in later.deleted] == ["done-1d"]


# --- the local backend's failures -----------------------------------------------------


async def test_local_missing_root_is_not_ok_and_not_created(tmp_path: Path) -> None:
    root = tmp_path / "not-mounted"
    store = open_checkpoint_store(str(root))
    result = await store.probe()
    assert not result.ok and result.write_bandwidth_bytes_per_s == 0.0
    assert "does not exist" in (result.error or "") and "mounted" in (result.error or "")
    assert not root.exists()  # never written onto the empty mount point
    with pytest.raises(CheckpointStorageError) as e:
        await store.list_allocations()
    assert "Hint: " in e.value.render()


async def test_local_root_that_is_a_file_is_not_ok(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    result = await LocalCheckpointStore(tmp_path / "f").probe()
    assert not result.ok and "not a directory" in (result.error or "")


@contextlib.contextmanager
def _read_only_dir(path: Path) -> Iterator[None]:
    """A directory no write succeeds in: a read-only tmpfs as root (root ignores mode
    bits), mode 0555 otherwise."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("running as root without mount(8): no read-only directory to test with")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {r.stderr.decode()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


async def test_local_read_only_root_is_not_ok(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    with _read_only_dir(root):
        result = await open_checkpoint_store(str(root)).probe()
        assert not result.ok and result.write_bandwidth_bytes_per_s == 0.0
        assert "cannot" in (result.error or "")
        assert ("Read-only file system" in result.error) or ("Permission denied" in result.error)
        src = tmp_path / "c"
        _write_checkpoint(src)
        with pytest.raises(CheckpointStorageError):
            await open_checkpoint_store(str(root)).upload(src, KEY, "c1")


async def test_local_checkpoint_written_in_place_is_not_copied(tmp_path: Path) -> None:
    root = tmp_path / "nfs"
    root.mkdir()
    store = open_checkpoint_store(str(root))
    in_place = Path(store.checkpoint_path(KEY.tenant, KEY.project, KEY.alloc, "c1"))
    files = _write_checkpoint(in_place)
    assert await store.upload(in_place, KEY, "c1") == sum(len(b) for b in files.values())
    assert await store.list_checkpoints(KEY) == ["c1"]


# --- S3: a missing bucket, and an outage ------------------------------------------------


async def test_store_from_the_configuration_uses_the_storage_section(s3_server: Any) -> None:
    """checkpoint_root s3://... with the storage section's endpoint and credentials, as an
    operator sets them (the environment here, the same as config.yaml)."""
    cfg = load_config(
        None,
        env={
            "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": "s3://ckpt-from-config/prod",
            "LATTICE_CHECKPOINT__RETENTION_DAYS": "3",
            **s3_server.env("unused-log-bucket"),
        },
    )
    assert cfg.checkpoint.retention_days == 3.0
    store = store_from_config(cfg, probe_bytes=4096)
    assert isinstance(store, S3CheckpointStore)
    try:
        await store.create_bucket()
        result = await store.probe()
        assert result.ok, result.error
        assert store.checkpoint_path("t", "p", "a", "ckpt-1") == (
            "s3://ckpt-from-config/prod/t/p/a/checkpoints/ckpt-1/"
        )
    finally:
        await store.close()


async def test_s3_missing_bucket_probe_is_not_ok_and_uploads_fail(
    s3_server: Any, tmp_path: Path
) -> None:
    store = open_checkpoint_store("s3://no-such-bucket-here", _s3_config(s3_server.endpoint))
    assert isinstance(store, S3CheckpointStore)
    store.part_bytes = 5 << 20
    _write_checkpoint(tmp_path / "c", big=6 << 20)  # a multipart upload among the PUTs
    try:
        result = await store.probe()
        with pytest.raises(CheckpointStorageError) as e:
            await store.upload(tmp_path / "c", KEY, "c1")
    finally:
        await store.close()
    assert not result.ok
    assert "NoSuchBucket" in (result.error or "")
    assert "s3://no-such-bucket-here" in (result.error or "")
    assert "NoSuchBucket" in e.value.message
    assert "bucket exists" in e.value.hint


async def test_s3_endpoint_that_never_answers_fails_the_probe_at_its_timeout() -> None:
    # a listening socket nobody serves: connections open, requests hang (a wedged gateway)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        store = open_checkpoint_store("s3://ckpt-hung", _s3_config(endpoint), probe_timeout_s=1.5)
        t0 = time.monotonic()
        try:
            result = await store.probe()
        finally:
            await store.close()
    assert time.monotonic() - t0 < 10.0
    assert not result.ok
    assert "did not finish within 1.5 s" in (result.error or "")


@pytest.fixture
def s3_process() -> Iterator[MotoS3Process]:
    with MotoS3Process() as server:
        yield server


async def test_s3_outage_marks_storage_unavailable_and_recovery_clears_it(
    s3_process: MotoS3Process,
) -> None:
    cfg = _s3_config(s3_process.endpoint)
    store = open_checkpoint_store("s3://ckpt-outage/lattice", cfg, probe_timeout_s=20.0)
    assert isinstance(store, S3CheckpointStore)
    tracker = StorageOutageTracker(failures_to_unavailable=2)
    try:
        await store.create_bucket()
        ok = await store.probe()
        assert ok.ok and ok.write_bandwidth_bytes_per_s > 0
        assert tracker.observe(ok) is Transition.NONE
        assert _gauge() == 0.0

        s3_process.stop()  # the S3 service goes away: connections refused
        t0 = time.monotonic()
        first = await store.probe()
        took = time.monotonic() - t0
        assert not first.ok and first.write_bandwidth_bytes_per_s == 0.0
        assert "probe write failed" in (first.error or "")
        assert s3_process.endpoint in (first.error or "")
        assert took < 15.0  # refused connections fail the probe (retried), not the timeout
        assert tracker.observe(first) is Transition.NONE and _gauge() == 0.0
        assert tracker.observe(await store.probe()) is Transition.BECAME_UNAVAILABLE
        assert tracker.unavailable and _gauge() == 1.0
        assert tracker.write_bandwidth_bytes_per_s == 0.0
        with pytest.raises(CheckpointStorageError) as e:
            await store.list_checkpoints(KEY)
        assert "Hint: " in e.value.render()

        s3_process.start()  # back on the same endpoint; moto keeps no data across restarts
        await store.create_bucket()
        back = await store.probe()
        assert back.ok, back.error
        assert tracker.observe(back) is Transition.RECOVERED
        assert not tracker.unavailable and _gauge() == 0.0
        assert tracker.write_bandwidth_bytes_per_s > 0
    finally:
        await store.close()
        STORAGE_UNAVAILABLE.set(0)


# --- helpers ---------------------------------------------------------------------------


async def _put_output(store: CheckpointStore, key: AllocationKey) -> Any:
    if isinstance(store, LocalCheckpointStore):
        out = Path(store.root.path) / key.tenant / key.project / key.alloc / "output.txt"
        out.write_text("results")
        return out
    assert isinstance(store, S3CheckpointStore)
    client = await store._client()
    out = f"{store._prefix}{key.tenant}/{key.project}/{key.alloc}/output.txt"
    await client.put_object(Bucket=store.root.bucket, Key=out, Body=b"results")
    return out


async def _output_still_there(store: CheckpointStore, out: Any) -> bool:
    if isinstance(store, LocalCheckpointStore):
        return bool(out.read_text() == "results")
    assert isinstance(store, S3CheckpointStore)
    client = await store._client()
    resp = await client.get_object(Bucket=store.root.bucket, Key=out)
    async with resp["Body"] as body:
        return bool(await body.read() == b"results")
