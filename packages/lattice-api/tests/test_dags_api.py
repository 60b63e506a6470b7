"""DAG workflows through the API, over both transports (the ``served`` fixture: the
real REST and gRPC servers on a LocalQuorum): submit a diamond (JSON, YAML, gRPC),
read it back with its members Blocked/Pending, list, cancel (the submitter may, another
user may not), and the refusals, each with nothing stored: a cycle with its path, an
unknown ref, an invalid member spec naming the member, the size limit."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from lattice_api.auth import Role
from lattice_api.settings import ApiSettings
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState
from lattice_test_harness.local_api import serve_local_api
from served_api import AGENT_TOKEN, SECRET, Grpc, Rest, World, bearer, grpc_error

pytestmark = pytest.mark.timeout(60)

ALICE = bearer("alice")
BOB = bearer("bob")
ROOT = bearer("root", Role.SYSTEM_ADMIN)
WHERE = {"tenant": "physics", "vcluster": "batch"}


def member(mid: str, *deps: tuple[str, str], **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": mid, "entrypoint": f"./{mid}.sh", "walltime": "1h", **kw}
    if deps:
        body["depends_on"] = [{"ref": r, "condition": c} for r, c in deps]
    return body


DIAMOND = {
    "name": "diamond",
    **WHERE,
    "allocations": [
        member("prep"),
        member("left", ("prep", "success")),
        member("right", ("prep", "afterok")),
        member("join", ("left", "success"), ("right", "any")),
    ],
}

DIAMOND_YAML = """\
name: diamond
allocations:
  - name: prep
    entrypoint: ./prep.sh
    walltime: 1h
  - name: left
    entrypoint: ./left.sh
    walltime: 1h
    depends_on: [{prep: success}]
  - name: right
    entrypoint: ./right.sh
    walltime: 1h
    depends_on: [{prep: afterok}]
  - name: join
    entrypoint: ./join.sh
    walltime: 1h
    depends_on: [{left: success}, {right: any}]
