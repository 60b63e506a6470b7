"""ProcessRuntime against real processes: exits, signals, walltime, restart survival, logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest
from lattice_agent.persist import PERSIST_LATER_SECONDS
from lattice_agent.runtime import LogRecord, ProcessRuntime, signal_exit_code
from lattice_common.types import Allocation, AllocationReport, AllocationSpec

pytestmark = pytest.mark.timeout(30)


def make_alloc(aid: str, entrypoint: str, *, walltime: int = 0, **spec: object) -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(
            entrypoint=entrypoint, tenant="t", vcluster="v", walltime_seconds=walltime, **spec
        ),
    )


class Env:
    """Builds runtimes that share one work dir, log dir and state file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_file = root / "state" / "agent-state.json"
        self.runtimes: list[ProcessRuntime] = []
        self.pgids: set[int] = set()

    def runtime(self, **kw: object) -> tuple[ProcessRuntime, list[AllocationReport]]:
        changes: list[AllocationReport] = []
        kw.setdefault("walltime_grace_seconds", 0.5)
        rt = ProcessRuntime(
            node_id="n1",
            work_dir=self.root / "work",
            log_dir=self.root / "logs",
            state_file=self.state_file,
            on_change=changes.append,
            **kw,  # type: ignore[arg-type]
        )
        self.runtimes.append(rt)
        return rt, changes

    async def cleanup(self) -> None:
        for rt in self.runtimes:
            for r in rt.reports():
                if r.pid > 0:
                    self.pgids.add(r.pid)
            await rt.close()
        for pgid in self.pgids:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path)
    yield e
    await e.cleanup()


async def wait_exited(rt: ProcessRuntime, aid: str, timeout: float = 4.0) -> AllocationReport:
    deadline = time.monotonic() + timeout
    while True:
        for r in rt.reports():
            if r.allocation_id == aid and r.phase == "exited":
                return r
        assert time.monotonic() < deadline, f"{aid} did not exit: {rt.reports()}"
        await asyncio.sleep(0.02)


def report_of(rt: ProcessRuntime, aid: str) -> AllocationReport:
    (r,) = [r for r in rt.reports() if r.allocation_id == aid]
    return r


