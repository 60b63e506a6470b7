"""decide_vcluster: the per-vCluster decision the live loop and RM-Replay share, by
scheduler type (sensitive-reservation, service-binpack, hpc-backfill), borrowing and
preemption reasons."""

from __future__ import annotations

from lattice_common.types import AllocationState, Node, SchedulerType
from lattice_common.watch import StateMirror
from lattice_scheduler.decide import decide_vcluster
from lattice_test_harness import builders as b

NOW = 1_000_000.0


def mirror(nodes: list[Node], allocs, vclusters=()) -> StateMirror:
    m = StateMirror()
    m.nodes = {n.id: n for n in nodes}
    m.allocations = {a.id: a for a in allocs}
    m.pending = {a.id: None for a in allocs if a.state == AllocationState.PENDING}
    m.holding = {a.id: None for a in allocs if a.state == AllocationState.RUNNING}
    m.vclusters = {v.name: v for v in vclusters}
    return m


SENS = b.vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)


def test_ordinary_work_never_lands_on_claimed_nodes() -> None:
    a = b.allocation(id="a", vcluster="v", submitted_at=NOW - 10)
    m = mirror([b.node("n1", claimed_by="alice"), b.node("n2", claimed_by="bob")], [a])
    d = decide_vcluster(m, "v", NOW)
    assert d.proposals == [] and [w.allocation_id for w in d.waiting] == ["a"]


def test_sensitive_work_goes_to_its_users_claimed_node_first_then_unclaimed() -> None:
    mine = b.allocation(id="s1", vcluster="sens", user="alice", submitted_at=NOW - 20)
    more = b.allocation(id="s2", vcluster="sens", user="alice", submitted_at=NOW - 10)
    nodes = [
        b.node("n1"),
        b.node("n2", claimed_by="alice"),
        b.node("n3", claimed_by="bob"),
    ]
    d = decide_vcluster(mirror(nodes, [mine, more], [SENS]), "sens", NOW)
    placed = {p.allocation_id: p.node_ids for p in d.proposals}
    assert sorted(n for ids in placed.values() for n in ids) == ["n1", "n2"]
    assert "n3" not in {n for ids in placed.values() for n in ids}
    assert d.backfill_depth == 0 and d.borrowed == [] and d.reservations == []


def test_sensitive_work_skips_drifted_nodes() -> None:
    s = b.allocation(id="s", vcluster="sens", user="alice", submitted_at=NOW - 5)
    drifted = b.node("n1", conformance_drift=True, expected_conformance="a", conformance_group="b")
    d = decide_vcluster(mirror([drifted, b.node("n2")], [s], [SENS]), "sens", NOW)
    assert [p.node_ids for p in d.proposals] == [("n2",)]


def test_sensitive_pools_never_lend_and_high_class_work_never_borrows() -> None:
    lender = b.node("n1", home_vcluster="sens")
    other = b.node("n2", home_vcluster="hpc", owner="x")
    busy = b.allocation(id="x", vcluster="hpc", state=AllocationState.RUNNING)
    busy.assigned_nodes = ["n2"]
    low = b.allocation(id="low", vcluster="hpc", preemption_class=2, submitted_at=NOW - 9)
    d = decide_vcluster(mirror([lender, other], [busy, low], [SENS]), "hpc", NOW)
    assert d.borrowed == []

    pool = b.node("n3", home_vcluster="ml")
    high = b.allocation(id="high", vcluster="hpc", preemption_class=8, submitted_at=NOW - 9)
    d = decide_vcluster(mirror([pool, other], [busy, high]), "hpc", NOW)
    assert d.borrowed == []  # class 8 without checkpoint: not preemptible, not borrowed
    d = decide_vcluster(mirror([pool, other], [busy, low]), "hpc", NOW)
    assert [p.node_ids for p in d.borrowed] == [("n3",)]


def test_service_binpack_does_not_reserve_and_labels_preemption_reasons() -> None:
    svc = b.vcluster("svc", scheduler_type=SchedulerType.SERVICE_BINPACK)
    running = b.allocation(
        id="r", vcluster="svc", preemption_class=1, state=AllocationState.RUNNING
    )
    running.assigned_nodes = ["n1"]
    running.started_at = NOW - 60
    big = b.allocation(id="big", vcluster="svc", preemption_class=6, submitted_at=NOW - 5)
    m = mirror([b.node("n1", owner="r")], [running, big], [svc])
    d = decide_vcluster(m, "svc", NOW)
    assert d.backfill_depth == 0 and d.reservations == []
    assert [(p.victim, p.preemptor, p.reason) for p in d.preemptions] == [("r", "big", "priority")]
    sensitive = b.allocation(
        id="s", vcluster="sens", user="alice", preemption_class=10, submitted_at=NOW - 5
    )
    running2 = b.allocation(
        id="r2", vcluster="v", preemption_class=6, state=AllocationState.RUNNING
    )
    running2.assigned_nodes = ["n1"]
    running2.started_at = NOW - 60
    m = mirror([b.node("n1", owner="r2")], [running2, sensitive], [SENS])
    d = decide_vcluster(m, "sens", NOW)
    assert [(p.victim, p.reason) for p in d.preemptions] == [("r2", "sensitive")]


