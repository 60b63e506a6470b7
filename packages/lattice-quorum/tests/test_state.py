"""GlobalState and apply(): examples per command, then properties over random command
sequences (a Hypothesis rule-based state machine).

apply() is the only place exclusive ownership and hard quotas are enforced, so the
properties check them after every step: one owner per node, owners hold their nodes,
rejected commands change nothing, replays are deterministic, quotas hold and
allocations only move along the transition table.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from lattice_common import commands as c
from lattice_common.state_machine import ALLOCATION_TRANSITIONS
from lattice_common.types import (
    HOLDING_STATES,
    AllocationState,
    CheckpointRecord,
    NodeCapabilities,
    NodeState,
    RequeuePolicy,
    SchedulerType,
)
from lattice_quorum.state import Changes, GlobalState, allocation_id_for, apply
from lattice_test_harness import builders as b

A = AllocationState
N = NodeState


# --- helpers -------------------------------------------------------------------------


def encode(state: GlobalState) -> bytes:
    return msgspec.msgpack.encode(state)


def run(state: GlobalState, cmd: c.Command) -> c.CommandResult:
    """Apply a fresh decoded copy, as a quorum member does with a Raft entry."""
    return apply(state, c.decode_command(c.encode_command(cmd)))


def ok(state: GlobalState, cmd: c.Command) -> c.CommandResult:
    res = run(state, cmd)
    assert res.error is None, res.error
    return res


def rejected(state: GlobalState, cmd: c.Command, code: str) -> dict[str, Any]:
    """The command is rejected with ``code`` and the state is byte-identical."""
    before = encode(state)
    res = run(state, cmd)
    assert res.error is not None, f"expected {code}, got success"
    assert res.error["code"] == code, res.error
    assert encode(state) == before
    assert res.revision == state.revision
    return res.error


def world(
    *,
    nodes: int = 4,
    groups: int = 1,
    tenants: dict[str, dict[str, Any]] | None = None,
    vclusters: tuple[str, ...] = ("v",),
) -> GlobalState:
    s = GlobalState()
    for name, kw in (tenants if tenants is not None else {"t": {}}).items():
        ok(s, c.CreateTenant(tenant=b.tenant(name, **kw), now=1.0))
    for v in vclusters:
        ok(s, c.CreateVCluster(vcluster=b.vcluster(v), now=1.0))
    for i in range(nodes):
        register(s, f"n{i:04d}", group=i % groups)
    return s


def register(s: GlobalState, node_id: str, **kw: Any) -> c.CommandResult:
    kw.setdefault("capabilities", NodeCapabilities(cpu_cores=64, memory_gb=256))
    return ok(s, c.RegisterNode(node_id=node_id, now=2.0, **kw))


def submit(s: GlobalState, now: float = 10.0, **kw: Any) -> str:
    kw.setdefault("tenant", "t")
    kw.setdefault("vcluster", "v")
    res = ok(s, c.SubmitAllocation(spec=b.spec(**kw), now=now))
    assert res.allocation is not None
    return res.allocation.id


def assign(s: GlobalState, aid: str, node_ids: list[str], now: float = 20.0) -> c.CommandResult:
    return ok(s, c.AssignNodes(allocation_id=aid, node_ids=node_ids, now=now))


def set_state(s: GlobalState, aid: str, state: AllocationState, **kw: Any) -> c.CommandResult:
    return run(s, c.UpdateAllocationState(allocation_id=aid, state=state, now=30.0, **kw))


def running(s: GlobalState, node_ids: list[str], **kw: Any) -> str:
    kw.setdefault("nodes", len(node_ids))
    aid = submit(s, **kw)
    assign(s, aid, node_ids)
    return aid


# --- submit --------------------------------------------------------------------------


def test_submit_creates_pending_allocation_with_deterministic_id() -> None:
    s = world()
    rev = s.revision
    res = ok(s, c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v"), now=42.0))
    a = res.allocation
    assert a is not None
    assert a.state == A.PENDING
    assert (
        a.id == allocation_id_for(1, s.id_salt) and s.id_salt == int(42.0 * 1_000_003) & 0xFFFFFFFF
    )
    assert a.submitted_at == 42.0
    assert a.assigned_nodes == []
    assert res.revision == s.revision == rev + 1
    assert a.revision == s.revision
    assert s.allocations[a.id] is a


def test_allocation_ids_are_distinct() -> None:
    s = world()
    ids = {submit(s) for _ in range(200)}
    assert len(ids) == 200
    assert len({allocation_id_for(i) for i in range(1, 100_000)}) == 99_999


def test_submit_is_idempotent_on_request_id() -> None:
    s = world()
    first = submit(s, request_id="req-1")
    before = encode(s)
    res = ok(s, c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v", request_id="req-1")))
    assert res.allocation is not None
    assert res.allocation.id == first
    assert len(s.allocations) == 1
    assert s.alloc_seq == 1
    assert encode(s) == before  # no second allocation, no revision bump
    other = submit(s, request_id="req-2")
    assert other != first
    assert len(s.allocations) == 2


def test_submit_without_request_id_is_not_deduplicated() -> None:
    s = world()
    assert submit(s) != submit(s)


@pytest.mark.parametrize(
    ("tenant", "vcluster", "what", "available"),
    [
        ("nope", "v", 'unknown tenant "nope"', "physics, t"),
        ("t", "nope", 'unknown vCluster "nope"', "v, w"),
    ],
)
def test_submit_unknown_tenant_or_vcluster_lists_the_available_ones(
    tenant: str, vcluster: str, what: str, available: str
) -> None:
    s = world(tenants={"t": {}, "physics": {}}, vclusters=("w", "v"))
    err = rejected(
        s, c.SubmitAllocation(spec=b.spec(tenant=tenant, vcluster=vcluster)), "not_found"
    )
    assert err["message"] == what
    assert err["details"]["available"] == available
    assert err["hint"]
    assert s.allocations == {}


def test_submit_into_empty_state_says_none_available() -> None:
    s = GlobalState()
    err = rejected(s, c.SubmitAllocation(spec=b.spec()), "not_found")
    assert err["details"]["available"] == "(none)"


# --- AssignNodes ---------------------------------------------------------------------


def test_assign_gives_exclusive_ownership_and_starts_the_allocation() -> None:
    s = world(nodes=3)
    aid = submit(s, nodes=2)
    res = ok(
        s, c.AssignNodes(allocation_id=aid, node_ids=["n0000", "n0001"], now=25.0, vcluster="v")
    )
    a = res.allocation
    assert a is not None
    assert a.state == A.RUNNING
    assert a.assigned_nodes == ["n0000", "n0001"]
    assert a.started_at == 25.0
    for nid in ("n0000", "n0001"):
        n = s.nodes[nid]
        assert (n.owner, n.owner_tenant, n.owner_vcluster) == (aid, "t", "v")
        assert n.revision == s.revision
    assert s.nodes["n0002"].owner == ""
    assert aid in s.active


def test_second_assign_of_owned_node_is_an_ownership_conflict() -> None:
    s = world(nodes=3)
    first = running(s, ["n0000", "n0001"])
    second = submit(s, nodes=2)
    err = rejected(
        s, c.AssignNodes(allocation_id=second, node_ids=["n0002", "n0001"]), "ownership_conflict"
    )
    assert err["details"] == {"node": "n0001", "owner": first}
    assert s.allocations[second].state == A.PENDING
    assert s.nodes["n0002"].owner == ""


def test_assign_twice_to_same_allocation_is_rejected() -> None:
    s = world(nodes=3)
    aid = running(s, ["n0000"])
    rejected(s, c.AssignNodes(allocation_id=aid, node_ids=["n0001"]), "invalid_transition")


@pytest.mark.parametrize("how", ["degraded", "down", "drained", "disabled"])
def test_assign_needs_ready_nodes(how: str) -> None:
    s = world(nodes=2)
    cmd: c.Command = {
        "degraded": c.SetNodeHealth(node_id="n0001", state=N.DEGRADED),
        "down": c.SetNodeHealth(node_id="n0001", state=N.DOWN),
        "drained": c.DrainNode(node_id="n0001"),
        "disabled": c.DisableNode(node_id="n0001"),
    }[how]
    ok(s, cmd)
    aid = submit(s, nodes=2)
    err = rejected(
        s, c.AssignNodes(allocation_id=aid, node_ids=["n0000", "n0001"]), "ownership_conflict"
    )
    assert "not Ready" in err["message"]
    assert s.nodes["n0000"].owner == ""


def test_assign_with_stale_expected_revision_is_rejected() -> None:
    s = world(nodes=2)
    aid = submit(s)
    decided_at = s.revision
    # The allocation changes after the scheduler decided: cancelled.
    other = submit(s)
    ok(s, c.CancelAllocation(allocation_id=aid))
    rejected(
        s,
        c.AssignNodes(allocation_id=aid, node_ids=["n0000"], expected_revision=decided_at),
        "invalid_transition",
    )
    # A requeue (Pending again, but a newer revision) is the stale case proper.
    stale_at = s.revision
    assign(s, other, ["n0000"])
    ok(s, c.RequeueAllocation(allocation_id=other, reason="preempted"))
    assert s.allocations[other].state == A.PENDING
    err = rejected(
        s,
        c.AssignNodes(allocation_id=other, node_ids=["n0001"], expected_revision=stale_at),
        "stale_revision",
    )
    assert err["details"]["expected_revision"] == stale_at
    # The current revision is accepted.
    ok(s, c.AssignNodes(allocation_id=other, node_ids=["n0001"], expected_revision=s.revision))


def test_assign_with_node_changed_after_expected_revision_is_rejected() -> None:
    s = world(nodes=2)
    aid = submit(s)
    decided_at = s.revision
    # The node re-registers without its GPUs after the scheduler decided.
    register(s, "n0000", capabilities=NodeCapabilities(cpu_cores=64, gpu_count=0))
    rejected(
        s,
        c.AssignNodes(allocation_id=aid, node_ids=["n0000"], expected_revision=decided_at),
        "stale_revision",
    )


@pytest.mark.parametrize(
    "node_ids", [[], ["n0000", "n0000"], ["n0000"]], ids=["empty", "duplicate", "too-few"]
)
def test_assign_validates_the_node_list(node_ids: list[str]) -> None:
    s = world(nodes=2)
    aid = submit(s, nodes=2)
    rejected(s, c.AssignNodes(allocation_id=aid, node_ids=node_ids), "invalid_argument")


def test_assign_unknown_node_or_allocation_is_not_found() -> None:
    s = world(nodes=1)
    aid = submit(s)
    rejected(s, c.AssignNodes(allocation_id=aid, node_ids=["ghost"]), "not_found")
    rejected(s, c.AssignNodes(allocation_id="ffffffff", node_ids=["n0000"]), "not_found")


def test_max_nodes_quota_rejection_has_the_specified_text() -> None:
    s = world(nodes=205, tenants={"physics": {"max_nodes": 200}})
    ids = sorted(s.nodes)
    running(s, ids[:195], tenant="physics")
    aid = submit(s, tenant="physics", nodes=10)
    err = rejected(s, c.AssignNodes(allocation_id=aid, node_ids=ids[195:205]), "quota_exceeded")
    assert err["message"] == (
        'allocation rejected: tenant "physics" would exceed max_nodes quota '
        "(current: 195, requested: 10, limit: 200)"
    )
    assert err["details"] == {"current": 195, "requested": 10, "limit": 200}
    assert err["hint"]
    # Exactly up to the limit is fine.
    small = submit(s, tenant="physics", nodes=5)
    assign(s, small, ids[195:200])
    assert sum(1 for n in s.nodes.values() if n.owner_tenant == "physics") == 200


def test_max_nodes_counts_only_holding_allocations() -> None:
    s = world(nodes=4, tenants={"t": {"max_nodes": 2}})
    first = running(s, ["n0000", "n0001"])
    second = submit(s, nodes=2)
    rejected(s, c.AssignNodes(allocation_id=second, node_ids=["n0002", "n0003"]), "quota_exceeded")
    ok(s, c.UpdateAllocationState(allocation_id=first, state=A.COMPLETED, exit_code=0))
    assign(s, second, ["n0002", "n0003"])


def test_quotas_are_per_tenant() -> None:
    s = world(nodes=4, tenants={"t": {"max_nodes": 1}, "u": {}})
    running(s, ["n0000"], tenant="t")
    running(s, ["n0001", "n0002", "n0003"], tenant="u")


def test_max_concurrent_allocations_quota() -> None:
    s = world(nodes=4, tenants={"t": {"max_concurrent_allocations": 2}})
    a1 = running(s, ["n0000"])
    running(s, ["n0001"])
    third = submit(s)
    err = rejected(s, c.AssignNodes(allocation_id=third, node_ids=["n0002"]), "quota_exceeded")
    assert err["message"] == (
        'allocation rejected: tenant "t" would exceed max_concurrent_allocations quota '
        "(current: 2, requested: 1, limit: 2)"
    )
    ok(s, c.CancelAllocation(allocation_id=a1))
    assign(s, third, ["n0002"])


def test_lowering_max_nodes_below_usage_keeps_running_but_blocks_new() -> None:
    s = world(nodes=4, tenants={"t": {"max_nodes": 4}})
    first = running(s, ["n0000", "n0001", "n0002"])
    ok(s, c.UpdateTenant(name="t", fields={"max_nodes": 1}))
    assert s.allocations[first].state == A.RUNNING
    second = submit(s)
    err = rejected(s, c.AssignNodes(allocation_id=second, node_ids=["n0003"]), "quota_exceeded")
    assert err["details"] == {"current": 3, "requested": 1, "limit": 1}
    ok(s, c.UpdateAllocationState(allocation_id=first, state=A.COMPLETED))
    assign(s, second, ["n0003"])


# --- UpdateAllocationState -----------------------------------------------------------


def test_running_to_completed_releases_nodes() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"])
    res = set_state(s, aid, A.COMPLETED, exit_code=0, finished_at=33.0)
    assert res.error is None
    a = s.allocations[aid]
    assert (a.state, a.exit_code, a.finished_at) == (A.COMPLETED, 0, 33.0)
    assert aid not in s.active
    assert all(n.owner == "" and n.owner_tenant == "" for n in s.nodes.values())
    # The freed nodes can be assigned again.
    running(s, ["n0000", "n0001"])


def test_finished_at_defaults_to_command_time() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    set_state(s, aid, A.FAILED, exit_code=3, reason="exit_code_3")
    a = s.allocations[aid]
    assert (a.state, a.finished_at, a.reason) == (A.FAILED, 30.0, "exit_code_3")


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (A.COMPLETED, A.RUNNING),
        (A.CANCELLED, A.PENDING),
        (A.FAILED, A.COMPLETED),
        (A.PENDING, A.COMPLETED),
        (A.PENDING, A.CHECKPOINTING),
        (A.PENDING, A.SUSPENDED),
    ],
)
def test_invalid_transition_is_rejected(start: AllocationState, target: AllocationState) -> None:
    s = world(nodes=1)
    aid = submit(s)
    if start != A.PENDING:
        assign(s, aid, ["n0000"])
        assert set_state(s, aid, start).error is None
    err = rejected(
        s, c.UpdateAllocationState(allocation_id=aid, state=target), "invalid_transition"
    )
    assert err["details"] == {"allocation": aid, "from": start.value, "to": target.value}
    assert err["hint"]


def test_same_state_update_is_a_no_op() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    before = encode(s)
    res = set_state(s, aid, A.RUNNING)
    assert res.error is None
    assert encode(s) == before


def test_checkpointing_keeps_nodes_and_returns_to_running() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    assert set_state(s, aid, A.CHECKPOINTING).error is None
    assert s.nodes["n0000"].owner == aid
    assert aid in s.active
    assert set_state(s, aid, A.RUNNING).error is None
    assert s.nodes["n0000"].owner == aid


def test_running_back_to_pending_releases_nodes() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    assert set_state(s, aid, A.PENDING, reason="preempted").error is None
    a = s.allocations[aid]
    assert a.state == A.PENDING
    assert a.assigned_nodes == []
    assert s.nodes["n0000"].owner == ""
    assert aid not in s.active


def test_suspended_releases_nodes() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    assert set_state(s, aid, A.CHECKPOINTING).error is None
    ck = CheckpointRecord(id="ckpt-1", path="/ck/t/p/a/checkpoints/ckpt-1/")
    assert (
        apply(s, c.RecordCheckpoint(allocation_id=aid, node_id="n0000", checkpoint=ck)).error
        is None
    )
    # Suspended is not a holding state, so the node must not stay owned by it.
    assert s.nodes["n0000"].owner == ""


def test_pending_cannot_enter_a_holding_state_without_assign() -> None:
    s = world(nodes=2, tenants={"t": {"max_concurrent_allocations": 1}})
    running(s, ["n0000"])
    aid = submit(s)
    rejected(s, c.UpdateAllocationState(allocation_id=aid, state=A.RUNNING), "invalid_transition")


def test_pending_always_policy_allocation_can_be_failed() -> None:
    s = world()
    aid = submit(s, requeue_policy=RequeuePolicy.ALWAYS)
    res = set_state(s, aid, A.FAILED, reason="unsatisfiable")
    assert res.error is None
    assert s.allocations[aid].state == A.FAILED


def test_failure_with_always_policy_requeues_until_max_requeue() -> None:
    s = world(nodes=1)
    aid = submit(s, requeue_policy=RequeuePolicy.ALWAYS, max_requeue=2, now=5.0)
    for count in (1, 2):
        assign(s, aid, ["n0000"])
        assert set_state(s, aid, A.FAILED, exit_code=1).error is None
        a = s.allocations[aid]
        assert (a.state, a.requeue_count, a.submitted_at) == (A.PENDING, count, 5.0)
        assert s.nodes["n0000"].owner == ""
    assign(s, aid, ["n0000"])
    assert set_state(s, aid, A.FAILED, exit_code=1).error is None
    assert s.allocations[aid].state == A.FAILED
    assert s.allocations[aid].requeue_count == 2


def test_application_failure_with_on_node_failure_policy_fails() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"], requeue_policy=RequeuePolicy.ON_NODE_FAILURE)
    assert set_state(s, aid, A.FAILED, exit_code=1).error is None
    assert s.allocations[aid].state == A.FAILED
    assert s.allocations[aid].requeue_count == 0


def test_draining_node_becomes_drained_when_its_allocation_ends() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"])
    ok(s, c.DrainNode(node_id="n0000", reason="maintenance"))
    assert s.nodes["n0000"].state == N.DRAINING
    assert s.nodes["n0000"].owner == aid  # running allocations continue
    assert set_state(s, aid, A.COMPLETED, exit_code=0).error is None
    assert s.nodes["n0000"].state == N.DRAINED
    assert s.nodes["n0000"].owner == ""
    assert s.nodes["n0001"].state == N.READY


# --- Cancel and Requeue --------------------------------------------------------------


def test_cancel_running_frees_nodes() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"])
    res = ok(s, c.CancelAllocation(allocation_id=aid, now=50.0, requested_by="alice"))
    assert res.allocation is not None
    assert res.allocation.state == A.CANCELLED
    assert res.allocation.finished_at == 50.0
    assert res.allocation.reason == "cancelled"
    assert all(n.owner == "" for n in s.nodes.values())
    assert aid not in s.active


def test_cancel_pending() -> None:
    s = world()
    aid = submit(s)
    ok(s, c.CancelAllocation(allocation_id=aid))
    assert s.allocations[aid].state == A.CANCELLED


@pytest.mark.parametrize("final", [A.COMPLETED, A.FAILED, A.CANCELLED])
def test_cancelling_a_finished_allocation_is_an_invalid_transition(final: AllocationState) -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    assert set_state(s, aid, final).error is None
    err = rejected(s, c.CancelAllocation(allocation_id=aid), "invalid_transition")
    assert err["hint"] == "Nothing to cancel."


def test_cancel_unknown_allocation_is_not_found() -> None:
    err = rejected(world(), c.CancelAllocation(allocation_id="00000000"), "not_found")
    assert "lattice status" in err["hint"]


def test_requeue_command_uses_expected_requeue_count() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"], max_requeue=1)
    rejected(
        s,
        c.RequeueAllocation(allocation_id=aid, reason="x", expected_requeue_count=1),
        "stale_revision",
    )
    ok(s, c.RequeueAllocation(allocation_id=aid, reason="x", expected_requeue_count=0))
    assert s.allocations[aid].requeue_count == 1
    assert s.nodes["n0000"].owner == ""
    # A second reconciler with the same expectation must not double-increment.
    rejected(
        s,
        c.RequeueAllocation(allocation_id=aid, reason="x", expected_requeue_count=0),
        "stale_revision",
    )
    assign(s, aid, ["n0000"])
    ok(s, c.RequeueAllocation(allocation_id=aid, reason="x", expected_requeue_count=1))
    assert s.allocations[aid].state == A.FAILED  # at max_requeue


# --- nodes: drain, undrain, disable, enable, health, register -------------------------


def test_drain_idle_node_goes_straight_to_drained_and_is_idempotent() -> None:
    s = world(nodes=1)
    ok(s, c.DrainNode(node_id="n0000", reason="upgrade"))
    n = s.nodes["n0000"]
    assert (n.state, n.state_reason) == (N.DRAINED, "upgrade")
    before = encode(s)
    ok(s, c.DrainNode(node_id="n0000"))
    assert encode(s) == before


def test_undrain_only_from_drained() -> None:
    s = world(nodes=2)
    running(s, ["n0000"])
    ok(s, c.DrainNode(node_id="n0000"))
    err = rejected(s, c.UndrainNode(node_id="n0000"), "invalid_transition")
    assert "only works from Drained" in err["message"]
    assert err["hint"].startswith("Wait for its allocations to finish")
    err = rejected(s, c.UndrainNode(node_id="n0001"), "invalid_transition")
    assert err["details"] == {"node": "n0001", "state": "Ready"}
    assert err["hint"] == "Only a drained node can be undrained."
    ok(s, c.DrainNode(node_id="n0001"))
    ok(s, c.UndrainNode(node_id="n0001"))
    assert s.nodes["n0001"].state == N.READY
    assert s.nodes["n0001"].state_reason == ""


def test_drain_of_a_down_node_is_rejected() -> None:
    s = world(nodes=1)
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN))
    rejected(s, c.DrainNode(node_id="n0000"), "invalid_transition")


def test_node_commands_on_unknown_node_are_not_found() -> None:
    s = world(nodes=0)
    for cmd in (
        c.DrainNode(node_id="x"),
        c.UndrainNode(node_id="x"),
        c.DisableNode(node_id="x"),
        c.EnableNode(node_id="x"),
        c.SetNodeHealth(node_id="x", state=N.DOWN),
    ):
        rejected(s, cmd, "not_found")


def test_disable_and_enable() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"], requeue_policy=RequeuePolicy.NEVER)
    ok(s, c.DisableNode(node_id="n0000", reason="bad dimm"))
    n = s.nodes["n0000"]
    assert (n.state, n.disabled, n.state_reason, n.owner) == (N.DOWN, True, "bad dimm", "")
    a = s.allocations[aid]
    assert (a.state, a.reason) == (A.FAILED, "node_disabled")
    assert s.nodes["n0001"].owner == ""
    # An agent re-registering does not bring a disabled node back.
    register(s, "n0000")
    assert s.nodes["n0000"].state == N.DOWN
    ok(s, c.EnableNode(node_id="n0000"))
    assert (s.nodes["n0000"].state, s.nodes["n0000"].disabled) == (N.READY, False)
    before = encode(s)
    ok(s, c.EnableNode(node_id="n0000"))  # already enabled: no-op
    assert encode(s) == before


def test_register_node_creates_a_ready_node_and_updates_inventory() -> None:
    s = GlobalState()
    res = ok(
        s,
        c.RegisterNode(
            node_id="x1",
            hostname="x1.local",
            capabilities=NodeCapabilities(gpu_type="GH200", gpu_count=4),
            group=3,
            agent_address="127.0.0.1:9",
            home_vcluster="v",
            now=7.0,
        ),
    )
    n = res.node
    assert n is not None
    assert (n.state, n.group, n.registered_at, n.home_vcluster) == (N.READY, 3, 7.0, "v")
    res = ok(s, c.RegisterNode(node_id="x1", capabilities=NodeCapabilities(gpu_count=2), now=9.0))
    n = s.nodes["x1"]
    assert n.capabilities.gpu_count == 2
    assert n.registered_at == 7.0
    assert n.home_vcluster == "v"  # kept when not given


def test_register_brings_down_node_back_to_ready() -> None:
    s = world(nodes=1)
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN, reason="no heartbeat"))
    assert s.nodes["n0000"].state == N.DOWN
    register(s, "n0000")
    assert s.nodes["n0000"].state == N.READY
    assert s.nodes["n0000"].state_reason == ""


def test_register_keeps_drain() -> None:
    s = world(nodes=2)
    running(s, ["n0000"])
    ok(s, c.DrainNode(node_id="n0000"))
    ok(s, c.DrainNode(node_id="n0001"))
    register(s, "n0000")
    register(s, "n0001")
    assert s.nodes["n0000"].state == N.DRAINING
    assert s.nodes["n0001"].state == N.DRAINED


def test_drained_node_that_went_down_stays_drained_after_register() -> None:
    s = world(nodes=1)
    ok(s, c.DrainNode(node_id="n0000", reason="maintenance"))
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN))
    register(s, "n0000")
    assert s.nodes["n0000"].state != N.READY


def test_enable_and_later_reregistration_agree_about_the_drain() -> None:
    s = world(nodes=1)
    ok(s, c.DrainNode(node_id="n0000"))
    ok(s, c.DisableNode(node_id="n0000"))
    ok(s, c.EnableNode(node_id="n0000"))
    after_enable = s.nodes["n0000"].state
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN))
    register(s, "n0000")
    assert s.nodes["n0000"].state == after_enable


def test_health_degraded_and_back() -> None:
    s = world(nodes=1)
    aid = running(s, ["n0000"])
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DEGRADED, reason="missed heartbeat"))
    assert s.nodes["n0000"].state == N.DEGRADED
    assert s.nodes["n0000"].owner == aid  # existing allocations continue
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.READY))
    assert s.nodes["n0000"].state == N.READY


def test_health_does_not_override_admin_states() -> None:
    s = world(nodes=2)
    ok(s, c.DrainNode(node_id="n0000"))
    ok(s, c.SetNodeHealth(node_id="n0001", state=N.DOWN))
    before = encode(s)
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DEGRADED))
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.READY))
    ok(s, c.SetNodeHealth(node_id="n0001", state=N.READY))  # Down recovers by registering
    ok(s, c.SetNodeHealth(node_id="n0001", state=N.DEGRADED))
    assert encode(s) == before


@pytest.mark.parametrize("target", [N.DRAINED, N.BOOTING, N.FAILED, N.UNKNOWN, N.DRAINING])
def test_health_only_sets_ready_degraded_down(target: NodeState) -> None:
    s = world(nodes=1)
    rejected(s, c.SetNodeHealth(node_id="n0000", state=target), "invalid_argument")


def test_node_down_requeues_on_node_failure_until_max_requeue() -> None:
    s = world(nodes=4)
    aid = submit(s, nodes=2, max_requeue=2, now=3.0)
    pairs = [("n0000", "n0001"), ("n0002", "n0003"), ("n0000", "n0001")]
    for count, pair in enumerate(pairs[:2], start=1):
        assign(s, aid, list(pair))
        ok(s, c.SetNodeHealth(node_id=pair[0], state=N.DOWN, now=40.0))
        a = s.allocations[aid]
        assert a.state == A.PENDING
        assert a.requeue_count == count
        assert a.submitted_at == 3.0  # no queue-jumping penalty
        assert a.reason == "node_failure"
        assert a.assigned_nodes == []
        assert a.started_at is None
        assert s.nodes[pair[1]].owner == ""  # the healthy peer is released too
        assert s.nodes[pair[0]].owner == ""
        register(s, pair[0])
    assign(s, aid, list(pairs[2]))
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN, now=41.0))
    a = s.allocations[aid]
    assert (a.state, a.requeue_count, a.reason, a.finished_at) == (
        A.FAILED,
        2,
        "node_failure",
        41.0,
    )
    assert s.nodes["n0001"].owner == ""


def test_node_down_with_never_policy_fails_the_allocation() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"], requeue_policy=RequeuePolicy.NEVER)
    ok(s, c.SetNodeHealth(node_id="n0001", state=N.DOWN))
    a = s.allocations[aid]
    assert (a.state, a.requeue_count) == (A.FAILED, 0)
    assert all(n.owner == "" for n in s.nodes.values())


def test_node_down_of_a_draining_node_requeues_and_drains_its_peers() -> None:
    s = world(nodes=2)
    aid = running(s, ["n0000", "n0001"])
    ok(s, c.DrainNode(node_id="n0001"))
    ok(s, c.SetNodeHealth(node_id="n0000", state=N.DOWN))
    assert s.allocations[aid].state == A.PENDING
    assert s.nodes["n0001"].state == N.DRAINED


def test_changes_record_touched_keys() -> None:
    s = world(nodes=2)
    aid = submit(s, nodes=2)
    ch = Changes()
    apply(s, c.AssignNodes(allocation_id=aid, node_ids=["n0000", "n0001"]), ch)
    assert ch.allocations == {aid}
    assert ch.nodes == {"n0000", "n0001"}
    ch = Changes()
    apply(s, c.AssignNodes(allocation_id=aid, node_ids=["n0000"]), ch)  # rejected
    assert not ch


# --- tenants and vClusters -----------------------------------------------------------


def test_create_tenant_and_duplicates() -> None:
    s = GlobalState()
    res = ok(s, c.CreateTenant(tenant=b.tenant("physics", max_nodes=10), now=5.0))
    assert res.tenant is not None
    assert (res.tenant.created_at, res.tenant.revision) == (5.0, s.revision)
    err = rejected(s, c.CreateTenant(tenant=b.tenant("physics")), "already_exists")
    assert err["hint"]


def test_update_tenant() -> None:
    s = world(tenants={"physics": {"max_nodes": 10}})
    res = ok(s, c.UpdateTenant(name="physics", fields={"max_nodes": 20, "fair_share_target": 0.3}))
    t = s.tenants["physics"]
    assert res.tenant == t
    assert (t.max_nodes, t.fair_share_target, t.revision) == (20, 0.3, s.revision)
    ok(s, c.UpdateTenant(name="physics", fields={"max_nodes": None}))
    assert s.tenants["physics"].max_nodes is None


def test_update_tenant_rejects_unknown_fields_and_unknown_tenant() -> None:
    s = world(tenants={"physics": {}})
    err = rejected(
        s,
        c.UpdateTenant(name="physics", fields={"max_nodes": 1, "maxnodes": 2}),
        "invalid_argument",
    )
    assert "maxnodes" in err["message"]
    rejected(s, c.UpdateTenant(name="physics", fields={"name": "x"}), "invalid_argument")
    rejected(s, c.UpdateTenant(name="chemistry", fields={"max_nodes": 1}), "not_found")


def test_update_tenant_with_wrong_type_is_rejected() -> None:
    s = world(tenants={"physics": {}})
    rejected(s, c.UpdateTenant(name="physics", fields={"max_nodes": "lots"}), "invalid_argument")


def test_create_vcluster() -> None:
    s = world(tenants={"physics": {}}, vclusters=())
    ok(s, c.CreateVCluster(vcluster=b.vcluster("hpc", tenant="physics")))
    rejected(s, c.CreateVCluster(vcluster=b.vcluster("hpc")), "already_exists")
    rejected(s, c.CreateVCluster(vcluster=b.vcluster("x", tenant="nobody")), "not_found")
    assert set(s.vclusters) == {"hpc"}


def test_update_vcluster_merges_weights() -> None:
    s = world()
    before = msgspec.structs.replace(s.vclusters["v"].weights)
    res = ok(
        s,
        c.UpdateVCluster(
            name="v",
            fields={"weights": {"priority": 0.5}, "scheduler_type": "service-binpack"},
        ),
    )
    v = s.vclusters["v"]
    assert res.vcluster == v
    assert v.weights.priority == 0.5
    assert v.weights.wait_time == before.wait_time
    assert v.weights.conformance == before.conformance
    assert v.scheduler_type == SchedulerType.SERVICE_BINPACK
    assert v.revision == s.revision
    ok(s, c.UpdateVCluster(name="v", fields={"weights": {"energy": 0.1}}))
    assert (s.vclusters["v"].weights.priority, s.vclusters["v"].weights.energy) == (0.5, 0.1)


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "other"},
        {"colour": "blue"},
        {"scheduler_type": "lottery"},
        {"weights": {"priority": "high"}},
        {"backfill_depth": "deep"},
    ],
)
def test_update_vcluster_rejects_unknown_or_invalid_fields(fields: dict[str, Any]) -> None:
    s = world()
    rejected(s, c.UpdateVCluster(name="v", fields=fields), "invalid_argument")


def test_update_unknown_vcluster_is_not_found() -> None:
    rejected(world(), c.UpdateVCluster(name="nope", fields={}), "not_found")


def test_update_vcluster_rejects_unknown_weight_names() -> None:
    s = world()
    rejected(
        s, c.UpdateVCluster(name="v", fields={"weights": {"prioirty": 0.9}}), "invalid_argument"
    )


# --- Batch ---------------------------------------------------------------------------


def test_batch_results_are_independent() -> None:
    s = world(nodes=2)
    res = run(
        s,
        c.Batch(
            commands=[
                c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v")),
                c.SubmitAllocation(spec=b.spec(tenant="nope", vcluster="v")),
                c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v")),
            ]
        ),
    )
    assert res.error is None
    assert res.results is not None
    r1, r2, r3 = res.results
    assert r1.error is None and r3.error is None
    assert r2.error is not None and r2.error["code"] == "not_found"
    assert r1.allocation is not None and r3.allocation is not None
    assert r1.allocation.id != r3.allocation.id
    assert r1.revision < r3.revision == s.revision
    assert len(s.allocations) == 2


def test_batch_of_conflicting_assigns_first_wins() -> None:
    s = world(nodes=2)
    a1, a2 = submit(s), submit(s)
    res = run(
        s,
        c.Batch(
            commands=[
                c.AssignNodes(allocation_id=a1, node_ids=["n0000"]),
                c.AssignNodes(allocation_id=a2, node_ids=["n0000"]),
                c.AssignNodes(allocation_id=a2, node_ids=["n0001"]),
            ]
        ),
    )
    assert res.results is not None
    assert [r.error["code"] if r.error else None for r in res.results] == [
        None,
        "ownership_conflict",
        None,
    ]
    assert (s.nodes["n0000"].owner, s.nodes["n0001"].owner) == (a1, a2)


def test_batch_result_revision_is_the_revision_after_the_batch() -> None:
    s = world()
    res = run(s, c.Batch(commands=[c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v"))]))
    assert res.revision == s.revision


# --- properties over random command sequences ------------------------------------------

NODE_IDS = [f"n{i}" for i in range(7)]
TENANTS = ["physics", "bio"]
GHOST = "ghost"


class StateMachineModel(RuleBasedStateMachine):
    """Random command sequences through apply(), with invariants checked after each step.

    Commands go through encode/decode (as through the Raft log) and are recorded so the
    teardown can replay them on a fresh state (determinism).
    """

    def __init__(self) -> None:
        super().__init__()
        self.state = GlobalState()
        self.log: list[bytes] = []
        self.results: list[bytes] = []
        self.now = 0.0
        # Tenants whose max_nodes / max_concurrent_allocations was lowered below usage.
        self.lowered_nodes: set[str] = set()
        self.lowered_allocs: set[str] = set()
        self.seen_states: dict[str, AllocationState] = {}

    # -- plumbing

    def do(self, cmd: c.Command) -> c.CommandResult:
        self.now += 1.0
        cmd.now = self.now
        raw = c.encode_command(cmd)
        before = encode(self.state)
        usage_before = self.usage()
        res = apply(self.state, c.decode_command(raw))
        self.log.append(raw)
        self.results.append(c.encode_result(res))
        after = encode(self.state)
        if res.error is not None:
            # (3) a rejected command changes nothing
            assert after == before, res.error
            assert res.revision == self.state.revision
        # (5) usage only grows within the hard limits
        usage_after = self.usage()
        for name, t in self.state.tenants.items():
            nb, ab = usage_before.get(name, (0, 0))
            na, aa = usage_after.get(name, (0, 0))
            if na > nb and t.max_nodes is not None:
                assert na <= t.max_nodes, (name, na, t.max_nodes)
            if aa > ab and t.max_concurrent_allocations is not None:
                assert aa <= t.max_concurrent_allocations, (name, aa)
        self.check_transitions()
        return res

    def usage(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for a in self.state.allocations.values():
            if a.state in HOLDING_STATES:
                n, k = out.get(a.spec.tenant, (0, 0))
                out[a.spec.tenant] = (n + len(a.assigned_nodes), k + 1)
        return out

    def check_transitions(self) -> None:
        # (6) allocation states only move along ALLOCATION_TRANSITIONS
        for aid, a in self.state.allocations.items():
            prev = self.seen_states.get(aid)
            if prev is None:
                assert a.state == A.PENDING
            elif prev != a.state:
                assert a.state in ALLOCATION_TRANSITIONS[prev], (aid, prev, a.state)
            self.seen_states[aid] = a.state

    def alloc_ids(self) -> list[str]:
        return [*sorted(self.state.allocations), "deadbeef"]

    def has(self, states: frozenset[AllocationState] | None = None) -> bool:
        return any(
            (a.state in states if states is not None else not a.terminal)
            for a in self.state.allocations.values()
        )

    def pick(self, data: st.DataObject, states: frozenset[AllocationState] | None = None) -> str:
        """Mostly an allocation in ``states`` (default: not finished), sometimes any id."""
        live = sorted(
            a.id
            for a in self.state.allocations.values()
            if (a.state in states if states is not None else not a.terminal)
        )
        if live and data.draw(st.integers(0, 9), label="prefer") > 0:
            return data.draw(st.sampled_from(live), label="allocation")
        return data.draw(st.sampled_from(self.alloc_ids()), label="allocation")

    # -- rules

    @initialize()
    def setup(self) -> None:
        self.do(
            c.CreateTenant(tenant=b.tenant("physics", max_nodes=5, max_concurrent_allocations=3))
        )
        self.do(c.CreateTenant(tenant=b.tenant("bio")))
        self.do(c.CreateVCluster(vcluster=b.vcluster("v")))
        for nid in NODE_IDS[:6]:
            self.do(c.RegisterNode(node_id=nid, group=int(nid[1:]) % 2))

    @rule(node=st.sampled_from(NODE_IDS), group=st.integers(0, 2), gpus=st.integers(0, 4))
    def register_node(self, node: str, group: int, gpus: int) -> None:
        self.do(
            c.RegisterNode(node_id=node, group=group, capabilities=NodeCapabilities(gpu_count=gpus))
        )

    @rule(
        tenant=st.sampled_from([*TENANTS, *TENANTS, GHOST]),
        vcluster=st.sampled_from(["v", "v", "v", GHOST]),
        nodes=st.integers(1, 3),
        policy=st.sampled_from(list(RequeuePolicy)),
        max_requeue=st.integers(0, 2),
        request_id=st.sampled_from(["", "", "r1", "r2"]),
    )
    def submit(
        self,
        tenant: str,
        vcluster: str,
        nodes: int,
        policy: RequeuePolicy,
        max_requeue: int,
        request_id: str,
    ) -> None:
        known = self.state.request_ids.get(request_id) if request_id else None
        count = len(self.state.allocations)
        res = self.do(
            c.SubmitAllocation(
                spec=b.spec(
                    tenant=tenant,
                    vcluster=vcluster,
                    nodes=nodes,
                    requeue_policy=policy,
                    max_requeue=max_requeue,
                    request_id=request_id,
                )
            )
        )
        if known is not None:
            assert res.allocation is not None and res.allocation.id == known
            assert len(self.state.allocations) == count

    @precondition(lambda self: self.has(frozenset({A.PENDING})))
    @rule(data=st.data(), good=st.booleans())
    def assign(self, data: st.DataObject, good: bool) -> None:
        aid = self.pick(data, frozenset({A.PENDING}))
        a = self.state.allocations.get(aid)
        free = sorted(n.id for n in self.state.nodes.values() if n.schedulable)
        if good and a is not None and len(free) >= a.spec.nodes:
            # mostly-valid proposals, as a scheduler would make them
            node_ids = data.draw(st.permutations(free), label="nodes")[: a.spec.nodes]
            expected = data.draw(st.sampled_from([0, self.state.revision]), label="expected")
        else:
            node_ids = data.draw(
                st.lists(st.sampled_from([*NODE_IDS, "nX"]), max_size=5, unique=True),
                label="nodes",
            )
            expected = data.draw(
                st.integers(max(0, self.state.revision - 3), self.state.revision),
                label="expected_revision",
            )
        before = {nid: self.state.nodes[nid].state for nid in node_ids if nid in self.state.nodes}
        res = self.do(
            c.AssignNodes(allocation_id=aid, node_ids=node_ids, expected_revision=expected)
        )
        event(f"assign: {res.error['code'] if res.error else 'ok'}")
        if res.error is None:
            assert all(st_ == N.READY for st_ in before.values())
            assert self.state.allocations[aid].assigned_nodes == node_ids

    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        """Submit (sometimes) and assign free nodes to a pending allocation, as a scheduler."""
        if data.draw(st.booleans(), label="submit first"):
            self.submit(
                "physics" if data.draw(st.booleans()) else "bio",
                "v",
                1,
                *data.draw(
                    st.tuples(st.sampled_from(list(RequeuePolicy)), st.integers(0, 2), st.just(""))
                ),
            )
        self.assign(data, True)

    @precondition(lambda self: self.has())
    @rule(data=st.data())
    def update_state(self, data: st.DataObject) -> None:
        aid = self.pick(data)
        a = self.state.allocations.get(aid)
        before = a.state.value if a is not None else "missing"
        target = data.draw(st.sampled_from(list(A)), label="target")
        res = self.do(c.UpdateAllocationState(allocation_id=aid, state=target, exit_code=0))
        event(f"update {before}->{target.value}: {'error' if res.error else 'ok'}")
        if a is not None and before == "Pending" and target in HOLDING_STATES:
            assert res.error is not None  # only AssignNodes starts an allocation

    @precondition(lambda self: self.has())
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        aid = self.pick(data)
        was_terminal = aid in self.state.allocations and self.state.allocations[aid].terminal
        res = self.do(c.CancelAllocation(allocation_id=aid))
        if aid in self.state.allocations:
            assert (res.error is not None) == was_terminal
            assert self.state.allocations[aid].terminal

    @precondition(lambda self: self.has(HOLDING_STATES))
    @rule(data=st.data(), use_expected=st.booleans())
    def requeue(self, data: st.DataObject, use_expected: bool) -> None:
        aid = self.pick(data, HOLDING_STATES)
        expected = data.draw(st.integers(0, 2), label="expected") if use_expected else None
        self.do(
            c.RequeueAllocation(allocation_id=aid, reason="test", expected_requeue_count=expected)
        )

    @rule(
        node=st.sampled_from([*NODE_IDS, "nX"]),
        op=st.sampled_from(["drain", "undrain", "disable", "enable"]),
    )
    def node_admin(self, node: str, op: str) -> None:
        cmd = {
            "drain": c.DrainNode(node_id=node),
            "undrain": c.UndrainNode(node_id=node),
            "disable": c.DisableNode(node_id=node),
            "enable": c.EnableNode(node_id=node),
        }[op]
        self.do(cmd)

    @rule(node=st.sampled_from(NODE_IDS), health=st.sampled_from([N.READY, N.DEGRADED, N.DOWN]))
    def health(self, node: str, health: NodeState) -> None:
        owner = self.state.nodes[node].owner if node in self.state.nodes else ""
        self.do(c.SetNodeHealth(node_id=node, state=health))
        if health == N.DOWN and node in self.state.nodes:
            n = self.state.nodes[node]
            assert (n.state, n.owner) == (N.DOWN, "")
            if owner:
                a = self.state.allocations[owner]
                assert a.state in (A.PENDING, A.FAILED), a

    @rule(
        tenant=st.sampled_from([*TENANTS, GHOST]),
        max_nodes=st.one_of(st.none(), st.integers(0, 8)),
        max_allocs=st.one_of(st.none(), st.integers(0, 4)),
        bad_field=st.booleans(),
    )
    def update_tenant(
        self, tenant: str, max_nodes: int | None, max_allocs: int | None, bad_field: bool
    ) -> None:
        fields: dict[str, Any] = {"max_nodes": max_nodes, "max_concurrent_allocations": max_allocs}
        if bad_field:
            fields["max_gpus"] = 1
        usage = self.usage()
        res = self.do(c.UpdateTenant(name=tenant, fields=fields))
        if res.error is None:
            nodes, allocs = usage.get(tenant, (0, 0))
            if max_nodes is not None and nodes > max_nodes:
                self.lowered_nodes.add(tenant)
            if max_allocs is not None and allocs > max_allocs:
                self.lowered_allocs.add(tenant)

    @rule(priority=st.floats(0, 1), bad=st.booleans())
    def update_vcluster(self, priority: float, bad: bool) -> None:
        fields: dict[str, Any] = {"weights": {"priority": priority}}
        if bad:
            fields["unknown"] = 1
        self.do(c.UpdateVCluster(name="v", fields=fields))

    # -- invariants

    @invariant()
    def ownership_is_exclusive_and_consistent(self) -> None:
        s = self.state
        owned: dict[str, str] = {}
        for n in s.nodes.values():
            if n.state in (N.DRAINING, N.DRAINED):
                assert n.drain_requested, n  # only an operator's drain leads there
            if not n.owner:
                assert n.owner_tenant == "" and n.owner_vcluster == ""
                assert n.state != N.DRAINING, n
                continue
            # (1) the owner is an allocation in a holding state that lists the node
            a = s.allocations.get(n.owner)
            assert a is not None, n
            assert a.state in HOLDING_STATES, (n.id, a.id, a.state)
            assert n.id in a.assigned_nodes
            assert n.owner_tenant == a.spec.tenant
            assert n.state in (N.READY, N.DEGRADED, N.DRAINING), n
            owned[n.id] = a.id
        for a in s.allocations.values():
            if a.state in HOLDING_STATES:
                # (2) every holding allocation owns all its nodes
                assert a.assigned_nodes, a
                assert len(set(a.assigned_nodes)) == len(a.assigned_nodes)
                for nid in a.assigned_nodes:
                    assert owned.get(nid) == a.id, (a.id, nid, owned.get(nid))
            elif a.state == A.PENDING:
                assert a.assigned_nodes == []
        # a node is never listed by two holding allocations
        listed = [
            nid
            for a in s.allocations.values()
            if a.state in HOLDING_STATES
            for nid in a.assigned_nodes
        ]
        assert len(listed) == len(set(listed))
        assert set(s.active) == {a.id for a in s.allocations.values() if a.state in HOLDING_STATES}

    @invariant()
    def hard_quotas_hold(self) -> None:
        # (5) unless the limit was lowered below usage after the nodes were assigned
        for name, (nodes, allocs) in self.usage().items():
            t = self.state.tenants[name]
            if t.max_nodes is not None and nodes > t.max_nodes:
                assert name in self.lowered_nodes, (name, nodes, t.max_nodes)
            if t.max_concurrent_allocations is not None and allocs > t.max_concurrent_allocations:
                assert name in self.lowered_allocs, (name, allocs)

    @invariant()
    def requeue_counts_are_bounded(self) -> None:
        for a in self.state.allocations.values():
            assert 0 <= a.requeue_count <= a.spec.max_requeue, a

    def teardown(self) -> None:
        # (4) determinism: the same log on a fresh state gives the same bytes and results
        replay = GlobalState()
        results = [c.encode_result(apply(replay, c.decode_command(raw))) for raw in self.log]
        assert results == self.results
        assert encode(replay) == encode(self.state)


StateMachineModel.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStateMachine = StateMachineModel.TestCase


# --- preemption ------------------------------------------------------------------------


def test_preempt_moves_victim_to_checkpointing_then_requeue_keeps_submit_time() -> None:
    s = world(nodes=1)
    victim = running(s, ["n0000"])
    s.allocations[victim].spec.preemption_class = 2
    boss = submit(s, preemption_class=8)
    submitted = s.allocations[victim].submitted_at
    ok(s, c.PreemptAllocation(allocation_id=victim, preemptor_id=boss))
    v = s.allocations[victim]
    assert v.state == A.CHECKPOINTING and v.preempted_by == boss
    assert s.nodes["n0000"].owner == victim  # still holds its node until it has stopped
    ck = CheckpointRecord(id="ckpt-1", path="/ck/t/p/a/checkpoints/ckpt-1/")
    ok(s, c.RecordCheckpoint(allocation_id=victim, node_id="n0000", checkpoint=ck))
    assert s.nodes["n0000"].owner == ""
    ok(s, c.RequeueAllocation(allocation_id=victim, reason="preempted", preempted=True))
    v = s.allocations[victim]
    assert v.state == A.PENDING and v.submitted_at == submitted
    assert (v.preempted_count, v.requeue_count, v.resume_from_checkpoint) == (1, 0, True)


def test_preempt_only_moves_down_and_never_class_10() -> None:
    s = world(nodes=2)
    same = running(s, ["n0000"])
    s.allocations[same].spec.preemption_class = 5
    top = running(s, ["n0001"])
    s.allocations[top].spec.preemption_class = 10
    boss = submit(s, preemption_class=5)
    rejected(s, c.PreemptAllocation(allocation_id=same, preemptor_id=boss), "invalid_argument")
    boss10 = submit(s, preemption_class=10)
    rejected(s, c.PreemptAllocation(allocation_id=top, preemptor_id=boss10), "invalid_argument")


def test_checkpointing_allocation_cannot_be_preempted_again() -> None:
    s = world(nodes=1)
    victim = running(s, ["n0000"])
    s.allocations[victim].spec.preemption_class = 1
    boss = submit(s, preemption_class=8)
    ok(s, c.PreemptAllocation(allocation_id=victim, preemptor_id=boss))
    rejected(s, c.PreemptAllocation(allocation_id=victim, preemptor_id=boss), "invalid_transition")


# --- task groups -----------------------------------------------------------------------


def test_task_group_creates_one_allocation_per_index() -> None:
    s = world()
    res = ok(
        s, c.SubmitTaskGroup(spec=b.spec("run --i=${INDEX}"), start=0, end=9, step=3, concurrency=2)
    )
    tasks = res.allocations or []
    assert [t.task_index for t in tasks] == [0, 3, 6, 9]
    assert all(
        t.task_group_id == res.task_group_id and t.task_group_concurrency == 2 for t in tasks
    )
    assert tasks[1].spec.entrypoint == "run --i=3"
    assert tasks[1].spec.env["LATTICE_TASK_INDEX"] == "3"
    assert len({t.id for t in tasks} | {res.task_group_id}) == 5


def test_task_group_is_idempotent_and_validated() -> None:
    s = world()
    spec = b.spec(request_id="rq-1")
    first = ok(s, c.SubmitTaskGroup(spec=spec, start=0, end=2))
    again = ok(s, c.SubmitTaskGroup(spec=spec, start=0, end=2))
    assert again.task_group_id == first.task_group_id and len(s.allocations) == 3
    rejected(s, c.SubmitTaskGroup(spec=b.spec(), start=5, end=1), "invalid_argument")


def test_request_id_of_one_kind_of_submission_is_refused_for_the_other() -> None:
    """A retried submission is recognised by its request_id; the same id sent with the
    other kind of submission is a client bug, refused with nothing changed (it used to
    escape apply as a KeyError, or answer with an empty task group)."""
    s = world()
    ok(s, c.SubmitTaskGroup(spec=b.spec(request_id="rq-g"), start=0, end=1))
    submit(s, request_id="rq-a")
    before = encode(s)
    err = rejected(s, c.SubmitAllocation(spec=b.spec(request_id="rq-g")), "already_exists")
    assert "task group" in err["message"]
    err = rejected(
        s, c.SubmitTaskGroup(spec=b.spec(request_id="rq-a"), start=0, end=1), "already_exists"
    )
    assert "allocation" in err["message"]
    assert encode(s) == before


def test_home_vcluster_may_reclaim_a_borrowed_node_whatever_the_class() -> None:
    s = world(nodes=1, vclusters=("v", "w"))
    s.nodes["n0000"].home_vcluster = "w"
    victim = running(s, ["n0000"])  # a job of vCluster v on w's node
    s.allocations[victim].spec.preemption_class = 9
    owner = submit(s, vcluster="w", preemption_class=1)
    ok(s, c.PreemptAllocation(allocation_id=victim, preemptor_id=owner))
    assert s.allocations[victim].state == A.CHECKPOINTING


def test_preemption_class_above_the_tenants_maximum_is_refused() -> None:
    s = world(tenants={"t": {"max_preemption_class": 4}})
    err = rejected(
        s,
        c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v", preemption_class=7), now=10.0),
        "permission_denied",
    )
    assert "above tenant t's maximum of 4" in err["message"] and err["hint"]
    assert s.allocations[submit(s, preemption_class=4)].spec.preemption_class == 4
    # raising the tenant's maximum lets the same request in
    ok(s, c.UpdateTenant(name="t", fields={"max_preemption_class": 8}, now=20.0))
    assert s.allocations[submit(s, preemption_class=7)].spec.preemption_class == 7
