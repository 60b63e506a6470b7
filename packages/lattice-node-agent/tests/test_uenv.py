"""uenv: directory and HTTP registries, signatures, the verified LRU cache, the image
resolved at submit, views read from real images, and real SquashFS mounts in a job's own
mount namespace through ProcessRuntime (with a view's variables)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from lattice_agent import uenv as uenv_module
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.spawn import environment
from lattice_agent.uenv import (
    UenvCache,
    UenvChanged,
    UenvDisabled,
    UenvError,
    UenvHashMismatch,
    UenvNotFound,
    UenvRegistry,
    UenvSignatureError,
    UenvUnreachable,
    parse_ref,
)
from lattice_common.types import Allocation, AllocationReport, AllocationSpec
from lattice_common.uenv_registry import sign_index_entry
from lattice_test_harness.uenv_images import build_squashfs, index_entry, mount_support

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


_MOUNT_SKIP = mount_support()


@pytest.fixture(scope="module")
def squashfs_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _MOUNT_SKIP:
        pytest.skip(_MOUNT_SKIP)
    root = tmp_path_factory.mktemp("uenv-build")
    image = build_squashfs(
        root / "prgenv.sqfs", {"bin/hello-uenv": '#!/bin/sh\necho "hello from the uenv $1"\n'}
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
    wrong = hashlib.sha256(b"not the image").hexdigest() if tamper else ""
    entry = index_entry(root / "img.sqfs", sha256=wrong)
    (root / "index.json").write_text(json.dumps({ref: entry}))


def _host_mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


async def _run_uenv_job(
    tmp_path: Path,
    cache: UenvCache,
    entrypoint: str,
    mount_point: Path,
    *,
    view: str = "",
    uenv_sha256: str = "",
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
            entrypoint=entrypoint,
            tenant="t",
            vcluster="v",
            uenv="prgenv-gnu/24.11:v1",
            view=view,
        ),
        uenv_sha256=uenv_sha256,
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


# ---------------------------------------------------------------------- HTTP registry


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real HTTP server (stdlib, in a thread) serving ``tmp_path/www``: (URL, dir)."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_downloads_from_an_http_registry(tmp_path: Path, http_root: tuple[str, Path]) -> None:
    url, root = http_root
    data = os.urandom(3 * (1 << 20) + 17)  # several chunks, streamed while hashing
    publish(root, {"a/1:v1": data, "b/1:v1": b"tampered"}, bad_hash={"b/1:v1"})
    cache = UenvCache(UenvRegistry(url), tmp_path / "cache", 1 << 30, clock=Clock())
    path = cache.fetch("a/1")
    assert path.read_bytes() == data
    assert path.name == hashlib.sha256(data).hexdigest() + ".sqfs"
    with pytest.raises(UenvHashMismatch, match=r"uenv b/1:v1: image hash mismatch"):
        cache.fetch("b/1:v1")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".ref")] == [
        path.name
    ]


def test_an_unreachable_http_registry_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    cache = UenvCache(UenvRegistry(url, timeout=2), tmp_path / "cache", 1 << 30)
    with pytest.raises(UenvUnreachable, match=rf"^uenv registry {url} unreachable: "):
        cache.fetch("a/1:v1")


# ---------------------------------------------------------------------- signatures


@pytest.fixture(scope="module")
def site_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """(private key PEM, path of the public key PEM) of a test site."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = tmp_path_factory.mktemp("site-key") / "uenv.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def _sign_index(root: Path, private: bytes, refs: set[str]) -> None:
    index = json.loads((root / "index.json").read_text())
    for ref in refs:
        index[ref]["signature"] = sign_index_entry(private, index[ref]["sha256"])
    (root / "index.json").write_text(json.dumps(index))


def test_signed_images_only(tmp_path: Path, site_key: tuple[bytes, Path]) -> None:
    private, public = site_key
    root = tmp_path / "registry"
    publish(root, {"a/1:v1": b"signed", "b/1:v1": b"unsigned", "c/1:v1": b"c"})
    _sign_index(root, private, {"a/1:v1", "c/1:v1"})
    index = json.loads((root / "index.json").read_text())
    index["c/1:v1"]["sha256"] = hashlib.sha256(b"c2").hexdigest()  # signed another hash
    (root / "c_1_v1.sqfs").write_bytes(b"c2")
    (root / "index.json").write_text(json.dumps(index))
    cache = UenvCache(UenvRegistry(root, signing_key=public), tmp_path / "cache", 1 << 30)
    assert cache.fetch("a/1:v1").read_bytes() == b"signed"
    with pytest.raises(UenvSignatureError, match=r"^uenv b/1:v1: signature missing$"):
        cache.fetch("b/1:v1")
    with pytest.raises(
        UenvSignatureError, match=r"^uenv c/1:v1: signature does not verify with the site key$"
    ):
        cache.fetch("c/1:v1")
    # a cached image is checked again on every use: its signature withdrawn, it is refused
    index = json.loads((root / "index.json").read_text())
    del index["a/1:v1"]["signature"]
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(UenvSignatureError, match="signature missing"):
        cache.fetch("a/1:v1")
    assert {p.name for p in (tmp_path / "cache").glob("*.sqfs")} == {
        hashlib.sha256(b"signed").hexdigest() + ".sqfs"
    }


