"""The policies: FCFS and EASY baselines against the real Lattice scheduler."""

from __future__ import annotations

import pytest
from lattice_common.types import AllocationSpec, Constraints, Node, NodeCapabilities
from rm_replay.engine import simulate
from rm_replay.policies import (
    EasyPolicy,
    FcfsPolicy,
    LatticePolicy,
    make_policy,
)
from rmr_helpers import T0, H, inventory, submit


def node(node_id: str, gpu_type: str = "", features: tuple[str, ...] = ()) -> Node:
    caps = NodeCapabilities(
        cpu_cores=64,
        memory_gb=256,
        gpu_type=gpu_type,
        gpu_count=4 if gpu_type else 0,
        features=list(features),
    )
    return Node(id=node_id, capabilities=caps)


def by_id(result):
    return {j.id: j for j in result.jobs}


# 4 nodes. "long" holds 3 of them for 10 h; "big" (4 nodes) must wait for it; "short"
# (1 node, 1 h) fits the free node before big's reservation; "longer" (1 node, 20 h)
# fits the free node too, but would hold it past the reservation.
HEAD_OF_LINE = [
    submit("long", 0, nodes=3, walltime=10 * H),
    submit("big", 10, nodes=4, walltime=H),
    submit("longer", 20, nodes=1, walltime=20 * H),
    submit("short", 30, nodes=1, walltime=H),
]


def test_fcfs_head_of_line_blocking() -> None:
    j = by_id(simulate(HEAD_OF_LINE, inventory(4), policy="fcfs"))
    assert j["big"].start == T0 + 10 * H
    # nothing passes the blocked head, although a node stays idle for 10 hours
    assert j["longer"].start == T0 + 11 * H
    assert j["short"].start == T0 + 11 * H
    assert not any(x.backfilled for x in j.values())


def test_easy_backfills_without_delaying_the_head() -> None:
    r = simulate(HEAD_OF_LINE, inventory(4), policy="easy")
    j = by_id(r)
    assert j["big"].start == T0 + 10 * H  # its reservation: when "long" ends
    assert (j["short"].start, j["short"].backfilled) == (T0 + 30, True)
    assert (j["longer"].start, j["longer"].backfilled) == (T0 + 11 * H, False)


def test_easy_backfill_may_outlast_the_reservation_on_nodes_the_head_does_not_need() -> None:
    # 5 nodes: the head needs 4, so a fifth free node may run something long
    r = simulate(HEAD_OF_LINE, inventory(5), policy="easy")
    j = by_id(r)
    assert j["big"].start == T0 + 10 * H
    assert (j["longer"].start, j["longer"].backfilled) == (T0 + 20, True)
    assert j["short"].start == T0 + 30  # on the other free node, done before 10 h


def test_easy_never_delays_the_head_reservation() -> None:
    # many backfill candidates of every length; the head still starts when its
    # reservation said (the end of the running allocations' walltimes)
    trace = [
        submit("a", 0, nodes=2, walltime=5 * H, runtime=5 * H),
        submit("b", 0, nodes=2, walltime=8 * H, runtime=8 * H),
        submit("head", 60, nodes=6, walltime=H),
        *[submit(f"f{i}", 120 + i, nodes=1 + i % 2, walltime=(1 + i) * H) for i in range(10)],
    ]
    r = simulate(trace, inventory(6), policy="easy")
    j = by_id(r)
    assert j["head"].start == T0 + 8 * H
    # jobs that jumped the head while it waited all ended by its reservation (the head
    # needs every node, so none may outlast it)
    jumped = [x for x in j.values() if x.backfilled and x.start < j["head"].start]
    assert jumped and all(x.end <= j["head"].start for x in jumped)


def test_lattice_backfill_respects_reservations_too() -> None:
    j = by_id(simulate(HEAD_OF_LINE, inventory(4), policy="lattice"))
    assert j["big"].start == T0 + 10 * H
    assert (j["short"].start, j["short"].backfilled) == (T0 + 30, True)
    assert j["longer"].start == T0 + 11 * H


