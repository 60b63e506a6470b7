"""Wall time of ``lattice status --all`` with 500 queued allocations.

A dev cluster with no agents (LocalCluster members=1, agents=0), so submissions stay
Pending. After ``--queued`` submissions, the real console script a user runs
(``.venv/bin/lattice``, else ``python -m lattice_cli.main``) is run ``--runs`` times
with LATTICE_ENDPOINT / LATTICE_TENANT set and an empty config file; each run's wall
time includes interpreter start, imports, the REST request, rendering and exit.

To say where the time goes it also times, with the same interpreter: a bare
``python -c pass`` (interpreter start), ``python -c "import lattice_cli.main"``
(start + imports), ``lattice status --all -o json`` (no table rendering), and the REST
list request alone from a warm process; plus ``-X importtime``'s slowest imports and a
cProfile summary (time spent compiling sources, top self time).

Bytecode: the headline ``status_p50_ms`` runs with a bytecode cache, as a normal
install has (written once to a private PYTHONPYCACHEPREFIX dir, nothing is written
into the checkout); ``status_p50_ms_as_is_env`` runs in this environment unchanged,
which on the dev machines sets PYTHONDONTWRITEBYTECODE=1 with no __pycache__ in the
venv, so every run recompiles typer's and lattice's sources.

    uv run python scripts/bench/cli_latency.py [--runs N] [--queued N] [--quick]

Goal: p50 < 200 ms. Reference: squeue ~9 ms on this machine.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    USER,
    count_allocations,
    dev_cluster,
    emit,
    job_body,
    latency_summary,
    log,
    parser,
    r,
    rest_headers,
    runs_of,
)

SQUEUE_MS = 9


def lattice_command() -> tuple[list[str], str]:
    exe = Path(sys.executable).parent / "lattice"
    if not exe.exists():
        exe = REPO / ".venv" / "bin" / "lattice"
    if exe.exists():
        return [str(exe)], str(exe.relative_to(REPO) if exe.is_relative_to(REPO) else exe)
    return [sys.executable, "-m", "lattice_cli.main"], "python -m lattice_cli.main"


async def submit_many(cluster: Any, n: int, concurrency: int = 16) -> int:
    import aiohttp

    body = job_body(cluster, "sleep 600", name="bench-cli")
    url = cluster.rest_url + "/api/v1/allocations"
    ok = 0
    left = n

    async with aiohttp.ClientSession(headers=rest_headers(cluster.tenant)) as s:

        async def worker() -> None:
            nonlocal ok, left
            while left > 0:
                left -= 1
                async with s.post(url, json=body) as resp:
                    if resp.status == 201:
                        ok += 1
                    else:
                        log(f"submit failed: {resp.status} {(await resp.text())[:200]}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def time_cmd(argv: list[str], env: dict[str, str], n: int) -> tuple[list[float], str]:
    samples: list[float] = []
    out = ""
    for _ in range(n):
        t0 = time.perf_counter()
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        samples.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[-800:]}")
        out = p.stdout
    return samples, out


def import_profile(argv_tail: list[str], env: dict[str, str], top: int = 10) -> dict[str, Any]:
    """``-X importtime`` of a real ``lattice status --all`` run: total import time and
    the slowest imports (cumulative ms) at the top two levels of the import tree."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lattice_cli.main", *argv_tail],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = []
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), (len(m.group(3)) - 1) // 2, m.group(4)))
    total = sum(c for c, d, _ in rows if d == 0)
    slow = sorted((x for x in rows if x[1] <= 1), reverse=True)[:top]
    return {
        "total_import_ms": r(total / 1000.0, 1),
        "slowest_cumulative_ms": [[name, r(cum / 1000.0, 1)] for cum, _, name in slow],
    }


