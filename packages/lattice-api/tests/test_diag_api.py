"""GetDiagnostics (``lattice diag``): the pure report (lattice_api.diagnostics: health
marks, thresholds, facts, sections; property-tested), then the real REST and gRPC
servers over a LocalQuorum asking real agent services on loopback (NodeAgentService with
its Diagnoser probing real directories and a running telemetry loop fed by a fixed
source): the combined view, the sections, a node whose agent is gone, REST and gRPC
agreeing, the refusals (unknown id, another user's, a pending or ended allocation, the
shared 30/min limit with Retry-After), sensitive allocations, and the TSDB's facts when a
real VictoriaMetrics holds them."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpclib
import pytest
from grpclib.server import Server
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent.diagnostics import Diagnoser
from lattice_agent.scratch import Scratch
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import TelemetryLoop
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_api.diagnostics import (
    CRITICAL,
    FREE_CRITICAL,
    FREE_WARNING,
    MARKS,
    OK,
    PROBE_CRITICAL,
    PROBE_WARNING,
    UNKNOWN,
    WARNING,
    build_report,
    facts_from_latest,
    facts_from_series,
    mount_check,
    parse_scope,
    split_key,
    worst,
)
from lattice_api.ops.diag import diagnostics_record
from lattice_api.tsdb import Series
from lattice_common.config import RateLimitConfig
from lattice_common.errors import Unavailable, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationSpec, AllocationState, Node
from lattice_test_harness import victoria
from served_api import World, bearer, grpc_error, serve_seeded

pytestmark = pytest.mark.timeout(120)

ALICE = bearer("alice")
BOB = bearer("bob")
DIAG = "/api/v1/allocations/{}/diagnostics"
STATUSES = (*MARKS, UNKNOWN)

# =====================================================================================
# the pure report


def _alloc(nodes: Sequence[str], topology: str = "") -> Allocation:
    spec = AllocationSpec(entrypoint="x", tenant="t", vcluster="v", user="bob")
    spec.constraints.topology = topology
    return Allocation(id="a1", spec=spec, state=AllocationState.RUNNING, assigned_nodes=list(nodes))


def _mount(total: float, free: float, probe: float = 0.001, **kw: Any) -> dict[str, Any]:
    return {
        "role": "scratch",
        "path": "/scratch/a1",
        "mount_point": "/scratch",
        "fs_type": "ext4",
        "total_bytes": total,
        "free_bytes": free,
        "total_inodes": 0,
        "free_inodes": 0,
        "probe_seconds": probe,
        "timed_out": False,
        "error": "",
        "read_only": False,
        **kw,
    }


@given(st.lists(st.sampled_from(STATUSES), max_size=8))
def test_worst_is_the_worst_judged_mark(statuses: list[str]) -> None:
    got = worst(statuses)
    judged = [s for s in statuses if s != UNKNOWN]
    if not judged:
        assert got == UNKNOWN
    else:
        assert got in judged and all(MARKS.index(got) >= MARKS.index(s) for s in judged)


@given(
    total=st.floats(1e6, 1e15),
    frac=st.floats(0.0, 1.0),
    probe=st.floats(0.0, 5.0),
)
def test_mount_marks_follow_the_thresholds(total: float, frac: float, probe: float) -> None:
    c = mount_check("n1", _mount(total, total * frac, probe))
    space = CRITICAL if frac < FREE_CRITICAL else WARNING if frac < FREE_WARNING else OK
    speed = CRITICAL if probe >= PROBE_CRITICAL else WARNING if probe >= PROBE_WARNING else OK
    assert c["status"] == worst([space, speed])
    assert c["section"] == "storage" and c["node_id"] == "n1"
    assert c["message"].startswith("/scratch/a1 (ext4 on /scratch): ")
    assert c["values"]["free_bytes"] == pytest.approx(total * frac)


def test_mount_failures_are_marked_and_said() -> None:
    hung = mount_check("n1", _mount(0, 0, 5.0, timed_out=True, error="did not finish within 5 s"))
    assert hung["status"] == CRITICAL and "hung mount" in hung["message"]
    ro = mount_check("n1", _mount(1e9, 5e8, error="Read-only file system", read_only=True))
    assert ro["status"] == WARNING and "read-only" in ro["message"]
    full = mount_check("n1", _mount(1e9, 0, error="No space left on device"))
    assert full["status"] == CRITICAL and "No space left" in full["message"]


@given(
    st.dictionaries(
        st.sampled_from(
            ["io_read_bytes", "network_tx_bytes", "gpu_utilization", "cpu_utilization"]
        ),
        st.floats(0, 1e12),
        max_size=4,
    ),
    st.integers(0, 7),
)
def test_latest_keys_split_into_metric_and_gpu(values: dict[str, float], gpu: int) -> None:
    keyed = {(f"{k}{{gpu={gpu}}}" if k.startswith("gpu_") else k): v for k, v in values.items()}
    facts = facts_from_latest("n1", keyed)
    for key, v in keyed.items():
        name, g = split_key(key)
        if name == "cpu_utilization":  # not read by diagnostics
            assert name not in facts.get("n1", {})
            continue
        assert facts["n1"][name][g] == v
        assert g == (str(gpu) if name.startswith("gpu_") else "")


def test_tsdb_means_win_over_raw_values() -> None:
    series = [
        Series({"__name__": "network_tx_bytes", "node_id": "n1", "agg": "raw"}, 5.0, 0),
        Series({"__name__": "network_tx_bytes", "node_id": "n1", "agg": "mean"}, 3.0, 0),
        Series({"__name__": "network_rx_bytes", "node_id": "n2", "agg": "raw"}, 7.0, 0),
        Series({"__name__": "cpu_utilization", "node_id": "n2", "agg": "mean"}, 7.0, 0),
    ]
    assert facts_from_series(series) == {
        "n1": {"network_tx_bytes": {"": 3.0}},
        "n2": {"network_rx_bytes": {"": 7.0}},
    }


node_ids = st.lists(st.sampled_from(["n1", "n2", "n3", "n4"]), min_size=1, max_size=4, unique=True)


@settings(max_examples=60)
@given(
    ids=node_ids,
    groups=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    down=st.sets(st.sampled_from(["n1", "n2", "n3", "n4"])),
    scope=st.sampled_from(["all", "network", "storage"]),
    tight=st.booleans(),
    tx=st.floats(0, 1e11),
)
def test_report_marks_every_line_and_keeps_to_its_sections(
    ids: list[str], groups: list[int], down: set[str], scope: str, tight: bool, tx: float
) -> None:
    nodes = [Node(id=n, group=groups[i]) for i, n in enumerate(ids)]
    answers: dict[str, Any] = {}
    for n in ids:
        if n in down:
            answers[n] = Unavailable(f"node {n}: its agent could not be reached")
        else:
            answers[n] = {"mounts": [_mount(1e9, 5e8)], "latest": {"network_tx_bytes": tx}}
    rep = build_report(_alloc(ids, "tight" if tight else ""), nodes, answers, {}, scope=scope)
    assert all(c["status"] in STATUSES for c in rep["checks"])
    assert {c["section"] for c in rep["checks"]} <= set(rep["sections"])
    assert rep["status"] == worst(c["status"] for c in rep["checks"])
    assert [n["node_id"] for n in rep["nodes"]] == ids
    assert {n["node_id"] for n in rep["nodes"] if not n["ok"]} == down & set(ids)
    lost = {c["node_id"] for c in rep["checks"] if c["name"] == "agent"}
    assert lost == down & set(ids)
    assert all(c["status"] == CRITICAL for c in rep["checks"] if c["name"] == "agent")
    if down & set(ids):
        assert rep["status"] == CRITICAL
    if scope != "storage":
        (span,) = [c for c in rep["checks"] if c["name"] == "group_span"]
        distinct = len({groups[i] for i in range(len(ids))})
        assert span["values"]["groups"] == distinct
        assert span["status"] == (WARNING if tight and distinct > 1 else OK)


def test_no_data_is_said_not_invented() -> None:
    nodes = [Node(id="n1"), Node(id="n2")]
    answers = {"n1": {"mounts": []}, "n2": {"mounts": []}}
    rep = build_report(_alloc(["n1", "n2"]), nodes, answers, {})
    by = {c["name"]: c for c in rep["checks"] if not c["node_id"]}
    for name in ("congestion", "inter_node_bandwidth", "gpus"):
        assert by[name]["status"] == UNKNOWN and "no" in by[name]["message"]
        assert by[name]["values"].keys() <= {"gpus"}
    io = [c for c in rep["checks"] if c["name"] == "io"]
    assert all(c["status"] == UNKNOWN and "no data" in c["message"] for c in io)


def test_sections_parse() -> None:
    assert parse_scope(None) == parse_scope("") == parse_scope("ALL") == "all"
    assert parse_scope(" network ") == "network"
    with pytest.raises(ValidationError) as e:
        parse_scope("fabric")
    assert "section=network" in e.value.hint


# =====================================================================================
# the served API and real agents


class Source:
    name = "fixed"

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        return {t.alloc_id: dict(self.values) for t in targets}

    def forget(self, alloc_id: str) -> None:
        pass


class Agent:
    """A real NodeAgentService on loopback: the Diagnoser probing this allocation's real
    work and scratch directories under ``tmp``, a telemetry loop with fixed values."""

    def __init__(self, node: str, alloc: Allocation, values: dict[str, float], tmp: Path) -> None:
        self.node = node
        self.loop = TelemetryLoop(
            lambda: [Target(AllocLabels(alloc.id, node, "physics", "bob"))],
            [Source(values)],
            window_seconds=1.0,
            interval=0.2,
        )
        root = tmp / node
        self.workdir = root / "work" / alloc.id
        self.workdir.mkdir(parents=True)
        scratch = Scratch(root / "scratch")
        self.scratch = scratch.path(alloc.id)
        self.scratch.mkdir(parents=True)
        assigned = {alloc.id: alloc}
        self.service = NodeAgentService(
            node,
            None,  # type: ignore[arg-type]
            root,
            telemetry=self.loop,
            allocation=assigned.get,
            diagnostics=Diagnoser(
                node,
                allocation=assigned.get,
                work_dir=root / "work",
                scratch=scratch,
                telemetry=self.loop,
            ),
        )
        self.server: Server | None = None
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = Server([self.service])
        await self.server.start("127.0.0.1", 0)
        self.port = self.server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.task = asyncio.create_task(self.loop.run())

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None


N2 = {
    "io_read_bytes": 5e6,
    "io_write_bytes": 2e6,
    "network_tx_bytes": 1.5e9,
    "network_rx_bytes": 1e9,
}
N3 = {
    **N2,
    "network_tx_bytes": 0.5e9,
    "gpu_utilization{gpu=0}": 90.0,
    "gpu_utilization{gpu=1}": 80.0,
    "gpu_memory_used{gpu=0}": 10e9,
    "gpu_memory_total{gpu=0}": 80e9,
}


async def _running_pair(api: Any, world: World, tmp: Path) -> tuple[str, list[Agent]]:
    """Bob's allocation running on n2 and n3 (groups 0 and 5), each with a real agent."""
    spec = world.spec("bob")
    spec.nodes = 2
    alloc = api.submit(spec)
    alloc = api.start(alloc.id, ["n2", "n3"])
    agents = [Agent("n2", alloc, N2, tmp), Agent("n3", alloc, N3, tmp)]
    for a, group in zip(agents, (0, 5), strict=True):
        await a.start()
        api.add_node(a.node, agent_address=f"127.0.0.1:{a.port}", group=group)
    return alloc.id, agents


