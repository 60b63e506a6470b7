"""Shared bits of the Lattice benchmark scripts.

Every script prints progress to stderr and exactly one JSON object as the last line
of stdout (``emit``). Nothing here asserts a timing: benchmarks measure and print.

* argument parsing (``--runs``, ``--quick``, ``--profile``)
* statistics (``percentile``, ``median``, ``latency_summary``)
* real dev clusters (``dev_cluster``: LocalCluster on ephemeral loopback ports in a
  temp dir, always stopped and removed again)
* small REST / gRPC client helpers
* optional evidence gathering: per-process CPU time from /proc and py-spy sampling
  profiles summarised to the hottest functions (``--profile``)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("Completed", "Failed", "Cancelled")
USER = "bench"


# --- output ---------------------------------------------------------------------------


def log(*parts: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """The one JSON object on stdout; always the last line."""
    sys.stdout.flush()
    print(json.dumps(result, default=_jsonable), flush=True)


def _jsonable(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, set | tuple):
        return list(o)
    return str(o)


def r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


# --- arguments ------------------------------------------------------------------------


class _BenchParser(argparse.ArgumentParser):
    """Applies ``--work-dir`` as it parses, so that every benchmark honours it."""

    def parse_args(self, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
        args = super().parse_args(*a, **kw)
        if args.work_dir:
            Path(args.work_dir).mkdir(parents=True, exist_ok=True)
            tempfile.tempdir = str(Path(args.work_dir).resolve())
        return args


def parser(description: str, *, default_runs: int = 5) -> argparse.ArgumentParser:
    p = _BenchParser(description=description)
    p.add_argument("--runs", type=int, default=None, help=f"repetitions (default {default_runs})")
    p.add_argument("--quick", action="store_true", help="1-2 small runs (CI smoke test)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="sample the server/scheduler/agent processes with py-spy during the measured "
        "phase, write raw stacks to DIR and add a hot-function summary to the JSON",
    )
    p.add_argument("--keep", action="store_true", help="keep the cluster's temp dir (logs)")
    p.add_argument(
        "--work-dir",
        metavar="DIR",
        default=None,
        help="where clusters (and a Slurm anchor) keep their files (default: the temp dir); "
        "e.g. /dev/shm for nodes whose local disk is tmpfs, as diskless HPC nodes' is",
    )
    p.set_defaults(_default_runs=default_runs)
    return p


def work_dir() -> dict[str, str]:
    """Where this run's clusters keep their files (``--work-dir``, else the temp dir) and
    its file-system type, for the JSON: creating and removing a job's files is a large
    part of an agent's work on some file systems."""
    where = tempfile.gettempdir()
    return {"path": where, "fs": fs_type(where)}


