"""The autoscaler's shell against a real VictoriaMetrics and the real quorum state
machine (LocalQuorum): the test is the load generator, pushing the allocation's
``cpu_utilization`` as the node agents do (percent of one core, ``agg="mean"``), and the
decisions run on a stepped clock (one evaluation per step), so windows and cooldowns
are exact.

Shown: 2 -> 3 -> 4 under load with the cooldown between steps and never past
max_nodes 4; back to 2 when idle; a tenant max_nodes of 3 stops it at 3 (the blocked
reason published) until the quota is raised; a TSDB that is down is no action and is
counted; a custom metric is read scoped to the allocation's nodes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
from lattice_common import commands as c
from lattice_common.types import (
    AllocationSpec,
    LifecycleType,
    NodeCapabilities,
    ScalingSpec,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror, decode_delta
from lattice_quorum.local import LocalQuorum
from lattice_scheduler import autoscaler as shell
from lattice_scheduler.autoscaler import Autoscaler
from lattice_test_harness import victoria
from lattice_test_harness.victoria import VictoriaMetrics

pytestmark = pytest.mark.skipif(not victoria.available(), reason="victoria-metrics not installed")

SCALING = ScalingSpec(
    metric="cpu_utilization",
    target=0.8,
    evaluation_interval=10,
    scale_up_window=20,
    scale_down_window=30,
    scale_down_threshold=0.25,
    cooldown=30,
)


@pytest.fixture(scope="module")
def vm() -> Iterator[VictoriaMetrics]:
    with VictoriaMetrics() as v:
        yield v


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class World:
    """A LocalQuorum with 5 two-core nodes, tenant physics and one reactive allocation
    (2..4 nodes) running on two of them."""

    def __init__(self, vm: VictoriaMetrics, *, metric: str = "cpu_utilization") -> None:
        self.vm = vm
        self.lq = LocalQuorum()
        self.clock = Clock()
        self.ts = 0
        ok = self.lq.apply
        ok(c.CreateTenant(tenant=Tenant(name="physics")))
        ok(c.CreateVCluster(vcluster=VCluster(name="svc", tenant="physics")))
        for i in range(5):
            r = ok(
                c.RegisterNode(
                    node_id=f"n{i}", capabilities=NodeCapabilities(cpu_cores=2), group=i % 2
                )
            )
            assert r.error is None, r.error
        spec = AllocationSpec(
            entrypoint="serve",
            tenant="physics",
            vcluster="svc",
            nodes=4,
            min_nodes=2,
            lifecycle=LifecycleType.REACTIVE,
            scaling=msgspec.structs.replace(SCALING, metric=metric),
        )
        res = ok(c.SubmitAllocation(spec=spec, now=self.clock.t))
        assert res.error is None, res.error
        self.alloc_id = res.allocation.id
        res = ok(
            c.AssignNodes(allocation_id=self.alloc_id, node_ids=["n0", "n1"], now=self.clock.t)
        )
        assert res.error is None, res.error
        self.scaler = Autoscaler(self.lq, ["svc"], tsdb_url=vm.url, clock=self.clock)  # type: ignore[arg-type]
        self.sizes: list[tuple[float, int]] = []

    def mirror(self) -> StateMirror:
        m = StateMirror()
        m.apply(decode_delta(self.lq.snapshot_delta()))
        return m

    @property
    def alloc(self):  # type: ignore[no-untyped-def]
        return self.lq.state.allocations[self.alloc_id]

    def load(self, percent: float, name: str = "cpu_utilization", scope: str = "alloc") -> None:
        """Every node of the allocation reports ``percent`` (of one core) now."""
        self.ts = max(self.ts + 1, int((time.time() - 2) * 1000))
        lines = []
        for nid in self.alloc.assigned_nodes:
            labels = (
                f'alloc_id="{self.alloc_id}",node_id="{nid}",tenant="physics",agg="mean"'
                if scope == "alloc"
                else f'node_id="{nid}",job="inference"'
            )
            lines.append(f"{name}{{{labels}}} {percent} {self.ts}")
        self.vm.push("\n".join(lines) + "\n")
        self.vm.flush()

    async def step(self, n: int = 1, **load: float) -> None:
        """``n`` evaluations, one evaluation interval apart."""
        for _ in range(n):
            if "percent" in load:
                self.load(load["percent"])
            self.clock.t += SCALING.evaluation_interval
            await self.scaler.evaluate(self.mirror())
            size = len(self.alloc.assigned_nodes)
            if not self.sizes or self.sizes[-1][1] != size:
                self.sizes.append((self.clock.t, size))


async def test_scales_two_to_four_and_back_within_windows(vm: VictoriaMetrics) -> None:
    w = World(vm)
    start = w.clock.t
    w.sizes.append((start, 2))
    await w.step(12, percent=180.0)  # 0.9 of each 2-core node
    assert [s for _, s in w.sizes] == [2, 3, 4]
    times = [t for t, _ in w.sizes]
    # the first step after the start's cooldown, the next one cooldown after it
    assert times[1] - start >= SCALING.cooldown
    assert times[2] - times[1] >= SCALING.cooldown
    assert times[2] - times[1] <= SCALING.cooldown + SCALING.scale_up_window + 10
    st = w.alloc.scaling_status
    assert (st.last_decision, st.target) == ("up", 4)
    assert st.reason.startswith("cpu_utilization 0.90 >= 0.80 for ")
    await w.step(6, percent=180.0)
    assert len(w.alloc.assigned_nodes) == 4  # never past max_nodes
    assert w.alloc.scaling_status.blocked == "at max_nodes 4"
    # idle: down one node at a time to min_nodes, the head node kept
    head = w.alloc.assigned_nodes[0]
    await w.step(20, percent=10.0)
    assert [s for _, s in w.sizes][-3:] == [4, 3, 2]
    assert w.alloc.assigned_nodes[0] == head
    assert w.alloc.scaling_status.last_decision == "down"
    assert "<= 0.20 (0.25 of target 0.8)" in w.alloc.scaling_status.reason
    downs = [t for t, _ in w.sizes][-2:]
    assert downs[1] - downs[0] >= SCALING.cooldown
    freed = [n for n in w.lq.state.nodes.values() if not n.owner]
    assert len(freed) == 3


async def test_tenant_quota_stops_scaling_until_it_grows(vm: VictoriaMetrics) -> None:
    w = World(vm)
    w.lq.apply(c.UpdateTenant(name="physics", fields={"max_nodes": 3}))
    await w.step(14, percent=180.0)
    assert len(w.alloc.assigned_nodes) == 3
    assert w.alloc.scaling_status.blocked == "tenant physics holds 3 of max_nodes 3"
    w.lq.apply(c.UpdateTenant(name="physics", fields={"max_nodes": 4}))
    await w.step(6, percent=180.0)
    assert len(w.alloc.assigned_nodes) == 4
    assert w.alloc.scaling_status.blocked == "at max_nodes 4"


async def test_tsdb_down_is_no_action_and_counted(vm: VictoriaMetrics) -> None:
    w = World(vm)
    w.scaler.tsdb_url = "http://127.0.0.1:9"  # nothing listens there
    before = shell.QUERY_FAILURES._value.get()
    await w.step(8)
    assert len(w.alloc.assigned_nodes) == 2
    assert shell.QUERY_FAILURES._value.get() - before == 8
    assert w.scaler.failures_in_a_row == 8
    assert w.alloc.scaling_status.blocked == "no value of cpu_utilization for this allocation"
    w.scaler.tsdb_url = vm.url  # back: evaluation resumes, one scale_up_window later
    await w.step(2, percent=180.0)
    assert len(w.alloc.assigned_nodes) == 2
    await w.step(2, percent=180.0)
    assert len(w.alloc.assigned_nodes) == 3
    assert w.scaler.failures_in_a_row == 0


async def test_custom_metric_scoped_to_the_allocations_nodes(vm: VictoriaMetrics) -> None:
    w = World(vm, metric='queue_depth{job="inference"}')
    w.scaler.tracks.clear()
    for _ in range(4):
        w.load(50.0, name="queue_depth", scope="node")  # 50 pending requests, target 0.8
        await w.step()
    assert len(w.alloc.assigned_nodes) == 3
    assert w.alloc.scaling_status.reason.startswith(
        'queue_depth{job="inference"} 50.00 >= 0.80 for '
    )