def lines(records: list[LogRecord], stream: str | None = None) -> list[str]:
    return [r.line for r in records if stream is None or r.stream == stream]


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def group_size(pgid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            rest = data[data.rindex(b")") + 2 :].split()
            if int(rest[2]) == pgid and rest[0] != b"Z":
                n += 1
    return n


def is_running(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] != b"Z"


async def test_echo_hello_exits_zero_and_is_tailed(env: Env) -> None:
    rt, changes = env.runtime()
    await rt.start(make_alloc("a1", "echo hello"), nodelist=["n1"])
    r = await wait_exited(rt, "a1")
    assert r.exit_code == 0
    assert r.reason == ""
    assert r.pid > 0
    assert r.started_at is not None and r.finished_at is not None
    assert r.started_at <= r.finished_at
    assert [c.phase for c in changes] == ["running", "exited"]
    assert "hello" in lines(rt.tail("a1"), "stdout")
    assert (env.root / "logs" / "a1" / "stdout.log").read_text() == "hello\n"
    assert rt.running_ids() == set()
    assert group_gone(r.pid)


async def test_environment_and_working_dir(env: Env, tmp_path: Path) -> None:
    rt, _ = env.runtime()
    entry = (
        'echo "id=$LATTICE_ALLOC_ID"; echo "nodes=$LATTICE_NODELIST"; echo "nn=$LATTICE_NNODES";'
        ' echo "slurm=$SLURM_JOB_ID"; echo "snodes=$SLURM_JOB_NODELIST"; echo "snn=$SLURM_NNODES";'
        ' echo "name=$LATTICE_JOB_NAME/$SLURM_JOB_NAME"; echo "node=$LATTICE_NODE_ID";'
        ' echo "foo=$FOO"; echo "pwd=$(pwd)"; echo "work=$LATTICE_WORK_DIR";'
        ' echo "submit=$LATTICE_SUBMIT_DIR/$SLURM_SUBMIT_DIR"'
    )
    await rt.start(make_alloc("env1", entry, env={"FOO": "bar"}), nodelist=["n1", "n2"])
    r = await wait_exited(rt, "env1")
    assert r.exit_code == 0
    out = lines(rt.tail("env1"), "stdout")
    work = str(env.root / "work" / "env1")
    assert "id=env1" in out
    assert "nodes=n1,n2" in out
    assert "nn=2" in out
    assert "slurm=env1" in out
    assert "snodes=n1,n2" in out
    assert "snn=2" in out
    assert "name=echo/echo" in out
    assert "node=n1" in out
    assert "foo=bar" in out
    assert f"pwd={work}" in out
    assert f"work={work}" in out
    assert f"submit={work}/{work}" in out

    submit = tmp_path / "submit here"
    submit.mkdir()
    alloc = make_alloc(
        "env2", 'pwd; echo "$SLURM_SUBMIT_DIR"', name="train", submit_dir=str(submit)
    )
    await rt.start(alloc, nodelist=["n1"])
    await wait_exited(rt, "env2")
    assert lines(rt.tail("env2")) == [str(submit), str(submit)]


async def test_nonzero_exit_code_and_stderr(env: Env) -> None:
    rt, _ = env.runtime()
    await rt.start(make_alloc("bad", "echo oops >&2; exit 7"), nodelist=["n1"])
    r = await wait_exited(rt, "bad")
    assert r.exit_code == 7
    assert r.reason == ""
    assert lines(rt.tail("bad", stream="stderr")) == ["oops"]
    assert rt.tail("bad", stream="stdout") == []


async def test_walltime_terminates_whole_group(env: Env) -> None:
    rt, changes = env.runtime(walltime_grace_seconds=0.5)
    t0 = time.monotonic()
    await rt.start(make_alloc("wt", "sleep 60", walltime=1), nodelist=["n1"])
    pgid = report_of(rt, "wt").pid
    r = await wait_exited(rt, "wt", timeout=4)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 3.0
    assert r.reason == "walltime_exceeded"
    assert r.exit_code == signal_exit_code(signal.SIGTERM) == 143
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert [c.phase for c in changes] == ["running", "exited"]


async def test_sigterm_ignored_gets_sigkill_after_grace(env: Env) -> None:
    rt, _ = env.runtime(walltime_grace_seconds=0.5)
    entry = "trap '' TERM; sleep 60 & sleep 60; wait"
    await rt.start(make_alloc("stubborn", entry, walltime=1), nodelist=["n1"])
    pgid = report_of(rt, "stubborn").pid
    t0 = time.monotonic()
    r = await wait_exited(rt, "stubborn", timeout=4)
    assert time.monotonic() - t0 >= 1.4  # 1 s walltime + 0.5 s grace
    assert r.reason == "walltime_exceeded"
    assert r.exit_code == signal_exit_code(signal.SIGKILL) == 137
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


async def test_stop_kills_grandchildren(env: Env) -> None:
    rt, changes = env.runtime(walltime_grace_seconds=0.5)
    await rt.start(make_alloc("fam", "sleep 60 & sleep 60 & wait"), nodelist=["n1"])
    pgid = report_of(rt, "fam").pid
    deadline = time.monotonic() + 3
    while group_size(pgid) < 4:  # wrapper, sh, sleep, sleep
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgrp(int(p)) == pgid]
    await asyncio.gather(rt.stop("fam"), rt.stop("fam", reason="other"))  # idempotent
    r = report_of(rt, "fam")
    assert r.phase == "exited"
    assert r.reason == "cancelled"
    assert r.exit_code == 143
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    for pid in members:
        assert not is_running(pid)
    await rt.stop("fam")  # after exit: nothing happens
    await rt.stop("unknown")
    assert [c.phase for c in changes] == ["running", "exited"]


def _pgrp(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[2])


async def test_leftover_background_processes_are_killed_at_exit(env: Env) -> None:
    rt, _ = env.runtime()
    await rt.start(make_alloc("bg", "sleep 60 & echo bye"), nodelist=["n1"])
    r = await wait_exited(rt, "bg")
    assert r.exit_code == 0
    assert r.reason == ""
    assert group_gone(r.pid)


async def test_restart_survival(env: Env) -> None:
    marker = env.root / "marker"
    alloc = make_alloc(
        "surv", 'echo started >> "$MARKER"; sleep 2; echo done', env={"MARKER": str(marker)}
    )
    a, _ = env.runtime()
    assert await a.recover() == []
    await a.start(alloc, nodelist=["n1"])
    pid = report_of(a, "surv").pid
    await asyncio.sleep(0.3)
    await a.close()  # the agent goes away; the workload must not
    assert is_running(pid)

    b, changes = env.runtime()
    assert await b.recover() == ["surv"]
    await b.start(alloc, nodelist=["n1"])  # already known: must not start a second copy
    r = report_of(b, "surv")
    assert r.phase == "running"
    assert r.pid == pid
    assert b.running_ids() == {"surv"}
    r = await wait_exited(b, "surv", timeout=4)
    assert r.exit_code == 0
    assert r.reason == ""
    await asyncio.sleep(0.3)
    exited = [c for c in changes if c.allocation_id == "surv" and c.phase == "exited"]
    assert len(exited) == 1
    assert marker.read_text().splitlines() == ["started"]
    assert "done" in lines(b.tail("surv"))
    await b.start(alloc, nodelist=["n1"])  # exited but not forgotten: still a no-op
    assert marker.read_text().splitlines() == ["started"]
    assert group_gone(pid)


