"""Audit mode end to end on the real kernel and a real API: a process of a sensitive
allocation opens files; the eBPF program sees the opens, the agent's file-access auditing
ships them with the agent's credentials over gRPC, and they are in the audit log as
``file.access`` under the allocation's user (read back with the audit query the CLI
uses, filtered by action and allocation). A process of no audited allocation opening a
file at the same time is not recorded. The cluster's answer switches the sensitive
allocation to audit mode on its own. While the API is unreachable the records wait
(bounded) and arrive once it is back. Skips, with probe()'s reason, where eBPF cannot
run (scripts/bootstrap-ebpf)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jwt
import pytest
from grpclib.client import Channel
from lattice_agent.telemetry.ebpf import probe
from lattice_agent.telemetry.fileaudit import FileAudit, node_service_report
from lattice_agent.telemetry.samples import MODE_AUDIT, AllocLabels, Target
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, SchedulerType
from lattice_sdk import LatticeClient
from lattice_test_harness.local_api import LocalApi, serve_local_api

OK, WHY = probe()
needs_ebpf = pytest.mark.skipif(not OK, reason=f"eBPF cannot run here: {WHY}")

SECRET = "file-audit-test-secret-long-enough-0123456789"
AGENT_TOKEN = "file-audit-agent-token-0123456789"


def admin_client(api: LocalApi) -> LatticeClient:
    claims = {"sub": "auditor", "scope": "admin", "exp": int(time.time()) + 600}
    return LatticeClient(api.host, api.rest_port, token=jwt.encode(claims, SECRET, "HS256"))


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[LocalApi, str]]:
    async with serve_local_api(hmac_secret=SECRET, agent_token=AGENT_TOKEN) as api:
        api.add_tenant("hospital")
        api.add_vcluster("sensitive", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
        api.add_node("n1")
        spec = AllocationSpec(
            entrypoint="analyse",
            tenant="hospital",
            vcluster="sensitive",
            user="dr-x",
            walltime_seconds=3600,
        )
        alloc = api.submit(spec)
        api.start(alloc.id, ["n1"])
        yield api, alloc.id


def waiting_shell(script: str) -> subprocess.Popen[bytes]:
    """``sh -c script`` in its own session, held at a ``read`` (no opens) until fed."""
    return subprocess.Popen(
        ["sh", "-c", f"read go; {script}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def go(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.close()


async def until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def file_access_records(api: LocalApi, alloc_id: str | None = None) -> list[dict[str, Any]]:
    """Every file.access record in the audit log (with its entry's actor and tenant)."""
    out: list[dict[str, Any]] = []
    async with admin_client(api) as client:
        async for e in client.audit_entries(action="file.access", allocation_id=alloc_id):
            for r in json.loads(e["details"].get("records", "[]")):
                out.append({**r, "actor": e["actor"], "tenant": e["tenant"], "target": e["target"]})
    return out


def auditor(
    api_address: Callable[[], tuple[str, int]],
    alloc_id: str,
    pgid: int,
    modes: dict[str, str],
    **kw: Any,
) -> FileAudit:
    channels: list[Channel] = []

    def stub() -> v1.NodeServiceStub:
        host, port = api_address()
        ch = Channel(host, port)
        channels.append(ch)
        return v1.NodeServiceStub(ch, metadata={"authorization": f"Bearer {AGENT_TOKEN}"})

    target = Target(AllocLabels(alloc_id, "n1", "hospital", "dr-x", "sensitive"), (pgid,))
    fa = FileAudit(
        "n1",
        mode_of=lambda aid: modes.get(aid, "prod"),
        set_audit=lambda aid: modes.__setitem__(aid, MODE_AUDIT),
        assigned=lambda: [alloc_id],
        targets=lambda: [target],
        report=node_service_report(stub, "n1"),
        interval=0.2,
        ship_interval=0.5,
        **kw,
    )
    fa.channels = channels  # type: ignore[attr-defined]
    return fa


async def stop(fa: FileAudit, task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for ch in fa.channels:  # type: ignore[attr-defined]
        ch.close()


@needs_ebpf
async def test_sensitive_opens_reach_the_audit_log(
    cluster: tuple[LocalApi, str], tmp_path: Path
) -> None:
    api, alloc_id = cluster
    written, read = tmp_path / "result.csv", tmp_path / "subject-001.dat"
    read.write_text("patient data")
    elsewhere = tmp_path / "not-audited.txt"
    elsewhere.write_text("x")
    audited = waiting_shell(f"echo done > {written}; cat {read} > /dev/null")
    other = waiting_shell(f"cat {elsewhere} > /dev/null")
    modes: dict[str, str] = {}  # prod: the cluster's answer makes it audit
    fa = auditor(lambda: (api.host, api.grpc_port), alloc_id, audited.pid, modes)
    task = asyncio.create_task(fa.run())
    try:
        await until(lambda: modes.get(alloc_id) == MODE_AUDIT, "the cluster to say audit")
        await until(lambda: fa.watching(alloc_id), "the allocation's processes in the filter")
        assert fa.notes() == ["file-access:ebpf"]
        go(audited)
        go(other)
        audited.wait(30)
        other.wait(30)

        def mine() -> Any:
            async def check() -> list[dict[str, Any]] | None:
                got = await file_access_records(api, alloc_id)
                paths = {r["path"] for r in got}
                return got if {str(written), str(read)} <= paths else None

            return check()

        got = await until(mine, "the opens in the audit log")
        by_path = {r["path"]: r for r in got}
        w = by_path[str(written)]
        assert w["flags"] == "w,create,trunc" and w["comm"] == "sh" and w["result"] >= 0
        assert w["pid"] == audited.pid and w["uid"] == os.getuid() and w["source"] == "ebpf"
        assert w["actor"] == "dr-x" and w["tenant"] == "hospital"
        assert w["target"] == f"allocation:{alloc_id}"
        r = by_path[str(read)]
        assert r["flags"] == "r" and r["comm"] == "cat" and r["pid"] != audited.pid  # a child
        everything = await file_access_records(api)
        assert str(elsewhere) not in {x["path"] for x in everything}
    finally:
        await stop(fa, task)
        for p in (audited, other):
            if p.poll() is None:
                p.kill()
                p.wait()


@needs_ebpf
async def test_records_wait_while_the_api_is_unreachable(
    cluster: tuple[LocalApi, str], tmp_path: Path
) -> None:
    api, alloc_id = cluster
    address = {"at": ("127.0.0.1", 9)}  # nothing listens on the discard port
    files = [tmp_path / f"out-{i}" for i in range(5)]
    script = "; ".join(f"echo {i} > {f}" for i, f in enumerate(files))
    proc = waiting_shell(script)
    modes = {alloc_id: MODE_AUDIT}  # audited from the start (e.g. the node's default)
    fa = auditor(lambda: address["at"], alloc_id, proc.pid, modes, buffer_limit=3)
    task = asyncio.create_task(fa.run())
    try:
        await until(lambda: fa.watching(alloc_id), "the allocation's processes in the filter")
        go(proc)
        proc.wait(30)
        await until(lambda: fa.outbox.dropped >= 2, "the bounded buffer to drop the oldest")
        assert len(fa.outbox) == 3  # the newest wait
        address["at"] = (api.host, api.grpc_port)  # the API is back
        await until(lambda: len(fa.outbox) == 0 and fa.outbox.dropped == 0, "the backlog to go")

        async def arrived() -> list[dict[str, Any]] | None:
            got = await file_access_records(api, alloc_id)
            return got if {str(files[-1])} <= {r["path"] for r in got} else None

        got = await until(arrived, "the newest records in the audit log")
        assert str(files[0]) not in {r["path"] for r in got}  # dropped, not pretended
        async with admin_client(api) as client:
            lost = [
                e
                async for e in client.audit_entries(action="file.access", target="node:n1")
                if "lost" in e["details"]
            ]
        assert lost and sum(int(e["details"]["lost"]) for e in lost) >= 2
    finally:
        await stop(fa, task)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
