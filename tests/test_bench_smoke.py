"""The benchmark scripts still run and print their JSON (a bounded --quick run each).

Figures are not asserted here: benchmarks measure, tests check behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"

EXPECTED = {
    "raft_commit.py": {"members", "p50_ms", "p99_ms", "pipelined_commits_per_s"},
    "submit_latency.py": {"p50_ms", "p95_ms"},
    "submit_throughput.py": {"clients", "submits_per_s"},
    "job_throughput.py": {"agents", "jobs_per_s"},
    "cli_latency.py": {"queued", "status_p50_ms"},
    "scheduler_cycle.py": {"pending", "nodes", "median_s", "peak_rss_mb"},
    "pmi_fence.py": {"fence_ms", "fanout_256_ms"},
    "dag.py": {"chain_per_stage_ms", "fanout_enqueue_s", "attach_echo_p50_ms"},
    "prologue.py": {"bare_ms", "uenv_added_ms", "oci_added_ms", "agent_cpu_64"},
    "auth_overhead.py": {"secure_submits_per_s", "dev_submits_per_s", "ratio", "secure_p99_ms"},
    "accounting.py": {"reservations_per_s", "overspent", "charge_pass_s"},
    "backup.py": {"pause_ms", "stall_ms", "verify_ms", "file_mb"},
    "checkpoint.py": {"eval_10k_s", "hint_to_suspended_ms"},
    "heartbeat_cost.py": {
        "single_ms_per_heartbeat",
        "batch_ms_per_heartbeat",
        "reconnect_ms_per_stream_known",
    },
    "scale.py": {
        "nodes",
        "pending",
        "heartbeat_cpu_pct",
        "cycle_s",
        "leader_rss_mb",
        "failover_s",
        "dump_s",
        "max_commit_stall_ms",
    },
    "observability.py": {
        "log_streams_100_cpu_pct",
        "ingest_latency_p99_ms",
        "agent_cpu_pct",
        "ebpf_overhead_pct",
    },
}


@pytest.mark.cluster
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_prints_its_json(script: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the bench stops the cluster it started (SIGKILL would leave it)
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"{script} --quick ran over 240 s; its last output:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-2000:]
    last = stdout.strip().splitlines()[-1]
    result = json.loads(last)
    first = result[0] if isinstance(result, list) else result  # scheduler_cycle: one per size
    assert EXPECTED[script] <= set(first), result
