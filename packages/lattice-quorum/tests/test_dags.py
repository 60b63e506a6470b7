"""DAG workflows in the quorum's apply: submission as one unit, held members released or
cancelled in the same command as their predecessor's end, the DAG's end, cancellation,
and that it all survives a snapshot (encode/decode of the state) like any other state."""

from __future__ import annotations

import msgspec
from lattice_common import commands as c
from lattice_common.types import AllocationState, Dependency
from lattice_quorum.state import Changes, GlobalState, apply
from lattice_test_harness import builders as b
from test_state import assign, ok, rejected, world

DONE = AllocationState.COMPLETED
FAILED = AllocationState.FAILED


def member(ref: str, *deps: tuple[str, str]) -> c.DagMemberSubmission:
    spec = b.spec(f"run {ref}", tenant="t", vcluster="v", user="alice")
    spec.depends_on = [Dependency(r, cond) for r, cond in deps]
    return c.DagMemberSubmission(ref=ref, spec=spec)


def submit_dag(s: GlobalState, *members: c.DagMemberSubmission, **kw: object) -> dict[str, str]:
    res = ok(s, c.SubmitDag(name="wf", members=list(members), now=10.0, **kw))  # type: ignore[arg-type]
    assert res.dag is not None
    return dict(res.dag.members)


def held(s: GlobalState, ids: dict[str, str]) -> set[str]:
    return {ref for ref, aid in ids.items() if s.allocations[aid].held}


def end(s: GlobalState, aid: str, state: AllocationState, code: int) -> Changes:
    """Run it to its end; the Changes of the ending command."""
    assign(s, aid, ["n0000"])
    ch = Changes()
    res = apply(
        s, c.UpdateAllocationState(allocation_id=aid, state=state, exit_code=code, now=30.0), ch
    )
    assert res.error is None, res.error
    return ch


def test_diamond_releases_each_stage_in_the_command_that_ends_the_last_predecessor() -> None:
    s = world()
    ids = submit_dag(
        s,
        member("a"),
        member("b", ("a", "success")),
        member("c", ("a", "success")),
        member("d", ("b", "success"), ("c", "success")),
    )
    dag_id = s.allocations[ids["a"]].dag_id
    assert held(s, ids) == {"b", "c", "d"}
    assert s.allocations[ids["b"]].pending_reason == "waiting for dependencies"
    ch = end(s, ids["a"], DONE, 0)
    assert held(s, ids) == {"d"}
    assert {ids["b"], ids["c"]} <= ch.allocations  # released in the same delta
    end(s, ids["b"], DONE, 0)
    assert held(s, ids) == {"d"}  # c has not ended yet
    end(s, ids["c"], DONE, 0)
    assert held(s, ids) == set()
    end(s, ids["d"], DONE, 0)
    d = s.dags[dag_id]
    assert d.state == "Completed" and d.finished_at == 30.0


def test_failure_cancels_success_successors_and_runs_the_failure_branch() -> None:
    s = world()
    ids = submit_dag(
        s,
        member("train"),
        member("evaluate", ("train", "success")),
        member("deploy", ("evaluate", "success")),
        member("notify", ("train", "failure")),
        member("cleanup", ("train", "any")),
    )
    end(s, ids["train"], FAILED, 3)
    ev, dep = s.allocations[ids["evaluate"]], s.allocations[ids["deploy"]]
    assert ev.state == dep.state == AllocationState.CANCELLED  # cascaded in one command
    assert ev.reason == "dependency never satisfied: train failed (needed success)"
    assert "evaluate" in dep.reason
    assert held(s, ids) == set()  # notify and cleanup released
    for ref in ("notify", "cleanup"):
        assert s.allocations[ids[ref]].state == AllocationState.PENDING
        end(s, ids[ref], DONE, 0)
    dag = s.dags[s.allocations[ids["train"]].dag_id]
    assert dag.state == "Completed"  # the failure was caught by notify


def test_failure_branch_is_cancelled_when_the_predecessor_succeeds() -> None:
    s = world()
    ids = submit_dag(s, member("train"), member("notify", ("train", "failure")))
    end(s, ids["train"], DONE, 0)
    n = s.allocations[ids["notify"]]
    assert n.state == AllocationState.CANCELLED
    assert n.reason == "dependency never satisfied: train succeeded (needed failure)"
    assert s.dags[n.dag_id].state == "Completed"


