"""Debug traces: the telemetry loop's raw samples of a debug-mode allocation (a real
process measured by the real /proc collector) written by TraceWriter as chunks in a
real store, parsed back; sensitive ones only in the encrypted pool."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from lattice_agent.logship import LogPools
from lattice_agent.telemetry.loop import TelemetryLoop
from lattice_agent.telemetry.proc import ProcCollector
from lattice_agent.telemetry.samples import MODE_DEBUG, AllocLabels, Target
from lattice_agent.telemetry.traces import TraceWriter
from lattice_common.logcrypt import EncryptedLogStore, LogKey
from lattice_common.logstore import (
    FsLogStore,
    decode_trace_chunk,
    decode_trace_metadata,
    trace_metadata_key,
)
from lattice_common.types import Allocation, AllocationSpec

pytestmark = pytest.mark.timeout(60)

KEY = LogKey(os.urandom(32))


def alloc(aid: str, vcluster: str) -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(entrypoint="x", tenant="physics", vcluster=vcluster, project="qcd"),
    )


async def test_debug_mode_writes_trace_chunks_that_parse_back(tmp_path: Path) -> None:
    ordinary = FsLogStore(tmp_path / "logs")
    sensitive_raw = FsLogStore(tmp_path / "sensitive")
    allocs = {"d1": alloc("d1", "batch"), "s1": alloc("s1", "secure"), "p1": alloc("p1", "batch")}

    async def classify(aid: str) -> bool:
        return allocs[aid].spec.vcluster == "secure"

    pools = LogPools(
        ordinary, EncryptedLogStore(sensitive_raw, KEY), node_id="n1", classify=classify
    )
    writer = TraceWriter(pools, node_id="n1", allocation=allocs.get, interval=60)
    procs = {
        aid: subprocess.Popen(["python3", "-c", "while True: pass"], start_new_session=True)
        for aid in allocs
    }
    try:
        targets = [Target(AllocLabels.of(allocs[aid], "n1"), (p.pid,)) for aid, p in procs.items()]
        loop = TelemetryLoop(lambda: targets, [ProcCollector(None)])
        loop.on_raw = writer.offer
        loop.set_mode("d1", MODE_DEBUG)
        loop.set_mode("s1", MODE_DEBUG)  # p1 stays in prod: no trace
        for _ in range(4):
            await loop.tick()
            await asyncio.sleep(0.3)
        assert await writer.flush() == 2
        for _ in range(2):
            await loop.tick()
            await asyncio.sleep(0.3)
        assert await writer.flush() == 2
    finally:
        for p in procs.values():
            p.kill()
            p.wait()

    keys = await ordinary.list("")
    chunks = [k for k in keys if k.endswith(".ndjson.zst")]
    assert chunks == [
        "physics/qcd/d1/telemetry/n1/trace_000000.ndjson.zst",
        "physics/qcd/d1/telemetry/n1/trace_000001.ndjson.zst",
    ]
    samples = []
    for k in chunks:
        data = await ordinary.get(k)
        assert data is not None
        samples += decode_trace_chunk(data)
    names = {s[0] for s in samples}
    assert "cpu_utilization" in names or any("cpu" in n for n in names), names
    assert all(s[1]["agg"] == "raw" and s[1]["alloc_id"] == "d1" for s in samples)
    stamps = [s[3] for s in samples]
    assert len(set(stamps)) >= 4  # one per collection
    meta = decode_trace_metadata(await ordinary.get(trace_metadata_key("physics/qcd/d1")))
    assert meta is not None
    assert meta.nodes["n1"].chunks == 2 and meta.nodes["n1"].samples == len(samples)
    assert meta.nodes["n1"].last_ts == max(stamps) / 1000
    # the sensitive allocation's traces: only in the sensitive pool, sealed
    assert not [k for k in keys if "/s1/" in k]
    sealed = [k for k in await sensitive_raw.list("") if k.endswith(".ndjson.zst")]
    assert len(sealed) == 2
    raw = await sensitive_raw.get(sealed[0])
    assert raw is not None and raw.startswith(b"LLE1") and b"cpu" not in raw
    opened = await EncryptedLogStore(sensitive_raw, KEY).get(sealed[0])
    assert opened is not None and decode_trace_chunk(opened)
    # a restarted writer continues the numbering
    again = TraceWriter(pools, node_id="n1", allocation=allocs.get, interval=60)
    from lattice_agent.telemetry.aggregate import raw_samples
    from lattice_agent.telemetry.samples import Reading

    reading = Reading(AllocLabels.of(allocs["d1"], "n1"), 1.0, {"cpu_utilization": 0.5})
    again.offer(reading, raw_samples(reading))
    assert await again.flush() == 1
    assert "physics/qcd/d1/telemetry/n1/trace_000002.ndjson.zst" in await ordinary.list("")
