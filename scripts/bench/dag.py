"""DAG workflows on a dev cluster: the cost of a dependency per stage, and how fast a wide
fan-out is released.

A dev cluster (LocalCluster: 1 lattice-server, 4 agents, a fresh cluster per run).

* chain: a DAG of ``--chain`` stages running ``true``, each after the previous one
  succeeded (``POST /api/v1/dags``). ``chain_per_stage_ms`` = (last stage's start -
  first stage's start) / (stages - 1), the servers' own timestamps: a stage's
  turnaround on a node (assign -> spawn -> exit -> heartbeat -> commit) plus releasing
  its successor (in the same commit, ``lattice_quorum.handlers.dags``) and scheduling
  it (the scheduler is poked by the release). ``chain_submit_to_last_start_s`` adds the
  submission.
* fan-out: a root that runs until released and ``--fanout`` members after it. From the
  root's end (its ``finished_at``) until ``GET /api/v1/dags/{id}`` shows no member
  Blocked: ``fanout_enqueue_s`` (polled every 10 ms, so it includes up to one poll
  interval and one request). The members are cancelled afterwards (running 1,000
  trivial jobs is not what is measured).
* ``attach_echo_p50_ms``: ``lattice attach``'s keystroke -> echo round trip through the
  real API (WebSocket) and agent (PTY running ``cat``), median of 200 (``_attach_echo``),
  on the same cluster after the DAG runs.

    uv run python scripts/bench/dag.py [--runs N] [--quick] [--chain N] [--fanout N]

Goals (spec issue): < 50 ms per chain stage; all 1,000 fan-out members enqueued within
1 s of the root completing; attach echo p50 < 20 ms.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _attach_echo import attach_echo_p50
from _common import dev_cluster, emit, log, median, parser, r, rest_headers, runs_of

AGENTS = 4


def _call(cluster: Any, method: str, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(
        cluster.leader().rest_url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers=rest_headers(cluster.tenant),
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read() or b"null")


def _dag_body(cluster: Any, name: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tenant": cluster.tenant,
        "vcluster": cluster.vclusters[0],
        "dag": {"name": name, "allocations": members},
    }


def _member(mid: str, entrypoint: str, after: str | None) -> dict[str, Any]:
    m: dict[str, Any] = {"id": mid, "entrypoint": entrypoint, "walltime": "10m"}
    if after:
        m["depends_on"] = [{"ref": after, "condition": "success"}]
    return m


def _dag(cluster: Any, dag_id: str) -> dict[str, Any]:
    return _call(cluster, "GET", f"/api/v1/dags/{dag_id}")


def chain(cluster: Any, n: int) -> dict[str, Any]:
    members = [_member(f"s{i}", "true", f"s{i - 1}" if i else None) for i in range(n)]
    t0 = time.time()
    res = _call(cluster, "POST", "/api/v1/dags", _dag_body(cluster, "chain", members))
    dag_id = res["dag_id"]
    deadline = time.monotonic() + 30 + 2.0 * n
    while time.monotonic() < deadline:
        d = _dag(cluster, dag_id)
        if d["state"] != "Running":
            break
        time.sleep(0.5)
    if d["state"] != "Completed":
        raise RuntimeError(f"chain DAG ended {d['state']}")
    ids = {m["ref"]: m["allocation_id"] for m in d["members"]}
    first = _call(cluster, "GET", f"/api/v1/allocations/{ids['s0']}")
    last = _call(cluster, "GET", f"/api/v1/allocations/{ids[f's{n - 1}']}")
    per_stage = (last["started_at"] - first["started_at"]) / max(1, n - 1)
    return {
        "chain_per_stage_ms": per_stage * 1000,
        "chain_submit_to_last_start_s": last["started_at"] - t0,
    }


def fanout(cluster: Any, n: int, workdir: Path) -> dict[str, Any]:
    release = workdir / "release-root"
    root = _member("root", f"sh -c 'while [ ! -e {release} ]; do sleep 0.02; done'", None)
    members = [root, *(_member(f"m{i}", "true", "root") for i in range(n))]
    res = _call(cluster, "POST", "/api/v1/dags", _dag_body(cluster, "fanout", members))
    dag_id = res["dag_id"]
    root_id = next(
        m["allocation_id"] for m in _dag(cluster, dag_id)["members"] if m["ref"] == "root"
    )
    deadline = time.monotonic() + 60
    while _call(cluster, "GET", f"/api/v1/allocations/{root_id}")["state"] != "Running":
        if time.monotonic() > deadline:
            raise RuntimeError("the fan-out root never started")
        time.sleep(0.05)
    release.touch()
    deadline = time.monotonic() + 60
    while True:
        d = _dag(cluster, dag_id)
        if not any(m["state"] == "Blocked" for m in d["members"]):
            released_at = time.time()
            break
        if time.monotonic() > deadline:
            raise RuntimeError("fan-out members still Blocked after 60 s")
        time.sleep(0.01)
    ended = _call(cluster, "GET", f"/api/v1/allocations/{root_id}")["finished_at"]
    _call(cluster, "DELETE", f"/api/v1/dags/{dag_id}")
    return {"fanout_enqueue_s": released_at - ended}


def main() -> None:
    p = parser(__doc__ or "", default_runs=3)
    p.add_argument("--chain", type=int, default=1000, help="stages of the chain")
    p.add_argument("--fanout", type=int, default=1000, help="members after the fan-out root")
    args = p.parse_args()
    runs = runs_of(args)
    n_chain, n_fan = (20, 50) if args.quick else (args.chain, args.fanout)
    results: list[dict[str, Any]] = []
    for run in range(runs):
        env = {"LATTICE_SCHEDULING__MAX_DAG_SIZE": str(max(n_chain, n_fan + 1))}
        with dev_cluster(agents=AGENTS, env=env) as cluster:
            out = chain(cluster, n_chain)
            log(
                f"run {run + 1}: chain of {n_chain}: {out['chain_per_stage_ms']:.1f} ms per "
                f"stage, {out['chain_submit_to_last_start_s']:.1f} s submit -> last start"
            )
            out.update(fanout(cluster, n_fan, Path(cluster.base)))
            log(f"run {run + 1}: fan-out of {n_fan}: enqueued {out['fanout_enqueue_s']:.3f} s")
            out["attach_echo_p50_ms"] = attach_echo_p50(cluster, samples=50 if args.quick else 200)
            log(f"run {run + 1}: attach echo p50 {out['attach_echo_p50_ms']:.2f} ms")
            results.append(out)
    emit(
        {
            "chain_per_stage_ms": r(median(x["chain_per_stage_ms"] for x in results)),
            "chain_submit_to_last_start_s": r(
                median(x["chain_submit_to_last_start_s"] for x in results)
            ),
            "fanout_enqueue_s": r(median(x["fanout_enqueue_s"] for x in results), 3),
            "attach_echo_p50_ms": r(median(x["attach_echo_p50_ms"] for x in results)),
            "chain_stages": n_chain,
            "fanout_members": n_fan,
            "agents": AGENTS,
            "runs": runs,
        }
    )


if __name__ == "__main__":
    main()
