"""Per-allocation cgroups: both backends on a fake cgroupfs tree, then real v1 here.

The fake trees hold the files the kernel would present (a new cgroup directory gets its
interface files when it is created; the fake ``mkdir`` is emulated by pre-creating them via
``_kernel_mkdir``). The real tests need a writable ``/sys/fs/cgroup/memory`` (root, v1).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from lattice_agent import lifecycle as lc
from lattice_agent.cgroups import (
    GIB,
    CgroupsV1,
    CgroupsV2,
    Limits,
    NoCgroups,
    detect,
    limits_for,
    memory_reserve_bytes,
)
from lattice_common.types import Allocation, AllocationSpec, Constraints


def _alloc(memory_gb: int = 0, tags: dict[str, str] | None = None, aid: str = "a1") -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(
            entrypoint="true",
            tenant="t",
            vcluster="v",
            constraints=Constraints(memory_gb=memory_gb),
            tags=tags or {},
        ),
    )


# ---------------------------------------------------------------------------- limits


def test_limits_from_request_and_whole_node() -> None:
    node = 64 * GIB
    assert limits_for(_alloc(8), node_memory_bytes=node).memory_bytes == 8 * GIB
    # whole node: capacity minus 5 %, at least 1 GiB
    whole = limits_for(_alloc(), node_memory_bytes=node)
    assert whole.memory_bytes == node - int(node * 0.05)
    small = limits_for(_alloc(), node_memory_bytes=4 * GIB)
    assert small.memory_bytes == 3 * GIB  # 5 % of 4 GiB < 1 GiB
    assert memory_reserve_bytes(100 * GIB, 10, GIB) == 10 * GIB
    assert limits_for(_alloc(), node_memory_bytes=0).memory_bytes is None
    lim = limits_for(
        _alloc(tags={"cpuset": "0-3", "cpuset_mems": "0", "gpus": "0,2"}),
        node_memory_bytes=node,
        pids_max=100,
    )
    assert (lim.cpus, lim.mems, lim.pids_max, lim.allowed_gpus) == ("0-3", "0", 100, {0, 2})
    assert lim.cpu_quota_cores is None and lim.cpu_weight == 100
    assert limits_for(_alloc(), node_memory_bytes=node, pids_max=0).pids_max is None


# ---------------------------------------------------------------------------- fake v2

_V2_FILES = {
    "cgroup.procs": "",
    "cgroup.kill": "",
    "cgroup.subtree_control": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.current": "0\n",
    "memory.peak": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
    "cpuset.cpus": "\n",
    "cpuset.mems": "\n",
    "pids.max": "max\n",
    "pids.current": "0\n",
}


def _kernel_mkdir(d: Path, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


@pytest.fixture
def v2root(tmp_path: Path) -> Path:
    root = tmp_path / "cg2"
    _kernel_mkdir(
        root,
        {
            "cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma\n",
            "cgroup.subtree_control": "",
            "cgroup.procs": "",
        },
    )
    _kernel_mkdir(root / "workload.slice", _V2_FILES)
    _kernel_mkdir(root / "workload.slice" / "alloc-a1.scope", _V2_FILES)
    return root


def test_detect(tmp_path: Path, v2root: Path) -> None:
    assert isinstance(detect("auto", v2root), CgroupsV2)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    assert isinstance(detect("auto", v1), CgroupsV1)
    none = detect("auto", tmp_path / "nothing")
    assert isinstance(none, NoCgroups) and not none.available and "no cgroup" in none.why
    assert isinstance(detect("none", v2root), NoCgroups)


def test_v2_create_writes_limits(v2root: Path) -> None:
    cg = CgroupsV2(v2root)
    scope = cg.create("a1", Limits(memory_bytes=2 * GIB, cpus="0-1", mems="0", pids_max=64))
    d = v2root / "workload.slice" / "alloc-a1.scope"
    assert scope.dirs == {"": d}
    assert (d / "memory.max").read_text() == str(2 * GIB)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "cpu.weight").read_text() == "100"
    assert (d / "cpu.max").read_text() == "max 100000"
    assert (d / "cpuset.cpus").read_text() == "0-1"
    assert (d / "cpuset.mems").read_text() == "0"
    assert (d / "pids.max").read_text() == "64"
    # controllers enabled on the way down (the fake file keeps the last write)
    assert (v2root / "cgroup.subtree_control").read_text().startswith("+")
    assert cg.procs_files(scope) == [d / "cgroup.procs"]
    cg.create("a1", Limits(memory_bytes=GIB, cpu_quota_cores=2.5))
    assert (d / "cpu.max").read_text() == "250000 100000"


def test_v2_a_slice_removed_meanwhile_is_made_again(v2root: Path) -> None:
    """Controllers are enabled down to the slice once; a slice removed under the agent
    is made (and enabled) again for the next scope."""
    import shutil

    cg = CgroupsV2(v2root)
    cg.create("a1", Limits(pids_max=64))
    shutil.rmtree(v2root / "workload.slice")
    scope = cg.create("a2", Limits(memory_bytes=GIB, pids_max=32))
    d = v2root / "workload.slice" / "alloc-a2.scope"
    assert scope.dirs[""] == d
    assert (d / "memory.max").read_text() == str(GIB)
    assert (d / "pids.max").read_text() == "32"
    assert (v2root / "cgroup.subtree_control").read_text().startswith("+")


def test_v2_usage_and_oom(v2root: Path) -> None:
    cg = CgroupsV2(v2root)
    scope = cg.scope("a1")
    d = scope.dirs[""]
    (d / "memory.current").write_text("1048576\n")
    (d / "memory.peak").write_text("5242880\n")
    (d / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    (d / "pids.current").write_text("3\n")
    u = cg.usage(scope)
    assert (u.memory_current, u.memory_peak, u.cpu_seconds, u.pids) == (1 << 20, 5 << 20, 2.5, 3)
    assert not cg.oom_killed(scope)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert cg.oom_killed(scope)


def test_v2_orphans_and_remove(v2root: Path) -> None:
    cg = CgroupsV2(v2root)
    _kernel_mkdir(v2root / "workload.slice" / "alloc-b2.scope", _V2_FILES)
    (v2root / "workload.slice" / "other.scope").mkdir()
    assert [s.alloc_id for s in cg.orphans({"a1"})] == ["b2"]
    assert {s.alloc_id for s in cg.orphans(set())} == {"a1", "b2"}
    scope = cg.scope("b2")
    for f in scope.dirs[""].iterdir():  # the kernel's files vanish with the directory
        f.unlink()
    assert cg.remove(scope)
    assert not scope.dirs[""].exists()
    assert cg.remove(scope)  # idempotent


# ---------------------------------------------------------------------------- fake v1

_V1_FILES = {
    "memory": {
        "cgroup.procs": "",
        "memory.limit_in_bytes": "9223372036854771712\n",
        "memory.memsw.limit_in_bytes": "9223372036854771712\n",
        "memory.usage_in_bytes": "0\n",
        "memory.max_usage_in_bytes": "0\n",
        "memory.failcnt": "0\n",
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
    },
    "cpu": {
        "cgroup.procs": "",
        "cpu.shares": "1024\n",
        "cpu.cfs_quota_us": "-1\n",
        "cpu.cfs_period_us": "100000\n",
    },
    "cpuacct": {"cgroup.procs": "", "cpuacct.usage": "0\n"},
    "cpuset": {"cgroup.procs": "", "cpuset.cpus": "\n", "cpuset.mems": "\n"},
    "pids": {"cgroup.procs": "", "pids.max": "max\n", "pids.current": "0\n"},
    "devices": {"cgroup.procs": "", "devices.deny": "", "devices.allow": ""},
}


@pytest.fixture
def v1root(tmp_path: Path) -> Path:
    root = tmp_path / "cg1"
    for c, files in _V1_FILES.items():
        _kernel_mkdir(root / c, files)
        (root / c / "cpuset.cpus").write_text("0-7\n") if c == "cpuset" else None
        (root / c / "cpuset.mems").write_text("0-1\n") if c == "cpuset" else None
        for rel in ("workload.slice", "workload.slice/alloc-a1.scope"):
            _kernel_mkdir(root / c / rel, files)
    return root


def test_v1_create_writes_limits(v1root: Path, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    cg = CgroupsV1(v1root, dev_dir=dev)
    assert set(cg.controllers) == set(_V1_FILES)
    scope = cg.create("a1", Limits(memory_bytes=3 * GIB, pids_max=128))
    rel = Path("workload.slice/alloc-a1.scope")
    assert set(scope.dirs) == set(_V1_FILES)
    m = v1root / "memory" / rel
    assert (m / "memory.limit_in_bytes").read_text() == str(3 * GIB)
    assert (m / "memory.memsw.limit_in_bytes").read_text() == str(3 * GIB)
    assert (v1root / "cpu" / rel / "cpu.shares").read_text() == "1024"
    assert (v1root / "cpu" / rel / "cpu.cfs_quota_us").read_text() == "-1"
    assert (v1root / "pids" / rel / "pids.max").read_text() == "128"
    # an empty v1 cpuset is filled from its parents, all the way down
    assert (v1root / "cpuset" / "workload.slice" / "cpuset.cpus").read_text() == "0-7"
    assert (v1root / "cpuset" / rel / "cpuset.cpus").read_text() == "0-7"
    assert (v1root / "cpuset" / rel / "cpuset.mems").read_text() == "0-1"
    assert sorted(cg.procs_files(scope)) == sorted(
        v1root / c / rel / "cgroup.procs" for c in _V1_FILES
    )
    # no GPUs here: nothing denied
    assert (v1root / "devices" / rel / "devices.deny").read_text() == ""
    cg.create("a1", Limits(cpus="2-3", cpu_quota_cores=1.5, cpu_weight=50))
    assert (v1root / "cpuset" / rel / "cpuset.cpus").read_text() == "2-3"
    assert (v1root / "cpu" / rel / "cpu.cfs_quota_us").read_text() == "150000"
    assert (v1root / "cpu" / rel / "cpu.shares").read_text() == "512"


def test_v1_devices_deny_unassigned_gpus(v1root: Path, tmp_path: Path) -> None:
    """GPU device nodes on a fake /dev: character devices made by mknod (root) or, without
    that, the /dev/null node linked under the GPU names (same type, known numbers)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    nodes = {}
    for i in range(4):
        p = dev / f"nvidia{i}"
        try:
            os.mknod(p, 0o600 | 0o020000, os.makedev(195, i))
            nodes[i] = f"c 195:{i} rwm"
        except PermissionError:
            os.symlink("/dev/null", p)
            st = os.stat("/dev/null")
            nodes[i] = f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm"
    (dev / "nvidiactl").write_text("")  # not a per-GPU node: never denied
    cg = CgroupsV1(v1root, dev_dir=dev)
    assert cg.denied_devices(Limits(allowed_gpus=None)) == []  # whole node
    assert cg.denied_devices(Limits(allowed_gpus=frozenset({0, 2}))) == [nodes[1], nodes[3]]
    cg.create("a1", Limits(allowed_gpus=frozenset({0, 1, 2})))
    deny = v1root / "devices" / "workload.slice/alloc-a1.scope" / "devices.deny"
    assert deny.read_text() == nodes[3]