def _gpu_node(node_id: str, *, fast_pair: tuple[int, int] | None) -> Node:
    """4 GPUs on PCIe (32 GB/s), optionally one NVLink pair (450 GB/s)."""
    from lattice_common.types import GpuDevice, GpuLink, GpuLinkType

    links = []
    for i in range(4):
        for j in range(i + 1, 4):
            fast = fast_pair == (i, j)
            links.append(
                GpuLink(
                    gpu_a=i,
                    gpu_b=j,
                    link_type=GpuLinkType.NVLINK if fast else GpuLinkType.PCIE,
                    bandwidth_gbps=450.0 if fast else 32.0,
                )
            )
    n = b.node(node_id, gpu_type="H100", gpu_count=4)
    n.capabilities.gpus = [GpuDevice(index=i, model="H100") for i in range(4)]
    n.capabilities.gpu_links = links
    return n


def test_node_selection_prefers_the_node_whose_gpus_are_linked_best() -> None:
    two_gpus = b.allocation(id="g", vcluster="v", constraints={"gpu_type": "H100", "gpu_count": 2})
    nodes = [_gpu_node("n1", fast_pair=None), _gpu_node("n2", fast_pair=(0, 1))]
    d = decide_vcluster(mirror(nodes, [two_gpus]), "v", NOW)
    assert [p.node_ids for p in d.proposals] == [("n2",)]
    # without topology reports the solver's choice (lowest id) stands
    plain = [b.node("n1", gpu_type="H100", gpu_count=4), b.node("n2", gpu_type="H100", gpu_count=4)]
    d = decide_vcluster(mirror(plain, [two_gpus]), "v", NOW)
    assert [p.node_ids for p in d.proposals] == [("n1",)]


def _fair_share_cluster(*, physics_burst: float = 0.0, physics_wait: float = 3 * 3600):
    """Four nodes; physics (target 25%) runs on two of them, biology (target 25%) on
    none. One node is free; physics' job has waited ``physics_wait``, biology's only a
    minute."""
    held = []
    for i in (1, 2):
        r = b.allocation(id=f"p-run{i}", tenant="physics", state=AllocationState.RUNNING)
        r.assigned_nodes = [f"n{i}"]
        r.started_at = NOW - 600
        held.append(r)
    busy = b.allocation(id="c-run", tenant="chem", state=AllocationState.RUNNING)
    busy.assigned_nodes = ["n3"]
    busy.started_at = NOW - 600
    old = b.allocation(id="p-old", tenant="physics", submitted_at=NOW - physics_wait)
    new = b.allocation(id="b-new", tenant="biology", submitted_at=NOW - 60)
    nodes = [b.node("n1", owner="p-run1"), b.node("n2", owner="p-run2")]
    nodes += [b.node("n3", owner="c-run"), b.node("n4")]
    m = mirror(nodes, [*held, busy, old, new])
    m.tenants = {
        "physics": b.tenant("physics", fair_share_target=0.25, burst_allowance=physics_burst),
        "biology": b.tenant("biology", fair_share_target=0.25),
        "chem": b.tenant("chem", fair_share_target=0.5),
    }
    return m


def test_a_tenant_above_its_fair_share_waits_behind_one_below_it() -> None:
    # physics holds 50% against a 25% target: its 3-hour-old job comes after biology's
    # new one (f3 alone would let the older job win: w2 * log(4) > w3)
    d = decide_vcluster(_fair_share_cluster(), "v", NOW)
    assert [(p.allocation_id, p.node_ids) for p in d.proposals] == [("b-new", ("n4",))]
    assert d.scores["p-old"] < d.scores["b-new"]
    reasons = {w.allocation_id: w.text for w in d.waiting}
    assert reasons["p-old"] == (
        "all suitable nodes occupied: tenant physics holds at least its fair share, "
        "so other tenants' work goes first"
    )
    # deprioritized, not starved: after two days of waiting it outranks even the fresh
    # job of a tenant that has used nothing (f3 = 1)
    d = decide_vcluster(_fair_share_cluster(physics_wait=48 * 3600), "v", NOW)
    assert [p.allocation_id for p in d.proposals] == ["p-old"]


def test_beyond_its_burst_allowance_a_tenant_runs_only_on_what_nobody_else_wants() -> None:
    # burst allowance 1.5 x 25%: at 50% physics is beyond it; even a two-day-old job waits
    m = _fair_share_cluster(physics_burst=1.5, physics_wait=48 * 3600)
    d = decide_vcluster(m, "v", NOW)
    assert [p.allocation_id for p in d.proposals] == ["b-new"]
    # alone in the queue it still starts: a soft quota never blocks idle capacity
    del m.pending["b-new"], m.allocations["b-new"]
    assert [p.allocation_id for p in decide_vcluster(m, "v", NOW).proposals] == ["p-old"]