def fs_type(path: str) -> str:
    """The file-system type of the mount ``path`` is on (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mnt = fields[1].replace("\\040", " ")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    return kind


def runs_of(args: argparse.Namespace, quick_runs: int = 1) -> int:
    if args.runs is not None:
        return max(1, args.runs)
    return quick_runs if args.quick else args._default_runs


# --- statistics -------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method), p in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def median(values: Iterable[float]) -> float:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(xs)) if xs else float("nan")


def latency_summary(samples_s: Sequence[float]) -> dict[str, float | None]:
    """Milliseconds: p50/p95/p99/min/max/mean of samples given in seconds."""
    ms = [s * 1000.0 for s in samples_s]
    if not ms:
        return {}
    return {
        "p50_ms": r(percentile(ms, 50)),
        "p95_ms": r(percentile(ms, 95)),
        "p99_ms": r(percentile(ms, 99)),
        "min_ms": r(min(ms)),
        "max_ms": r(max(ms)),
        "mean_ms": r(statistics.fmean(ms)),
    }


def median_of_runs(runs: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, float | None]:
    """For each key, the median over the runs that have it."""
    return {k: r(median(x[k] for x in runs if x.get(k) is not None)) for k in keys}


# --- dev clusters ---------------------------------------------------------------------------


def _ensure_import_path() -> None:
    # scripts/bench is not a package: make `import _common` work from any cwd and keep the
    # workspace packages importable (they are when run with `uv run`).
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


_ensure_import_path()


_TO_REMOVE: list[Path] = []


def remove_at_exit(path: Path) -> None:
    """Remove ``path`` when this benchmark ends, not now. On ext4 without a journal (and
    ext2/3) every file created in the next 1-6 minutes skips, one by one, the inodes a
    removal freed (the kernel's ``recently_deleted``): removing one run's cluster (thousands
    of files) just before the next run made each job's files there up to 8x dearer to
    create, so the benchmark's own clean-up was charged to the next run, and to the
    second side of a comparison."""
    if not _TO_REMOVE:
        atexit.register(remove_registered)
    _TO_REMOVE.append(path)


def remove_registered() -> None:
    """What :func:`remove_at_exit` was given, now (at exit, or a test that checks it)."""
    while _TO_REMOVE:
        shutil.rmtree(_TO_REMOVE.pop(), ignore_errors=True)


@contextlib.contextmanager
def dev_cluster(
    *,
    members: int = 1,
    agents: int = 0,
    vclusters: tuple[str, ...] = ("default",),
    keep: bool = False,
    start_timeout: float = 60.0,
    **kw: Any,
) -> Iterator[Any]:
    """A real LocalCluster (lattice-server, scheduler, agents as processes on loopback,
    ephemeral ports, temp dir). Everything it started is stopped on the way out, even
    when starting failed half-way; the temp dir is removed when the benchmark ends
    (:func:`remove_at_exit`) unless ``keep``."""
    from lattice_cli.devcluster import LocalCluster

    base = Path(tempfile.mkdtemp(prefix="lattice-bench-"))
    owner = os.getpid()
    stopping = False
    deferred = 0  # a SIGTERM that came while stopping: honoured once everything is stopped

    def terminated(signum: int, _frame: Any) -> None:
        nonlocal deferred
        if os.getpid() != owner:  # a forked helper: SIGTERM as usual
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif stopping:
            deferred = signum
        else:
            raise SystemExit(128 + signum)

    # SIGTERM (a time limit) unwinds like an exception, so the cluster is stopped: its
    # processes run in sessions of their own and would otherwise outlive the bench
    try:
        previous: Any = signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # not the main thread: its owner handles signals
        previous = None
    cluster = LocalCluster(
        base / "cluster", members=members, agents=agents, vclusters=vclusters, **kw
    )
    log(f"starting dev cluster: members={members} agents={agents} in {base}")
    t0 = time.perf_counter()
    try:
        cluster.start(timeout=start_timeout)
        log(f"cluster up in {time.perf_counter() - t0:.1f}s; REST {cluster.rest_url}")
        yield cluster
    except BaseException:
        _dump_logs(cluster)
        raise
    finally:
        stopping = True
        stop_cluster(cluster)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if keep:
            log(f"cluster files kept in {base}")
        else:
            remove_at_exit(base)
        if deferred:
            raise SystemExit(128 + deferred)


def cluster_procs(cluster: Any) -> dict[str, subprocess.Popen[bytes]]:
    out: dict[str, subprocess.Popen[bytes]] = {}
    for m in cluster.members:
        if m.proc is not None:
            out[f"server-{m.id}"] = m.proc
    for vc, p in cluster.schedulers.items():
        out[f"scheduler-{vc}"] = p
    for a in cluster.agents:
        if a.proc is not None:
            out[f"agent-{a.node_id}"] = a.proc
    return out


def stop_cluster(cluster: Any) -> None:
    procs = list(cluster_procs(cluster).values())
    try:
        cluster.stop()
    except Exception as e:
        log(f"cluster.stop() failed: {e!r}; killing its processes")
    # Belt and braces: every child was started in its own session (pgid == pid).
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                p.wait(5)
    with contextlib.suppress(Exception):
        cluster.kill_workloads()


def _dump_logs(cluster: Any, lines: int = 30) -> None:
    logs = cluster.base / "logs"
    for f in sorted(logs.glob("*.log")) if logs.exists() else []:
        tail = f.read_text(errors="replace").splitlines()[-lines:]
        log(f"--- {f.name} (last {len(tail)} lines) ---\n" + "\n".join(tail))


# --- clients --------------------------------------------------------------------------------


def rest_headers(tenant: str = "default") -> dict[str, str]:
    return {"x-lattice-user": USER, "x-lattice-tenant": tenant, "Content-Type": "application/json"}


def job_body(cluster: Any, entrypoint: str = "true", **extra: Any) -> dict[str, Any]:
    return {
        "entrypoint": entrypoint,
        "tenant": cluster.tenant,
        "vcluster": cluster.vclusters[0],
        "walltime": "10m",
        "nodes": 1,
        **extra,
    }


def grpc_channel(address: str) -> Any:
    from grpclib.client import Channel
    from lattice_common.net import split_host_port

    return Channel(*split_host_port(address, default_host="127.0.0.1"))


def grpc_metadata() -> dict[str, str]:
    return {"x-lattice-user": USER}


def count_allocations(cluster: Any, state: str | None = None) -> int:
    import urllib.request

    url = cluster.leader().rest_url + "/api/v1/allocations?all=true"
    if state:
        url += f"&state={state}"
    req = urllib.request.Request(url, headers=rest_headers(cluster.tenant))
    with urllib.request.urlopen(req, timeout=60) as resp:
        return len(json.loads(resp.read())["allocations"])


# --- evidence: CPU time and py-spy ---------------------------------------------------------------

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_times(pid: int) -> tuple[float, float, float] | None:
    """(user, kernel, reaped children's user + kernel) seconds of a process, its threads
    included, from /proc. An agent reaps its jobs' wrappers, and a wrapper its command,
    so an agent's third figure is the CPU of the jobs it ran."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    utime, stime, cutime, cstime = (int(f) / _CLK for f in fields[11:15])
    return utime, stime, cutime + cstime


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (its threads included), from /proc."""
    times = cpu_times(pid)
    return None if times is None else times[0] + times[1]


def settle_processes(
    pids: dict[str, int], *, quiet_cores: float = 0.15, window: float = 0.5, timeout: float = 30.0
) -> tuple[bool, float]:
    """Wait until the processes together use less than ``quiet_cores`` over ``window``
    seconds: an agent compiles and loads its eBPF programs, a server warms its caches
    after it says it is up, and a rate measured from the first submission would count
    that work as the workload's. (quiet, seconds waited); not quiet after ``timeout``."""
    t0 = time.perf_counter()
    while True:
        c0 = sum(cpu_seconds(p) or 0.0 for p in pids.values())
        time.sleep(window)
        used = sum(cpu_seconds(p) or 0.0 for p in pids.values()) - c0
        waited = time.perf_counter() - t0
        if used / window < quiet_cores:
            return True, waited
        if waited >= timeout:
            return False, waited


def machine_busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


class CpuMeter:
    """CPU seconds used by named processes between start() and stop(), and as a share of
    one core over the wall time (1.0 == one core fully busy). ``machine`` is the whole
    machine's busy cores out of os.cpu_count() in the same interval (other users'
    processes included), to tell "we are CPU-bound" from "the box is busy"."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.self_pid = os.getpid()
        self._t0 = 0.0
        self._c0: dict[str, float | None] = {}
        self._t0s: dict[str, tuple[float, float, float] | None] = {}
        self.result: dict[str, dict[str, float | None]] = {}

    def start(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._t0s = {n: cpu_times(p) for n, p in self.pids.items()}
        self._c0 = {n: None if t is None else t[0] + t[1] for n, t in self._t0s.items()}
        self._c0["this-process"] = time.process_time()
        self._m0 = machine_busy_jiffies()
        return self

    def stop(self) -> dict[str, dict[str, float | None]]:
        wall = time.perf_counter() - self._t0
        times = {n: cpu_times(p) for n, p in self.pids.items()}
        now = {n: None if t is None else t[0] + t[1] for n, t in times.items()}
        now["this-process"] = time.process_time()
        out: dict[str, dict[str, float | None]] = {}
        for n, c1 in now.items():
            c0 = self._c0.get(n)
            if c0 is None or c1 is None:
                continue
            used = c1 - c0
            out[n] = {"cpu_s": r(used), "cores": r(used / wall if wall > 0 else 0.0)}
            t0, t1 = self._t0s.get(n), times.get(n)
            if t0 is not None and t1 is not None:
                out[n]["kernel_s"] = r(t1[1] - t0[1])
                if t1[2] > t0[2]:  # processes it reaped (an agent: its jobs)
                    out[n]["reaped_children_s"] = r(t1[2] - t0[2])
        b1, t1 = machine_busy_jiffies()
        b0, t0 = self._m0
        ncpu = os.cpu_count() or 1
        if t1 > t0:
            out["machine"] = {
                "busy_cores": r(ncpu * (b1 - b0) / (t1 - t0)),
                "of_cores": ncpu,
                "wall_s": r(wall),
            }
        self.result = out
        return out

    def __enter__(self) -> CpuMeter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _py_spy_cmd() -> list[str] | None:
    exe = shutil.which("py-spy")
    if exe:
        return [exe]
    if shutil.which("uvx"):
        return ["uvx", "py-spy"]
    return None


class PySpy:
    """py-spy ``record --format raw --gil`` on several pids for the duration of a
    with-block; the summary gives the hottest functions (self and inclusive share of the
    samples in which some thread held the GIL, i.e. of the process's Python CPU time)."""

    def __init__(
        self, out_dir: str | Path | None, pids: dict[str, int], rate: int = 100, gil: bool = True
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.pids = pids
        self.rate = rate
        self.gil = gil  # only samples where a thread holds the GIL: where Python CPU goes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.summary: dict[str, Any] = {}

    def __enter__(self) -> PySpy:
        cmd = _py_spy_cmd()
        if self.out_dir is None:
            return self
        if cmd is None:
            log("--profile: py-spy not found (pip install py-spy, or have uvx); skipping")
            self.out_dir = None
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            out = self.out_dir / f"{name}.txt"
            self.procs[name] = subprocess.Popen(
                [
                    *cmd,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(self.rate),
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--threads",
                    *(["--gil"] if self.gil else []),
                    "-o",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=open(self.out_dir / f"{name}.py-spy.log", "wb"),
                start_new_session=True,
            )
        time.sleep(1.0)  # let py-spy attach before the measured phase
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGINT)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.out_dir is not None:
            for name in self.procs:
                f = self.out_dir / f"{name}.txt"
                if f.exists():
                    self.summary[name] = summarise_collapsed(f)
                    self.summary[name]["file"] = str(f)

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None


def _frame_name(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"; keep "func (file.py)"
    fn, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    fname = loc.rsplit("/", 1)[-1].split(":", 1)[0]
    return f"{fn} ({fname})" if fname else fn


def summarise_collapsed(path: Path, top: int = 12) -> dict[str, Any]:
    """Top functions by self samples and by inclusive samples, per thread and overall."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        total += k
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else ""
        if frames and frames[0].startswith("process"):
            frames = frames[1:]
            thread = frames[0] if frames and frames[0].startswith("thread") else thread
        if frames and frames[0].startswith("thread"):
            thread = frames[0]
            frames = frames[1:]
        threads[thread or "?"] += k
        names = [_frame_name(f) for f in frames]
        if names:
            self_c[names[-1]] += k
        for nm in set(names):
            incl_c[nm] += k

    def pct(c: Counter[str]) -> list[list[Any]]:
        return [[nm, round(100.0 * v / total, 1)] for nm, v in c.most_common(top)] if total else []

    return {
        "samples": total,
        "threads_pct": pct(threads),
        "self_pct": pct(self_c),
        "inclusive_pct": pct(incl_c),
    }


def wait_until(what: str, fn: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