async def test_restart_recomputes_walltime_from_started_at(env: Env) -> None:
    a, _ = env.runtime()
    await a.start(make_alloc("wt2", "sleep 60", walltime=3), nodelist=["n1"])
    pid = report_of(a, "wt2").pid
    await a.close()
    # the new agent's clock says 2.5 s more have passed: 0.5 s left of the 3 s walltime
    b, changes = env.runtime(clock=lambda: time.time() + 2.5)
    t0 = time.monotonic()
    assert await b.recover() == ["wt2"]
    r = await wait_exited(b, "wt2", timeout=4)
    assert time.monotonic() - t0 < 2.0
    assert r.reason == "walltime_exceeded"
    assert r.exit_code == 143
    assert group_gone(pid)
    assert [c.phase for c in changes] == ["exited"]


async def test_restart_finds_dead_process_without_exit_file(env: Env) -> None:
    a, _ = env.runtime()
    await a.start(make_alloc("gone", "sleep 60"), nodelist=["n1"])
    pid = report_of(a, "gone").pid
    await a.close()
    os.killpg(pid, signal.SIGKILL)  # dies without its wrapper writing the exit file
    os.waitpid(pid, 0)  # and is reaped by "init", as after a real agent restart
    b, changes = env.runtime()
    assert await b.recover() == []
    r = report_of(b, "gone")
    assert r.phase == "exited"
    assert r.exit_code is None
    assert r.reason == "lost_on_agent_restart"
    assert [c.phase for c in changes] == ["exited"]


async def test_restart_reports_process_that_finished_while_away(env: Env) -> None:
    a, _ = env.runtime()
    await a.start(make_alloc("quick", "echo hi; exit 3"), nodelist=["n1"])
    await a.close()
    await asyncio.sleep(0.3)  # it ends while no agent watches
    b, changes = env.runtime()
    assert await b.recover() == []
    r = report_of(b, "quick")
    assert (r.phase, r.exit_code, r.reason) == ("exited", 3, "")
    assert changes == [r]
    assert lines(b.tail("quick")) == ["hi"]


async def test_exited_allocations_persist_until_forgotten(env: Env) -> None:
    a, _ = env.runtime()
    await a.start(make_alloc("e1", "echo one"), nodelist=["n1"])
    await wait_exited(a, "e1")
    await a.close()
    b, changes = env.runtime()
    assert await b.recover() == []
    r = report_of(b, "e1")
    assert (r.phase, r.exit_code) == ("exited", 0)
    assert changes == []  # nothing changed
    b.forget("e1")
    assert b.reports() == []
    # a removal is written with the next write, at most PERSIST_LATER_SECONDS later
    assert saved_ids(env) == ["e1"]
    await asyncio.sleep(PERSIST_LATER_SECONDS + 0.3)
    assert saved_ids(env) == []
    assert lines(b.tail("e1")) == ["one"]  # files stay; tail reads them


def saved_ids(env: Env) -> list[str]:
    return [e["id"] for e in json.loads(env.state_file.read_text())["allocations"]]


async def test_a_removal_goes_with_the_next_write_and_at_close(env: Env) -> None:
    """A short job's end and the next job's start: the forgotten one leaves the state
    file in the write that records the new one (one write less per job)."""
    rt, _ = env.runtime()
    await rt.start(make_alloc("f1", "true"), nodelist=["n1"])
    await wait_exited(rt, "f1")
    rt.forget("f1")
    await rt.start(make_alloc("f2", "sleep 60", walltime=100), nodelist=["n1"])
    assert saved_ids(env) == ["f2"]  # at once, not after the deferral
    await rt.stop("f2", reason="cancelled")
    rt.forget("f2")
    await rt.close()  # a pending removal is written before the runtime goes
    assert saved_ids(env) == []


