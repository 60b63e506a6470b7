"""The NVML source without a GPU: who owns a GPU, how readings become per-GPU series, and
the path from the source through windows, raw samples, alerts and the watch stream.

The driver is an outside component that needs a GPU: here a small stand-in with
pynvml's call shapes feeds :class:`NvmlSource`; the same source against the real driver
is ``test_telemetry_nvml_gpu.py`` (skipped without a GPU)."""

from __future__ import annotations

import asyncio
import types

from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.telemetry import nvml as nv
from lattice_agent.telemetry.aggregate import Windows, raw_samples
from lattice_agent.telemetry.alerts import DEFAULT_RULES, derived, step
from lattice_agent.telemetry.loop import TelemetryLoop
from lattice_agent.telemetry.samples import AllocLabels, Reading, Target, series_key, split_key
from lattice_agent.telemetry.watch import snapshot

GIB = 1 << 30


def target(aid: str, gpus: frozenset[int] | None = None, pgid: int = 0) -> Target:
    return Target(AllocLabels(aid, "n1", "t", "u", "vc"), (pgid,) if pgid else (), None, gpus)


# --- keys --------------------------------------------------------------------------------


@given(st.sampled_from(nv.GPU_SERIES), st.integers(0, 63))
def test_series_key_round_trips(name: str, gpu: int) -> None:
    assert split_key(series_key(name, gpu)) == (name, (("gpu", str(gpu)),))
    assert split_key(name) == (name, ())


# --- ownership ---------------------------------------------------------------------------


def test_a_whole_node_allocation_owns_every_gpu() -> None:
    assert nv.gpu_owners([0, 1, 2, 3], {"a": None}, {}) == {0: "a", 1: "a", 2: "a", 3: "a"}


def test_allocations_own_the_gpus_they_were_given() -> None:
    claims = {"a": frozenset({0, 1}), "b": frozenset({2})}
    assert nv.gpu_owners([0, 1, 2, 3], claims, {}) == {0: "a", 1: "a", 2: "b"}


def test_a_contested_gpu_goes_to_the_allocation_holding_it_or_to_nobody() -> None:
    claims = {"a": None, "b": None}
    assert nv.gpu_owners([0, 1], claims, {0: frozenset({"b"})}) == {0: "b"}
    both = {0: frozenset({"a", "b"})}
    assert nv.gpu_owners([0], claims, both) == {}


@given(
    st.lists(st.integers(0, 7), unique=True, min_size=1),
    st.dictionaries(
        st.sampled_from("abcd"),
        st.none() | st.frozensets(st.integers(0, 7)),
        max_size=4,
    ),
    st.dictionaries(st.integers(0, 7), st.frozensets(st.sampled_from("abcd"))),
)
def test_ownership_never_gives_a_gpu_to_an_allocation_that_did_not_claim_it(
    gpus: list[int], claims: dict[str, frozenset[int] | None], holders: dict
) -> None:
    owners = nv.gpu_owners(gpus, claims, holders)
    for g, a in owners.items():
        assert g in gpus
        assert claims[a] is None or g in claims[a]
        claimants = [x for x, mine in claims.items() if mine is None or g in mine]
        assert len(claimants) == 1 or a in holders.get(g, frozenset())


# --- attribution ---------------------------------------------------------------------------


def test_readings_become_per_gpu_series_and_counters_become_rates() -> None:
    r0 = nv.GpuReading(0, values={"gpu_utilization": 90.0}, counters={"gpu_nvlink_tx_bytes": 1e9})
    r1 = nv.GpuReading(1, values={"gpu_utilization": 10.0}, counters={"gpu_nvlink_tx_bytes": 5e8})
    first, keep = nv.attribute([r0, r1], {0: "a"}, {}, now=100.0)
    assert first == {"a": {"gpu_utilization{gpu=0}": 90.0}}  # no rate before a second reading
    r0b = nv.GpuReading(0, values={"gpu_utilization": 80.0}, counters={"gpu_nvlink_tx_bytes": 3e9})
    second, _ = nv.attribute([r0b, r1], {0: "a", 1: "b"}, keep, now=102.0)
    assert second["a"] == {"gpu_utilization{gpu=0}": 80.0, "gpu_nvlink_tx_bytes{gpu=0}": 1e9}
    assert second["b"] == {"gpu_utilization{gpu=1}": 10.0, "gpu_nvlink_tx_bytes{gpu=1}": 0.0}


def test_a_counter_that_went_backwards_gives_no_rate() -> None:
    keep = {0: (1.0, {"gpu_nvlink_rx_bytes": 5e9})}
    r = nv.GpuReading(0, counters={"gpu_nvlink_rx_bytes": 1e3})
    values, _ = nv.attribute([r], {0: "a"}, keep, now=2.0)
    assert values == {"a": {}}


# --- the source over a stand-in driver -------------------------------------------------------


class _NotSupported(Exception):
    value = 3  # NVML_ERROR_NOT_SUPPORTED, as pynvml's NVMLError carries it


def fake_driver(gpus: list[dict]) -> types.SimpleNamespace:
    """pynvml's call shapes over ``gpus`` (dicts: util, mem, used, power_mw, procs)."""

    def dev(h: int) -> dict:
        return gpus[h]

    def unsupported(*_a: object) -> None:
        calls.append(_a)
        raise _NotSupported("not supported")

    calls: list[tuple] = []

    return types.SimpleNamespace(
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX=138,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX=139,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        NVML_PCIE_UTIL_TX_BYTES=0,
        NVML_PCIE_UTIL_RX_BYTES=1,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(
            gpu=dev(h)["util"], memory=dev(h)["util"] // 2
        ),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=dev(h)["used"], total=80 * GIB
        ),
        nvmlDeviceGetPowerUsage=lambda h: dev(h)["power_mw"],
        nvmlDeviceGetTotalEccErrors=lambda h, kind, _c: 0 if kind == 0 else 2,
        nvmlDeviceGetPcieThroughput=unsupported,
        nvmlDeviceGetTemperature=lambda h, _s: 40,
        nvmlDeviceGetFieldValues=unsupported,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=p, usedGpuMemory=GIB) for p in dev(h)["procs"]
        ],
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlShutdown=lambda: None,
        unsupported_calls=calls,
    )