async def _when_measured(rest: Any, alloc_id: str, who: dict[str, str], **q: Any) -> dict[str, Any]:
    """The answer once both agents have made a collection (their loops just started)."""
    deadline = time.monotonic() + 20
    while True:
        status, body = await rest.call("GET", DIAG.format(alloc_id), who, **q)
        assert status == 200, body
        io = [c for c in body["checks"] if c["name"] == "io"]
        bw = [c for c in body["checks"] if c["name"] == "inter_node_bandwidth"]
        ready_io = len(io) == 2 and all(c["values"] for c in io)
        ready_bw = all(c["status"] != UNKNOWN for c in bw)
        if ((ready_io or not io) and ready_bw) or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.2)


@pytest.fixture
async def diag_api(tmp_path: Path):  # type: ignore[no-untyped-def]
    async for api, world, rest, channel in serve_seeded(World):
        alloc_id, agents = await _running_pair(api, world, tmp_path)
        try:
            yield api, world, rest, channel, alloc_id, agents
        finally:
            for a in agents:
                await a.close()


async def test_combined_view_from_the_agents(diag_api) -> None:  # type: ignore[no-untyped-def]
    _api, _world, rest, _channel, alloc_id, agents = diag_api
    body = await _when_measured(rest, alloc_id, BOB)
    assert body["allocation_id"] == alloc_id and body["state"] == "Running"
    assert body["sections"] == ["network", "storage", "gpu"] and body["scope"] == "all"
    assert body["tsdb"] == "not configured"
    assert [(n["node_id"], n["group"], n["ok"]) for n in body["nodes"]] == [
        ("n2", 0, True),
        ("n3", 5, True),
    ]
    by = {(c["name"], c["node_id"], c["details"].get("role", "")): c for c in body["checks"]}
    span = by[("group_span", "", "")]
    assert span["message"] == "2 groups (g0, g5)" and span["status"] == OK
    bw = by[("inter_node_bandwidth", "", "")]
    assert bw["values"]["tx_bytes_per_second"] == pytest.approx(1e9)
    assert bw["values"]["rx_bytes_per_second"] == pytest.approx(1e9)
    assert bw["details"]["source"] == "agent" and bw["status"] == OK
    assert by[("congestion", "", "")]["status"] == UNKNOWN
    for a in agents:
        work = by[("mount", a.node, "working directory")]
        assert work["status"] == OK and work["details"]["path"] == str(a.workdir)
        assert work["message"].startswith(f"{a.workdir} (")
        assert work["values"]["total_bytes"] > 0 and work["values"]["probe_seconds"] > 0
        scratch = by[("mount", a.node, "scratch")]
        assert scratch["status"] == OK and scratch["details"]["path"] == str(a.scratch)
        io = by[("io", a.node, "")]
        assert io["values"]["read_bytes_per_second"] == 5e6
        assert io["values"]["write_bytes_per_second"] == 2e6
        assert io["status"] == UNKNOWN and "eBPF" in io["message"]  # no latency measured here
        # the probe leaves nothing behind
        assert list(a.workdir.iterdir()) == [] and list(a.scratch.iterdir()) == []
    sm = by[("sm_occupancy", "", "")]
    assert sm["values"] == {"utilization_percent": 85.0, "gpus": 2.0} and sm["status"] == OK
    mem = by[("gpu_memory", "", "")]
    assert mem["values"]["used_percent"] == pytest.approx(12.5)
    assert by[("ecc_errors", "", "")]["status"] == UNKNOWN
    assert body["status"] == OK and body["summary"].startswith("all ok")