def test_v1_usage_oom_and_orphans(v1root: Path) -> None:
    cg = CgroupsV1(v1root)
    scope = cg.scope("a1")
    (scope.dirs["memory"] / "memory.usage_in_bytes").write_text("4096\n")
    (scope.dirs["memory"] / "memory.max_usage_in_bytes").write_text("1073741824\n")
    (scope.dirs["cpuacct"] / "cpuacct.usage").write_text("1500000000\n")
    (scope.dirs["pids"] / "pids.current").write_text("7\n")
    u = cg.usage(scope)
    assert (u.memory_current, u.memory_peak, u.cpu_seconds, u.pids) == (4096, GIB, 1.5, 7)
    assert not cg.oom_killed(scope)
    oom = scope.dirs["memory"] / "memory.oom_control"
    oom.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cg.oom_killed(scope)
    # an old kernel without the oom_kill line: the failure count says it
    oom.write_text("oom_kill_disable 0\nunder_oom 0\n")
    assert not cg.oom_killed(scope)
    (scope.dirs["memory"] / "memory.failcnt").write_text("3\n")
    assert cg.oom_killed(scope)
    # an orphan known to one controller only still counts
    (v1root / "pids" / "workload.slice" / "alloc-zz.scope").mkdir()
    assert [s.alloc_id for s in cg.orphans({"a1"})] == ["zz"]