async def test_state_file_is_private_and_complete(env: Env) -> None:
    rt, _ = env.runtime()
    await rt.start(make_alloc("s1", "echo up; exec sleep 60", walltime=100), nodelist=["n1"])
    mode = stat.S_IMODE(os.stat(env.state_file).st_mode)
    assert mode == 0o600
    (entry,) = json.loads(env.state_file.read_text())["allocations"]
    r = report_of(rt, "s1")
    assert entry["id"] == "s1"
    assert entry["pid"] == entry["pgid"] == r.pid
    assert entry["started_at"] == r.started_at
    assert entry["deadline"] == pytest.approx(r.started_at + 100)
    assert entry["stdout"].endswith("s1/stdout.log")
    assert entry["stderr"].endswith("s1/stderr.log")
    assert entry["phase"] == "running"
    # stopped once the command runs: a SIGTERM that comes while the wrapper's child is
    # between fork and exec is taken by the wrapper's trap there and lost (then SIGKILL)
    deadline = time.monotonic() + 10
    while "up" not in lines(rt.tail("s1"), "stdout"):
        assert time.monotonic() < deadline, "the command never ran"
        await asyncio.sleep(0.02)
    await rt.stop("s1")
    (entry,) = json.loads(env.state_file.read_text())["allocations"]
    assert (entry["phase"], entry["reason"], entry["exit_code"]) == ("exited", "cancelled", 143)
    assert stat.S_IMODE(os.stat(env.state_file).st_mode) == 0o600


async def test_entrypoint_keeps_shell_semantics(env: Env) -> None:
    rt, _ = env.runtime()
    entry = (
        "echo \"it's $(echo sub)\" 'a\"b' '$HOME'; x='\"$@\"; exit 9'; echo \"$x\"; "
        'printf "%s\\n" "$0" | wc -l; exit 4'
    )
    await rt.start(make_alloc("q1", entry), nodelist=["n1"])
    r = await wait_exited(rt, "q1")
    assert lines(rt.tail("q1"), "stdout") == ["it's sub a\"b $HOME", '"$@"; exit 9', "1"]
    assert r.exit_code == 4


async def test_follow_streams_lines_while_running(env: Env) -> None:
    rt, _ = env.runtime()
    entry = "for i in 1 2 3 4; do echo line$i; sleep 0.2; done; echo err >&2"
    await rt.start(make_alloc("f1", entry), nodelist=["n1"])
    got: list[tuple[str, str, bool]] = []
    async for rec in rt.follow("f1"):
        got.append((rec.stream, rec.line, "f1" in rt.running_ids()))
    assert [(s, line) for s, line, _ in got] == [
        ("stdout", "line1"),
        ("stdout", "line2"),
        ("stdout", "line3"),
        ("stdout", "line4"),
        ("stderr", "err"),
    ]
    assert got[0][2], "first line should arrive while the allocation still runs"
    assert report_of(rt, "f1").phase == "exited"
    # following an exited allocation replays the buffer and ends
    assert [r.line async for r in rt.follow("f1", stream="stderr")] == ["err"]


async def test_tail_ring_buffer_is_bounded(env: Env) -> None:
    rt, _ = env.runtime(ring_buffer_lines=5)
    await rt.start(make_alloc("many", "seq 1 20; printf 'no newline'"), nodelist=["n1"])
    await wait_exited(rt, "many")
    await asyncio.sleep(0.2)  # the tailer drains after the exit
    assert lines(rt.tail("many")) == ["17", "18", "19", "20", "no newline"]
    assert lines(rt.tail("many", n=2)) == ["20", "no newline"]
    assert rt.tail("many", n=0) == []


async def test_start_is_idempotent(env: Env) -> None:
    marker = env.root / "m"
    alloc = make_alloc("once", 'echo x >> "$M"; sleep 0.3', env={"M": str(marker)})
    rt, changes = env.runtime()
    await asyncio.gather(rt.start(alloc, nodelist=["n1"]), rt.start(alloc, nodelist=["n1"]))
    await rt.start(alloc, nodelist=["n1"])
    await wait_exited(rt, "once")
    assert marker.read_text() == "x\n"
    assert [c.phase for c in changes] == ["running", "exited"]


async def test_forget_keeps_running_allocations(env: Env) -> None:
    rt, _ = env.runtime()
    await rt.start(make_alloc("r1", "sleep 60"), nodelist=["n1"])
    rt.forget("r1")  # refused: still running
    assert rt.running_ids() == {"r1"}
    await rt.stop("r1", reason="preempted")
    assert report_of(rt, "r1").reason == "preempted"
    rt.forget("r1")
    assert rt.reports() == []


async def test_spawn_failure_is_reported_as_exited(env: Env) -> None:
    rt, changes = env.runtime()
    await rt.start(make_alloc("nope", "true", env={"BAD=NAME": "x"}), nodelist=["n1"])
    r = report_of(rt, "nope")
    assert (r.phase, r.exit_code) == ("exited", None)
    assert r.reason.startswith("spawn_failed: ")
    assert changes == [r]
    with pytest.raises(ValueError):
        await rt.start(make_alloc("../escape", "true"), nodelist=["n1"])
    with pytest.raises(ValueError):
        rt.tail("nope", stream="stdin")