async def test_sections_and_the_spec_routes(diag_api) -> None:  # type: ignore[no-untyped-def]
    _api, _world, rest, _channel, alloc_id, _agents = diag_api
    body = await _when_measured(rest, alloc_id, BOB, section="network")
    assert body["sections"] == ["network"]
    assert {c["section"] for c in body["checks"]} == {"network"}
    status, storage = await rest.call("GET", DIAG.format(alloc_id) + "/storage", BOB)
    assert status == 200 and storage["scope"] == "storage"
    assert {c["section"] for c in storage["checks"]} == {"storage"}
    status, bad = await rest.call("GET", DIAG.format(alloc_id), BOB, section="fabric")
    assert status == 400 and "section=network" in bad["error"]["hint"]


async def test_a_node_whose_agent_is_gone_is_reported(diag_api) -> None:  # type: ignore[no-untyped-def]
    _api, _world, rest, _channel, alloc_id, agents = diag_api
    await agents[1].close()
    status, body = await rest.call("GET", DIAG.format(alloc_id), BOB)
    assert status == 200
    nodes = {n["node_id"]: n for n in body["nodes"]}
    assert nodes["n2"]["ok"] and not nodes["n3"]["ok"]
    assert "could not be reached" in nodes["n3"]["error"]
    (lost,) = [c for c in body["checks"] if c["name"] == "agent"]
    assert lost["node_id"] == "n3" and lost["status"] == CRITICAL
    assert any(c["name"] == "mount" and c["node_id"] == "n2" for c in body["checks"])
    assert body["status"] == CRITICAL and "1 critical" in body["summary"]