"""

EXPECTED_STATES = {"prep": "Pending", "left": "Blocked", "right": "Blocked", "join": "Blocked"}
EXPECTED_EDGES = {
    ("prep", "left", "success"),
    ("prep", "right", "success"),
    ("left", "join", "success"),
    ("right", "join", "any"),
}


def states_of(dag: dict[str, Any]) -> dict[str, str]:
    return {m["ref"]: m["state"] for m in dag["members"]}


def edges_of(dag: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(e["upstream"], e["downstream"], e["condition"]) for e in dag["edges"]}


def grpc_dag(allocations: list[dict[str, Any]], name: str = "diamond") -> v1.SubmitRequest:
    members = []
    for m in allocations:
        deps = [
            v1.Dependency(ref=d["ref"], condition=d["condition"]) for d in m.get("depends_on", [])
        ]
        spec = v1.AllocationSpec(
            entrypoint=m["entrypoint"],
            walltime=m.get("walltime", ""),
            nodes=m.get("nodes"),
            depends_on=deps,
            **WHERE,
        )
        members.append(v1.DagAllocation(id=m["id"], spec=spec))
    return v1.SubmitRequest(dag=v1.DagSpec(name=name, allocations=members))


def stored(api: Any) -> tuple[int, int]:
    return len(api.quorum.state.allocations), len(api.quorum.state.dags)


async def test_diamond_over_rest_submit_get_list_cancel(served: Any) -> None:
    api, _w, rest, _channel = served
    status, res = await rest.call("POST", "/api/v1/dags", ALICE, DIAMOND)
    assert status == 201, res
    dag_id = res["dag_id"]
    assert res["dag"]["id"] == dag_id and res["dag"]["name"] == "diamond"
    assert res["dag"]["state"] == "Running" and res["dag"]["user"] == "alice"
    assert states_of(res["dag"]) == EXPECTED_STATES
    assert edges_of(res["dag"]) == EXPECTED_EDGES
    assert len(res["allocation_ids"]) == 4
    assert [a["dag_ref"] for a in res["allocations"]] == ["prep", "left", "right", "join"]
    for a in res["allocations"]:
        stored_alloc = api.quorum.state.allocations[a["id"]]
        assert stored_alloc.dag_id == dag_id and stored_alloc.spec.user == "alice"
        assert stored_alloc.spec.name == a["dag_ref"]  # the member id when no name given
        assert stored_alloc.held == (a["dag_ref"] != "prep")

    status, got = await rest.call("GET", f"/api/v1/dags/{dag_id}", ALICE)
    assert status == 200 and got == res["dag"]
    status, got = await rest.call("GET", f"/api/v1/dags/{dag_id}", BOB)  # any reader
    assert status == 200 and states_of(got) == EXPECTED_STATES

    status, listed = await rest.call("GET", "/api/v1/dags", ALICE)
    assert [d["id"] for d in listed["dags"]] == [dag_id]
    status, listed = await rest.call("GET", "/api/v1/dags", ALICE, state="completed")
    assert status == 200 and listed["dags"] == []
    status, listed = await rest.call("GET", "/api/v1/dags", BOB)  # bob's own: none
    assert status == 200 and listed["dags"] == []
    status, err = await rest.call("GET", "/api/v1/dags", BOB, user="alice")  # not bob's
    assert status == 403 and "allocation.list_all" in err["error"]["message"], err
    status, listed = await rest.call("GET", "/api/v1/dags", ROOT, user="alice")
    assert [d["id"] for d in listed["dags"]] == [dag_id]
    status, err = await rest.call("GET", "/api/v1/dags", BOB, all="true")
    assert status == 403, err
    status, listed = await rest.call("GET", "/api/v1/dags", ROOT, all="true")
    assert [d["id"] for d in listed["dags"]] == [dag_id]
    status, err = await rest.call("GET", "/api/v1/dags", ALICE, state="bogus")
    assert status == 400 and "Running" in err["error"]["details"]["available"]

    status, err = await rest.call("DELETE", f"/api/v1/dags/{dag_id}", BOB)
    assert status == 403 and "belongs to alice" in err["error"]["message"]
    assert err["error"]["hint"]
    assert all(not api.quorum.state.allocations[i].terminal for i in res["allocation_ids"])

    status, out = await rest.call("DELETE", f"/api/v1/dags/{dag_id}", ALICE, reason="enough")
    assert status == 200, out
    assert sorted(out["cancelled_allocation_ids"]) == sorted(res["allocation_ids"])
    assert out["dag"]["state"] == "Cancelled" and out["dag"]["finished_at"]
    assert set(states_of(out["dag"]).values()) == {"Cancelled"}
    for i in res["allocation_ids"]:
        a = api.quorum.state.allocations[i]
        assert a.state == AllocationState.CANCELLED and a.reason == "enough"
    status, err = await rest.call("DELETE", f"/api/v1/dags/{dag_id}", ALICE)
    assert status == 409 and "already ended" in err["error"]["message"]
    status, err = await rest.call("GET", "/api/v1/dags/nope", ALICE)
    assert status == 404 and "lattice dag list" in err["error"]["hint"]


async def test_yaml_bodies_and_the_request_defaults(served: Any) -> None:
    api, _w, rest, _channel = served
    # the file itself, defaults in the query string
    async with rest.session.post(
        rest.url + "/api/v1/dags",
        data=DIAMOND_YAML,
        headers={**ALICE, "Content-Type": "application/yaml"},
        params=WHERE,
    ) as r:
        res = await r.json()
        assert r.status == 201, res
    assert res["dag"]["name"] == "diamond"
    assert states_of(res["dag"]) == EXPECTED_STATES and edges_of(res["dag"]) == EXPECTED_EDGES
    # {"yaml": TEXT} in JSON, defaults beside it; a member's own vcluster wins
    text = DIAMOND_YAML.replace(
        "    entrypoint: ./join.sh\n", "    entrypoint: ./join.sh\n    vcluster: nowhere\n"
    )
    status, err = await rest.call("POST", "/api/v1/dags", ALICE, {"yaml": text, **WHERE})
    assert status == 404 and err["error"]["message"].startswith("member 'join': unknown vCluster")
    status, res = await rest.call("POST", "/api/v1/dags", ALICE, {"yaml": DIAMOND_YAML, **WHERE})
    assert status == 201 and len(res["allocation_ids"]) == 4
    # broken YAML is the parser's error, with its place
    status, err = await rest.call("POST", "/api/v1/dags", ALICE, {"yaml": "name: [x\n"})
    assert status == 400 and "not valid YAML at line" in err["error"]["message"]
    # the same DAG with a request id is one DAG
    once = {**DIAMOND, "request_id": "r-1"}
    _, first = await rest.call("POST", "/api/v1/dags", ALICE, once)
    _, again = await rest.call("POST", "/api/v1/dags", ALICE, once)
    assert first["dag_id"] == again["dag_id"]
    assert len(api.quorum.state.dags) == 3


async def test_diamond_over_grpc(served: Any) -> None:
    _api, _w, _rest, channel = served
    alice, bob = Grpc(channel, ALICE), Grpc(channel, BOB)
    res = await alice.alloc.submit(grpc_dag(DIAMOND["allocations"]))
    assert res.dag_id and len(res.allocation_ids) == 4
    assert [a.dag_ref for a in res.allocations] == ["prep", "left", "right", "join"]
    got = await alice.alloc.get_dag(v1.GetDagRequest(id=res.dag_id))
    assert {m.ref: m.state for m in got.members} == EXPECTED_STATES
    assert {(e.upstream, e.downstream, e.condition) for e in got.edges} == EXPECTED_EDGES
    assert got.state == "Running" and got.finished_at is None
    listed = await alice.alloc.list_dags(v1.ListDagsRequest())
    assert [d.id for d in listed.dags] == [res.dag_id]
    assert (await bob.alloc.list_dags(v1.ListDagsRequest())).dags == []
    status, err = await grpc_error(bob.alloc.cancel_dag(v1.CancelDagRequest(id=res.dag_id)))
    assert status == "PERMISSION_DENIED" and "belongs to alice" in err["message"]
    out = await alice.alloc.cancel_dag(v1.CancelDagRequest(id=res.dag_id, reason="r"))
    assert out.dag.state == "Cancelled"
    assert sorted(out.cancelled_allocation_ids) == sorted(res.allocation_ids)
    status, _ = await grpc_error(alice.alloc.get_dag(v1.GetDagRequest(id="nope")))
    assert status == "NOT_FOUND"
    # an admin may cancel anyone's
    res = await alice.alloc.submit(grpc_dag(DIAMOND["allocations"]))
    out = await Grpc(channel, ROOT).alloc.cancel_dag(v1.CancelDagRequest(id=res.dag_id))
    assert out.dag.state == "Cancelled"


REFUSALS = [
    (
        "cycle",
        [member("a", ("c", "success")), member("b", ("a", "success")), member("c", ("b", "any"))],
        "dependency cycle: a -> b -> c -> a",
    ),
    (
        "unknown ref",
        [member("a"), member("b", ("ghost", "success"))],
        "member 'b' depends on unknown member 'ghost'",
    ),
    (
        "invalid member spec",
        [member("a"), member("b", ("a", "success"), nodes=0)],
        "member 'b': nodes must be at least 1",
    ),
    (
        "member the vCluster can never run",
        [member("a"), member("big", ("a", "success"), nodes=9)],
        "member 'big': allocation rejected: needs 9 nodes",
    ),
]


@pytest.mark.parametrize(("name", "allocs", "text"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_refusals_store_nothing_over_both_transports(
    served: Any, name: str, allocs: list[dict[str, Any]], text: str
) -> None:
    api, _w, rest, channel = served
    before = stored(api)
    status, err = await rest.call("POST", "/api/v1/dags", ALICE, {**WHERE, "allocations": allocs})
    assert 400 <= status < 500 and err["error"]["message"].startswith(text), err
    assert err["error"]["hint"]
    gstatus, gerr = await grpc_error(Grpc(channel, ALICE).alloc.submit(grpc_dag(allocs)))
    assert gerr == err["error"], name
    assert gstatus in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED")
    assert stored(api) == before


async def test_the_size_limit_comes_from_the_settings() -> None:
    settings = ApiSettings(max_dag_size=2)
    async with serve_local_api(
        hmac_secret=SECRET, agent_token=AGENT_TOKEN, settings=settings
    ) as api:
        World(api)
        async with aiohttp.ClientSession() as session:
            rest = Rest(session, api.rest_url)
            before = stored(api)
            body = {**WHERE, "allocations": [member("a"), member("b"), member("c")]}
            status, err = await rest.call("POST", "/api/v1/dags", ALICE, body)
            assert status == 400
            assert err["error"]["message"] == "DAG exceeds maximum size (3 allocations, limit: 2)"
            assert "increase the limit" in err["error"]["hint"]
            assert stored(api) == before
            status, _ = await rest.call(
                "POST", "/api/v1/dags", ALICE, {**body, "allocations": body["allocations"][:2]}
            )
            assert status == 201


async def test_task_group_members_pair_elements_with_aftercorr(served: Any) -> None:
    _, _w, rest, _channel = served
    body = {
        **WHERE,
        "allocations": [
            member("pre", task_group="0-3%2"),
            {**member("train", task_group="0-5"), "depends_on": [{"pre": "corresponding"}]},
        ],
    }
    status, res = await rest.call("POST", "/api/v1/dags", ALICE, body)
    assert status == 201, res
    states = {m["ref"]: m["state"] for m in res["dag"]["members"]}
    assert {f"pre[{i}]" for i in range(4)} <= set(states)
    # train[i] waits for pre[i]; train[4] and train[5] have no pre element: queued at once
    assert [states[f"train[{i}]"] for i in range(6)] == ["Blocked"] * 4 + ["Pending"] * 2
    pre = [a for a in res["allocations"] if a["dag_ref"].startswith("pre[")]
    assert {a["task_group_concurrency"] for a in pre} == {2}
    assert all(a["spec"]["env"]["LATTICE_TASK_INDEX"] == a["dag_ref"][4] for a in pre)