def test_uncaught_failure_fails_the_dag() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")))
    end(s, ids["a"], FAILED, 1)
    assert s.dags[s.allocations[ids["a"]].dag_id].state == "Failed"


def test_cyclic_oversized_or_dangling_dags_are_refused_and_nothing_is_stored() -> None:
    s = world()
    err = rejected(
        s,
        c.SubmitDag(
            name="loop",
            members=[
                member("a", ("c", "success")),
                member("b", ("a", "success")),
                member("c", ("b", "any")),
            ],
            now=10.0,
        ),
        "invalid_argument",
    )
    assert "dependency cycle: a -> b -> c -> a" in err["message"]
    err = rejected(
        s,
        c.SubmitDag(name="x", members=[member("a", ("ghost", "success"))], now=10.0),
        "invalid_argument",
    )
    assert "ghost" in err["message"]
    err = rejected(
        s,
        c.SubmitDag(name="big", members=[member(f"m{i}") for i in range(3)], max_size=2, now=10.0),
        "invalid_argument",
    )
    assert err["message"] == "DAG exceeds maximum size (3 allocations, limit: 2)"


def test_held_members_cannot_be_assigned() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")))
    err = rejected(
        s, c.AssignNodes(allocation_id=ids["b"], node_ids=["n0001"], now=20.0), "invalid_transition"
    )
    assert "waits for its dependencies" in err["message"]


def test_cancel_dag_cancels_what_has_not_ended() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")), member("c", ("b", "any")))
    assign(s, ids["a"], ["n0000"])
    dag_id = s.allocations[ids["a"]].dag_id
    res = ok(s, c.CancelDag(dag_id=dag_id, now=40.0))
    assert sorted(a.id for a in res.allocations or []) == sorted(ids.values())
    assert all(s.allocations[i].state == AllocationState.CANCELLED for i in ids.values())
    assert s.dags[dag_id].state == "Cancelled" and held(s, ids) == set()
    rejected(s, c.CancelDag(dag_id=dag_id, now=41.0), "invalid_transition")
    rejected(s, c.CancelDag(dag_id="nope", now=41.0), "not_found")


def test_resubmitting_the_same_request_id_returns_the_same_dag() -> None:
    s = world()
    first = submit_dag(s, member("a"), request_id="r1")
    again = submit_dag(s, member("a"), request_id="r1")
    assert first == again and len(s.dags) == 1


def test_a_1000_stage_chain_resolves_one_stage_per_end() -> None:
    s = world()
    refs = [f"s{i}" for i in range(1000)]
    ids = submit_dag(
        s, member(refs[0]), *(member(r, (refs[i], "success")) for i, r in enumerate(refs[1:]))
    )
    for i, ref in enumerate(refs):
        assert not s.allocations[ids[ref]].held
        ch = end(s, ids[ref], DONE, 0)
        # the end touches the ended stage (and its node) and releases exactly the next one
        if i + 1 < len(refs):
            assert ch.allocations == {ids[ref], ids[refs[i + 1]]}
    assert s.dags[s.allocations[ids["s0"]].dag_id].state == "Completed"


def test_dags_survive_a_snapshot() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")))
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=GlobalState)
    end(restored, ids["a"], DONE, 0)
    assert not restored.allocations[ids["b"]].held


# --- submit --dependency: allocations submitted alone ------------------------------------


def submit_after(s: GlobalState, *deps: tuple[str, str]) -> str:
    spec = b.spec("run", tenant="t", vcluster="v", user="alice")
    spec.depends_on = [Dependency(r, cond) for r, cond in deps]
    res = ok(s, c.SubmitAllocation(spec=spec, now=11.0))
    assert res.allocation is not None
    return res.allocation.id


def submit_alone(s: GlobalState) -> str:
    res = ok(s, c.SubmitAllocation(spec=b.spec("run", tenant="t", vcluster="v"), now=10.0))
    assert res.allocation is not None
    return res.allocation.id