def test_the_source_reports_what_the_device_supports_and_leaves_out_the_rest() -> None:
    drv = fake_driver([{"util": 95, "used": 70 * GIB, "power_mw": 650_000, "procs": [11]}])
    src = nv.NvmlSource(drv)
    got = src.collect([target("a")])["a"]
    assert got["gpu_utilization{gpu=0}"] == 95.0
    assert got["gpu_memory_used{gpu=0}"] == 70 * GIB
    assert got["gpu_memory_total{gpu=0}"] == 80 * GIB
    assert got["gpu_power_draw{gpu=0}"] == 650.0
    assert got["gpu_ecc_errors_uncorrected{gpu=0}"] == 2.0
    assert got["gpu_temperature{gpu=0}"] == 40.0
    assert not any(k.startswith(("gpu_pcie", "gpu_nvlink")) for k in got)  # unsupported: absent


def test_two_allocations_claiming_every_gpu_are_settled_by_their_processes() -> None:
    drv = fake_driver(
        [
            {"util": 90, "used": GIB, "power_mw": 1000, "procs": [101]},
            {"util": 5, "used": GIB, "power_mw": 1000, "procs": [202]},
        ]
    )
    members = {"a": {101, 102}, "b": {202}}
    src = nv.NvmlSource(drv, pids_of=lambda t: members[t.alloc_id])
    got = src.collect([target("a"), target("b")])
    assert set(got["a"]) >= {"gpu_utilization{gpu=0}"} and got["a"]["gpu_utilization{gpu=0}"] == 90
    assert got["b"]["gpu_utilization{gpu=1}"] == 5
    assert not any(k.endswith("{gpu=1}") for k in got["a"])


# --- what the series become downstream ----------------------------------------------------------


def test_per_gpu_values_reach_the_tsdb_with_a_gpu_label() -> None:
    labels = AllocLabels("a", "n1", "t", "u", "vc")
    reading = Reading(labels, 100.2, {"gpu_utilization{gpu=3}": 50.0, "cpu_utilization": 10.0})
    raw = {(s.name, dict(s.labels).get("gpu")) for s in raw_samples(reading)}
    assert raw == {("gpu_utilization", "3"), ("cpu_utilization", None)}
    w = Windows(2.0)
    w.add(reading)
    closed = w.close(200.0)
    gpu = [s for s in closed if s.name == "gpu_utilization"]
    assert {dict(s.labels)["gpu"] for s in gpu} == {"3"} and len(gpu) == 6  # every agg
    assert all(s.labels == tuple(sorted(s.labels)) for s in closed)


def test_alerts_see_the_allocation_wide_gpu_values() -> None:
    values = {
        "gpu_utilization{gpu=0}": 4.0,
        "gpu_utilization{gpu=1}": 6.0,
        "gpu_memory_used{gpu=0}": 79 * GIB,
        "gpu_memory_total{gpu=0}": 80 * GIB,
        "gpu_memory_used{gpu=1}": 78 * GIB,
        "gpu_memory_total{gpu=1}": 80 * GIB,
    }
    d = derived(values)
    assert d["gpu_utilization"] == 5.0
    assert round(d["gpu_memory_utilization"], 2) == round(100 * 157 / 160, 2)
    _, events = step(DEFAULT_RULES, {}, values, 0.0)
    _, events = step(DEFAULT_RULES, {}, values, 0.0)
    rules = {e.rule for e in events}
    assert any("mem" in r for r in rules)  # GPU memory > 95 % fires at once


def test_the_watch_stream_names_the_gpu_of_each_sample() -> None:
    msg = snapshot(
        "n1",
        "a",
        "metrics",
        at=1.0,
        mode="prod",
        until=None,
        values={"gpu_utilization{gpu=1}": 70.0, "memory_used": 1.0},
        agg="mean",
        names=frozenset({"gpu_utilization"}),
    )
    assert [(s.name, s.labels) for s in msg.samples] == [
        ("gpu_utilization", {"gpu": "1", "agg": "mean"})
    ]
    assert msg.samples[0].unit == "percent"


def test_the_loop_merges_the_gpu_source_with_the_others() -> None:
    drv = fake_driver([{"util": 60, "used": GIB, "power_mw": 300_000, "procs": []}])
    now = [1000.0]
    loop = TelemetryLoop(
        lambda: [target("a", pgid=1)],
        [nv.NvmlSource(drv)],
        window_seconds=1.0,
        clock=lambda: now[0],
    )
    asyncio.run(loop.tick())
    latest = loop.latest("a")
    assert latest is not None and latest.values["gpu_power_draw{gpu=0}"] == 300.0
    now[0] = 1003.0
    closed = asyncio.run(loop.tick())
    assert any(s.name == "gpu_power_draw" and dict(s.labels)["gpu"] == "0" for s in closed)


def test_a_query_the_device_does_not_support_is_asked_once() -> None:
    drv = fake_driver([{"util": 1, "used": GIB, "power_mw": 1000, "procs": []}])
    src = nv.NvmlSource(drv)
    src.collect([target("a")])
    asked = len(drv.unsupported_calls)
    assert asked > 0
    for _ in range(5):
        src.collect([target("a")])
    assert len(drv.unsupported_calls) == asked
