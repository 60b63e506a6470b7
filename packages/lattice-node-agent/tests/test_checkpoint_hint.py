"""Checkpoint broker hints on the agent: "checkpoint and continue". Real test
applications under the agent's ProcessRuntime are asked through their protocol, write
their checkpoint and keep running; each hint's checkpoint stays in its own directory,
the heartbeat carries the outcome with the hint id, and a later preemption still gets a
fresh checkpoint. Also reconcile: an outstanding hint of the current run is acted on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from lattice_agent.checkpoint import CheckpointManager
from lattice_agent.reconcile import Checkpoint, reconcile
from lattice_agent.runtime import ProcessRuntime
from lattice_common.types import (
    PHASE_CHECKPOINTED,
    Allocation,
    AllocationReport,
    AllocationSpec,
    AllocationState,
    CheckpointHint,
)

pytestmark = pytest.mark.timeout(120)

APPS = Path(__file__).parent / "apps"


def app_alloc(aid: str, protocol: str, *args: str) -> Allocation:
    return Allocation(
        id=aid,
        state=AllocationState.RUNNING,
        assigned_nodes=["n1"],
        spec=AllocationSpec(
            entrypoint=f"{sys.executable} {APPS / f'ckpt_{protocol}.py'} {' '.join(args)}",
            tenant="physics",
            project="climate",
            vcluster="v",
            checkpoint="auto",
            checkpoint_protocol=protocol,
        ),
    )


class Node:
    def __init__(self, root: Path) -> None:
        self.ckpt_root = root / "checkpoints"
        self.runtime = ProcessRuntime(
            node_id="n1",
            work_dir=root / "work",
            log_dir=root / "logs",
            state_file=root / "state" / "agent-state.json",
            walltime_grace_seconds=1.0,
            checkpoint_env=lambda a, d: self.manager.environment(a, d),
        )
        self.manager = CheckpointManager(
            self.runtime,
            node_id="n1",
            work_dir=root / "work",
            root=self.ckpt_root,
            timeout=20.0,
            poll_interval=0.05,
        )

    def output(self, aid: str) -> list[str]:
        return [r.line for r in self.runtime.tail(aid, None, "stdout")]

    async def wait(self, what: str, cond, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"no {what}: reports {self.runtime.reports()}, hint outcomes "
            f"{self.manager.hint_outcomes}, hinting {list(self.manager._hint_tasks)}"
        )

    async def wait_line(self, aid: str, prefix: str) -> str:
        return await self.wait(
            f"{prefix!r} from {aid}",
            lambda: next((ln for ln in self.output(aid) if ln.startswith(prefix)), None),
        )

    def report(self, aid: str) -> AllocationReport:
        (r,) = [r for r in self.manager.reports(self.runtime.reports()) if r.allocation_id == aid]
        return r

    async def close(self) -> None:
        pids = [r.pid for r in self.runtime.reports() if r.pid > 0]
        await self.manager.close()
        await self.runtime.close()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
async def node(tmp_path: Path):
    n = Node(tmp_path)
    yield n
    await n.close()


def hinted(a: Allocation, n: int, *, done: bool = False) -> Allocation:
    a.checkpoint_hint = CheckpointHint(
        id=f"hint-{n}", epoch=n, at=time.time(), run=0, done_at=time.time() if done else None
    )
    a.checkpoint_hints = n
    return a


@pytest.mark.parametrize("protocol", ["signal", "shmem", "grpc"])
async def test_a_hinted_application_checkpoints_and_keeps_running(
    node: Node, protocol: str
) -> None:
    a = app_alloc(f"h-{protocol}", protocol, "1000000", "0.05")
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    await node.wait_line(a.id, "count 5")
    if protocol == "grpc":
        await node.wait_line(a.id, "checkpoint endpoint registered")
    base = node.ckpt_root / "physics" / "climate" / a.id / "checkpoints"
    records = []
    for n in (1, 2):
        a = hinted(a, n)
        await node.manager.sync({a.id: a})
        node.manager.begin_hint(a, f"hint-{n}")
        node.manager.begin_hint(a, f"hint-{n}")  # idempotent
        r = await node.wait(
            f"hint-{n} outcome",
            lambda n=n, aid=a.id: (r := node.report(aid)).hint_id == f"hint-{n}" and r,
        )
        assert r.phase == "running" and r.checkpoint_id == f"ckpt-1-hint-{n}", r
        assert Path(r.checkpoint_path) == base / f"ckpt-1-hint-{n}"
        records.append(int((Path(r.checkpoint_path) / "counter").read_text()))
        # the quorum records it: the hint is done, the report goes back to plain running
        a = hinted(a, n, done=True)
        await node.manager.sync({a.id: a})
        assert node.report(a.id).hint_id == ""
    assert a.id in node.runtime.running_ids()  # it kept running throughout
    assert records[1] > records[0] >= 5
    before = len(node.output(a.id))
    await node.wait("more counting", lambda: len(node.output(a.id)) > before + 3)
    # preemption afterwards: a fresh checkpoint in the run's own directory, then stopped
    node.manager.begin(a)
    outcome = await node.wait("preemption outcome", lambda: node.manager.outcomes.get(a.id))
    assert outcome.ok and Path(outcome.record.path) == base / "ckpt-1"
    assert int((base / "ckpt-1" / "counter").read_text()) > records[1]
    await node.wait("exit", lambda: a.id not in node.runtime.running_ids())
    assert node.report(a.id).phase == PHASE_CHECKPOINTED


async def test_an_unresponsive_application_fails_the_hint_but_keeps_running(
    node: Node,
) -> None:
    node.manager.timeout = 0.5
    a = hinted(app_alloc("h-hang", "signal", "1000000", "0.05", "hang"), 1)
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    await node.wait_line(a.id, "count 3")
    node.manager.begin_hint(a, "hint-1")
    r = await node.wait("hint outcome", lambda: (r := node.report(a.id)).hint_id and r, 20)
    assert r.phase == "running" and r.checkpoint_id == "" and r.reason == "checkpoint_timeout"
    assert a.id in node.runtime.running_ids()


async def test_a_hint_right_after_the_start_waits_for_the_applications_handler(
    node: Node,
) -> None:
    """Hinted at once, while the job is the wrapper, then a shell, then ``sleep``, and
    only 1.5 s later the application: SIGUSR1 reaches no process before the
    application catches it (it would be lost in a shell's trap, or end a process that
    has the default action), then it is sent once; the checkpoint completes and the
    job runs on."""
    a = hinted(app_alloc("h-late", "signal"), 1)
    a.spec.entrypoint = f"sleep 1.5; exec {sys.executable} {APPS / 'ckpt_signal.py'} 1000000 0.05"
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    assert not node.runtime.signal_disposition(a.id, signal.SIGUSR1).catching
    node.manager.begin_hint(a, "hint-1")
    r = await node.wait("hint outcome", lambda: (r := node.report(a.id)).hint_id and r, 30)
    assert r.phase == "running" and r.checkpoint_id == "ckpt-1-hint-1", r
    assert a.id in node.runtime.running_ids()
    assert any(ln.startswith("checkpointed at") for ln in node.output(a.id))


async def test_an_application_run_as_a_child_of_its_script_checkpoints(node: Node) -> None:
    """The script's shell waits for the application (no ``exec``), as most batch
    scripts do: the shell ignores SIGUSR1, the application catches it, so the group's
    signal checkpoints the application and the script runs on."""
    a = hinted(app_alloc("h-child", "signal"), 1)
    a.spec.entrypoint = (
        f"{sys.executable} {APPS / 'ckpt_signal.py'} 1000000 0.05; echo the application ended"
    )
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    node.manager.begin_hint(a, "hint-1")
    r = await node.wait("hint outcome", lambda: (r := node.report(a.id)).hint_id and r, 30)
    assert r.phase == "running" and r.checkpoint_id == "ckpt-1-hint-1", r
    await node.wait_line(a.id, "checkpointed at")
    await asyncio.sleep(0.3)
    assert a.id in node.runtime.running_ids()
    assert "the application ended" not in node.output(a.id)


async def test_a_script_that_traps_usr1_checkpoints_between_its_commands(node: Node) -> None:
    """The batch-script pattern: the script traps USR1 and loops over short commands
    (which have the default action): the script gets the signal, they are not ended by
    it, and the trap writes the checkpoint."""
    a = hinted(app_alloc("h-trap", "signal"), 1)
    a.spec.entrypoint = (
        "bash -c 'trap \"echo saved > $LATTICE_CHECKPOINT_DIR/state; "
        'touch $LATTICE_CHECKPOINT_SENTINEL; echo trapped" USR1; '
        "echo looping; while :; do sleep 0.2; done'"
    )
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    await node.wait_line(a.id, "looping")
    node.manager.begin_hint(a, "hint-1")
    r = await node.wait("hint outcome", lambda: (r := node.report(a.id)).hint_id and r, 30)
    assert r.phase == "running" and r.checkpoint_id == "ckpt-1-hint-1", r
    assert (Path(r.checkpoint_path) / "state").read_text() == "saved\n"
    assert node.output(a.id).count("trapped") == 1
    assert a.id in node.runtime.running_ids()


async def test_a_job_that_never_catches_sigusr1_gets_no_signal_and_runs_on(node: Node) -> None:
    """A job none of whose processes catches SIGUSR1 (a shell waiting for ``sleep``):
    no signal is sent, the hint times out as for an application that does not answer,
    and the job is not ended by it."""
    node.manager.timeout = 0.5
    a = hinted(app_alloc("h-shell", "signal"), 1)
    a.spec.entrypoint = "sleep 60; true"
    await node.manager.sync({a.id: a})
    await node.runtime.start(a, nodelist=["n1"])
    node.manager.begin_hint(a, "hint-1")
    r = await node.wait("hint outcome", lambda: (r := node.report(a.id)).hint_id and r, 20)
    assert r.phase == "running" and r.reason == "checkpoint_timeout", r
    await asyncio.sleep(0.3)
    assert a.id in node.runtime.running_ids()  # SIGUSR1 would have ended it with 138


def _report(aid: str, phase: str = "running") -> AllocationReport:
    return AllocationReport(allocation_id=aid, phase=phase, pid=1)


def test_reconcile_acts_on_an_outstanding_hint_of_the_current_run_only() -> None:
    a = hinted(app_alloc("a", "signal"), 1)
    acts = reconcile("n1", [a], [_report("a")], {"a": 0})
    assert acts == [Checkpoint(a, hint_id="hint-1")]
    done = hinted(app_alloc("a", "signal"), 1, done=True)
    assert reconcile("n1", [done], [_report("a")], {"a": 0}) == []
    stale = hinted(app_alloc("a", "signal"), 1)
    stale.requeue_count = 1  # issued in the run before: moot
    assert not any(isinstance(x, Checkpoint) for x in reconcile("n1", [stale], [], {}))
    none = hinted(app_alloc("a", ""), 1)
    assert reconcile("n1", [none], [_report("a")], {"a": 0}) == []
    not_head = hinted(app_alloc("a", "signal"), 1)
    not_head.assigned_nodes = ["n0", "n1"]
    assert not any(isinstance(x, Checkpoint) for x in reconcile("n1", [not_head], [], {}))