def test_burst_allocations_are_preempted_first() -> None:
    # two class-1 victims of equal cost; the one of the tenant above its share goes
    held = []
    for aid, tenant, node in (("bio-run", "biology", "n1"), ("phys-run", "physics", "n2")):
        r = b.allocation(id=aid, tenant=tenant, preemption_class=1, state=AllocationState.RUNNING)
        r.assigned_nodes = [node]
        r.started_at = NOW - 600
        held.append(r)
    urgent = b.allocation(id="urgent", tenant="chem", preemption_class=8, submitted_at=NOW - 5)
    nodes = [b.node("n1", owner="bio-run"), b.node("n2", owner="phys-run")]
    m = mirror(nodes, [*held, urgent])
    m.tenants = {
        "physics": b.tenant("physics", fair_share_target=0.25),
        "biology": b.tenant("biology", fair_share_target=0.75),
    }
    d = decide_vcluster(m, "v", NOW)
    assert [(p.victim, p.preemptor) for p in d.preemptions] == [("phys-run", "urgent")]
    m.tenants["physics"] = b.tenant("physics", fair_share_target=0.75)
    m.tenants["biology"] = b.tenant("biology", fair_share_target=0.25)
    d = decide_vcluster(m, "v", NOW)
    assert [(p.victim, p.preemptor) for p in d.preemptions] == [("bio-run", "urgent")]


def test_work_over_its_share_does_not_preempt_a_tenant_below_its_share() -> None:
    # physics holds half the cluster (target 25%); its class-6 job may not take the node
    # biology (half the cluster, target 75%: below its share) runs class-5 work on, but
    # may take a class-5 node of a tenant without a share contract
    def cluster(victim_tenant: str) -> StateMirror:
        allocs = []
        for aid, tenant, node in (("p-run", "physics", "n1"), ("v-run", victim_tenant, "n2")):
            r = b.allocation(
                id=aid,
                tenant=tenant,
                preemption_class=5 if aid == "v-run" else 9,
                state=AllocationState.RUNNING,
            )
            r.assigned_nodes = [node]
            r.started_at = NOW - 600
            allocs.append(r)
        allocs.append(
            b.allocation(id="p-next", tenant="physics", preemption_class=6, submitted_at=NOW - 5)
        )
        m = mirror([b.node("n1", owner="p-run"), b.node("n2", owner="v-run")], allocs)
        m.tenants = {
            "physics": b.tenant("physics", fair_share_target=0.25),
            "biology": b.tenant("biology", fair_share_target=0.75),
        }
        return m

    assert decide_vcluster(cluster("biology"), "v", NOW).preemptions == []
    d = decide_vcluster(cluster("guest"), "v", NOW)
    assert [(p.victim, p.preemptor, p.reason) for p in d.preemptions] == [
        ("v-run", "p-next", "priority")
    ]


def test_a_job_with_solver_flags_preempts_a_lower_class_victim() -> None:
    """The preemption step uses the solver's hard filter: ``require_unified_memory`` on
    a unified-memory node, ``prefer_same_numa`` anywhere."""
    for flag, gpu_type in (("require_unified_memory", "GH200"), ("prefer_same_numa", "")):
        node = b.node("n1", gpu_type=gpu_type, owner="low")
        low = b.allocation(
            id="low", vcluster="v", preemption_class=1, state=AllocationState.RUNNING
        )
        low.assigned_nodes, low.started_at = ["n1"], NOW - 60
        high = b.allocation(
            id="high",
            vcluster="v",
            preemption_class=8,
            constraints={"features": [flag]},
            submitted_at=NOW - 5,
        )
        d = decide_vcluster(mirror([node], [low, high]), "v", NOW)
        assert [(p.victim, p.preemptor) for p in d.preemptions] == [("low", "high")], flag


DAY = 86400.0


def _budget_cluster() -> StateMirror:
    """Tenant "spent" used its whole GPU-hour budget in one day that ended 10 days ago;
    "fresh" used nothing. One pending allocation each, otherwise alike."""
    old = b.allocation(id="old", tenant="spent", vcluster="v", state=AllocationState.COMPLETED)
    old.assigned_nodes, old.started_at, old.finished_at = ["n1"], NOW - 11 * DAY, NOW - 10 * DAY
    spent = b.allocation(id="s", tenant="spent", vcluster="v", submitted_at=NOW - 60)
    fresh = b.allocation(id="f", tenant="fresh", vcluster="v", submitted_at=NOW - 60)
    nodes = [b.node(f"n{i}", gpu_type="H100", gpu_count=4) for i in (1, 2)]
    m = mirror(nodes, [old, spent, fresh])
    m.tenants = {t: b.tenant(t, gpu_hours_budget=96.0) for t in ("spent", "fresh")}
    return m


def test_the_budget_penalty_counts_usage_in_the_configured_window_only() -> None:
    m = _budget_cluster()
    default = decide_vcluster(m, "v", NOW)  # 90 days: the old run exhausts the budget
    assert default.scores["s"] < default.scores["f"]
    week = decide_vcluster(m, "v", NOW, budget_period_days=7)  # 10 days ago: outside
    assert week.scores["s"] == week.scores["f"]
