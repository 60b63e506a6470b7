"""Backups through the real servers (REST and gRPC over a LocalQuorum, signed tokens):
create to a server path, a directory, S3 or back to the caller; verify (a damaged copy
is refused with the reason); restore answers the restart steps and refuses a damaged
file; only system admins; audited; scheduled snapshots with retention, to a directory
and to a real S3 server (moto), with their metrics."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from urllib.parse import quote

import msgspec
import pytest
from lattice_api.auth import Role
from lattice_api.ops import backup as ops_backup
from lattice_api.ops.backup import BackupOps, BackupScheduler, snapshots_to_prune
from lattice_common import backup as fmt
from lattice_common.config import BackupConfig, StorageConfig
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_quorum import backup
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY
from prometheus_client import REGISTRY
from served_api import Grpc, bearer, grpc_error

ADMIN = bearer("root", Role.SYSTEM_ADMIN)
pytestmark = pytest.mark.timeout(120)


def verify_url(path: object) -> str:
    return "/api/v1/admin/backup/verify?path=" + quote(str(path), safe="")


def damage(path: Path) -> Path:
    bad = path.with_name("damaged.lattice")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one byte
    bad.write_bytes(bytes(data))
    return bad


async def test_create_verify_restore_over_rest(served, tmp_path: Path) -> None:
    api, _world, rest, _channel = served
    revision = api.quorum.revision  # the audit entry of the backup comes after it
    status, info = await rest.call("POST", "/api/v1/admin/backup", ADMIN, {"path": f"{tmp_path}/"})
    assert status == 200, info
    path = Path(info["path"])
    assert path.parent == tmp_path and path.name.startswith("backup-")
    assert path.name.endswith("Z.lattice")
    assert info["checksum"] == fmt.checksum(path.read_bytes())
    assert (info["allocations"], info["nodes"], info["tenants"], info["vclusters"]) == (3, 3, 2, 1)
    assert info["revision"] == revision and info["format_version"] == 1
    _report, state = backup.verify(path.read_bytes())
    assert msgspec.msgpack.encode(state.allocations) == msgspec.msgpack.encode(
        api.quorum.state.allocations
    )

    status, got = await rest.call("GET", verify_url(path), ADMIN)
    assert status == 200 and got["valid"] is True and got["checksum"] == info["checksum"]

    bad = damage(path)
    status, got = await rest.call("GET", verify_url(bad), ADMIN)
    assert status == 200 and got["valid"] is False
    assert "corrupted: checksum mismatch" in got["message"] and got["hint"]

    status, got = await rest.call("POST", "/api/v1/admin/restore", ADMIN, {"path": str(bad)})
    assert status == 400 and "corrupted" in got["error"]["message"]
    status, got = await rest.call("POST", "/api/v1/admin/restore", ADMIN, {"path": str(path)})
    assert status == 200, got
    assert f"--recover-from {path} --bootstrap" in got["message"]
    assert got["info"]["checksum"] == info["checksum"]

    status, got = await rest.call("GET", verify_url("/nope/x"), ADMIN)
    assert status == 404 and "no backup file" in got["error"]["message"]


async def test_download_sends_the_file_back(served) -> None:
    api, _world, rest, _channel = served
    revision = api.quorum.revision
    async with rest.session.post(
        rest.url + "/api/v1/admin/backup", json={"download": True}, headers=ADMIN
    ) as r:
        assert r.status == 200 and r.content_type == "application/octet-stream"
        data = await r.read()
        assert r.headers["X-Lattice-Backup-Checksum"] == fmt.checksum(data)
    report, _view = fmt.verify(data)  # the CLI's own check
    assert report.counts["allocations"] == 3 and report.header.revision == revision


async def test_only_system_admins(served, tmp_path: Path) -> None:
    _api, _world, rest, channel = served
    for who in (bearer("alice"), bearer("ops", Role.OPERATOR), bearer("ta", Role.TENANT_ADMIN)):
        status, _ = await rest.call("POST", "/api/v1/admin/backup", who, {"path": str(tmp_path)})
        assert status == 403
        status, _ = await rest.call("GET", verify_url("x"), who)
        assert status == 403
        status, _ = await rest.call("POST", "/api/v1/admin/restore", who, {"path": "x"})
        assert status == 403
    g = Grpc(channel, bearer("alice"))
    status_name, _err = await grpc_error(
        g.admin.create_backup(v1.CreateBackupRequest(path=str(tmp_path)))
    )
    assert status_name == "PERMISSION_DENIED"
    assert list(tmp_path.iterdir()) == []


async def test_grpc_and_the_audit_log(served, tmp_path: Path) -> None:
    api, _world, rest, channel = served
    g = Grpc(channel, bearer("ops", Role.SYSTEM_ADMIN))
    target = tmp_path / "nightly.lattice"
    info = await g.admin.create_backup(v1.CreateBackupRequest(path=str(target)))
    assert info.path == str(target) and target.exists() and info.tenants == 2
    got = await g.admin.verify_backup(v1.VerifyBackupRequest(path=str(target)))
    assert got.valid and got.info.checksum == info.checksum and got.info.allocations == 3
    got = await g.admin.verify_backup(v1.VerifyBackupRequest(path=str(damage(target))))
    assert not got.valid and "checksum mismatch" in got.message
    out = await g.admin.restore_backup(v1.RestoreBackupRequest(path=str(target)))
    assert "--recover-from" in out.message and out.info.revision == info.revision

    await api.ops.recorder.flush(timeout=5)
    status, body = await rest.call("GET", "/api/v1/admin/audit", ADMIN, action="backup.")
    assert status == 200
    actions = [(e["actor"], e["action"], e["details"]["path"]) for e in body["entries"]]
    assert actions == [
        ("ops", "backup.create", str(target)),
        ("ops", "backup.restore", str(target)),
    ]


def test_retention_keeps_the_newest() -> None:
    names = [f"snap-2026010{i}T000000Z.bin" for i in range(1, 8)] + ["snap-latest.bin", "x"]
    assert snapshots_to_prune(names, 5) == [
        "snap-20260101T000000Z.bin",
        "snap-20260102T000000Z.bin",
    ]
    assert snapshots_to_prune(names[:3], 5) == []


async def _three_snapshots(ops: BackupOps) -> None:
    for day in (1, 2, 3):
        await ops.scheduled_snapshot(now=1767225600.0 + day * 86400)


async def test_scheduled_snapshots_to_a_directory(served, tmp_path: Path) -> None:
    api, _world, _rest, _channel = served
    ops = BackupOps(
        api.quorum, config=BackupConfig(destination=str(tmp_path / "raft"), retention_count=2)
    )
    await _three_snapshots(ops)
    names = sorted(p.name for p in (tmp_path / "raft").iterdir())
    assert names == ["snap-20260103T000000Z.bin", "snap-20260104T000000Z.bin", "snap-latest.bin"]
    latest = (tmp_path / "raft" / "snap-latest.bin").read_bytes()
    assert latest == (tmp_path / "raft" / "snap-20260104T000000Z.bin").read_bytes()
    got = await ops.verify(bearer("x"), "")  # no path: the latest scheduled snapshot
    assert got["valid"] and got["path"].endswith("snap-latest.bin")


async def test_scheduled_snapshots_to_s3(served, s3_server) -> None:
    api, _world, _rest, _channel = served
    bucket = f"lattice-backup-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(s3_server.create_bucket, bucket)
    storage = StorageConfig(
        s3_endpoint=s3_server.endpoint,
        s3_access_key_id=ACCESS_KEY_ID,
        s3_secret_access_key=SECRET_ACCESS_KEY,
    )
    ops = BackupOps(
        api.quorum,
        config=BackupConfig(destination=f"s3://{bucket}/raft", retention_count=2),
        storage=storage,
    )
    try:
        await _three_snapshots(ops)
        keys = await ops.storage.list(ops_backup.parse_location(f"s3://{bucket}/raft/"))
        assert keys == ["snap-20260103T000000Z.bin", "snap-20260104T000000Z.bin", "snap-latest.bin"]
        got = await ops.verify(bearer("x"), f"s3://{bucket}/raft/snap-latest.bin")
        assert got["valid"] and got["allocations"] == 3
        info = await ops.create(bearer("x"), f"s3://{bucket}/manual/")
        assert info["path"].startswith(f"s3://{bucket}/manual/backup-")
        assert (await ops.verify(bearer("x"), info["path"]))["valid"]
    finally:
        await ops.storage.close()


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_the_scheduler_runs_on_the_leader_and_counts_failures(served, tmp_path) -> None:
    api, _world, _rest, _channel = served
    good = BackupOps(
        api.quorum,
        config=BackupConfig(schedule_interval_seconds=0.1, destination=str(tmp_path / "s")),
    )
    sched = BackupScheduler(good)
    before = _sample("lattice_backup_last_success_timestamp_seconds")
    sched.start()
    try:
        for _ in range(200):
            # the success is counted once the snapshot call returns, after the file
            if (tmp_path / "s" / "snap-latest.bin").exists() and _sample(
                "lattice_backup_last_success_timestamp_seconds"
            ) > before:
                break
            await asyncio.sleep(0.05)
        assert (tmp_path / "s" / "snap-latest.bin").exists()
        assert _sample("lattice_backup_last_success_timestamp_seconds") > before
    finally:
        await sched.stop()

    (tmp_path / "file").write_text("not a directory")
    bad = BackupOps(
        api.quorum,
        config=BackupConfig(schedule_interval_seconds=0.1, destination=str(tmp_path / "file")),
    )
    failures = _sample("lattice_backup_failures_total")
    sched = BackupScheduler(bad)
    sched.start()
    try:
        for _ in range(200):
            if _sample("lattice_backup_failures_total") > failures:
                break
            await asyncio.sleep(0.05)
        assert _sample("lattice_backup_failures_total") > failures
        # the quorum is not held up
        assert api.quorum.read(lambda st: st.revision) == api.quorum.revision
    finally:
        await sched.stop()

    api.quorum.set_leader(False)  # a follower never writes snapshots
    follower = BackupOps(
        api.quorum,
        config=BackupConfig(schedule_interval_seconds=0.05, destination=str(tmp_path / "f")),
    )
    sched = BackupScheduler(follower)
    sched.start()
    await asyncio.sleep(0.5)
    await sched.stop()
    assert not (tmp_path / "f").exists()


def test_locations_and_names() -> None:
    loc = ops_backup.parse_location("s3://lattice-backup/raft/")
    assert (loc.kind, loc.bucket, loc.path) == ("s3", "lattice-backup", "raft/")
    assert str(loc.join("snap-latest.bin")) == "s3://lattice-backup/raft/snap-latest.bin"
    assert str(ops_backup.parse_location("s3://b").join("x.bin")) == "s3://b/x.bin"
    assert ops_backup.parse_location("/var/lib/lattice/backups").kind == "fs"
    with pytest.raises(ValidationError, match="no bucket"):
        ops_backup.parse_location("s3:///key")
    assert ops_backup.backup_name(1772712000.0) == "backup-20260305T120000Z.lattice"
    assert ops_backup.snapshot_name(1772712000.0) == "snap-20260305T120000Z.bin"
