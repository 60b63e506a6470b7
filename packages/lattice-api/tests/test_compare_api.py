"""CompareMetrics (``lattice compare``; gRPC AllocationService.CompareMetrics, REST
``GET /api/v1/compare``) against the real servers over a LocalQuorum reading a real
VictoriaMetrics, into which the tests push what node agents push (series named as the
catalog, labels alloc_id node_id tenant user vcluster agg, GPU series also gpu; prod
windows mean/p50/p95/p99/max/count stamped with the window's end).

Allocations that started hours or a day apart, with series of the same shape (their
windows even at different phases of the 30 s grid), come back aligned at t=0: equal
values at equal offsets. Another user's allocation in the list is NotFound exactly as
an unknown id; crafted ids never reach another allocation's series (also at the
operation level against the real TSDB); REST and gRPC give the same answer; not started,
sensitive mixes, bad parameters, no TSDB and the shared 10/min limit are refused."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any
from urllib.parse import quote

import grpclib
import jwt
import pytest
from lattice_api.auth import Identity, Role
from lattice_api.grpc.allocation_service import compare_response
from lattice_api.ops.compare import (
    CompareOps,
    aligned_points,
    compare_duration,
    compare_metrics,
    compare_step,
    parse_align,
    parse_ids,
    series_queries,
    summarize,
    versus,
)
from lattice_api.ops.metrics import MetricsOps
from lattice_api.tsdb import RangeSeries
from lattice_common.config import RateLimitConfig
from lattice_common.errors import FailedPrecondition, NotFound, PermissionDenied, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    SchedulerType,
    VCluster,
)
from lattice_test_harness import victoria
from lattice_test_harness.local_api import LocalApi
from served_api import (
    ROLE_CLAIMS,
    SECRET,
    TOKEN_LIFETIME_S,
    Grpc,
    Rest,
    bearer,
    serve_seeded,
)

pytestmark = pytest.mark.timeout(120)

ALICE = bearer("alice")
BOB = bearer("bob")
ROOT = bearer("root", Role.SYSTEM_ADMIN)
CRAFTED = 'x"} or vector(1) or {a="'
AGGS = {"mean": 1.0, "p50": 0.5, "p95": 3.0, "p99": 4.0, "max": 5.0}


def member(user: str, tenant: str, role: Role = Role.USER) -> dict[str, str]:
    claims = {
        "sub": user,
        "exp": int(time.time()) + TOKEN_LIFETIME_S,
        "tenant": tenant,
        **ROLE_CLAIMS[role],
    }
    return {"authorization": "Bearer " + jwt.encode(claims, SECRET, algorithm="HS256")}


# =====================================================================================
# pure parts
# =====================================================================================


def test_ids_align_metrics_duration_and_step() -> None:
    assert parse_ids(["a,b", " c ", "a", ""]) == ["a", "b", "c"]
    for bad in (["a"], ["a,a"], [], [f"x{i}" for i in range(17)]):
        with pytest.raises(ValidationError):
            parse_ids(bad)
    assert parse_align(None) == parse_align("") == parse_align("Relative") == "relative"
    with pytest.raises(ValidationError):
        parse_align("absolute")
    assert compare_metrics([]) == ["gpu_utilization", "cpu_utilization", "memory_used"]
    assert compare_metrics(["memory_used,gpu_utilization"]) == ["gpu_utilization", "memory_used"]
    with pytest.raises(ValidationError):
        compare_metrics(['gpu"} or vector(1)'])
    assert compare_duration(None) is None and compare_duration(0) is None
    assert compare_duration("1h") == 3600
    with pytest.raises(ValidationError):
        compare_duration("40d")
    assert compare_step(None, 3600, 30) == 30
    assert compare_step(None, 86400, 30) == 360  # about 240 points, whole windows
    assert compare_step("1m", 3600, 30) == 60
    for bad in ("10s", "soon", "-1m"):
        with pytest.raises(ValidationError):
            compare_step(bad, 3600, 30)
    with pytest.raises(ValidationError) as e:
        compare_step("30s", 31 * 86400, 30)  # 89,280 points
    assert "points" in e.value.message


def test_points_are_shifted_to_the_start_and_summarised() -> None:
    start = 1_000_000.123
    s = RangeSeries({}, [(start + 30, 1.0), (start + 60.0004, 3.0), (start + 90, 5.0)])
    assert aligned_points(s, start, 30, 300) == [[30, 1.0], [60, 3.0], [90, 5.0]]
    assert aligned_points(s, start, 30, 60) == [[30, 1.0], [60, 3.0]]  # within the duration
    assert summarize([[30, 1.0], [60, 3.0], [90, 5.0]]) == {"mean": 3.0, "max": 5.0, "final": 5.0}
    assert summarize([]) == {"mean": None, "max": None, "final": None}
    assert versus(6.0, 3.0) == {"delta": 3.0, "ratio": 2.0}
    assert versus(1.0, 0.0) == {"delta": 1.0, "ratio": None}
    assert versus(None, 3.0) == versus(3.0, None) == {"delta": None, "ratio": None}


def test_queries_read_mean_windows_combined_as_the_summary() -> None:
    planned = {p.op: p.expr for p in series_queries(compare_metrics([]), "a1", 60)}
    assert planned == {
        "avg": 'avg by (__name__) (avg_over_time({__name__=~"gpu_utilization|cpu_utilization", '
        'alloc_id="a1", agg="mean"}[60s]) keep_metric_names)',
        "sum": 'sum by (__name__) (avg_over_time({__name__="memory_used", alloc_id="a1", '
        'agg="mean"}[60s]) keep_metric_names)',
    }
    p99 = series_queries(["io_latency_p99"], "a1", 30)[0]
    assert p99.expr.startswith("max by (__name__) (max_over_time(")
    crafted = series_queries(["cpu_utilization"], CRAFTED, 30)[0].expr
    assert 'alloc_id="x\\"} or vector(1) or {a=\\""' in crafted


# =====================================================================================
# the served API over a real VictoriaMetrics
# =====================================================================================


def _esc(value: str) -> str:
    """A label value in the Prometheus text exposition format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def agent_lines(
    ident: Mapping[str, str], node: str, values: Mapping[str, Any], at: float
) -> list[str]:
    """One prod window of one node (GPU metrics: a list, one series per GPU), every
    aggregation kind pushed (only ``mean`` may be read)."""
    lines = []
    for name, value in values.items():
        for index, v in enumerate(value if isinstance(value, list) else [value]):
            labels = {**ident, "node_id": node}
            if isinstance(value, list):
                labels["gpu"] = str(index)
            for agg, factor in AGGS.items():
                text = ",".join(f'{k}="{_esc(x)}"' for k, x in {**labels, "agg": agg}.items())
                lines.append(f"{name}{{{text}}} {v * factor} {int(at * 1000)}")
            text = ",".join(f'{k}="{_esc(x)}"' for k, x in {**labels, "agg": "count"}.items())
            lines.append(f"{name}{{{text}}} 30 {int(at * 1000)}")
    return lines