def cprofile_top(argv_tail: list[str], env: dict[str, str], top: int = 12) -> dict[str, Any]:
    """cProfile of one ``lattice status --all`` run: total, time in ``compile()`` (source
    compiled because no .pyc was found), and the functions with the most self time."""
    import pstats

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "prof"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "cProfile",
                "-o",
                str(out),
                "-m",
                "lattice_cli.main",
                *argv_tail,
            ],
            env=env,
            capture_output=True,
            timeout=120,
        )
        if not out.exists():
            return {}
        st = pstats.Stats(str(out))
    rows = []
    compile_s = 0.0
    for (file, line, fn), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if fn == "<built-in method builtins.compile>":
            compile_s += tt
        short = "/".join(Path(file).parts[-2:]) if file != "~" else ""
        rows.append((tt, f"{fn} ({short}:{line})" if short else fn))
    rows.sort(reverse=True)
    return {
        "total_ms": r(st.total_tt * 1000.0, 1),  # type: ignore[attr-defined]
        "compile_ms": r(compile_s * 1000.0, 1),
        "top_self_ms": [[name, r(tt * 1000.0, 1)] for tt, name in rows[:top]],
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=15)
    p.add_argument("--queued", type=int, default=None, help="pending allocations (500)")
    args = p.parse_args()
    n_runs = runs_of(args, quick_runs=3)
    queued = args.queued or (100 if args.quick else 500)
    cmd, cmd_name = lattice_command()

    tmp = Path(tempfile.mkdtemp(prefix="lattice-bench-cli-"))
    try:
        with dev_cluster(members=1, agents=0, keep=args.keep) as cluster:
            t0 = time.perf_counter()
            ok = asyncio.run(submit_many(cluster, queued))
            log(f"submitted {ok} in {time.perf_counter() - t0:.1f}s")
            have = count_allocations(cluster, "Pending")
            cfg = tmp / "config.yaml"
            cfg.write_text("{}\n")
            base_env = {
                **os.environ,
                "LATTICE_ENDPOINT": cluster.rest_url,
                "LATTICE_TENANT": cluster.tenant,
                "LATTICE_CONFIG": str(cfg),
                "USER": USER,
                "NO_COLOR": "1",
                "COLUMNS": "160",
            }
            base_env.pop("LATTICE_TOKEN", None)
            # "cached": bytecode written once to a private cache (PYTHONPYCACHEPREFIX, so
            # nothing is written into the checkout or the venv) and reused, as on a normal
            # install. "as_is": this environment unchanged (it may set
            # PYTHONDONTWRITEBYTECODE=1 with no __pycache__ in the venv: every run then
            # compiles typer's and lattice's sources again).
            env = {**base_env, "PYTHONPYCACHEPREFIX": str(tmp / "pyc")}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            as_is = dict(base_env)
            time_cmd([*cmd, "status", "--all"], env, 2)  # writes the bytecode cache
            status, out = time_cmd([*cmd, "status", "--all"], env, n_runs)
            rows = sum(1 for ln in out.splitlines() if "bench-cli" in ln)
            log(
                f"`lattice status --all`: p50 {1000 * sorted(status)[len(status) // 2]:.0f} ms; "
                f"{rows} rows of ours in the output"
            )
            status_as_is, _ = time_cmd([*cmd, "status", "--all"], as_is, n_runs)
            status_json, _ = time_cmd([*cmd, "status", "--all", "-o", "json"], env, n_runs)
            bare, _ = time_cmd([sys.executable, "-c", "pass"], env, n_runs)
            imp, _ = time_cmd([sys.executable, "-c", "import lattice_cli.main"], env, n_runs)
            helpt, _ = time_cmd([*cmd, "--help"], env, max(3, n_runs // 3))
            # the REST request alone, from a warm process (no keep-alive, like the CLI)
            req = urllib.request.Request(
                cluster.rest_url + "/api/v1/allocations?all=true",
                headers=rest_headers(cluster.tenant),
            )
            rest = []
            size = 0
            for _ in range(n_runs):
                t = time.perf_counter()
                with urllib.request.urlopen(req, timeout=60) as resp:
                    size = len(resp.read())
                rest.append(time.perf_counter() - t)
            imports = import_profile(["status", "--all"], env)
            cprof = {
                "cached": cprofile_top(["status", "--all"], env),
                "as_is": cprofile_top(["status", "--all"], as_is),
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    s = latency_summary(status)
    out_json: dict[str, Any] = {
        "queued": have,
        "status_p50_ms": s.get("p50_ms"),
        "runs": n_runs,
        "status_p95_ms": s.get("p95_ms"),
        "status_min_ms": s.get("min_ms"),
        "squeue_reference_ms": SQUEUE_MS,
        "ratio_to_squeue": r((s.get("p50_ms") or 0) / SQUEUE_MS, 1),
        "command": f"{cmd_name} status --all",
        "status_p50_ms_as_is_env": latency_summary(status_as_is).get("p50_ms"),
        "as_is_env": {
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
            "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX", ""),
        },
        "note": "status_p50_ms: with a bytecode cache (normal install); "
        "status_p50_ms_as_is_env: this environment unchanged",
        "rows_in_output": rows,
        "breakdown_p50_ms": {
            "python_startup (python -c pass)": latency_summary(bare).get("p50_ms"),
            "startup+imports (import lattice_cli.main)": latency_summary(imp).get("p50_ms"),
            "lattice --help": latency_summary(helpt).get("p50_ms"),
            "lattice status --all -o json": latency_summary(status_json).get("p50_ms"),
            "lattice status --all (table)": s.get("p50_ms"),
            "REST list request alone (warm process)": latency_summary(rest).get("p50_ms"),
        },
        "rest_list_bytes": size,
        "imports_in_status_run": imports,
        "cprofile": cprof,
        "goal_p50_ms": 200,
    }
    emit(out_json)


if __name__ == "__main__":
    main()
