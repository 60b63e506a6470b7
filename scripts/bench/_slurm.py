"""A private, tuned single-machine Slurm (Debian's slurm-wlm) as a benchmark anchor.

``anchor(...)`` starts munged, slurmctld and N slurmd daemons on loopback in a temp dir
(their own ports, sockets, spool and state; nothing under /etc or /run is touched),
measures and stops everything again:

* ``par_submits_per_s``: ``clients`` concurrent clients each run
  ``sbatch --hold --wrap true`` back to back for ``seconds``; accepted submissions / elapsed. The jobs are submitted
  ``--hold`` so they stay Pending, like the Lattice submit benchmark's allocations on a
  cluster without agents (the controller still runs its scheduler on every submission).
* ``jobs_per_s`` per node count: ``jobs`` one-node ``sbatch --wrap true`` jobs
  submitted by ``clients`` concurrent sbatch loops; from the first submission until
  ``squeue`` shows none of them pending, running or completing (polled every 50 ms).

The Slurm config (see ``slurm_conf``) follows Slurm's high-throughput guide where it
applies to one host, plus what measuring here showed:

* ``SchedulerType=sched/builtin``: plain FIFO; every job here is identical, so
  backfill's planning is pure cost.
* ``SchedulerParameters=batch_sched_delay=0,sched_max_job_start=0,
  default_queue_depth=1000,partition_job_depth=0,max_rpc_cnt=0``: batch jobs are not
  held back for batching, the scheduler is not throttled by RPC load and starts as many
  jobs as there are free nodes (``sched_min_interval`` stays at its 2 us default: 0 is
  rejected). ``sched/backfill`` measured ~10 % slower here.
* ``Epilog=/bin/true``: the one setting that matters most. Without an epilog, slurmd
  answers the controller's terminate request directly and the freed node waits for the
  controller's 1 s background tick before the next job is started (~1 job/s per node);
  with one, slurmd sends MESSAGE_EPILOG_COMPLETE, which runs the scheduler at once
  (2.2 -> 15.7 jobs/s with 2 nodes here). A newly submitted job still waits for that
  tick (at most ~1 s, once per burst).
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
  ``JobAcctGatherType=jobacct_gather/none``, ``AccountingStorageType=none``,
  ``JobCompType=jobcomp/none``, ``MpiDefault=none``: no cgroups, no accounting, no
  per-step sampling (Lattice's dev cluster does not account either).
* ``SelectType=select/cons_tres`` with one CPU per node: one job per node at a time,
  like Lattice's exclusive nodes.
* ``MinJobAge=10``: finished jobs leave the controller's table quickly, keeping its
  state small; ``MaxJobCount=500000`` so the submit test never hits the limit.
* Logging at ``error`` only; ``SlurmctldDebug``/``SlurmdDebug`` writes cost time.
* Several slurmd on one host: ``slurmd -N nodeN``, one ``NodeName`` line per node with
  its own ``Port`` (Debian's slurmd accepts ``-N``).

Daemons run as root (``SlurmUser=root``); munged runs with ``--force`` against a copy of
the key and its own socket, passed to every Slurm program by ``AuthInfo=socket=``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import remove_at_exit

SBIN = ("/usr/sbin", "/usr/bin")


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([*SBIN, os.environ.get("PATH", "")]))


def available() -> str | None:
    """None when slurm-wlm and munge are installed; otherwise why not."""
    missing = [n for n in ("slurmctld", "slurmd", "sbatch", "squeue", "munged") if not _which(n)]
    if missing:
        return "not installed: " + ", ".join(missing) + " (apt-get install -y slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the anchor runs slurmctld/slurmd/munged as root; not root"
    return None


def ensure_installed() -> str | None:
    """Install slurm-wlm + munge with apt when missing (root only). None when ready."""
    why = available()
    if why is None or os.geteuid() != 0 or not shutil.which("apt-get"):
        return why
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"]
    rc = subprocess.run(cmd, env=env, capture_output=True, check=False).returncode
    if rc != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
        subprocess.run(cmd, env=env, capture_output=True, check=False)
    return available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_conf(base: Path, nodes: int, ctl_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=anchor",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={base}/munge/munge.socket",
        f"SlurmctldPort={ctl_port}",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool/%n",
        f"SlurmctldPidFile={base}/run/slurmctld.pid",
        f"SlurmdPidFile={base}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log",
        f"SlurmdLogFile={base}/log/slurmd-%n.log",
        "SlurmctldDebug=error",
        "SlurmdDebug=error",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=batch_sched_delay=0,sched_max_job_start=0,"
        "default_queue_depth=1000,partition_job_depth=0,max_rpc_cnt=0",
        "ReturnToService=2",
        "MinJobAge=10",
        "MaxJobCount=500000",
        "KillWait=5",
        "InactiveLimit=0",
        "Waittime=0",
        "MessageTimeout=30",
        f"PlugStackConfig={base}/plugstack.conf",
        # with an epilog slurmd reports MESSAGE_EPILOG_COMPLETE, which runs the scheduler
        # at once; without one a freed node waits for the controller's 1 s background tick
        "Epilog=/bin/true",
    ]
    for i, port in enumerate(node_ports[:nodes], 1):
        lines.append(
            f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 "
            "RealMemory=1000 State=UNKNOWN"
        )
    lines.append("PartitionName=anchor Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmd, all in ``base``; ``env`` for the clients."""

    def __init__(self, base: Path, nodes: int) -> None:
        self.base = base
        self.nodes = nodes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
        self.conf_text = ""

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "wb")  # noqa: SIM115 - lives with the proc
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def start(self, timeout: float = 60.0) -> None:
        b = self.base
        for d in (
            "munge",
            "state",
            "run",
            "log",
            *(f"spool/n{i}" for i in range(1, 1 + self.nodes)),
        ):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o700)
        key = b / "munge" / "munge.key"
        if Path("/etc/munge/munge.key").exists():
            shutil.copyfile("/etc/munge/munge.key", key)
        else:
            key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--socket={b}/munge/munge.socket",
                f"--key-file={key}",
                f"--pid-file={b}/munge/munged.pid",
                f"--log-file={b}/log/munged.log",
                f"--seed-file={b}/munge/munged.seed",
                "--num-threads=4",
            ],
        )
        _wait(lambda: (b / "munge" / "munge.socket").exists(), 10, "munged socket")
        ctl_port = _free_port()
        node_ports = [_free_port() for _ in range(self.nodes)]
        self.conf_text = slurm_conf(b, self.nodes, ctl_port, node_ports)
        (b / "slurm.conf").write_text(self.conf_text)
        (b / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        (b / "plugstack.conf").write_text("")
        conf = str(b / "slurm.conf")
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", conf])
        for i in range(1, 1 + self.nodes):
            self._spawn(
                f"slurmd-n{i}", [_which("slurmd") or "slurmd", "-D", "-N", f"n{i}", "-f", conf]
            )
        _wait(self._all_idle, timeout, f"{self.nodes} idle slurmd nodes", self._check_alive)

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                out = (self.base / "log" / f"{name}.out").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with {p.returncode}: {out}")

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = [ln.split()[1] for ln in out.splitlines() if len(ln.split()) == 2]
        return len(states) == self.nodes and all(s == "idle" for s in states)

    def run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def active_jobs(self) -> int:
        out = self.run(["squeue", "-h", "-t", "PD,CF,R,CG", "-o", "%i"], check=False).stdout.split()
        return len(out)

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(["scancel", "--full", "-u", "root"], check=False)
        for name in sorted(self.procs, key=lambda n: n == "munged"):  # munged last
            p = self.procs[name]
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def _wait(fn: Any, timeout: float, what: str, check: Any = None, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
        if fn():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextlib.contextmanager
def slurm_cluster(nodes: int, keep: bool = False) -> Iterator[SlurmCluster]:
    base = Path(tempfile.mkdtemp(prefix="slurm-anchor-"))
    c = SlurmCluster(base, nodes)
    # a SIGTERM (timeout, CI cancel) must still stop the daemons: they run in their own
    # sessions and would outlive this process
    prev = None
    if threading.current_thread() is threading.main_thread():
        prev = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if not keep:
            remove_at_exit(base)
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _sbatch_loop(
    c: SlurmCluster, args: list[str], stop: Any, counts: list[int], errs: list[str], i: int
) -> None:
    cmd = ["sbatch", "--parsable", "-N1", "-n1", "-o", "/dev/null", "-e", "/dev/null", *args]
    while not stop():
        p = subprocess.run(cmd, env=c.env, capture_output=True, text=True, check=False)
        if p.returncode == 0:
            counts[i] += 1
        elif len(errs) < 5:
            errs.append(p.stderr.strip()[:200])


def par_submit_rate(c: SlurmCluster, clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` threads each running ``sbatch --hold --wrap true`` back to back."""
    counts = [0] * clients
    errs: list[str] = []
    t_end = time.monotonic() + seconds
    t0 = time.monotonic()
    threads = [
        threading.Thread(
            target=_sbatch_loop,
            args=(
                c,
                ["--hold", "--wrap", "true"],
                lambda: time.monotonic() >= t_end,
                counts,
                errs,
                i,
            ),
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    n = sum(counts)
    c.run(["scancel", "--full", "-u", "root"], check=False)
    return {
        "clients": clients,
        "submitted": n,
        "elapsed_s": round(elapsed, 3),
        "par_submits_per_s": round(n / elapsed, 1),
        "errors": errs,
    }


def end_to_end(c: SlurmCluster, jobs: int, clients: int, timeout: float = 600) -> dict[str, Any]:
    """``jobs`` trivial one-node jobs through sbatch; first submit -> none left active."""
    _wait(lambda: c.active_jobs() == 0, 120, "an empty queue")
    counts = [0] * clients
    errs: list[str] = []
    lock = threading.Lock()
    left = [jobs]

    def take() -> bool:  # True = stop
        with lock:
            if left[0] <= 0:
                return True
            left[0] -= 1
            return False

    t0 = time.monotonic()
    threads = [
        threading.Thread(target=_sbatch_loop, args=(c, ["--wrap", "true"], take, counts, errs, i))
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_sub = time.monotonic() - t0
    deadline = t0 + timeout
    while c.active_jobs() > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Slurm jobs still active after {timeout:.0f}s")
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    n = sum(counts)
    return {
        "nodes": c.nodes,
        "jobs": n,
        "elapsed_s": round(elapsed, 3),
        "submit_phase_s": round(t_sub, 3),
        "jobs_per_s": round(n / elapsed, 1),
        "errors": errs,
    }


def anchor(
    *,
    node_counts: tuple[int, ...] = (2, 8),
    jobs: int = 500,
    submit_clients: int = 16,
    submit_seconds: float = 10.0,
    submit_windows: int = 1,
    e2e_clients: int = 16,
    e2e_runs: int = 1,
    measure_submit: bool = True,
    keep: bool = False,
) -> dict[str, Any]:
    """Slurm's parallel sbatch rate (on the first node count's cluster; the median of
    ``submit_windows`` windows of ``submit_seconds``) and its end-to-end trivial-job rate
    per node count (the median of ``e2e_runs`` runs on one cluster); every daemon is
    stopped before returning."""
    why = ensure_installed()
    if why is not None:
        return {"available": False, "reason": why}
    out: dict[str, Any] = {"available": True, "version": _version(), "e2e": {}}
    load0 = os.getloadavg()
    for k, nodes in enumerate(node_counts):
        with slurm_cluster(nodes, keep=keep) as c:
            if k == 0:
                out["config"] = c.conf_text.replace(str(c.base), "$BASE")
            if measure_submit and k == 0:
                # the median of several windows: one window's rate moved by up to a third
                # between invocations on a shared 2-core machine
                windows = [
                    par_submit_rate(c, submit_clients, submit_seconds)
                    for _ in range(max(1, submit_windows))
                ]
                out["submit"] = _median_run(windows, "par_submits_per_s", "windows")
                out["par_submits_per_s"] = out["submit"]["par_submits_per_s"]
            if jobs > 0:
                runs = [end_to_end(c, jobs, e2e_clients) for _ in range(max(1, e2e_runs))]
                out["e2e"][str(nodes)] = _median_run(runs, "jobs_per_s", "run_rates")
    out["jobs_per_s"] = {n: v["jobs_per_s"] for n, v in out["e2e"].items()}
    out["loadavg_before"] = [round(x, 2) for x in load0]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _median_run(runs: list[dict[str, Any]], key: str, every: str) -> dict[str, Any]:
    """The run whose ``key`` is the median (the upper one of an even count: a real run,
    never an average), with every run's ``key`` under ``every``."""
    rates = [r[key] for r in runs]
    median = sorted(rates)[len(rates) // 2]
    return {**next(r for r in runs if r[key] == median), every: rates}


def _version() -> str:
    p = subprocess.run(
        [_which("slurmctld") or "slurmctld", "-V"], capture_output=True, text=True, check=False
    )
    return p.stdout.strip()