def test_reaped_oom_sets_reason_and_peak() -> None:
    """The lifecycle side: an OOM seen by the shell -> reason oom_killed, peak kept."""
    rec, _ = lc.step(None, lc.Assigned(allocation_id="a", at=1.0), grace=1)
    rec, _ = lc.step(rec, lc.Spawned(), grace=1)
    rec, _ = lc.step(rec, lc.Exited(at=2.0), grace=1)
    rec, out = lc.step(
        rec, lc.Reaped(exit_file_code=137, oom_killed=True, peak_memory_bytes=99), grace=1
    )
    assert rec is not None
    assert (rec.reason, rec.exit_code, rec.peak_memory_bytes) == ("oom_killed", 137, 99)
    assert lc.Report(phase=lc.PHASE_EXITED, exit_code=137, reason="oom_killed") in out


# ---------------------------------------------------------------------------- real v1

_V1 = Path("/sys/fs/cgroup")


def _v1_writable() -> str:
    if (_V1 / "cgroup.controllers").exists():
        return "pure cgroup v2 host (the real tests here exercise v1)"
    mem = _V1 / "memory"
    if not mem.is_dir():
        return "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    if not os.access(mem, os.W_OK):
        return "/sys/fs/cgroup/memory is not writable (needs root)"
    return ""


