"""The three checkpoint protocols and the timeout table against real processes: the
test applications in tests/apps run under the agent's ProcessRuntime, the
CheckpointManager asks them to checkpoint, and what the heartbeat would report is
checked, down to the application resuming from its saved counter."""

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
from lattice_agent.checkpoint import shmem as agent_shmem
from lattice_agent.checkpoint.coordinator import Outcome
from lattice_agent.runtime import ProcessRuntime
from lattice_common.types import (
    PHASE_CHECKPOINT_FAILED,
    PHASE_CHECKPOINTED,
    Allocation,
    AllocationSpec,
)
from lattice_sdk import checkpoint as sdk

pytestmark = pytest.mark.timeout(90)

APPS = Path(__file__).parent / "apps"


def app_alloc(aid: str, protocol: str, *args: str, walltime: int = 0, **env: str) -> Allocation:
    script = APPS / f"ckpt_{protocol}.py"
    return Allocation(
        id=aid,
        assigned_nodes=["n1"],
        spec=AllocationSpec(
            entrypoint=f"{sys.executable} {script} {' '.join(args)}",
            tenant="physics",
            project="climate",
            vcluster="v",
            walltime_seconds=walltime,
            checkpoint="manual",
            checkpoint_protocol=protocol,
            env=env,
        ),
    )


