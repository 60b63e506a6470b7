"""A file-system checkpoint root (NFS, Lustre) is probed before preemption or suspend
asks the application, as an S3 root is: a root that is gone (an unmounted share) or a
probe that does not finish in time (a hung mount) stops the application without a
checkpoint and the outcome fails with ``checkpoint storage unavailable: <why>``, so
the allocation ends Failed instead of hanging. A real test application under the
agent's ProcessRuntime; the root is a real directory."""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lattice_agent.checkpoint import CheckpointManager
from lattice_common.types import PHASE_CHECKPOINT_FAILED, PHASE_CHECKPOINTED
from test_checkpoint_s3 import Node, app_alloc

pytestmark = pytest.mark.timeout(120)


class FsNode(Node):
    def __init__(self, root: Path, ckpt_root: Path, probe_timeout: float = 5.0) -> None:
        from lattice_agent.runtime import ProcessRuntime

        self.ckpt_root = ckpt_root
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
            root=ckpt_root,
            timeout=20.0,
            poll_interval=0.05,
            probe_timeout=probe_timeout,
        )


@pytest.fixture
async def make_node(tmp_path: Path) -> AsyncIterator:  # type: ignore[type-arg]
    nodes: list[FsNode] = []

    def make(probe_timeout: float = 5.0) -> FsNode:
        root = tmp_path / "ckpt"
        root.mkdir(exist_ok=True)
        n = FsNode(tmp_path, root, probe_timeout)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        await n.close()


def asked(node: FsNode, aid: str) -> bool:
    return any(ln.startswith("checkpointed at") for ln in node.output(aid))


async def test_a_reachable_root_passes_the_probe_and_the_checkpoint_is_written(
    make_node,  # type: ignore[no-untyped-def]
) -> None:
    node = make_node()
    a = app_alloc("ck-fs-ok", "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 3")
    node.manager.begin(a)
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINTED, r
    assert Path(r.checkpoint_path).is_dir() and r.checkpoint_size_bytes > 0
    assert not any((node.ckpt_root / ".lattice-probe").glob("*"))  # the probe cleaned up


async def test_an_unmounted_root_fails_the_preemption_without_asking_the_application(
    make_node,  # type: ignore[no-untyped-def]
) -> None:
    node = make_node()
    a = app_alloc("ck-fs-gone", "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 3")
    # the share goes away under the running job (as an unmount leaves its mount point)
    shutil.rmtree(node.ckpt_root)
    t0 = time.monotonic()
    node.manager.begin(a)
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINT_FAILED, r
    assert r.reason.startswith("checkpoint storage unavailable: "), r.reason
    assert "does not exist" in r.reason, r.reason
    assert time.monotonic() - t0 < 15  # the probe, then SIGTERM: no checkpoint timeout
    assert not asked(node, a.id)
    assert not node.ckpt_root.exists()  # nothing written in its place


async def test_a_probe_that_does_not_finish_in_time_counts_as_a_hung_mount(
    make_node,  # type: ignore[no-untyped-def]
) -> None:
    # a probe timeout far below what a 64 KiB fsync'd write takes: the probe is
    # abandoned as a write into a hung NFS mount would be
    node = make_node(probe_timeout=1e-6)
    a = app_alloc("ck-fs-hung", "1000000", "0.05")
    await node.start(a)
    await node.wait_line(a.id, "count 3")
    node.manager.begin(a)
    r = await node.final(a.id)
    assert r.phase == PHASE_CHECKPOINT_FAILED, r
    assert r.reason.startswith("checkpoint storage unavailable: "), r.reason
    assert "did not finish within" in r.reason, r.reason
    assert not asked(node, a.id)