async def test_rest_and_grpc_agree(diag_api) -> None:  # type: ignore[no-untyped-def]
    from served_api import Grpc

    _api, _world, rest, channel, alloc_id, _agents = diag_api
    body = await _when_measured(rest, alloc_id, BOB)
    msg = await Grpc(channel, BOB).alloc.get_diagnostics(
        v1.GetDiagnosticsRequest(allocation_id=alloc_id)
    )
    got = diagnostics_record(msg)

    def stable(rec: dict[str, Any]) -> Any:
        return (
            {k: rec[k] for k in ("allocation_id", "state", "scope", "sections", "tsdb", "nodes")},
            [
                (
                    c["section"],
                    c["name"],
                    c["node_id"],
                    c["status"],
                    c["details"],
                    sorted(c["values"]),
                )
                for c in rec["checks"]
            ],
        )

    assert stable(got) == stable(body)
    net = await Grpc(channel, BOB).alloc.get_diagnostics(
        v1.GetDiagnosticsRequest(allocation_id=alloc_id, scope="network")
    )
    assert list(net.sections) == ["network"]


async def test_refusals(diag_api) -> None:  # type: ignore[no-untyped-def]
    from served_api import Grpc

    _api, world, rest, channel, alloc_id, _agents = diag_api
    status, unknown = await rest.call("GET", DIAG.format("nope"), BOB)
    assert status == 404 and unknown["error"]["code"] == "not_found"
    # another user's allocation is the NotFound of an unknown id
    status, other = await rest.call("GET", DIAG.format(alloc_id), ALICE)
    assert status == 404
    assert other["error"]["message"] == f"allocation {alloc_id} not found"
    assert other["error"]["hint"] == unknown["error"]["hint"]
    code, err = await grpc_error(
        Grpc(channel, ALICE).alloc.get_diagnostics(v1.GetDiagnosticsRequest(allocation_id=alloc_id))
    )
    assert code == "NOT_FOUND" and err["message"] == f"allocation {alloc_id} not found"
    # pending and ended: nothing to diagnose, and the hint says what to do
    for alloc in (world.alice_pending, world.alice_done):
        status, body = await rest.call("GET", DIAG.format(alloc), ALICE)
        assert status == 409, body
        assert "diagnostics need an allocation that holds nodes" in body["error"]["message"]
        assert "lattice status ID" in body["error"]["hint"]