def test_the_image_resolved_at_submit_or_a_refusal(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"a/1:v1": b"v1"})
    sha = hashlib.sha256(b"v1").hexdigest()
    assert cache.acquire("a/1:v1", "job-1", sha256=sha).name == f"{sha}.sqfs"
    publish(tmp_path / "registry", {"a/1:v1": b"republished"})
    with pytest.raises(UenvChanged) as e:
        cache.acquire("a/1:v1", "job-2", sha256=sha)
    now = hashlib.sha256(b"republished").hexdigest()
    assert str(e.value) == (
        f"uenv a/1:v1 changed in the registry since submit "
        f"(submitted: sha256 {sha[:12]}, now: {now[:12]})"
    )
    assert "Resubmit" in e.value.hint


# ---------------------------------------------------------------------- views

VIEWS = {
    "views": {
        "default": {
            "description": "the compilers",
            "env": {
                "UENV_GREETING": "hello from the view",
                "PATH": {"prepend": ["@MP@/bin"]},
                "MANPATH": {"append": ["@MP@/man"]},
            },
        },
        "modules": {"env": {"MODULEPATH": {"prepend": ["@MP@/modules"]}}},
    }
}


def _view_image(root: Path, mount_point: Path) -> Path:
    """A SquashFS image with ``bin/hello`` and ``meta/env.json`` (views pointing into
    ``mount_point``)."""
    if shutil.which("mksquashfs") is None or shutil.which("unsquashfs") is None:
        pytest.skip("squashfs-tools not installed")
    return build_squashfs(
        root / "view.sqfs",
        {
            "bin/hello": '#!/bin/sh\necho "hello: $UENV_GREETING"\n',
            "meta/env.json": json.dumps(VIEWS).replace("@MP@", str(mount_point)),
        },
    )


def test_views_are_read_from_the_image_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mount_point = tmp_path / "mp"
    image = _view_image(tmp_path, mount_point)
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", image)
    cache = UenvCache(UenvRegistry(tmp_path / "registry"), tmp_path / "cache", 1 << 30)
    cached = cache.fetch("prgenv-gnu/24.11:v1")
    reads = []
    real = uenv_module.read_env_json
    monkeypatch.setattr(uenv_module, "read_env_json", lambda *a: reads.append(a) or real(*a))
    view = cache.view(cached, "prgenv-gnu/24.11:v1", "default")
    assert view.description == "the compilers"
    assert view.values == {"UENV_GREETING": "hello from the view"}
    assert cache.view(cached, "prgenv-gnu/24.11:v1", "modules").prepend == {
        "MODULEPATH": (f"{mount_point}/modules",)
    }
    with pytest.raises(UenvError) as e:
        cache.view(cached, "prgenv-gnu/24.11:v1", "spack")
    assert str(e.value) == "uenv prgenv-gnu/24.11:v1 has no view spack (views: default, modules)"
    assert len(reads) == 1  # memoized by sha256
    env = environment(
        Allocation(
            id="a1",
            spec=AllocationSpec(entrypoint="x", tenant="t", vcluster="v", env={"PATH": "/job/bin"}),
        ),
        ["n1"],
        "n1",
        "/s",
        tmp_path / "w",
        view=view,
    )
    assert env["PATH"] == f"{mount_point}/bin:/job/bin"  # onto the job's own PATH
    assert env["UENV_GREETING"] == "hello from the view"


def test_an_image_without_env_json_has_no_views(tmp_path: Path, squashfs_image: Path) -> None:
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", squashfs_image)
    cache = UenvCache(UenvRegistry(tmp_path / "registry"), tmp_path / "cache", 1 << 30)
    with pytest.raises(UenvError, match=r"has no view default \(views: none\)$"):
        cache.view(cache.fetch("prgenv-gnu/24.11:v1"), "prgenv-gnu/24.11:v1", "default")


async def test_a_job_sees_its_view(tmp_path: Path, squashfs_image: Path) -> None:
    # squashfs_image: only for the mount support check (skips where there is none)
    mount_point = tmp_path / "user-environment"
    image = _view_image(tmp_path, mount_point)
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", image)
    cache = UenvCache(
        UenvRegistry(tmp_path / "registry"),
        tmp_path / "cache",
        1 << 30,
        mount_point=str(mount_point),
    )
    sha = hashlib.sha256(image.read_bytes()).hexdigest()
    r, _, _ = await _run_uenv_job(
        tmp_path, cache, 'hello; echo "PATH=$PATH"', mount_point, view="default", uenv_sha256=sha
    )
    assert (r.exit_code, r.reason) == (0, ""), r
    out = (tmp_path / "logs" / "u1" / "stdout.log").read_text()
    assert "hello: hello from the view" in out  # bin/hello found through the view's PATH
    assert f"PATH={mount_point}/bin:" in out


async def test_an_unknown_view_fails_the_start(tmp_path: Path, squashfs_image: Path) -> None:
    mount_point = tmp_path / "mp"
    image = _view_image(tmp_path, mount_point)
    _publish_image(tmp_path / "registry", "prgenv-gnu/24.11:v1", image)
    cache = UenvCache(
        UenvRegistry(tmp_path / "registry"),
        tmp_path / "cache",
        1 << 30,
        mount_point=str(mount_point),
    )
    r, _, _ = await _run_uenv_job(tmp_path, cache, "echo should-not-run", mount_point, view="x")
    assert r.reason == (
        "spawn_failed: uenv prgenv-gnu/24.11:v1 has no view x (views: default, modules)"
    )
    assert cache.status()["images"][0]["in_use"] is False  # type: ignore[index]  # released