real_v1 = pytest.mark.skipif(bool(_v1_writable()), reason=_v1_writable() or "-")


@pytest.fixture
def real_cg() -> CgroupsV1:
    cg = CgroupsV1(_V1, slice_name=f"lattice-test-{uuid.uuid4().hex[:8]}.slice")
    yield cg
    for scope in cg.orphans(set()):
        cg.remove(scope)
    for mount in cg.controllers.values():
        d = mount / cg.slice
        if d.is_dir():
            d.rmdir()


def _join_and_run(
    cg: CgroupsV1, scope, script: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Run ``script`` the way the spawn wrapper does: join every procs file, then exec."""
    files = " ".join(f"'{p}'" for p in cg.procs_files(scope))
    wrapper = f'for f in {files}; do echo $$ > "$f" || exit 125; done; exec sh -c "$0"'
    return subprocess.run(
        ["sh", "-c", wrapper, script], capture_output=True, text=True, timeout=timeout
    )


@real_v1
def test_real_v1_children_stay_inside(real_cg: CgroupsV1, tmp_path: Path) -> None:
    scope = real_cg.create("join", Limits(memory_bytes=GIB, pids_max=64))
    pid_file = tmp_path / "pids.txt"
    r = _join_and_run(
        real_cg,
        scope,
        f"exec >/dev/null 2>&1; sleep 30 & echo $! > {pid_file}; (sleep 30 &); exit 0",
    )
    try:
        assert r.returncode == 0, r.stderr
        child = int(pid_file.read_text())
        for d in scope.dirs.values():
            members = (d / "cgroup.procs").read_text().split()
            assert str(child) in members, d
            assert len(members) == 2  # both background sleeps, and nothing else
        assert real_cg.usage(scope).pids == 2
    finally:
        pid_file.unlink(missing_ok=True)
        assert real_cg.remove(scope)
    assert not any(d.exists() for d in scope.dirs.values())
    assert _dead(child)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever inherited it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@real_v1
def test_real_v1_memory_limit_oom_kills(real_cg: CgroupsV1) -> None:
    scope = real_cg.create("oom", Limits(memory_bytes=64 << 20))
    r = _join_and_run(
        real_cg, scope, f"{sys.executable} -c 'x = b\"a\" * (256 << 20); print(len(x))'"
    )
    try:
        assert r.returncode == 137 or r.returncode < 0, (r.returncode, r.stdout, r.stderr)
        assert real_cg.oom_killed(scope)
        peak = real_cg.usage(scope).memory_peak
        assert peak is not None and 32 << 20 < peak <= 64 << 20
    finally:
        assert real_cg.remove(scope)


@real_v1
def test_real_v1_no_oom_under_limit(real_cg: CgroupsV1) -> None:
    scope = real_cg.create("fine", Limits(memory_bytes=256 << 20))
    r = _join_and_run(real_cg, scope, f"{sys.executable} -c 'x = b\"a\" * (32 << 20)'")
    try:
        assert r.returncode == 0, r.stderr
        assert not real_cg.oom_killed(scope)
        assert (real_cg.usage(scope).memory_peak or 0) >= 32 << 20
    finally:
        assert real_cg.remove(scope)


@real_v1
def test_real_v1_fork_bomb_stops_at_pids_limit(real_cg: CgroupsV1) -> None:
    """500 background sleeps against pids.max 50: forks fail, the host is untouched."""
    scope = real_cg.create("bomb", Limits(pids_max=50))
    script = (
        "exec 2>/dev/null; ok=0; fail=0; i=0; while [ $i -lt 500 ]; do "
        "if sleep 5 >/dev/null & then ok=$((ok+1)); else fail=$((fail+1)); fi; "
        "i=$((i+1)); done; echo $ok $fail"
    )
    t0 = time.monotonic()
    r = _join_and_run(real_cg, scope, script, timeout=120)
    try:
        events = (scope.dirs["pids"] / "pids.events").read_text()
        assert int(events.split()[-1]) > 0, events  # "max N": forks refused by the limit
        assert real_cg.usage(scope).pids <= 50
        # the host can still fork
        assert subprocess.run(["true"]).returncode == 0
    finally:
        assert real_cg.remove(scope)
    assert time.monotonic() - t0 < 120
    assert not any(d.exists() for d in scope.dirs.values()), r.stdout


@real_v1
def test_real_v1_runtime_scope_lifecycle(real_cg: CgroupsV1, tmp_path: Path) -> None:
    """Through ProcessRuntime: the job runs inside its scope, an OOM ends it Failed
    (reason oom_killed, peak reported), the scope is gone after the reap, and an orphaned
    scope is removed at the next start."""
    from lattice_agent.runtime import ProcessRuntime

    async def main() -> None:
        reports = []
        rt = ProcessRuntime(
            node_id="n1",
            work_dir=tmp_path / "work",
            log_dir=tmp_path / "log",
            state_file=tmp_path / "state.json",
            walltime_grace_seconds=1,
            on_change=reports.append,
            subreaper=False,
            cgroups=real_cg,
        )
        await rt.recover()
        alloc = _alloc(aid="rt-oom")
        lim_alloc = Allocation(
            id="rt-oom",
            spec=AllocationSpec(
                entrypoint=(
                    f"cat /proc/self/cgroup > {tmp_path}/cg.txt; "
                    f"{sys.executable} -c 'x = b\"a\" * (512 << 20)'"
                ),
                tenant="t",
                vcluster="v",
            ),
        )
        real_cg.node_memory_bytes = 0
        orig = real_cg.limits
        real_cg.limits = lambda a: Limits(memory_bytes=64 << 20)  # type: ignore[method-assign]
        try:
            await rt.start(lim_alloc, nodelist=["n1"])
            for _ in range(300):
                if any(r.phase == "exited" for r in reports):
                    break
                await asyncio.sleep(0.05)
        finally:
            real_cg.limits = orig  # type: ignore[method-assign]
        final = [r for r in reports if r.phase == "exited"]
        assert final, reports
        assert final[0].reason == "oom_killed"
        assert final[0].peak_memory_bytes and final[0].peak_memory_bytes > 32 << 20
        text = (tmp_path / "cg.txt").read_text()
        assert f"{real_cg.slice}/alloc-rt-oom.scope" in text
        assert not any(d.exists() for d in real_cg.scope("rt-oom").dirs.values())
        await rt.close()
        # an orphan (no state entry) is removed by the next agent's recover
        orphan = real_cg.create(alloc.id + "-orphan", Limits())
        rt2 = ProcessRuntime(
            node_id="n1",
            work_dir=tmp_path / "work",
            log_dir=tmp_path / "log",
            state_file=tmp_path / "state.json",
            subreaper=False,
            cgroups=real_cg,
        )
        await rt2.recover()
        assert not any(d.exists() for d in orphan.dirs.values())
        await rt2.close()

    asyncio.run(main())


@real_v1
def test_real_v1_a_slice_removed_meanwhile_is_made_again(real_cg: CgroupsV1) -> None:
    """The levels above a scope are set up once; when the slice goes away under the agent
    (an operator's cleanup), the next scope sets it up again, cpuset filled."""
    first = real_cg.create("s1", Limits(pids_max=64))
    assert real_cg.remove(first)
    for mount in real_cg.controllers.values():
        (mount / real_cg.slice).rmdir()
    scope = real_cg.create("s2", Limits(pids_max=64))
    cpuset = scope.dirs["cpuset"]
    assert (cpuset.parent / "cpuset.cpus").read_text().strip()
    assert (cpuset / "cpuset.cpus").read_text().strip()
    r = _join_and_run(real_cg, scope, "cat /proc/self/cgroup")
    assert r.returncode == 0, r.stderr
    assert f"{real_cg.slice}/alloc-s2.scope" in r.stdout


@real_v1
def test_real_v1_output_of_escaped_processes_is_shipped_before_the_end(
    real_cg: CgroupsV1, tmp_path: Path
) -> None:
    """A process that left the job's process group (setsid) but still writes its output
    is killed in the scope before the last read: the store holds every line the file
    has when the end is reported, and the file grows no more."""
    from lattice_agent.runtime import ProcessRuntime
    from lattice_common.logstore import FsLogStore, allocation_logs

    async def main() -> None:
        ended = asyncio.Event()
        store = FsLogStore(tmp_path / "store")
        rt = ProcessRuntime(
            node_id="n1",
            work_dir=tmp_path / "work",
            log_dir=tmp_path / "log",
            state_file=tmp_path / "state.json",
            on_change=lambda r: ended.set() if r.phase == "exited" else None,
            subreaper=False,
            cgroups=real_cg,
            log_store=store,
            log_flush_interval=30,
        )
        await rt.recover()
        alloc = Allocation(
            id="escaper",
            spec=AllocationSpec(
                entrypoint="setsid sh -c 'while :; do echo x; done' & sleep 0.2; echo bye",
                tenant="t",
                vcluster="v",
            ),
        )
        try:
            await rt.start(alloc, nodelist=["n1"])
            await asyncio.wait_for(ended.wait(), 30)
            in_file = (tmp_path / "log" / "escaper" / "stdout.log").read_text().splitlines()
            stored = await allocation_logs(store, alloc).read()
            assert stored.complete
            assert "bye" in in_file and len(in_file) > 10
            assert [ln.line for ln in stored.lines if ln.stream == "stdout"] == in_file
            await asyncio.sleep(0.1)  # killed with the scope: the file grows no more
            assert (tmp_path / "log" / "escaper" / "stdout.log").read_text().splitlines() == (
                in_file
            )
        finally:
            await rt.close()

    asyncio.run(main())