async def test_rest_and_grpc_share_the_diagnostics_limit(tmp_path: Path) -> None:
    from served_api import Grpc

    limits = RateLimitConfig(diagnostics_per_minute=3)
    async for api, world, rest, channel in serve_seeded(World, rate_limit=limits):
        alloc_id, agents = await _running_pair(api, world, tmp_path)
        try:
            url = rest.url + DIAG.format(alloc_id)
            async with aiohttp.ClientSession() as s:
                for path in ("", "/storage"):
                    async with s.get(url + path, headers=BOB) as r:
                        assert r.status == 200
                await Grpc(channel, BOB).alloc.get_diagnostics(
                    v1.GetDiagnosticsRequest(allocation_id=alloc_id)
                )
                async with s.get(url + "/network", headers=BOB) as r:
                    assert r.status == 429
                    assert int(r.headers["Retry-After"]) >= 1
                    body = await r.json()
                assert body["error"]["message"].startswith(
                    "rate limit exceeded: Diagnostics allows 3 requests per minute per user"
                )
            with pytest.raises(grpclib.GRPCError) as e:
                await Grpc(channel, BOB).alloc.get_diagnostics(
                    v1.GetDiagnosticsRequest(allocation_id=alloc_id)
                )
            assert e.value.status == grpclib.Status.RESOURCE_EXHAUSTED
            # per user: alice still has hers (and gets the NotFound of bob's allocation)
            assert (await rest.call("GET", DIAG.format(alloc_id), ALICE))[0] == 404
        finally:
            for a in agents:
                await a.close()


# --- the TSDB's facts ------------------------------------------------------------------


@pytest.fixture
def vm() -> Any:
    if not victoria.available():
        pytest.skip("victoria-metrics is not installed (apt-get install victoria-metrics)")
    with victoria.VictoriaMetrics() as server:
        yield server