class Node:
    """A ProcessRuntime and a CheckpointManager wired as the agent wires them."""

    def __init__(self, root: Path, *, timeout: float = 20.0, max_deferral: float = 300.0) -> None:
        self.root = root
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
            timeout=timeout,
            max_deferral=max_deferral,
            poll_interval=0.05,
        )

    async def start(self, a: Allocation) -> None:
        await self.manager.sync({a.id: a})
        await self.runtime.start(a, nodelist=["n1"])

    def output(self, aid: str) -> list[str]:
        return [r.line for r in self.runtime.tail(aid, None, "stdout")]

    async def wait_line(self, aid: str, prefix: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output(aid):
                if line.startswith(prefix):
                    return line
            await asyncio.sleep(0.05)
        raise AssertionError(f"{aid}: no line {prefix!r} in {self.output(aid)[-20:]}")

    async def outcome(self, aid: str, timeout: float = 45.0) -> Outcome:
        deadline = time.monotonic() + timeout
        while aid not in self.manager.outcomes:
            assert time.monotonic() < deadline, f"{aid}: no checkpoint outcome"
            await asyncio.sleep(0.05)
        return self.manager.outcomes[aid]

    async def exited(self, aid: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while aid in self.runtime.running_ids():
            assert time.monotonic() < deadline, f"{aid} still runs"
            await asyncio.sleep(0.05)

    def report(self, aid: str):
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


def resumed(a: Allocation, outcome: Outcome) -> Allocation:
    """The allocation as the quorum requeues it after Suspended: the resume flag, the
    recorded checkpoint, one more preemption."""
    a.resume_from_checkpoint = True
    a.last_checkpoint = outcome.record
    a.preempted_count += 1
    return a


@pytest.mark.parametrize("protocol", ["signal", "shmem", "grpc"])
async def test_each_protocol_checkpoints_and_the_next_run_resumes_from_it(
    node: Node, protocol: str
) -> None:
    a = app_alloc(f"ck-{protocol}", protocol, "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 5")
    if protocol == "grpc":
        await node.wait_line(a.id, "checkpoint endpoint registered")
    node.manager.begin(a)
    outcome = await node.outcome(a.id)
    assert outcome.ok, outcome
    await node.exited(a.id)
    record = outcome.record
    assert record is not None
    expected = node.ckpt_root / "physics" / "climate" / a.id / "checkpoints" / "ckpt-1"
    assert Path(record.path) == expected
    saved = int((expected / "counter").read_text())
    assert saved >= 5 and record.size_bytes >= len(str(saved)) and record.duration_seconds >= 0
    # the heartbeat carries the outcome in place of the exit
    r = node.report(a.id)
    assert (r.phase, r.checkpoint_id, r.checkpoint_path) == (
        PHASE_CHECKPOINTED,
        "ckpt-1",
        record.path,
    )
    # the next run starts with LATTICE_RESUME and continues from the saved counter
    node.runtime.forget(a.id)
    await node.manager.sync({})
    b = resumed(a, outcome)
    await node.start(b)
    await node.wait_line(b.id, f"resumed from {saved}")
    await node.wait_line(b.id, f"count {saved + 1}")
    # its next checkpoint goes to a new directory
    env_dir = node.ckpt_root / "physics" / "climate" / a.id / "checkpoints" / "ckpt-2"
    assert env_dir.is_dir()


async def test_unresponsive_application_is_stopped_and_the_checkpoint_failed(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, timeout=1.5)
    try:
        a = app_alloc("ck-hang", "signal", "1000000", "0.05", "hang")
        await node.start(a)
        await node.wait_line(a.id, "count 3")
        t0 = time.monotonic()
        node.manager.begin(a)
        outcome = await node.outcome(a.id)
        assert not outcome.ok and outcome.reason == "checkpoint_timeout", outcome
        assert not outcome.extended  # nothing answered: no extension
        await node.exited(a.id)
        assert time.monotonic() - t0 >= 1.5
        r = node.report(a.id)
        assert (r.phase, r.reason) == (PHASE_CHECKPOINT_FAILED, "checkpoint_timeout")
        # the incomplete checkpoint is never used
        assert not (
            node.ckpt_root / "physics" / "climate" / a.id / "checkpoints" / "ckpt-1"
        ).exists()
    finally:
        await node.close()


@pytest.mark.parametrize("protocol", ["shmem", "grpc"])
async def test_slow_but_responsive_application_gets_one_extension(
    tmp_path: Path, protocol: str
) -> None:
    # timeout 4 s, the checkpoint takes 5 s with progress: the 50 % extension (to 6 s)
    node = Node(tmp_path, timeout=4.0)
    try:
        a = app_alloc(f"ck-slow-{protocol}", protocol, "1000000", "0.05", "slow", CKPT_SLOW="5")
        await node.start(a)
        await node.wait_line(a.id, "count 3")
        if protocol == "grpc":
            await node.wait_line(a.id, "checkpoint endpoint registered")
        node.manager.begin(a)
        outcome = await node.outcome(a.id)
        assert outcome.ok and outcome.extended, outcome
    finally:
        await node.close()


async def test_the_extension_is_given_once(tmp_path: Path) -> None:
    # timeout 2 s, the checkpoint would take 20 s: one extension (to 3 s), then it fails
    node = Node(tmp_path, timeout=2.0)
    try:
        a = app_alloc("ck-slower", "shmem", "1000000", "0.05", "slow", CKPT_SLOW="20")
        await node.start(a)
        await node.wait_line(a.id, "count 3")
        t0 = time.monotonic()
        node.manager.begin(a)
        outcome = await node.outcome(a.id)
        assert not outcome.ok and outcome.extended and outcome.reason == "checkpoint_timeout"
        assert 3.0 <= time.monotonic() - t0 < 15.0
    finally:
        await node.close()


async def test_deferral_is_granted_up_to_max_deferral_then_forced(tmp_path: Path) -> None:
    node = Node(tmp_path, timeout=10.0, max_deferral=2.5)
    try:
        a = app_alloc("ck-defer", "grpc", "1000000", "0.05", "defer")
        await node.start(a)
        await node.wait_line(a.id, "checkpoint endpoint registered")
        t0 = time.monotonic()
        node.manager.begin(a)
        outcome = await node.outcome(a.id)
        assert outcome.ok and outcome.forced and outcome.deferred_seconds == 2.5, outcome
        assert time.monotonic() - t0 >= 2.5  # the deferrals were honoured
        lines = node.output(a.id)
        assert sum(1 for ln in lines if ln.startswith("deferring")) == 3  # 1 + 1 + 0.5 s
        assert any(ln.startswith("checkpointed at") and "forced=True" in ln for ln in lines)
    finally:
        await node.close()


async def test_walltime_during_an_incomplete_checkpoint_fails_walltime_exceeded(
    tmp_path: Path,
) -> None:
    # walltime is not extended for a checkpoint: SIGTERM, grace, SIGKILL; incomplete
    node = Node(tmp_path, timeout=60.0)
    try:
        a = app_alloc("ck-wall", "signal", "1000000", "0.05", "hang", walltime=3)
        await node.start(a)
        await node.wait_line(a.id, "count 3")
        node.manager.begin(a)
        outcome = await node.outcome(a.id)
        assert not outcome.ok and outcome.reason == "walltime_exceeded", outcome
        r = node.report(a.id)
        assert (r.phase, r.reason) == (PHASE_CHECKPOINT_FAILED, "walltime_exceeded")
    finally:
        await node.close()


async def test_walltime_during_a_checkpoint_completed_within_the_grace_is_usable(
    tmp_path: Path,
) -> None:
    # the app ignores SIGTERM long enough to finish its checkpoint inside the grace
    node = Node(tmp_path, timeout=60.0)
    node.runtime._grace = 6.0  # a generous grace for this race
    try:
        script = (
            "trap 'echo term' TERM; "
            'while [ ! -f "$LATTICE_CHECKPOINT_SENTINEL.go" ]; do sleep 0.1; done; '
            'echo 7 > "$LATTICE_CHECKPOINT_DIR/counter"; touch "$LATTICE_CHECKPOINT_SENTINEL"; '
            "sleep 30"
        )
        a = app_alloc("ck-race", "signal", walltime=2)
        a.spec.entrypoint = script
        await node.start(a)
        await asyncio.sleep(0.5)
        node.manager.begin(a)
        # walltime fires (SIGTERM) while the checkpoint is in progress ...
        deadline = time.monotonic() + 15
        while not any(ln == "term" for ln in node.output(a.id)):
            assert time.monotonic() < deadline, node.output(a.id)
            await asyncio.sleep(0.05)
        # ... and it completes inside the grace: usable
        d = node.ckpt_root / "physics" / "climate" / a.id / "checkpoints" / "ckpt-1"
        (d / "CHECKPOINT_DONE.go").touch()
        outcome = await node.outcome(a.id)
        assert outcome.ok and outcome.record is not None, outcome
        assert (d / "counter").read_text().strip() == "7"
    finally:
        await node.close()


def test_sdk_and_agent_agree_on_the_flag_region_layout(tmp_path: Path) -> None:
    for name in (
        "REGION_SIZE",
        "MAGIC",
        "OFF_REQUESTED",
        "OFF_DONE",
        "OFF_FAILED",
        "OFF_PROGRESS",
        "OFF_ID",
        "ID_SIZE",
    ):
        assert getattr(sdk, name) == getattr(agent_shmem, name), name
    path = tmp_path / "flag"
    agent_shmem.create_region(path)
    side = agent_shmem.ShmemProtocol(path)
    with sdk.shmem(path) as flag:
        assert not flag.requested()
        asyncio.run(side.request("ckpt-9", tmp_path, timeout=1, force=False, deferral_left=0))
        assert flag.requested() and flag.checkpoint_id() == "ckpt-9"
        flag.progress(0.5)
        assert side.poll().sign_of_life and not side.poll().done
        flag.done()
        assert side.poll().done and not flag.requested()
    asyncio.run(side.close())


def test_sdk_says_how_to_enable_a_protocol_it_was_not_started_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LATTICE_CHECKPOINT_SHM", raising=False)
    with pytest.raises(sdk.CheckpointUnavailable, match="--checkpoint=shmem"), sdk.shmem():
        pass
