"""Backups of a large quorum state: how long commits stall while one is taken, and what
the rest costs (compression, checksum, verification) off the apply lock.

A GlobalState of ``--allocations`` (100,000) allocations, ``--nodes`` (10,000) nodes and
``--audit`` (50,000) audit entries is served by a LocalQuorum (the same lock discipline
as a QuorumMember: ``read`` holds the apply lock). Per run:

* ``pause_ms``: time ``lattice_quorum.backup.take`` holds the lock (the msgspec encoding
  of the state plus the Raft status read) -- commits wait at most this long;
* ``stall_ms``: the longest gap between two applies of a thread applying small commands
  back to back (0.5 ms apart) while the backup was taken -- what a proposer notices;
  ``idle_apply_ms`` is the same without a backup. The encoding holds the GIL too, so
  in a lattice-server the whole process (its event loop) waits that long;
* ``build_ms`` (gzip + sha256, lock released), ``verify_ms`` (checksums + full typed
  decoding), ``file_mb``, ``state_mb`` (uncompressed).

    uv run python scripts/bench/backup.py [--runs N] [--quick]

Medians over runs; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from lattice_common import commands as c
from lattice_common.audit import AuditEntry
from lattice_common.types import AllocationState
from lattice_quorum import backup
from lattice_quorum.local import LocalQuorum
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b


def big_state(allocations: int, nodes: int, audit: int) -> GlobalState:
    st = GlobalState(revision=allocations + nodes)
    st.nodes = b.inventory(nodes, groups=16, gpu_type="GH200", gpu_count=4)
    st.tenants = {f"t{i}": b.tenant(f"t{i}", max_nodes=100) for i in range(20)}
    st.vclusters = {f"v{i}": b.vcluster(f"v{i}", tenant=f"t{i}") for i in range(20)}
    states = [AllocationState.COMPLETED, AllocationState.RUNNING, AllocationState.PENDING]
    for i in range(allocations):
        a = b.allocation(
            id=f"{i:08x}",
            state=states[i % 3],
            submitted_at=1.7e9 + i,
            entrypoint=f"python train.py --epochs {i % 50}",
            tenant=f"t{i % 20}",
            vcluster=f"v{i % 20}",
            user=f"user{i % 500}",
        )
        if a.state != AllocationState.PENDING:
            a.assigned_nodes = [f"n{(i * 7 + k) % nodes:04d}" for k in range(4)]
        st.allocations[a.id] = a
    st.audit_log = [
        AuditEntry(
            seq=i + 1,
            time=1.7e9 + i,
            actor=f"user{i % 500}",
            action="node.drain",
            target=f"node:n{i % nodes:04d}",
            details={"reason": "firmware update"},
            prev_hash="ab" * 32,
            key_id="0123456789abcdef",
            hash="cd" * 32,
            signature="ef" * 64,
        )
        for i in range(audit)
    ]
    st.alloc_seq = allocations
    return st


def worst_apply(q: LocalQuorum, stop: threading.Event, out: list[float]) -> None:
    cmd = c.UpdateTenant(name="t0", fields={"max_nodes": 100}, now=1.0)
    # the gap between consecutive applies: the encoding holds the GIL as well as the
    # lock, so a stalled applier cannot even start its timer; gaps see both
    last = time.perf_counter()
    while not stop.is_set():
        q.apply(cmd)
        time.sleep(0.0005)
        now = time.perf_counter()
        out.append(now - last)
        last = now


def one_run(q: LocalQuorum) -> dict[str, float]:
    # the applier alone
    stop, idle = threading.Event(), []
    t = threading.Thread(target=worst_apply, args=(q, stop, idle))
    t.start()
    time.sleep(0.5)
    stop.set()
    t.join()
    # the applier during a backup
    stop, busy = threading.Event(), []
    t = threading.Thread(target=worst_apply, args=(q, stop, busy))
    t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    snap = backup.take(q)
    pause = time.perf_counter() - t0
    time.sleep(0.05)
    stop.set()
    t.join()
    t0 = time.perf_counter()
    data = backup.build(snap, site="bench", created_at=time.time())
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    report, _state = backup.verify(data)
    verify = time.perf_counter() - t0
    return {
        "pause_ms": pause * 1000,
        "stall_ms": max(busy) * 1000,
        "idle_apply_ms": max(idle) * 1000,
        "build_ms": build * 1000,
        "verify_ms": verify * 1000,
        "file_mb": len(data) / 1e6,
        "state_mb": len(snap.state) / 1e6,
        "allocations": report.counts["allocations"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--allocations", type=int, default=100_000)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--audit", type=int, default=50_000)
    a = p.parse_args()
    if a.quick:
        a.runs, a.allocations, a.nodes, a.audit = 1, 5_000, 500, 2_000
    print(f"building a state of {a.allocations} allocations...", file=sys.stderr)
    q = LocalQuorum(big_state(a.allocations, a.nodes, a.audit))
    q.apply(c.CreateTenant(tenant=b.tenant("t0-extra"), now=1.0))
    runs = []
    for i in range(a.runs):
        runs.append(one_run(q))
        print(f"run {i + 1}: {runs[-1]}", file=sys.stderr)
    med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    out = {
        **med,
        "nodes": a.nodes,
        "audit_entries": a.audit,
        "runs": a.runs,
        "by_run": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