async def test_tsdb_facts_come_first(vm: Any, tmp_path: Path) -> None:
    async for api, world, rest, _channel in serve_seeded(World, tsdb_endpoint=vm.url):
        alloc_id, agents = await _running_pair(api, world, tmp_path)
        try:
            ms = int(time.time() * 1000) - 5000
            labels = f'alloc_id="{alloc_id}",tenant="physics",user="bob",vcluster="batch"'
            lines = []
            for node, tx, csig in (("n2", 4e9, 0.3), ("n3", 2e9, 0.1)):
                for name, value in (("network_tx_bytes", tx), ("csig_congestion", csig)):
                    lines.append(f'{name}{{{labels},node_id="{node}",agg="mean"}} {value} {ms}')
            # another allocation's series never count
            lines.append(f'csig_congestion{{alloc_id="other",node_id="n2",agg="mean"}} 0.9 {ms}')
            vm.push("\n".join(lines) + "\n")
            vm.flush()
            body = await _when_measured(rest, alloc_id, BOB, section="network")
            assert body["tsdb"] == "ok"
            by = {c["name"]: c for c in body["checks"]}
            cong = by["congestion"]
            assert cong["values"]["congestion"] == pytest.approx(0.2)
            assert cong["message"] == "MEDIUM (0.20 avg)" and cong["status"] == WARNING
            bw = by["inter_node_bandwidth"]
            assert bw["values"]["tx_bytes_per_second"] == pytest.approx(3e9)
            # rx only from the agents: both sources named
            assert bw["values"]["rx_bytes_per_second"] == pytest.approx(1e9)
            assert bw["details"]["source"] == "agent,tsdb"
        finally:
            for a in agents:
                await a.close()


def test_facts_are_finite() -> None:
    facts = facts_from_latest("n1", {"io_read_bytes": math.nan, "io_write_bytes": 1.0})
    assert facts == {"n1": {"io_write_bytes": {"": 1.0}}}


async def test_sensitive_allocations_are_audited_and_scoped(diag_api) -> None:  # type: ignore[no-untyped-def]
    from lattice_api.auth import Role
    from lattice_common.types import SchedulerType

    api, _world, rest, _channel, _alloc_id, _agents = diag_api
    api.add_vcluster("secure", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    spec = AllocationSpec(
        entrypoint="python analyse.py",
        tenant="physics",
        vcluster="secure",
        user="bob",
        walltime_seconds=3600,
    )
    api.add_node("s1")
    a = api.submit(spec)
    api.start(a.id, ["s1"])
    status, body = await rest.call("GET", DIAG.format(a.id), BOB, section="network")
    assert status == 200, body
    (cong,) = [c for c in body["checks"] if c["name"] == "congestion"]
    assert cong["status"] == UNKNOWN and "sensitive" in cong["message"]
    root = bearer("root", Role.SYSTEM_ADMIN)
    deadline = time.monotonic() + 10
    entries: list[Any] = []
    while not entries and time.monotonic() < deadline:
        status, res = await rest.call(
            "GET", "/api/v1/admin/audit", root, action="allocation.diagnostics"
        )
        assert status == 200, res
        entries = res["entries"]
        await asyncio.sleep(0.1)
    assert [(e["actor"], e["target"]) for e in entries] == [("bob", f"allocation:{a.id}")]
    assert entries[0]["details"]["section"] == "network"
    # a non-sensitive allocation's diagnostics are not audited
    await rest.call("GET", DIAG.format(_alloc_id), BOB)
    status, res = await rest.call(
        "GET", "/api/v1/admin/audit", root, action="allocation.diagnostics"
    )
    assert len(res["entries"]) == 1


@given(
    recent=st.one_of(st.none(), st.floats(0, 1e6)),
    hist=st.one_of(st.none(), st.floats(0, 1e6)),
)
def test_io_latency_mark_uses_the_recent_p99_first(
    recent: float | None, hist: float | None
) -> None:
    from lattice_api.diagnostics import IO_P99_CRITICAL, IO_P99_WARNING, storage_checks

    facts = {"n1": {"io_latency_p99": {"": recent}}} if recent is not None else {}
    diagnosis: dict[str, Any] = {"mounts": [_mount(1e9, 5e8)], "io_latency_p99_us": hist}
    (io,) = [c for c in storage_checks("n1", diagnosis, facts) if c["name"] == "io"]
    judged = recent if recent is not None else hist
    if judged is None:
        assert io["status"] == UNKNOWN and "latency_p99_us" not in io["values"]
    else:
        assert io["values"]["latency_p99_us"] == judged
        expected = (
            CRITICAL if judged >= IO_P99_CRITICAL else WARNING if judged >= IO_P99_WARNING else OK
        )
        assert io["status"] == expected
    if hist is not None:
        assert io["values"]["histogram_p99_us"] == hist