def ident_of(a: Allocation) -> dict[str, str]:
    return {
        "alloc_id": a.id,
        "tenant": a.spec.tenant,
        "user": a.spec.user,
        "vcluster": a.spec.vcluster,
    }


def shape(k: int, scale: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Window k (1-based) of the training-run shape, on its two nodes."""
    n1 = {
        "gpu_utilization": [scale * 5 * k, scale * (5 * k + 10)],
        "cpu_utilization": scale * (100 + k),
        "memory_used": scale * 1e9 * k,
    }
    n2 = {
        "gpu_utilization": [scale * (5 * k + 20), scale * (5 * k + 30)],
        "cpu_utilization": scale * (50 + k),
        "memory_used": scale * 2e9 * k,
    }
    return n1, n2


def expected(scale: float = 1.0, windows: int = 10) -> dict[str, list[list[float]]]:
    """What comparing the shape gives: GPU and CPU means across nodes (and GPUs), the
    memory summed, at offsets 30, 60, ... s."""
    ks = range(1, windows + 1)
    return {
        "gpu_utilization": [[30.0 * k, scale * (5 * k + 15)] for k in ks],
        "cpu_utilization": [[30.0 * k, scale * (75 + k)] for k in ks],
        "memory_used": [[30.0 * k, scale * 3e9 * k] for k in ks],
    }


def push_run(
    vm: victoria.VictoriaMetrics, a: Allocation, *, phase: float, scale: float = 1.0
) -> None:
    """12 windows from the allocation's start, each stamped ``phase`` s before a whole
    number of 30 s steps from the start (agents align windows to the wall clock, not to
    the start)."""
    assert a.started_at is not None
    lines = []
    for k in range(1, 13):
        n1, n2 = shape(k, scale)
        at = a.started_at + 30 * k - phase
        lines += agent_lines(ident_of(a), "n1", n1, at)
        lines += agent_lines(ident_of(a), "n2", n2, at)
    vm.push("\n".join(lines) + "\n")
    vm.flush()


@pytest.fixture(scope="module")
def vm() -> Any:
    if not victoria.available():
        pytest.skip("victoria-metrics is not installed (apt-get install victoria-metrics)")
    with victoria.VictoriaMetrics() as server:
        yield server


def spec(user: str, tenant: str, nodes: int = 2, vcluster: str = "batch") -> AllocationSpec:
    return AllocationSpec(
        entrypoint="python train.py",
        tenant=tenant,
        vcluster=vcluster,
        user=user,
        nodes=nodes,
        walltime_seconds=86400,
    )


class Runs:
    """alice's ``a`` (ran a day ago, 5 minutes, Completed), ``b`` (started 400 s ago,
    Running; windows at another phase) and ``c`` (two hours ago, every value doubled),
    bob's ``d`` (bio), alice's pending ``p``."""

    def __init__(self, api: LocalApi, vm: victoria.VictoriaMetrics) -> None:
        self.api = api
        api.add_tenant("physics")
        api.add_tenant("bio")
        api.add_vcluster("batch")
        for i in range(1, 9):
            api.add_node(f"h{i}", capabilities={"gpu_count": 2, "gpu_type": "GH200"})
        now = time.time()
        self.a = self._run("alice", "physics", ["h1", "h2"], now - 86400)
        api.set_state(self.a, AllocationState.COMPLETED, exit_code=0, now=now - 86400 + 300)
        self.b = self._run("alice", "physics", ["h3", "h4"], now - 400)
        self.c = self._run("alice", "physics", ["h5", "h6"], now - 7200)
        self.d = self._run("bob", "bio", ["h7", "h8"], now - 600)
        self.p = api.submit(spec("alice", "physics"), now=now).id
        push_run(vm, self.alloc(self.a), phase=3)
        push_run(vm, self.alloc(self.b), phase=17)
        push_run(vm, self.alloc(self.c), phase=0.5, scale=2.0)
        push_run(vm, self.alloc(self.d), phase=3, scale=7.0)

    def alloc(self, alloc_id: str) -> Allocation:
        return self.api.quorum.state.allocations[alloc_id]

    def _run(self, user: str, tenant: str, nodes: list[str], at: float) -> str:
        aid = self.api.submit(spec(user, tenant, len(nodes)), now=at - 60).id
        self.api.start(aid, nodes, now=at)
        return aid


Served = tuple[LocalApi, Runs, Rest, Any]


def _serve(vm: Any, **settings: Any) -> AsyncIterator[Served]:
    return serve_seeded(lambda api: Runs(api, vm), **settings)


@pytest.fixture
async def compare_api(vm: Any) -> AsyncIterator[Served]:
    async for served in _serve(vm, tsdb_endpoint=vm.url):
        yield served


async def get(rest: Rest, who: dict[str, str], ids: Iterable[str], **query: Any) -> tuple[int, Any]:
    return await rest.call("GET", "/api/v1/compare", who, ids=",".join(ids), **query)


def points(body: dict[str, Any]) -> dict[tuple[str, str], list[list[float]]]:
    return {
        (c["metric"], s["allocation_id"]): s["points"]
        for c in body["comparisons"]
        for s in c["series"]
    }


# --- alignment ----------------------------------------------------------------------


async def test_runs_a_day_apart_come_back_aligned_at_t0(compare_api: Served) -> None:
    _api, w, rest, _ = compare_api
    status, body = await get(rest, ALICE, [w.a, w.b], duration="5m", step="30s")
    assert status == 200, body
    assert body["align"] == "relative"
    assert (body["duration_seconds"], body["step_seconds"], body["resolution_seconds"]) == (
        300,
        30,
        30,
    )
    a, b = w.alloc(w.a), w.alloc(w.b)
    assert body["allocations"] == [
        {
            "allocation_id": w.a,
            "state": "Completed",
            "started_at": a.started_at,
            "finished_at": a.finished_at,
        },
        {"allocation_id": w.b, "state": "Running", "started_at": b.started_at, "finished_at": None},
    ]
    got = points(body)
    want = expected()
    for metric in ("gpu_utilization", "cpu_utilization", "memory_used"):
        # equal values at equal offsets, though the runs are a day apart and their
        # windows sit at other phases of the 30 s grid
        assert got[(metric, w.a)] == got[(metric, w.b)] == want[metric], metric
    gpu = body["comparisons"][0]
    assert (gpu["metric"], gpu["unit"], gpu["combine"]) == ("gpu_utilization", "percent", "avg")
    first, second = gpu["series"]
    assert (first["mean"], first["max"], first["final"]) == (42.5, 65.0, 65.0)
    assert (first["delta"], first["ratio"]) == (0.0, 1.0)
    assert (second["mean"], second["delta"], second["ratio"]) == (42.5, 0.0, 1.0)
    assert gpu["values"] == {w.a: 42.5, w.b: 42.5}
    memory = body["comparisons"][2]
    assert (memory["unit"], memory["combine"], memory["series"][0]["final"]) == (
        "bytes",
        "sum",
        30e9,
    )


async def test_difference_and_ratio_against_the_first(compare_api: Served) -> None:
    _api, w, rest, _ = compare_api
    status, body = await get(
        rest, ALICE, [w.c, w.a, w.b], metrics="cpu_utilization", duration="300", step="1m"
    )
    assert status == 200, body
    [cpu] = body["comparisons"]
    assert [s["allocation_id"] for s in cpu["series"]] == [w.c, w.a, w.b]
    # 1-minute steps: each point the mean of two windows (k = 2j-1, 2j)
    pairs = [[60.0 * j, 75 + 2 * j - 0.5] for j in range(1, 6)]
    assert cpu["series"][1]["points"] == pairs
    assert cpu["series"][0]["points"] == [[t, 2 * v] for t, v in pairs]
    base, other = cpu["series"][0]["mean"], cpu["series"][1]["mean"]
    assert base == 2 * other == 2 * 80.5
    assert cpu["series"][1]["delta"] == pytest.approx(-80.5)
    assert cpu["series"][1]["ratio"] == pytest.approx(0.5)
    assert cpu["series"][2]["ratio"] == pytest.approx(0.5)


async def test_default_duration_is_the_longest_run(compare_api: Served) -> None:
    _api, w, rest, _ = compare_api
    status, body = await get(rest, ALICE, [w.a, w.b], metric="memory_used")
    assert status == 200, body
    # b has run ~400 s, a ran 300 s (+ its last window): 400 s, every 30 s
    assert body["duration_seconds"] == pytest.approx(400, abs=10)
    assert body["step_seconds"] == 30
    got = points(body)
    # a's series stops at its end (its last windows were pushed up to 360 s)
    assert [t for t, _v in got[("memory_used", w.a)]][-1] == 360
    assert got[("memory_used", w.a)] == expected(windows=12)["memory_used"]


# --- who may compare what ------------------------------------------------------------


async def test_another_users_allocation_is_not_found_like_an_unknown_id(
    compare_api: Served,
) -> None:
    _api, w, rest, channel = compare_api
    status, theirs = await get(rest, ALICE, [w.a, w.d])
    status2, unknown = await get(rest, ALICE, [w.a, "ffffffff"])
    assert status == status2 == 404
    assert theirs["error"]["message"] == f"allocation {w.d} not found"
    assert {**theirs["error"], "message": ""} == {**unknown["error"], "message": ""}
    assert "comparisons" not in theirs
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.CompareMetricsRequest(allocation_ids=[w.d, w.a])
        await Grpc(channel, ALICE).alloc.compare_metrics(req)
    assert e.value.status == grpclib.Status.NOT_FOUND
    # bob sees his own, not alice's; the owner of both lists or an admin sees all
    assert (await get(rest, BOB, [w.d, w.a]))[0] == 404
    status, body = await get(rest, ROOT, [w.a, w.d], duration="5m")
    assert status == 200, body
    got = points(body)
    assert got[("cpu_utilization", w.d)] == [[t, 7 * v] for t, v in expected()["cpu_utilization"]]


async def test_tenant_admins_compare_their_tenant_only(compare_api: Served) -> None:
    _api, w, rest, _ = compare_api
    physics = member("tina", "physics", Role.TENANT_ADMIN)
    status, body = await get(rest, physics, [w.a, w.b], duration="5m")
    assert status == 200 and points(body)[("cpu_utilization", w.b)] == expected()["cpu_utilization"]
    assert (await get(rest, physics, [w.a, w.d]))[0] == 404
    assert (await get(rest, member("ben", "bio", Role.TENANT_ADMIN), [w.a, w.d]))[0] == 404


async def test_crafted_ids_are_refused_and_never_reach_data(compare_api: Served) -> None:
    _api, w, rest, channel = compare_api
    crafts = (CRAFTED, w.a + '"} or {alloc_id="' + w.d, f"{w.a}|{w.d}", ".*", w.d + "\x00")
    for crafted in crafts:
        for who in (ALICE, ROOT):
            status, body = await rest.call(
                "GET", f"/api/v1/compare?ids={quote(w.a)}&ids={quote(crafted)}", who
            )
            assert status in (400, 404), body
            assert "comparisons" not in body
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.CompareMetricsRequest(allocation_ids=[w.a, CRAFTED])
        await Grpc(channel, ROOT).alloc.compare_metrics(req)
    assert e.value.status == grpclib.Status.NOT_FOUND


class _Allocations:
    """A quorum stand-in holding the given allocations, whatever their ids, and the
    vClusters: what ``visible_allocation`` and the sensitive check read."""

    def __init__(self, allocs: Iterable[Allocation], vclusters: Iterable[VCluster] = ()) -> None:
        self.allocs = {a.id: a for a in allocs}
        self.vclusters = list(vclusters)

    def require_caught_up(self) -> None:
        pass

    def read(self, query: Any, *args: Any) -> Any:
        if getattr(query, "__name__", "") == "vclusters":
            return self.vclusters
        return self.allocs.get(args[0])


def running(alloc_id: str, user: str, started: float, vcluster: str = "batch") -> Allocation:
    return Allocation(
        id=alloc_id,
        spec=spec(user, "t", vcluster=vcluster),
        state=AllocationState.RUNNING,
        submitted_at=started - 10,
        started_at=started,
    )


async def test_any_id_reads_only_its_own_series(vm: Any) -> None:
    """Allocations whose ids are crafted (ids are the server's, so this cannot happen
    through the API: it is the escaping and the TSDB's extra_label scope that are tested)
    get nothing while only others' series exist, then exactly their own."""
    now = time.time()
    victim = running("victim-" + uuid.uuid4().hex[:6], "u", now - 400)
    push_run(vm, victim, phase=1)
    tag = uuid.uuid4().hex[:6]
    crafted = [
        running(tag + 'x"} or {alloc_id="' + victim.id, "mallory", now - 400),
        running(tag + victim.id + "|.*", "mallory", now - 400),
        running(tag + "\\", "mallory", now - 400),
    ]
    ops = CompareOps(MetricsOps(_Allocations([victim, *crafted]), tsdb_endpoint=vm.url))
    root = Identity("root", Role.SYSTEM_ADMIN)
    ids = [a.id for a in crafted]
    body = await ops.compare(root, ids, duration=300, step=30)
    assert all(s["points"] == [] for c in body["comparisons"] for s in c["series"])
    assert all(s["mean"] is None for c in body["comparisons"] for s in c["series"])
    for a in crafted[:2]:
        push_run(vm, a, phase=1, scale=3.0)
    body = await ops.compare(root, ids, duration=300, step=30)
    got = points(body)
    scaled = [[t, 3 * v] for t, v in expected()["cpu_utilization"]]
    assert got[("cpu_utilization", ids[0])] == got[("cpu_utilization", ids[1])] == scaled
    assert got[("cpu_utilization", ids[2])] == []
    # the victim is untouched and still reads its own
    mine = await ops.compare(root, [victim.id, ids[0]], duration=300, step=30)
    assert points(mine)[("cpu_utilization", victim.id)] == expected()["cpu_utilization"]


async def test_sensitive_allocations_compare_only_among_their_claimants_own(vm: Any) -> None:
    now = time.time()
    sensitive = VCluster(name="secure", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    s1 = running("s1", "sam", now - 100, "secure")
    s2 = running("s2", "sam", now - 100, "secure")
    s3 = running("s3", "sue", now - 100, "secure")
    plain = running("p1", "sam", now - 100)
    ops = CompareOps(
        MetricsOps(_Allocations([s1, s2, s3, plain], [sensitive]), tsdb_endpoint=vm.url)
    )
    root = Identity("root", Role.SYSTEM_ADMIN)
    assert (await ops.compare(root, ["s1", "s2"], duration=60))["allocations"]
    for mix in (["s1", "p1"], ["p1", "s1"], ["s1", "s3"]):
        with pytest.raises(PermissionDenied) as e:
            await ops.compare(root, mix, duration=60)
        assert "sensitive" in e.value.message
    with pytest.raises(NotFound):  # visibility first: sam cannot see sue's
        await ops.compare(Identity("sam", Role.USER), ["s1", "s3"], duration=60)


# --- refusals --------------------------------------------------------------------------


async def test_allocations_that_have_not_started_are_named(compare_api: Served) -> None:
    api, w, rest, channel = compare_api
    status, body = await get(rest, ALICE, [w.a, w.p])
    assert status == 412, body
    err = body["error"]
    assert err["code"] == "failed_precondition"
    assert (
        err["message"] == f"allocation {w.p} has not started (Pending): it has no t=0 to align to"
    )
    assert "lattice status" in err["hint"]
    p2 = api.submit(spec("alice", "physics"), now=time.time()).id
    status, body = await get(rest, ALICE, [w.p, w.a, p2])
    assert status == 412
    assert body["error"]["message"].startswith(
        f"2 allocations have not started: {w.p} (Pending), {p2} (Pending)"
    )
    assert body["error"]["details"] == {"not_started": f"{w.p}, {p2}"}
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.CompareMetricsRequest(allocation_ids=[w.a, w.p])
        await Grpc(channel, ALICE).alloc.compare_metrics(req)
    assert e.value.status == grpclib.Status.FAILED_PRECONDITION
    assert FailedPrecondition.code in (e.value.message or "")


async def test_bad_parameters_are_validation_errors(compare_api: Served) -> None:
    _api, w, rest, _ = compare_api
    for ids, query in (
        ([w.a], {}),
        ([w.a, w.b], {"step": "10s"}),
        ([w.a, w.b], {"duration": "soon"}),
        ([w.a, w.b], {"metrics": "gpu_temperature"}),
        ([w.a, w.b], {"align": "absolute"}),
        ([w.a, w.b], {"duration": "31d", "step": "30s"}),
    ):
        status, body = await get(rest, ALICE, ids, **query)
        assert status == 400, (query, body)
        assert body["error"]["hint"]


async def test_no_tsdb_configured(vm: Any) -> None:
    async for _api, w, rest, channel in _serve(vm):
        assert (await get(rest, BOB, [w.a, w.d]))[0] == 404  # visibility first
        status, body = await get(rest, ALICE, [w.a, w.b])
        assert status == 503
        assert body["error"]["message"] == "metrics are not available: no TSDB configured"
        with pytest.raises(grpclib.GRPCError) as e:
            req = v1.CompareMetricsRequest(allocation_ids=[w.a, w.b])
            await Grpc(channel, ALICE).alloc.compare_metrics(req)
        assert e.value.status == grpclib.Status.UNAVAILABLE


# --- REST and gRPC ----------------------------------------------------------------------


def from_grpc(m: v1.CompareMetricsResponse) -> dict[str, Any]:
    return {
        "align": m.align,
        "duration_seconds": m.duration_seconds,
        "step_seconds": m.step_seconds,
        "resolution_seconds": m.resolution_seconds,
        "allocations": [
            {
                "allocation_id": a.allocation_id,
                "state": a.state,
                "started_at": a.started_at,
                "finished_at": a.finished_at or None,
            }
            for a in m.allocations
        ],
        "comparisons": [
            {
                "metric": c.metric,
                "unit": c.unit,
                "combine": c.combine,
                "values": dict(c.values),
                "series": [
                    {
                        "allocation_id": s.allocation_id,
                        "points": [[p.t_offset_seconds, p.value] for p in s.points],
                        "mean": s.mean,
                        "max": s.max,
                        "final": s.final,
                        "delta": s.delta,
                        "ratio": s.ratio,
                    }
                    for s in c.series
                ],
            }
            for c in m.comparisons
        ],
    }


async def test_rest_and_grpc_agree(compare_api: Served) -> None:
    _api, w, rest, channel = compare_api
    cases: list[tuple[dict[str, str], list[str], dict[str, Any]]] = [
        (ALICE, [w.a, w.b], {"duration": 300.0, "step": 30.0}),
        (ALICE, [w.c, w.a, w.b], {"duration": 300.0, "step": 60.0, "metrics": "cpu_utilization"}),
        (ROOT, [w.a, w.d], {"duration": 600.0, "metrics": "memory_used,gpu_utilization"}),
    ]
    for who, ids, query in cases:
        status, body = await get(rest, who, ids, **query)
        assert status == 200, body
        req = v1.CompareMetricsRequest(
            allocation_ids=ids,
            metrics=[query["metrics"]] if "metrics" in query else [],
            duration_seconds=query["duration"],
            step_seconds=query.get("step", 0.0),
        )
        got = await Grpc(channel, who).alloc.compare_metrics(req)
        assert from_grpc(got) == body, query
    # the same refusal
    status, body = await get(rest, ALICE, [w.a, w.d])
    with pytest.raises(grpclib.GRPCError) as e:
        req = v1.CompareMetricsRequest(allocation_ids=[w.a, w.d])
        await Grpc(channel, ALICE).alloc.compare_metrics(req)
    assert status == 404 and json.loads(e.value.message or "{}") == body["error"]


def test_the_message_leaves_missing_statistics_unset() -> None:
    answer = {
        "align": "relative",
        "duration_seconds": 60.0,
        "step_seconds": 30.0,
        "resolution_seconds": 30.0,
        "allocations": [
            {"allocation_id": "a", "state": "Running", "started_at": 5.0, "finished_at": None}
        ],
        "comparisons": [
            {
                "metric": "cpu_utilization",
                "unit": "percent",
                "combine": "avg",
                "values": {},
                "series": [
                    {
                        "allocation_id": "a",
                        "points": [],
                        "mean": None,
                        "max": None,
                        "final": None,
                        "delta": None,
                        "ratio": None,
                    }
                ],
            }
        ],
    }
    msg = compare_response(answer)
    assert from_grpc(v1.CompareMetricsResponse.parse(bytes(msg))) == answer


async def test_rest_and_grpc_share_the_compare_limit(vm: Any) -> None:
    limits = RateLimitConfig(compare_per_minute=2)
    async for _api, w, rest, channel in _serve(vm, tsdb_endpoint=vm.url, rate_limit=limits):
        assert (await get(rest, ALICE, [w.a, w.b], duration="5m"))[0] == 200
        req = v1.CompareMetricsRequest(allocation_ids=[w.a, w.b], duration_seconds=300)
        await Grpc(channel, ALICE).alloc.compare_metrics(req)
        status, body = await get(rest, ALICE, [w.a, w.b])
        assert status == 429
        assert body["error"]["message"].startswith(
            "rate limit exceeded: Compare allows 2 requests per minute per user"
        )
        with pytest.raises(grpclib.GRPCError) as e:
            await Grpc(channel, ALICE).alloc.compare_metrics(req)
        assert e.value.status == grpclib.Status.RESOURCE_EXHAUSTED
        # per user, and QueryMetrics has its own bucket
        assert (await get(rest, BOB, [w.d, w.d + ",x"]))[0] == 404
        status, _ = await rest.call("GET", f"/api/v1/allocations/{w.a}/metrics", ALICE)
        assert status == 200
