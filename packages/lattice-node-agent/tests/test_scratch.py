"""scratch: per-allocation directories (plain and tmpfs), owned by the job's user, wiped
without following symlinks, orphans wiped at agent start."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_agent.identity import RunAs, resolve
from lattice_agent.scratch import REGISTRY, Scratch, ScratchError

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mount)")


@pytest.fixture
def root() -> Iterator[Path]:
    """A scratch root everyone can reach (pytest's tmp_path is under a root-only one)."""
    d = Path(tempfile.mkdtemp(prefix="lattice-scratch-"))
    d.chmod(0o755)
    yield d / "scratch"
    for line in Path("/proc/self/mounts").read_text().splitlines():  # a failed test's tmpfs
        point = line.split()[1]
        if point.startswith(str(d)):
            os.system(f"umount -l {point}")
    shutil.rmtree(d)


def nobody() -> RunAs:
    return resolve("nobody", user_map={}, allow_root=False)


def mounted(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines()
    )


def test_plain_directory_as_the_agent(root: Path) -> None:
    scratch = Scratch(root)
    path = scratch.create("a1", RunAs.agent())
    assert path == root / "a1" and path.is_dir()
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert (root / REGISTRY / "a1").exists()
    (path / "data").write_text("x")
    assert scratch.ensure("a1", RunAs.agent()) == path  # kept as it is
    assert (path / "data").exists()
    scratch.wipe("a1")
    assert not path.exists() and not (root / REGISTRY / "a1").exists()
    scratch.wipe("a1")  # idempotent
    assert scratch.ensure("a1", RunAs.agent()) == path and path.is_dir()  # made on demand


def test_a_stale_directory_starts_empty(root: Path) -> None:
    scratch = Scratch(root)
    (scratch.create("a1", RunAs.agent()) / "old").write_text("from the last run")
    assert list(scratch.create("a1", RunAs.agent()).iterdir()) == []


@as_root
def test_owned_by_the_user(root: Path) -> None:
    who = nobody()
    path = Scratch(root).create("a1", who)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (who.uid, who.gid, 0o700)


@as_root
def test_tmpfs(root: Path) -> None:
    who = nobody()
    scratch = Scratch(root, tmpfs_mb=4)
    path = scratch.create("a1", who)
    assert mounted(path)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (who.uid, who.gid, 0o700)
    (path / "data").write_bytes(b"x" * 1024)
    with pytest.raises(OSError):  # the size is a limit
        (path / "big").write_bytes(b"x" * (5 << 20))
    scratch.wipe("a1")
    assert not mounted(path) and not path.exists()
    scratch.wipe("a1")


def test_wipe_never_follows_symlinks(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    scratch = Scratch(root)
    path = scratch.create("a1", RunAs.agent())
    (path / "link").symlink_to(outside)
    (path / "sub").mkdir()
    (path / "sub" / "file-link").symlink_to(outside / "keep")
    scratch.wipe("a1")
    assert not path.exists() and (outside / "keep").read_text() == "precious"
    # the scratch directory itself replaced by a symlink: only the link goes
    scratch.create("a2", RunAs.agent())
    shutil.rmtree(root / "a2")
    (root / "a2").symlink_to(outside)
    scratch.wipe("a2")
    assert not (root / "a2").is_symlink() and (outside / "keep").exists()


@as_root
def test_orphans_are_wiped_at_start_only_if_ours(root: Path) -> None:
    who = nobody()
    first = Scratch(root, tmpfs_mb=4)
    for alloc_id in ("running", "gone", "mounted"):
        first.create(alloc_id, who if alloc_id == "mounted" else RunAs.agent())
    (root / "not-ours").mkdir()  # another tool's directory on a shared scratch disk
    restarted = Scratch(root)  # the agent restarted (tmpfs setting changed, even)
    assert restarted.orphans({"running"}) == ["gone", "mounted"]
    assert restarted.wipe_orphans({"running"}) == ["gone", "mounted"]
    assert sorted(p.name for p in root.iterdir()) == [REGISTRY, "not-ours", "running"]
    assert not mounted(root / "mounted")


@as_root
def test_a_root_users_can_write_is_refused(root: Path) -> None:
    root.mkdir()
    root.chmod(0o1777)
    with pytest.raises(ScratchError, match=r"writable by other users.*Hint: ") as e:
        Scratch(root).create("a1", nobody())
    assert "could not create scratch directory" in str(e.value)
    assert not (root / "a1").exists() and not (root / REGISTRY / "a1").exists()
    Scratch(root).create("a1", RunAs.agent())  # the agent's own jobs: nobody else to fear


@as_root
def test_a_root_the_user_cannot_reach_is_refused(tmp_path: Path) -> None:
    # pytest's tmp_path sits under a root-only directory
    with pytest.raises(ScratchError, match=r"cannot reach it.*mode 0755"):
        Scratch(tmp_path / "scratch").create("a1", nobody())
    assert not (tmp_path / "scratch" / "a1").exists()


def test_failures_say_why(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ScratchError, match=r"could not create scratch directory .*/file/a1: "):
        Scratch(tmp_path / "file").create("a1", RunAs.agent())
    with pytest.raises(ValueError):
        Scratch(tmp_path).path("../a1")
    with pytest.raises(ValueError):
        Scratch(tmp_path).path(REGISTRY)


async def test_the_runtime_wipes_orphans_at_start_and_scratch_at_the_reap(
    root: Path, tmp_path: Path
) -> None:
    from lattice_agent.runtime import ProcessRuntime
    from lattice_common.types import Allocation, AllocationSpec

    Scratch(root).create("ghost", RunAs.agent())  # a crash left it: no state entry
    rt = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "agent-state.json",
        scratch=Scratch(root),
    )
    try:
        await rt.recover()
        assert not (root / "ghost").exists()
        spec = AllocationSpec(
            entrypoint='test -d "$LATTICE_SCRATCH" && echo "$TMPDIR"', tenant="t", vcluster="v"
        )
        await rt.start(Allocation(id="a1", spec=spec), nodelist=["n1"])
        for _ in range(250):
            (r,) = rt.reports()
            if r.phase == "exited":
                break
            await asyncio.sleep(0.02)
        assert (r.exit_code, [x.line for x in rt.tail("a1")]) == (0, [str(root / "a1")])
        assert not (root / "a1").exists() and Scratch(root).orphans(set()) == []
    finally:
        await rt.close()
