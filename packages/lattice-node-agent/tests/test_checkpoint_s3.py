"""Checkpoints into an S3 bucket on the agent (lattice_agent.checkpoint.remote): a real
test application under the agent's ProcessRuntime, a real S3-compatible server (moto's
server mode, a process of its own so it can be stopped). The application writes into
staging on the node, the agent uploads; a resumed run reads the downloaded copy; the
bucket going away while the application writes, or before it is asked, fails the
checkpoint (the allocation ends Failed) instead of keeping something unusable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from lattice_agent.checkpoint import CheckpointManager
from lattice_agent.checkpoint.remote import RemoteCheckpoints, open_store
from lattice_agent.runtime import ProcessRuntime
from lattice_checkpoint.storage import AllocationKey
from lattice_common.config import StorageConfig
from lattice_common.types import (
    PHASE_CHECKPOINT_FAILED,
    PHASE_CHECKPOINTED,
    Allocation,
    AllocationReport,
    AllocationSpec,
    CheckpointRecord,
)
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, MotoS3Process

pytestmark = pytest.mark.timeout(120)

APP = Path(__file__).parent / "apps" / "ckpt_signal.py"
BUCKET = "ckpt"
ROOT = f"s3://{BUCKET}/agent"


def app_alloc(aid: str, *args: str, **env: str) -> Allocation:
    return Allocation(
        id=aid,
        assigned_nodes=["n1"],
        spec=AllocationSpec(
            entrypoint=f"{sys.executable} {APP} {' '.join(args)}",
            tenant="physics",
            project="climate",
            vcluster="v",
            checkpoint="manual",
            checkpoint_protocol="signal",
            env=env,
        ),
    )


class Node:
    def __init__(self, root: Path, s3: MotoS3Process) -> None:
        storage = StorageConfig(
            s3_endpoint=s3.endpoint,
            s3_access_key_id=ACCESS_KEY_ID,  # type: ignore[arg-type]
            s3_secret_access_key=SECRET_ACCESS_KEY,  # type: ignore[arg-type]
        )
        self.staging = root / "work" / ".checkpoint-staging"
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
            root=None,
            timeout=20.0,
            poll_interval=0.05,
            remote=RemoteCheckpoints(open_store(ROOT, storage), self.staging),
        )

    async def start(self, a: Allocation) -> None:
        await self.manager.sync({a.id: a})
        await self.manager.prepare(a)
        await self.runtime.start(a, nodelist=["n1"])

    def output(self, aid: str) -> list[str]:
        return [r.line for r in self.runtime.tail(aid, None, "stdout")]

    async def wait(self, what: str, cond, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {what}")

    async def wait_line(self, aid: str, prefix: str) -> str:
        return await self.wait(
            f"{prefix!r} from {aid}",
            lambda: next((ln for ln in self.output(aid) if ln.startswith(prefix)), None),
        )

    async def final(self, aid: str) -> AllocationReport:
        """The report once the checkpoint has an outcome and the processes are gone."""

        def done() -> AllocationReport | None:
            for r in self.manager.reports(self.runtime.reports()):
                if r.allocation_id == aid and r.phase in (
                    PHASE_CHECKPOINTED,
                    PHASE_CHECKPOINT_FAILED,
                    "exited",
                ):
                    return r
            return None

        return await self.wait(f"an outcome for {aid}", done, timeout=60)

    async def close(self) -> None:
        pids = [r.pid for r in self.runtime.reports() if r.pid > 0]
        await self.manager.close()
        await self.runtime.close()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def s3() -> AsyncIterator[MotoS3Process]:
    server = MotoS3Process().start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture
async def node(tmp_path: Path, s3: MotoS3Process) -> AsyncIterator[Node]:
    n = Node(tmp_path, s3)
    yield n
    await n.close()


async def test_checkpoint_is_uploaded_and_a_resumed_run_reads_it(node: Node) -> None:
    a = app_alloc("ck-s3", "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 5")
    env_dir = node.staging / "physics" / "climate" / a.id / "checkpoints" / "ckpt-1"
    node.manager.begin(a)
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINTED, r
    assert r.checkpoint_path == f"{ROOT}/physics/climate/{a.id}/checkpoints/ckpt-1/"
    assert not env_dir.exists()  # uploaded, then removed from the node
    store = node.manager.remote.store  # type: ignore[union-attr]
    key = AllocationKey("physics", "climate", a.id)
    assert await store.list_checkpoints(key) == ["ckpt-1"]
    assert r.checkpoint_size_bytes == await store.checkpoint_size(key, "ckpt-1") > 0
    saved = int(
        next(ln for ln in node.output(a.id) if ln.startswith("checkpointed at")).split()[-1]
    )
    # the next run resumes from the bucket: downloaded into staging before it starts
    node.runtime.forget(a.id)
    node.manager.outcomes.pop(a.id, None)
    resumed = msgspec.structs.replace(
        a,
        preempted_count=1,
        resume_from_checkpoint=True,
        last_checkpoint=CheckpointRecord(
            id="ckpt-1", path=r.checkpoint_path, size_bytes=r.checkpoint_size_bytes, at=1.0
        ),
    )
    await node.start(resumed)
    await node.wait_line(a.id, f"resumed from {saved}")

    def counted_on() -> bool:
        out = node.output(a.id)
        return f"count {saved + 1}" in out[out.index(f"resumed from {saved}") :]

    await node.wait("it counting on from there", counted_on)


async def test_upload_failing_after_the_application_wrote_fails_the_checkpoint(
    node: Node, s3: MotoS3Process
) -> None:
    # the application takes 3 s to write; the bucket goes away meanwhile
    a = app_alloc("ck-s3-lost", "1000000", "0.05", "slow", CKPT_SLOW="3")
    await node.start(a)
    await node.wait_line(a.id, "count 3")
    node.manager.begin(a)  # the probe passes: the application is asked
    await node.wait(
        "the application writing",
        lambda: any(
            (node.staging / "physics" / "climate" / a.id / "checkpoints" / "ckpt-1").glob("part-*")
        ),
    )
    s3.stop()
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINT_FAILED, r
    assert r.reason.startswith("checkpoint storage unavailable: "), r.reason
    assert not r.checkpoint_path
    assert any(ln.startswith("checkpointed at") for ln in node.output(a.id))  # it did write


async def test_bucket_down_before_the_request_never_asks_the_application(
    node: Node, s3: MotoS3Process
) -> None:
    a = app_alloc("ck-s3-down", "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 3")
    s3.stop()
    t0 = time.monotonic()
    node.manager.begin(a)
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINT_FAILED, r
    assert r.reason.startswith("checkpoint storage unavailable: "), r.reason
    assert "probe" in r.reason
    assert time.monotonic() - t0 < 15  # a short probe, then SIGTERM: no checkpoint timeout
    assert not any(ln.startswith("checkpointed at") for ln in node.output(a.id))


async def test_a_resume_whose_checkpoint_cannot_be_fetched_does_not_start(node: Node) -> None:
    a = app_alloc("ck-s3-missing", "1000000", "0.05")
    a.resume_from_checkpoint = True
    a.preempted_count = 1
    a.last_checkpoint = CheckpointRecord(
        id="ckpt-1",
        path=f"{ROOT}/physics/climate/{a.id}/checkpoints/ckpt-1/",
        size_bytes=3,
        at=1.0,
    )
    await node.start(a)
    r = await node.final(a.id)
    assert r.phase == "exited" and "checkpoint storage unavailable" in r.reason, r
    assert "started fresh" not in node.output(a.id)
