"""The broker around its evaluation pass: the storage probe before each evaluation
(a real directory that stops being writable, then is again), hints paused and the
``lattice_checkpoint_storage_unavailable`` gauge at 1 during the outage, and on
recovery the hints proposed in one batch, most recompute to save first; the f8
estimates are published as their own command. The quorum here records what the broker
proposes and answers as the real one would for valid commands (the quorum's own rules
are tested in test_hint_state.py and end to end in tests/test_checkpoint_broker_cluster.py);
the scheduler's f8 reads the published estimate."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from lattice_checkpoint import cost
from lattice_checkpoint.broker import Broker
from lattice_checkpoint.storage import STORAGE_UNAVAILABLE, LocalCheckpointStore
from lattice_common import commands as c
from lattice_common.types import Allocation, AllocationState, Node
from lattice_test_harness import builders as b


class RecordingQuorum:
    def __init__(self) -> None:
        self.proposed: list[c.Command] = []

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        self.proposed.append(cmd)
        if isinstance(cmd, c.Batch):
            return c.CommandResult(results=[c.CommandResult() for _ in cmd.commands])
        return c.CommandResult()


def running(aid: str, node: str, age: float) -> Allocation:
    spec = b.spec(tenant="t", vcluster="v", checkpoint="auto", checkpoint_protocol="signal")
    return Allocation(
        id=aid,
        spec=spec,
        state=AllocationState.RUNNING,
        assigned_nodes=[node],
        started_at=time.time() - age,
    )


def gauge() -> float:
    return STORAGE_UNAVAILABLE._value.get()  # type: ignore[attr-defined]


def test_storage_outage_pauses_hints_and_recovery_hints_the_most_at_risk_first(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    root.write_text("not a directory")  # the destination is broken
    quorum = RecordingQuorum()
    broker = Broker(
        quorum,  # type: ignore[arg-type]
        LocalCheckpointStore(str(root), probe_bytes=1 << 16),
        interval=30.0,
        params=cost.ModelParams(node_mtbf_hours=0.001, default_checkpoint_bytes_per_node=1e3),
    )
    for i, age in enumerate((600.0, 7200.0, 3600.0)):
        a = running(f"a{i}", f"n{i}", age)
        broker.mirror.allocations[a.id] = a
        broker.mirror.nodes[f"n{i}"] = Node(id=f"n{i}")

    ev = asyncio.run(broker.evaluate_once())
    assert gauge() == 1 and broker.storage_ok is False
    assert ev.hints == [] and quorum.proposed == []  # paused, nothing sent

    root.unlink()  # storage is back
    root.mkdir()
    ev = asyncio.run(broker.evaluate_once())
    assert gauge() == 0 and broker.storage_ok and broker.bandwidth > 0
    batch, estimates = quorum.proposed
    assert isinstance(batch, c.Batch)
    assert [h.allocation_id for h in batch.commands] == ["a1", "a2", "a0"]  # type: ignore[attr-defined]
    assert all(h.epoch == 0 for h in batch.commands)  # type: ignore[attr-defined]
    assert isinstance(estimates, c.SetCheckpointEstimates)
    assert set(estimates.minutes) == {"a0", "a1", "a2"}


def test_the_scheduler_f8_reads_the_published_estimate() -> None:
    from lattice_scheduler.cost import ScoringContext, f8_checkpoint_efficiency

    a = running("a", "n0", 10.0)
    ctx = ScoringContext(now=time.time())
    assert f8_checkpoint_efficiency(a, ctx) == 1 / (1 + ctx.default_checkpoint_minutes)
    a.checkpoint_minutes = 1.0
    assert f8_checkpoint_efficiency(a, ctx) == 0.5
    # the scheduler's own estimate, when it has one, wins
    assert f8_checkpoint_efficiency(a, ScoringContext(now=0, checkpoint_minutes={"a": 0.0})) == 1.0


def test_retention_deletes_checkpoints_of_allocations_ended_long_ago_live_or_in_history(
    tmp_path: Path,
) -> None:
    """The broker sweeps checkpoints of allocations ended longer ago than the retention:
    one still in the quorum's state (the mirror), one that already left it for the
    history store; a recent end, a running allocation and an unknown one are kept."""
    from lattice_checkpoint.broker import Retention
    from lattice_checkpoint.storage import allocation_key
    from lattice_common.history import HistoryStore, sqlite_url

    now = time.time()
    day = 86400.0

    def ended(aid: str, days_ago: float) -> Allocation:
        a = running(aid, "n0", 3600.0)
        a.state = AllocationState.COMPLETED
        a.finished_at = now - days_ago * day
        return a

    old_live, old_gone, recent, busy = (
        ended("old-live", 8),
        ended("old-gone", 30),
        ended("recent", 1),
        running("busy", "n1", 60.0),
    )
    unknown = running("unknown", "n2", 60.0)
    root = tmp_path / "ck"
    root.mkdir()
    store = LocalCheckpointStore(str(root), probe_bytes=1 << 16)
    src = tmp_path / "src"
    src.mkdir()
    (src / "state.bin").write_bytes(b"x" * 1024)
    for a in (old_live, old_gone, recent, busy, unknown):
        asyncio.run(store.upload(src, allocation_key(a), "ckpt-1"))

    async def sweep() -> list[str]:
        history = await HistoryStore.open(sqlite_url(str(tmp_path / "history.db")))
        try:
            await history.append([old_gone], revision=1)
            broker = Broker(
                RecordingQuorum(),  # type: ignore[arg-type]
                store,
                retention=Retention(store, 7 * day, history=history),
            )
            for a in (old_live, recent, busy):
                broker.mirror.allocations[a.id] = a
            report = await broker.sweep_retention(now=now)
            assert report is not None and report.errors == []
            return sorted(k.alloc for k in report.deleted)
        finally:
            await history.close()

    assert asyncio.run(sweep()) == ["old-gone", "old-live"]
    left = sorted(k.alloc for k in asyncio.run(store.list_allocations()))
    assert left == ["busy", "recent", "unknown"]
