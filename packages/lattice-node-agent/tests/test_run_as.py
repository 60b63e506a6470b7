"""End to end as a real user: a batch job through ProcessRuntime, an attach terminal and task
ranks run as the submitter (a system user made for the test), with its scratch directory,
and the start fails with a clear reason when the user cannot be run as."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from lattice_agent.attach import AttachManager
from lattice_agent.identity import IdentityPolicy, RunAs, resolve
from lattice_agent.pmi.server import LocalLaunch
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.scratch import Scratch
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationReport, AllocationSpec, AllocationState
from lattice_test_harness.uenv_images import build_squashfs, index_entry

USER = "lattice-test-u1"

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd"
    ),
]


@pytest.fixture(scope="module")
def user() -> Iterator[RunAs]:
    subprocess.run(["userdel", USER], capture_output=True, check=False)  # a killed run's
    subprocess.run(["useradd", "--system", "--no-create-home", USER], check=True)
    try:
        yield resolve(USER, user_map={}, allow_root=False)
    finally:
        subprocess.run(["userdel", USER], capture_output=True, check=False)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is under a root-only one)."""
    d = Path(tempfile.mkdtemp(prefix="lattice-run-as-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def scratch(open_tmp: Path) -> Scratch:
    return Scratch(open_tmp / "scratch")


@pytest.fixture
async def runtime(tmp_path: Path, scratch: Scratch) -> AsyncIterator[ProcessRuntime]:
    rt = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "agent-state.json",
        walltime_grace_seconds=0.5,
        identities=IdentityPolicy(node_id="n1", mode="submitter"),
        scratch=scratch,
    )
    yield rt
    await rt.close()


def make_alloc(aid: str, entrypoint: str, **spec: object) -> Allocation:
    spec.setdefault("user", USER)
    return Allocation(
        id=aid,
        spec=AllocationSpec(entrypoint=entrypoint, tenant="t", vcluster="v", **spec),  # type: ignore[arg-type]
        state=AllocationState.RUNNING,
    )


async def exited(rt: ProcessRuntime, aid: str, timeout: float = 5.0) -> AllocationReport:
    deadline = time.monotonic() + timeout
    while True:
        for r in rt.reports():
            if r.allocation_id == aid and r.phase == "exited":
                return r
        assert time.monotonic() < deadline, f"{aid} did not exit: {rt.reports()}"
        await asyncio.sleep(0.02)


async def test_batch_job_runs_as_the_submitter(
    runtime: ProcessRuntime, user: RunAs, open_tmp: Path, tmp_path: Path
) -> None:
    root_only = open_tmp / "root-only"
    root_only.mkdir(mode=0o700)
    entry = (
        'id -u; id -g; echo "home=$HOME user=$USER logname=$LOGNAME"; pwd; '
        'touch "$LATTICE_SCRATCH/x" && echo scratch-ok; '
        '[ "$TMPDIR" = "$LATTICE_SCRATCH" ] && echo tmpdir-ok; '
        f"touch {root_only}/x 2>/dev/null || echo root-only-denied; "
        "echo reopened >/dev/stderr"
    )
    await runtime.start(make_alloc("u1", entry), nodelist=["n1"])
    r = await exited(runtime, "u1")
    assert (r.exit_code, r.reason) == (0, "")
    scratch_dir = open_tmp / "scratch" / "u1"
    assert (tmp_path / "logs" / "u1" / "stdout.log").read_text().splitlines() == [
        str(user.uid),
        str(user.gid),
        f"home={user.home} user={USER} logname={USER}",
        str(scratch_dir),  # no submit directory: the user's own scratch
        "scratch-ok",
        "tmpdir-ok",
        "root-only-denied",
    ]
    assert (tmp_path / "logs" / "u1" / "stderr.log").read_text() == "reopened\n"
    assert not scratch_dir.exists()  # wiped at the reap
    assert not (root_only / "x").exists()
    assert (tmp_path / "work" / "u1" / "exit_code").stat().st_uid == 0  # the wrapper's


async def test_output_links_are_made_as_the_user(
    runtime: ProcessRuntime, user: RunAs, open_tmp: Path
) -> None:
    submit = open_tmp / "submit"
    submit.mkdir()
    os.chown(submit, user.uid, user.gid)
    forbidden = "/etc/lattice-test-u1-must-not-exist"
    alloc = make_alloc(
        "u2",
        "echo out; pwd",
        submit_dir=str(submit),
        tags={"slurm_output": "job-%j.out", "slurm_error": forbidden},
    )
    await runtime.start(alloc, nodelist=["n1"])
    assert (await exited(runtime, "u2")).exit_code == 0
    link = submit / "job-u2.out"
    assert link.read_text() == f"out\n{submit}\n"
    assert link.stat().st_uid == user.uid  # the log file, handed to the user
    assert not os.path.lexists(forbidden)  # root never made it
    assert f"could not create {forbidden} for stderr" in "".join(
        r.line for r in runtime.tail("u2", stream="stderr")
    )


async def test_start_fails_with_the_cause(
    runtime: ProcessRuntime, user: RunAs, open_tmp: Path
) -> None:
    closed = open_tmp / "closed"
    closed.mkdir(mode=0o700)
    cases = {
        "bad-user": (
            make_alloc("bad-user", "true", user="lattice-no-such-user"),
            "spawn_failed: user lattice-no-such-user has no account on node n1 (no NSS entry "
            "and no node_agent.user_map entry). Hint: ",
        ),
        "root": (
            make_alloc("root", "true", user="root"),
            "spawn_failed: allocation would run as root; the vCluster does not allow it. ",
        ),
        "closed": (
            make_alloc("closed", "true", submit_dir=str(closed)),
            f"spawn_failed: the working directory {closed} is not accessible to user {USER} ",
        ),
    }
    for alloc, _ in cases.values():
        await runtime.start(alloc, nodelist=["n1"])
    for aid, (_, reason) in cases.items():
        r = await exited(runtime, aid)
        assert r.reason.startswith(reason), r.reason
        assert not (open_tmp / "scratch" / aid).exists()


async def test_attach_runs_as_the_user(
    tmp_path: Path, user: RunAs, scratch: Scratch, open_tmp: Path
) -> None:
    alloc = make_alloc("u3", "sleep 30")
    mgr = AttachManager(
        "n1",
        allocation={alloc.id: alloc}.get,
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        identities=IdentityPolicy(node_id="n1", mode="submitter"),
        scratch=scratch,
    )
    command = 'id -u; stat -c %u "$(tty)"; touch "$LATTICE_SCRATCH/y" && echo attach-ok; pwd'
    inputs: asyncio.Queue[v1.AttachInput | None] = asyncio.Queue()
    inputs.put_nowait(
        v1.AttachInput(
            start=v1.AttachStart(allocation_id=alloc.id, command=["sh", "-c", command], tty=True)
        )
    )

    async def messages() -> AsyncIterator[v1.AttachInput]:
        while (msg := await inputs.get()) is not None:
            yield msg

    out = bytearray()
    code = None
    async for o in mgr.serve(messages()):
        if o.stdout:
            out += o.stdout
        if o.exit_code is not None:
            code = o.exit_code
    await mgr.idle()
    assert code == 0
    scratch_dir = open_tmp / "scratch" / "u3"
    assert out.decode().split() == [str(user.uid), str(user.uid), "attach-ok", str(scratch_dir)]
    assert (scratch_dir / "y").stat().st_uid == user.uid
    scratch.wipe("u3")


async def test_task_ranks_run_as_the_user(user: RunAs) -> None:
    # PR_GET_PDEATHSIG: the parent-death signal survives the switch (setpriv keeps it)
    probe = (
        "import ctypes, os; c = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(c), 0, 0, 0); print(os.getuid(), c.value)"
    )
    launch = LocalLaunch(
        ["/usr/bin/python3", "-c", probe], range(2), 2, launch_id="l1", pmi=False, run_as=user
    )
    result = await launch.run()
    assert result.exit_status == 0, result
    assert sorted(o.text for o in result.output) == [f"{user.uid} 9"] * 2  # 9 = SIGKILL


async def test_uenv_job_mounts_as_root_and_runs_as_the_user(
    tmp_path: Path, user: RunAs, scratch: Scratch, open_tmp: Path
) -> None:
    if not (shutil.which("mksquashfs") and shutil.which("unshare")):
        pytest.skip("mksquashfs/unshare not installed")
    from lattice_agent.uenv import UenvCache, UenvRegistry

    registry = tmp_path / "registry"
    image = build_squashfs(
        registry / "img.sqfs",
        {"bin/hello-uenv": '#!/bin/sh\necho "hello from the uenv as $(id -u)"\n'},
    )
    (registry / "index.json").write_text(json.dumps({"env/1:v1": index_entry(image)}))
    mount_point = open_tmp / "user-environment"
    rt = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "agent-state.json",
        identities=IdentityPolicy(node_id="n1", mode="submitter"),
        scratch=scratch,
        uenv=UenvCache(
            UenvRegistry(registry), tmp_path / "cache", 1 << 30, mount_point=str(mount_point)
        ),
    )
    try:
        await rt.start(
            make_alloc("u4", f"{mount_point}/bin/hello-uenv", uenv="env/1:v1"), nodelist=["n1"]
        )
        r = await exited(rt, "u4", timeout=15)
    finally:
        await rt.close()
    if r.reason.startswith("spawn_failed: could not mount"):
        pytest.skip(f"cannot loop-mount squashfs here: {r.reason}")
    assert (r.exit_code, r.reason) == (0, "")
    assert [x.line for x in rt.tail("u4")] == [f"hello from the uenv as {user.uid}"]