def test_afterok_chain_of_plain_submissions() -> None:
    s = world()
    a = submit_alone(s)
    bb = submit_after(s, (a, "success"))
    cc = submit_after(s, (bb, "success"))
    assert s.allocations[bb].held and s.allocations[cc].held
    end(s, a, DONE, 0)
    assert not s.allocations[bb].held and s.allocations[cc].held
    end(s, bb, FAILED, 2)
    assert s.allocations[cc].state == AllocationState.CANCELLED
    assert s.allocations[cc].reason == f"dependency never satisfied: {bb} failed (needed success)"
    assert s.dependents == {}


def test_afternotok_and_afterany_of_several_predecessors() -> None:
    s = world()
    a, a2 = submit_alone(s), submit_alone(s)
    on_fail = submit_after(s, (a, "failure"))
    both = submit_after(s, (a, "any"), (a2, "any"))
    end(s, a, FAILED, 1)
    assert not s.allocations[on_fail].held
    assert s.allocations[both].held  # a2 still runs
    end(s, a2, DONE, 0)
    assert not s.allocations[both].held


def test_dependency_on_an_ended_or_unknown_allocation() -> None:
    s = world()
    a = submit_alone(s)
    end(s, a, DONE, 0)
    ready = submit_after(s, (a, "success"))
    assert not s.allocations[ready].held  # already satisfied: queued at once
    spec = b.spec("run", tenant="t", vcluster="v")
    spec.depends_on = [Dependency(a, "failure")]
    err = rejected(s, c.SubmitAllocation(spec=spec, now=12.0), "invalid_transition")
    assert err["message"] == f"dependency never satisfied: {a} succeeded (needed failure)"
    spec.depends_on = [Dependency("deadbeef", "success")]
    err = rejected(s, c.SubmitAllocation(spec=spec, now=12.0), "not_found")
    assert "deadbeef" in err["message"] and err["hint"]


def test_cancelling_a_predecessor_releases_afterany_and_cancels_afterok() -> None:
    s = world()
    a = submit_alone(s)
    okay = submit_after(s, (a, "success"))
    anyway = submit_after(s, (a, "any"))
    ok(s, c.CancelAllocation(allocation_id=a, now=20.0))
    assert s.allocations[okay].state == AllocationState.CANCELLED
    assert not s.allocations[anyway].held


def test_plain_dependency_on_a_dag_member_cascades_through_the_dag() -> None:
    s = world()
    ids = submit_dag(s, member("a"), member("b", ("a", "success")))
    after_b = submit_after(s, (ids["b"], "success"))
    end(s, ids["a"], FAILED, 1)  # cancels b in the DAG, and so after_b
    assert s.allocations[ids["b"]].state == AllocationState.CANCELLED
    assert s.allocations[after_b].state == AllocationState.CANCELLED


def test_aftercorr_pairs_the_elements_of_two_task_groups() -> None:
    s = world()
    pre = c.DagMemberSubmission(
        ref="pre", spec=b.spec("prep ${INDEX}", tenant="t", vcluster="v"), task_group="0-9"
    )
    train = member("train", ("pre", "corresponding"))
    train.task_group = "0-9"
    res = ok(s, c.SubmitDag(name="arrays", members=[pre, train], now=10.0))
    assert res.dag is not None
    ids = dict(res.dag.members)
    assert len(ids) == 20 and s.allocations[ids["pre[3]"]].spec.entrypoint == "prep 3"
    assert held(s, ids) == {f"train[{i}]" for i in range(10)}
    end(s, ids["pre[3]"], DONE, 0)
    assert held(s, ids) == {f"train[{i}]" for i in range(10) if i != 3}
    end(s, ids["pre[4]"], FAILED, 1)
    t4 = s.allocations[ids["train[4]"]]
    assert t4.state == AllocationState.CANCELLED
    assert t4.reason == "dependency never satisfied: pre[4] failed (needed corresponding)"
    assert s.allocations[ids["train[5]"]].held  # element 5 does not care about element 4
    # the stored DAG resolves the same after a snapshot
    restored = msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=GlobalState)
    end(restored, ids["pre[5]"], DONE, 0)
    assert not restored.allocations[ids["train[5]"]].held