def test_baselines_pass_over_impossible_jobs() -> None:
    trace = [submit("never", 0, nodes=99), submit("ok", 1)]
    for policy in ("fcfs", "easy"):
        j = by_id(simulate(trace, inventory(2), policy=policy))
        assert j["never"].state == "unfinished"
        assert j["ok"].start == T0 + 1


def test_baselines_match_gpu_constraints() -> None:
    inv = inventory(2, extra=[{"name": "g", "count": 2, "gpu_type": "GH200", "gpus": 4}])
    trace = [submit("gpu", 0, nodes=2, gpu_type="gh200"), submit("cpu", 0, nodes=2)]
    for policy in ("fcfs", "easy", "lattice"):
        j = by_id(simulate(trace, inv, policy=policy))
        assert j["gpu"].start == T0 and j["gpu"].gpus_per_node == 4, policy
        assert j["cpu"].start == T0, policy


def test_baselines_do_not_preempt() -> None:
    trace = [
        submit("low", 0, nodes=2, walltime=10 * H, runtime=4 * H, preemption_class=1),
        submit("high", H, nodes=2, walltime=H, preemption_class=8),
    ]
    for policy in ("fcfs", "easy"):
        j = by_id(simulate(trace, inventory(2), policy=policy))
        assert j["low"].preempted_count == 0 and j["high"].start == T0 + 4 * H
    j = by_id(simulate(trace, inventory(2), policy="lattice"))
    assert j["low"].preempted_count == 1 and j["high"].start < T0 + 4 * H


def test_solver_flags_are_not_node_features_for_the_baselines() -> None:
    spec = AllocationSpec(
        entrypoint="x",
        tenant="t",
        vcluster="v",
        constraints=Constraints(features=["require_conformance", "nvme"], gpu_type="A100"),
    )
    a100 = node("n1", "A100", ("nvme",))
    without_nvme = node("n2", "A100")
    for policy in (FcfsPolicy(), EasyPolicy()):
        assert policy.node_filter(a100, spec) and not policy.node_filter(without_nvme, spec)
    trace = [submit("a", 0, nodes=2, features=("require_conformance",))]
    assert by_id(simulate(trace, inventory(2), policy="easy"))["a"].start == T0


def test_make_policy() -> None:
    assert isinstance(make_policy("lattice"), LatticePolicy)
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    assert isinstance(make_policy("easy"), EasyPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("sjf")


def test_node_ranges_shrink_to_what_is_free() -> None:
    # the lattice scheduler starts a blocked {min 1, max 4} allocation on the 2 free nodes
    trace = [submit("hold", 0, nodes=2, walltime=5 * H), submit("svc", 10, nodes=4, min_nodes=1)]
    j = by_id(simulate(trace, inventory(4)))
    assert j["svc"].start == T0 + 10
    assert j["svc"].node_seconds == 2 * H  # ran on 2 nodes


def test_the_baselines_hold_the_hard_flags() -> None:
    """One filter: ``require_unified_memory`` holds for the baselines as for the solver."""
    spec = AllocationSpec(
        entrypoint="x",
        tenant="t",
        vcluster="v",
        constraints=Constraints(features=["require_unified_memory"]),
    )
    gh200 = node("n1", "GH200")
    cpu = node("n2")
    for policy in (FcfsPolicy(), EasyPolicy(), LatticePolicy()):
        assert policy.node_filter(gh200, spec) and not policy.node_filter(cpu, spec)


def test_the_budget_window_reaches_the_lattice_policy() -> None:
    from rm_replay.engine import Replay

    assert make_policy("lattice").budget_period_days == 90  # type: ignore[attr-defined]
    replay = Replay([], inventory(1), budget_period_days=7)
    assert replay.policy.budget_period_days == 7  # type: ignore[attr-defined]
