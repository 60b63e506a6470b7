"""uenv: the directory registry, the verified LRU cache, and real SquashFS mounts in a job's
own mount namespace through ProcessRuntime."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.uenv import (
    UenvCache,
    UenvDisabled,
    UenvError,
    UenvHashMismatch,
    UenvNotFound,
    UenvRegistry,
    parse_ref,
)
from lattice_common.types import Allocation, AllocationReport, AllocationSpec

pytestmark = pytest.mark.timeout(60)


def publish(root: Path, entries: dict[str, bytes], *, bad_hash: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """A directory registry with one file per ref (``bad_hash``: index sha256 wrong)."""
    root.mkdir(parents=True, exist_ok=True)
    index = {}
    for ref, data in entries.items():
        name = ref.replace("/", "_").replace(":", "_") + ".sqfs"
        (root / name).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        if ref in bad_hash:
            sha = hashlib.sha256(b"something else").hexdigest()
        index[ref] = {"file": name, "sha256": sha, "size": len(data)}
    (root / "index.json").write_text(json.dumps(index))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


def make_cache(
    tmp_path: Path, entries: dict[str, bytes], max_bytes: int = 1 << 30, **kw
) -> UenvCache:
    publish(tmp_path / "registry", entries, **kw)
    return UenvCache(
        UenvRegistry(tmp_path / "registry"), tmp_path / "cache", max_bytes, clock=Clock()
    )


# ---------------------------------------------------------------------- registry


def test_parse_ref() -> None:
    assert parse_ref("prgenv-gnu/24.11:v1") == ("prgenv-gnu", "24.11", "v1")
    assert parse_ref("prgenv-gnu/24.11") == ("prgenv-gnu", "24.11", "")
    with pytest.raises(UenvNotFound, match="name/version"):
        parse_ref("no-version")


def test_resolve_exact_and_untagged(tmp_path: Path) -> None:
    publish(tmp_path, {"prgenv-gnu/24.11:v1": b"a", "prgenv-gnu/24.7:v2": b"b"})
    reg = UenvRegistry(tmp_path)
    img = reg.resolve("prgenv-gnu/24.11:v1")
    assert img.ref == "prgenv-gnu/24.11:v1"
    assert img.sha256 == hashlib.sha256(b"a").hexdigest() and img.size == 1
    assert reg.resolve("prgenv-gnu/24.11").ref == "prgenv-gnu/24.11:v1"  # the only tag


def test_unknown_ref_lists_the_available_versions(tmp_path: Path) -> None:
    publish(tmp_path, {"prgenv-gnu/24.11:v1": b"a", "prgenv-gnu/24.7:v2": b"b", "nvhpc/1:v1": b"c"})
    reg = UenvRegistry(tmp_path)
    with pytest.raises(UenvNotFound) as e:
        reg.resolve("prgenv-gnu/25.1:v1")
    assert str(e.value) == (
        "uenv prgenv-gnu/25.1:v1: not in the registry; available: "
        "prgenv-gnu/24.11:v1, prgenv-gnu/24.7:v2"
    )
    with pytest.raises(UenvNotFound, match=r"no uenv named 'cuda'.*available: nvhpc, prgenv-gnu"):
        reg.resolve("cuda/12:v1")


def test_missing_index_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UenvError, match=r"no index\.json"):
        UenvRegistry(tmp_path).resolve("a/1")


def test_disabled_cache_refuses_with_the_config_key(tmp_path: Path) -> None:
    cache = UenvCache(None, tmp_path, 100)
    with pytest.raises(UenvDisabled, match=r"node_agent\.uenv_registry is empty"):
        cache.fetch("prgenv-gnu/24.11:v1")


# ---------------------------------------------------------------------- cache


def test_fetch_copies_verified_and_hits_the_cache(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"a/1:v1": b"x" * 100})
    path = cache.fetch("a/1:v1")
    assert path.read_bytes() == b"x" * 100
    assert path.name == hashlib.sha256(b"x" * 100).hexdigest() + ".sqfs"
    (tmp_path / "registry" / "a_1_v1.sqfs").unlink()  # a hit does not read the registry file
    assert cache.fetch("a/1:v1") == path
    st = cache.status()
    assert st["used_bytes"] == 100
    assert [(i["ref"], i["size"], i["in_use"]) for i in st["images"]] == [("a/1:v1", 100, False)]


def test_hash_mismatch_is_refused_and_the_copy_removed(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"a/1:v1": b"tampered"}, bad_hash={"a/1:v1"})
    with pytest.raises(UenvHashMismatch) as e:
        cache.fetch("a/1:v1")
    expected = hashlib.sha256(b"something else").hexdigest()
    got = hashlib.sha256(b"tampered").hexdigest()
    assert str(e.value) == f"uenv a/1:v1: image hash mismatch (expected {expected}, got {got})"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []
    assert cache.status()["images"] == []


def test_lru_eviction_at_the_limit(tmp_path: Path) -> None:
    entries = {f"a/{i}:v1": bytes([i]) * 100 for i in range(4)}
    cache = make_cache(tmp_path, entries, max_bytes=300)
    for i in range(3):
        cache.fetch(f"a/{i}:v1")
    cache.fetch("a/0:v1")  # a/0 used again: a/1 is now the least recently used
    assert cache.status()["used_bytes"] == 300
    cache.fetch("a/3:v1")
    refs = {i["ref"] for i in cache.status()["images"]}  # type: ignore[union-attr]
    assert refs == {"a/0:v1", "a/2:v1", "a/3:v1"}
    assert cache.status()["used_bytes"] == 300


def test_in_use_images_are_never_evicted(tmp_path: Path) -> None:
    entries = {f"a/{i}:v1": bytes([i]) * 100 for i in range(3)}
    cache = make_cache(tmp_path, entries, max_bytes=150)
    pinned = cache.acquire("a/0:v1", "job-1")
    cache.fetch("a/1:v1")  # over the limit, but a/0 is pinned and a/1 just fetched
    assert pinned.exists()
    images = {i["ref"]: i["in_use"] for i in cache.status()["images"]}  # type: ignore[union-attr]
    assert images == {"a/0:v1": True, "a/1:v1": False}
    cache.fetch("a/2:v1")  # a/1 goes, a/0 stays pinned
    assert pinned.exists()
    assert {i["ref"] for i in cache.status()["images"]} == {"a/0:v1", "a/2:v1"}  # type: ignore[union-attr]
    cache.release("job-1")
    cache.fetch("a/2:v1")  # released: now a/0 is evictable
    assert not pinned.exists()
    assert cache.status()["used_bytes"] == 100


# ---------------------------------------------------------------------- real mounts


def _mount_support() -> str:
    if os.geteuid() != 0:
        return "needs root (mount in a private mount namespace)"
    for tool in ("mksquashfs", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    return ""


_MOUNT_SKIP = _mount_support()


@pytest.fixture(scope="module")
def squashfs_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _MOUNT_SKIP:
        pytest.skip(_MOUNT_SKIP)
    root = tmp_path_factory.mktemp("uenv-build")
    src = root / "src" / "bin"
    src.mkdir(parents=True)
    script = src / "hello-uenv"
    script.write_text('#!/bin/sh\necho "hello from the uenv $1"\n')
    script.chmod(0o755)
    image = root / "prgenv.sqfs"
    subprocess.run(
        ["mksquashfs", str(root / "src"), str(image), "-quiet", "-noappend", "-all-root"],
        check=True,
        capture_output=True,
    )
    # can this machine loop-mount it inside a private mount namespace?
    probe = root / "probe"
    probe.mkdir()
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "squashfs",
         "-o", "loop,ro", str(image), str(probe)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount squashfs here: {r.stderr.strip()}")
    return image


def _publish_image(root: Path, ref: str, image: Path, *, tamper: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(image, root / "img.sqfs")
    sha = hashlib.sha256(image.read_bytes()).hexdigest()
    if tamper:
        sha = hashlib.sha256(b"not the image").hexdigest()
    entry = {"file": "img.sqfs", "sha256": sha, "size": image.stat().st_size}
    (root / "index.json").write_text(json.dumps({ref: entry}))


def _host_mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


async def _run_uenv_job(
    tmp_path: Path, cache: UenvCache, entrypoint: str, mount_point: Path
) -> tuple[AllocationReport, list[str], ProcessRuntime]:
    changes: list[AllocationReport] = []
    rt = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "state.json",
        on_change=changes.append,
        walltime_grace_seconds=0.5,
        uenv=cache,
    )
    alloc = Allocation(
        id="u1",
        spec=AllocationSpec(
            entrypoint=entrypoint, tenant="t", vcluster="v", uenv="prgenv-gnu/24.11:v1"
        ),
    )
    seen: list[str] = []
    try:
        await rt.start(alloc, nodelist=["n1"])
        deadline = time.monotonic() + 20
        while True:
            seen.append(_host_mounts())
            (r,) = rt.reports()
            if r.phase == "exited":
                break
            assert time.monotonic() < deadline, r
            await asyncio.sleep(0.02)
    finally:
        for r in rt.reports():
            if r.pid > 0:
                with contextlib.suppress(OSError):
                    os.killpg(r.pid, signal.SIGKILL)
        await rt.close()
    seen.append(_host_mounts())
    return r, seen, rt


async def test_job_runs_a_binary_from_its_uenv_mount(tmp_path: Path, squashfs_image: Path) -> None:
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", squashfs_image)
    mount_point = tmp_path / "user-environment"
    cache = UenvCache(
        UenvRegistry(tmp_path / "registry"),
        tmp_path / "cache",
        1 << 30,
        mount_point=str(mount_point),
    )
    entry = (
        f'"{mount_point}/bin/hello-uenv" world; '
        f'grep " {mount_point} " /proc/self/mountinfo; '
        f'touch "{mount_point}/x" 2>/dev/null && echo WRITABLE; sleep 0.3'
    )
    r, seen, _ = await _run_uenv_job(tmp_path, cache, entry, mount_point)
    assert (r.exit_code, r.reason) == (0, ""), r
    out = (tmp_path / "logs" / "u1" / "stdout.log").read_text()
    assert "hello from the uenv world" in out
    mount_line = next(line for line in out.splitlines() if str(mount_point) in line)
    assert " ro," in mount_line and "squashfs" in mount_line  # read-only squashfs in the job
    assert "WRITABLE" not in out
    # the host never saw it, while the job ran or after
    assert len(seen) >= 2
    assert all(f" {mount_point} " not in m for m in seen)
    assert cache.status()["images"][0]["in_use"] is False  # type: ignore[index]  # released


async def test_tampered_image_fails_the_start_with_the_hash_error(
    tmp_path: Path, squashfs_image: Path
) -> None:
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", squashfs_image, tamper=True)
    cache = UenvCache(
        UenvRegistry(tmp_path / "registry"),
        tmp_path / "cache",
        1 << 30,
        mount_point=str(tmp_path / "mp"),
    )
    r, _, _ = await _run_uenv_job(tmp_path, cache, "echo should-not-run", tmp_path / "mp")
    assert r.exit_code is None
    assert r.reason.startswith(
        "spawn_failed: uenv prgenv-gnu/24.11:v1: image hash mismatch (expected "
    )
    assert not (tmp_path / "logs" / "u1" / "stdout.log").exists()
    assert list((tmp_path / "cache").glob("*.sqfs")) == []


async def test_a_mount_failure_fails_the_start_with_the_cause(
    tmp_path: Path, squashfs_image: Path
) -> None:
    # a registry file that verifies but is not a squashfs image: the wrapper's mount fails
    junk = tmp_path / "junk.sqfs"
    junk.write_bytes(b"not a squashfs image" * 100)
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", junk)
    mount_point = tmp_path / "mp"
    cache = UenvCache(
        UenvRegistry(tmp_path / "registry"),
        tmp_path / "cache",
        1 << 30,
        mount_point=str(mount_point),
    )
    r, seen, _ = await _run_uenv_job(tmp_path, cache, "echo should-not-run", mount_point)
    assert r.exit_code is None
    assert r.reason.startswith("spawn_failed: could not mount uenv image "), r.reason
    assert "should-not-run" not in (tmp_path / "logs" / "u1" / "stdout.log").read_text()
    assert all(f" {mount_point} " not in m for m in seen)
    assert cache.status()["images"][0]["in_use"] is False  # type: ignore[index]


async def test_a_uenv_job_on_a_node_without_registry_fails_to_start(tmp_path: Path) -> None:
    cache = UenvCache(None, tmp_path / "cache", 0)
    r, _, _ = await _run_uenv_job(tmp_path, cache, "true", tmp_path / "mp")
    assert r.reason == (
        "spawn_failed: uenv prgenv-gnu/24.11:v1: uenv is not enabled on this node "
        "(node_agent.uenv_registry is empty)"
    )
