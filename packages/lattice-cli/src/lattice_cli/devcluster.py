"""A whole Lattice cluster on one machine, as real processes on loopback.

Used by ``lattice dev up`` and by the test harness: 1 or 3 ``lattice-server``
members, one ``lattice-scheduler`` per vCluster and N ``lattice-agent`` processes,
each with its own config, data directory and log file under ``base_dir``. Synchronous
on purpose (subprocess + urllib) so both a CLI command and pytest fixtures can drive it.

``secure=True`` (`lattice dev up --secure`) runs it as production does: TLS, mTLS
between components, OIDC against a local identity provider (lattice_cli.devsecure).

``tsdb=True`` (the default when the ``victoria-metrics`` binary is installed) starts a
VictoriaMetrics on loopback first (data in ``<base>/victoria-metrics``, log in
``logs/victoria-metrics.log``) and gives every process it starts
``LATTICE_TELEMETRY__TSDB_ENDPOINT`` (agents push there, the API queries there).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from lattice_cli.devsecure import SecureSetup


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now for a process started later to listen on.

    Not ``bind(0)``: that hands out ports of the kernel's ephemeral range, where any
    outgoing connection on the machine may take the port before the process binds it,
    and may return the same port to two calls in a row (a member's gRPC port was once
    its peer's REST port). The port is drawn at random below the ephemeral range, from
    a slice of its own per pytest-xdist worker, and never handed out twice by this
    process."""
    lo, hi = _ephemeral_range()
    first, last = (20000, lo - 1) if lo - 20000 >= 2000 else (hi + 1, 65535)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and workers > 1:
        size = (last - first + 1) // workers
        first += int(worker[2:]) % workers * size
        last = first + size - 1
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randint(first, last)
        if port not in _handed_out and port_free(port):
            _handed_out.add(port)
            return port
    raise ClusterError(f"no free loopback port in {first}-{last}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Member:
    id: int
    raft_port: int
    grpc_port: int
    rest_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    scheme: str = "http"

    @property
    def rest_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.rest_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class AgentProc:
    node_id: str
    dir: Path
    group: int
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    tls_args: list[str] = field(default_factory=list)  # its bootstrap certificate (secure)


class ClusterError(RuntimeError):
    pass


_PROBLEM_MARKS = ('"level": "warning"', '"level": "error"', '"level": "critical"', "Traceback")


# --- the TSDB (VictoriaMetrics) ----------------------------------------------------------
TSDB_BINARY = "victoria-metrics"


def tsdb_installed() -> bool:
    return shutil.which(TSDB_BINARY) is not None


def tsdb_argv(data_dir: Path, port: int) -> list[str]:
    """The flags of lattice_test_harness.victoria (what was pushed is queryable at once:
    no 30 s latency offset, no cache; a sample pushed twice is stored once)."""
    return [
        TSDB_BINARY,
        f"-storageDataPath={data_dir}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-retentionPeriod=7d",
        "-search.latencyOffset=1s",
        "-search.maxStepForPointsAdjustment=0s",
        "-search.disableCache",
        "-dedup.minScrapeInterval=1ms",
        "-loggerLevel=WARN",
    ]


# vClusters a dev cluster creates get their scheduler type from their name
DEV_SCHEDULER_TYPES = {
    "interactive": "interactive-fifo",
    "service": "service-binpack",
    "sensitive": "sensitive-reservation",
}


class LocalCluster:
    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        members: int = 1,
        agents: int = 2,
        vclusters: tuple[str, ...] = ("default",),
        tenant: str = "default",
        groups: int = 2,
        cycle_interval: float = 5.0,
        heartbeat_interval: float = 10.0,
        heartbeat_timeout: float = 30.0,
        grace_period: float = 60.0,
        walltime_grace: float = 30.0,
        preferred_ports: bool = False,
        env: dict[str, str] | None = None,
        agent_homes: tuple[str, ...] = (),
        agent_args: tuple[str, ...] = (),
        secure: bool = False,
        tsdb: bool | None = None,
        accounting: bool | str = False,
        accounting_options: dict[str, Any] | None = None,
        checkpoint_broker: bool = True,
    ) -> None:
        if members not in (1, 3, 5):
            raise ClusterError("a quorum has 1, 3 or 5 members")
        self.base = Path(base_dir).resolve()
        self.n_members = members
        self.n_agents = agents
        self.vclusters = tuple(vclusters)
        self.tenant = tenant
        self.groups = max(1, groups)
        self.cycle_interval = cycle_interval
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.grace_period = grace_period
        self.walltime_grace = walltime_grace
        self.agent_homes = tuple(agent_homes)  # home vCluster pool per agent, in order
        self.agent_args = tuple(agent_args)  # extra lattice-agent flags (they win)
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # allocation output flushed into this cluster's own log store (not the default
        # /var/lib/lattice/log-store, which every cluster of the machine would share and
        # nothing would clean), unless the environment names a log store
        if not any(k.upper().startswith("LATTICE_STORAGE__LOG_STORE") for k in self.env):
            self.env["LATTICE_STORAGE__LOG_STORE_DIR"] = str(self.base / "log-store")
        # checkpoints: one directory of this cluster, shared by its agents (a job resumes
        # on any node), unless the environment names one
        self.env.setdefault("LATTICE_CHECKPOINT__CHECKPOINT_ROOT", str(self.base / "checkpoints"))
        # the broker's write probe wants a file-system destination to exist (as a mount
        # would); an s3:// root (or a wrong one, which the components refuse with a
        # hint) is no directory of the working directory
        root = self.env["LATTICE_CHECKPOINT__CHECKPOINT_ROOT"].strip()
        if os.path.isabs(root):
            with contextlib.suppress(OSError):
                Path(root).mkdir(parents=True, exist_ok=True)
        self.members: list[Member] = []
        self.schedulers: dict[str, subprocess.Popen[bytes]] = {}
        self.agents: list[AgentProc] = []
        self.secure: SecureSetup | None = None
        self.idp_proc: subprocess.Popen[bytes] | None = None
        self.idp_port = 0
        # the TSDB: None = start it when the binary is installed
        self.tsdb = tsdb_installed() if tsdb is None else tsdb
        self.tsdb_proc: subprocess.Popen[bytes] | None = None
        self.tsdb_port = 0
        # lattice-accounting: off, True (SQLite under the cluster dir) or a database URL
        # (postgresql+asyncpg://...); accounting_options: more of the accounting section
        self.accounting = accounting
        self.accounting_options = dict(accounting_options or {})
        self.accounting_proc: subprocess.Popen[bytes] | None = None
        # lattice-checkpoint, the checkpoint broker (its /metrics on a free port)
        self.checkpoint_broker = checkpoint_broker
        self.broker_proc: subprocess.Popen[bytes] | None = None
        self.broker_metrics_port = free_port() if checkpoint_broker else 0
        self.accounting_port = 0
        self.accounting_token = ""
        if accounting:
            import secrets

            self.accounting_port = free_port()
            self.accounting_token = secrets.token_urlsafe(24)
        if self.tsdb:
            self.tsdb_port = 8428 if preferred_ports and port_free(8428) else free_port()
            self.env["LATTICE_TELEMETRY__TSDB_ENDPOINT"] = self.tsdb_url
        if secure:
            from lattice_cli.devsecure import SecureSetup

            self.secure = SecureSetup(self.base)
            self.idp_port = free_port()
            self.secure.issuer = f"http://127.0.0.1:{self.idp_port}/realms/lattice"
        self._layout(preferred_ports)

    # --- layout and config --------------------------------------------------------

    def _layout(self, preferred: bool) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "logs").mkdir(exist_ok=True)
        saved = self.base / "cluster.json"
        if saved.exists():
            data = json.loads(saved.read_text())
            if data.get("members") == self.n_members:
                self.members = [Member(dir=Path(m.pop("dir")), **m) for m in data["ports"]]
        if not self.members:
            for i in range(1, self.n_members + 1):
                want = (9000 + i - 1, 50051 + i - 1, 8080 + i - 1) if preferred else (0, 0, 0)
                ports = [p if p and port_free(p) else free_port() for p in want]
                self.members.append(Member(i, *ports, dir=self.base / f"member-{i}"))
            saved.write_text(
                json.dumps(
                    {
                        "members": self.n_members,
                        "ports": [
                            {
                                "id": m.id,
                                "raft_port": m.raft_port,
                                "grpc_port": m.grpc_port,
                                "rest_port": m.rest_port,
                                "dir": str(m.dir),
                            }
                            for m in self.members
                        ],
                    }
                )
            )
        for m in self.members:
            m.scheme = "https" if self.secure is not None else "http"
            m.dir.mkdir(parents=True, exist_ok=True)
            (m.dir / "config.yaml").write_text(yaml.safe_dump(self.member_config(m)))
        for i in range(self.n_agents):
            self.agents.append(self._agent_proc(i))

    def _agent_proc(self, i: int) -> AgentProc:
        node_id = f"node-{i + 1:03d}"
        d = self.base / "agents" / node_id
        d.mkdir(parents=True, exist_ok=True)
        home = self.agent_homes[i] if i < len(self.agent_homes) else ""
        return AgentProc(
            node_id=node_id,
            dir=d,
            group=i % self.groups,
            args=["--home-vcluster", home] if home else [],
        )

    def member_config(self, m: Member) -> dict[str, Any]:
        cfg = self._plain_member_config(m)
        if self.secure is not None:
            for section, values in self.secure.member_config(f"member-{m.id}").items():
                cfg.setdefault(section, {}).update(values)
        return cfg

    def _plain_member_config(self, m: Member) -> dict[str, Any]:
        return {
            "quorum": {
                "node_id": m.id,
                "bind": f"127.0.0.1:{m.raft_port}",
                "data_dir": str(m.dir / "raft"),
                "peers": [
                    {
                        "id": p.id,
                        "address": f"127.0.0.1:{p.raft_port}",
                        "api_address": p.grpc_address,
                    }
                    for p in self.members
                    if p.id != m.id
                ],
            },
            "api": {
                "grpc_listen": m.grpc_address,
                "rest_listen": f"127.0.0.1:{m.rest_port}",
            },
            "node_agent": {
                "heartbeat_interval_seconds": self.heartbeat_interval,
                "heartbeat_timeout_seconds": self.heartbeat_timeout,
                "grace_period_seconds": self.grace_period,
                "walltime_grace_seconds": self.walltime_grace,
            },
            "scheduling": {"cycle_interval_seconds": self.cycle_interval},
            # one history store for every member (whichever leads writes it)
            "storage": {"history_database_url": self.history_url},
            **({"accounting": self._accounting_section()} if self.accounting else {}),
        }

    # --- accounting ---------------------------------------------------------------------

    def _accounting_section(self) -> dict[str, Any]:
        """The ``accounting`` section lattice-server and lattice-accounting share."""
        section: dict[str, Any] = {
            "enabled": True,
            "provider": "none",
            "listen": f"127.0.0.1:{self.accounting_port}",
            "service_token": self.accounting_token,
            "data_dir": str(self.base / "accounting"),
            "metrics_listen": "",
            "disk_buffer_path": str(self.base / "accounting" / "wal"),
        }
        if isinstance(self.accounting, str):
            section["database_url"] = self.accounting
        section.update(self.accounting_options)
        return section

    @property
    def history_url(self) -> str:
        """The history store every member and lattice-accounting share (one SQLite file)."""
        return f"sqlite+aiosqlite:///{(self.base / 'history.db').resolve()}"

    @property
    def accounting_url(self) -> str:
        return f"http://127.0.0.1:{self.accounting_port}"

    def start_accounting(self, timeout: float = 30.0) -> None:
        """lattice-accounting (when the cluster has accounting), ready when its internal
        API answers."""
        if not self.accounting:
            return
        cfg: dict[str, Any] = {
            "accounting": self._accounting_section(),
            "storage": {"history_database_url": self.history_url},  # the members' store
        }
        if self.secure is not None:
            cfg.update(self.secure.scheduler_config("accounting"))
        path = self.base / "accounting.yaml"
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)  # holds the service token
        self.accounting_proc = self._spawn(
            "accounting",
            "lattice_accounting.main",
            ["--config", str(path), "--quorum-endpoint", self.grpc_endpoints],
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.accounting_proc.poll() is not None:
                raise ClusterError(f"lattice-accounting exited; see {self.log_path('accounting')}")
            try:
                with urllib.request.urlopen(self.accounting_url + "/healthz", timeout=1) as r:
                    if json.loads(r.read()).get("ok"):
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        raise ClusterError(f"lattice-accounting did not start; see {self.log_path('accounting')}")

    def stop_accounting(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        _stop(self.accounting_proc, sig, timeout)
        self.accounting_proc = None

    @property
    def grpc_endpoints(self) -> str:
        return ",".join(m.grpc_address for m in self.members)

    @property
    def rest_url(self) -> str:
        return self.members[0].rest_url

    def log_path(self, name: str) -> Path:
        return self.base / "logs" / f"{name}.log"

    def diagnosis(self, per_log: int = 4) -> str:
        """What an error that timed out should carry (CI keeps no log directory): the
        log tails of the members, schedulers, broker, accounting and agents that have
        exited, then the last warnings and errors of those still running."""
        procs = [(f"member-{m.id}", m.proc) for m in self.members]
        procs += [(f"scheduler-{vc}", p) for vc, p in self.schedulers.items()]
        procs += [("checkpoint", self.broker_proc), ("accounting", self.accounting_proc)]
        procs += [(f"agent-{a.node_id}", a.proc) for a in self.agents]
        exited, problems = [], []
        for name, proc in procs:
            tail = self._log_tail(name)
            if proc is not None and proc.poll() is not None:
                exited.append(
                    f"\n--- {name} exited with {proc.returncode}:\n" + "\n".join(tail[-15:])
                )
            elif proc is not None:
                bad = [ln for ln in tail if any(k in ln for k in _PROBLEM_MARKS)][-per_log:]
                problems += [f"\n  {name}: {ln[:400]}" for ln in bad]
        return "".join(exited) + ("\nrecent warnings:" + "".join(problems) if problems else "")

    def _log_tail(self, name: str, size: int = 65536) -> list[str]:
        try:
            with open(self.log_path(name), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - size))
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        logf = open(self.log_path(name), "ab")  # noqa: SIM115 (kept open by the child)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # Ctrl-C in the terminal reaches only `dev up`
            )
        finally:
            logf.close()

    # --- members --------------------------------------------------------------------

    def start_member(self, m: Member, recover_from: Path | None = None) -> None:
        """``recover_from``: a backup file this member restores into its (empty) data
        directory (``lattice-server --recover-from``, spec: Backup & Restore)."""
        args = ["--config", str(m.dir / "config.yaml")]
        if recover_from is not None:
            args += ["--recover-from", str(recover_from)]
        if m.id == 1 and not (m.dir / "raft" / "cluster.json").exists():
            args.append("--bootstrap")
        m.proc = self._spawn(f"member-{m.id}", "lattice_api.main", args)

    def stop_member(self, m: Member, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        _stop(m.proc, sig, timeout)
        m.proc = None

    def leader(self, timeout: float = 15.0) -> Member:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is None or m.proc.poll() is not None:
                    continue
                h = self._get(m.rest_url + "/healthz", quiet=True)
                if h and h.get("is_leader"):
                    return m
            time.sleep(0.05)
        raise ClusterError(
            f"no Raft leader within {timeout:.0f}s; see {self.base / 'logs'}" + self.diagnosis()
        )

    # --- schedulers and agents ----------------------------------------------------------

    def start_scheduler(self, vcluster: str) -> None:
        config: list[str] = []
        if self.secure is not None:
            path = self.base / f"scheduler-{vcluster}.yaml"
            path.write_text(yaml.safe_dump(self.secure.scheduler_config(f"scheduler-{vcluster}")))
            config = ["--config", str(path)]
        self.schedulers[vcluster] = self._spawn(
            f"scheduler-{vcluster}",
            "lattice_scheduler.main",
            [
                *config,
                "--vcluster",
                vcluster,
                "--quorum-endpoint",
                self.grpc_endpoints,
                "--cycle-interval",
                str(self.cycle_interval),
                "--metrics-listen",
                "",
            ],
        )

    def start_broker(self) -> None:
        """lattice-checkpoint against this cluster (config from the environment, e.g.
        LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS)."""
        config: list[str] = []
        if self.secure is not None:
            path = self.base / "checkpoint.yaml"
            path.write_text(yaml.safe_dump(self.secure.scheduler_config("checkpoint")))
            config = ["--config", str(path)]
        self.broker_proc = self._spawn(
            "checkpoint",
            "lattice_checkpoint.main",
            [
                *config,
                "--quorum-endpoint",
                self.grpc_endpoints,
                "--metrics-listen",
                f"127.0.0.1:{self.broker_metrics_port}",
                "--history-database-url",
                self.history_url,
            ],
        )

    def stop_broker(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        _stop(self.broker_proc, sig, timeout)
        self.broker_proc = None

    def start_agent(self, a: AgentProc) -> None:
        a.proc = self._spawn(
            f"agent-{a.node_id}",
            "lattice_agent.main",
            [
                "--node-id",
                a.node_id,
                "--quorum-endpoint",
                self.grpc_endpoints,
                "--listen",
                "127.0.0.1:0",
                "--state-file",
                str(a.dir / "agent-state.json"),
                "--work-dir",
                str(a.dir / "work"),
                "--log-dir",
                str(a.dir / "logs"),
                "--heartbeat-interval",
                str(self.heartbeat_interval),
                "--walltime-grace",
                str(self.walltime_grace),
                "--group",
                str(a.group),
                "--metrics-listen",
                "",
                # agents share this host: each needs its own cgroup parent (else one agent's
                # orphan cleanup would remove another's scopes)
                "--cgroup-slice",
                f"{self.cgroup_slice}/{a.node_id}.slice",
                # dev users (alice, ...) have no account here: jobs run as the agent, and
                # their scratch stays inside the agent's own directory
                "--run-as",
                "agent",
                "--scratch-root",
                str(a.dir / "scratch"),
                "--cache-dir",
                str(a.dir / "cache"),
                *a.tls_args,
                *a.args,
                *self.agent_args,
            ],
        )

    def stop_agent(self, a: AgentProc, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        _stop(a.proc, sig, timeout)
        a.proc = None

    def add_agent(self, **kw: Any) -> AgentProc:
        a = self._agent_proc(len(self.agents))
        self.agents.append(a)
        self._bootstrap(a)
        self.start_agent(a)
        return a

    def _bootstrap(self, a: AgentProc) -> None:
        """Secure clusters: a fresh bootstrap certificate for the agent's first contact."""
        if self.secure is None:
            return

        def issue(kind: str, name: str, csr: str) -> dict[str, Any]:
            body = {"kind": kind, "name": name, "csr_pem": csr}
            return self._post(self.rest_url + "/api/v1/admin/ca/issue", body)

        a.tls_args = self.secure.bootstrap_agent(issue, a.node_id, a.dir)

    @property
    def tsdb_url(self) -> str:
        """The VictoriaMetrics base URL ("" without a TSDB)."""
        return f"http://127.0.0.1:{self.tsdb_port}" if self.tsdb else ""

    def start_tsdb(self, timeout: float = 15.0) -> None:
        """VictoriaMetrics on loopback, before anything that pushes to or queries it."""
        if not self.tsdb or (self.tsdb_proc is not None and self.tsdb_proc.poll() is None):
            return
        if not tsdb_installed():
            raise ClusterError(
                f"tsdb=True but {TSDB_BINARY} is not installed "
                "(Debian: apt-get install victoria-metrics)"
            )
        data = self.base / "victoria-metrics"
        data.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path("victoria-metrics"), "ab")  # noqa: SIM115 (kept by the child)
        try:
            self.tsdb_proc = subprocess.Popen(
                tsdb_argv(data, self.tsdb_port),
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            logf.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.tsdb_proc.poll() is not None:
                raise ClusterError(
                    f"{TSDB_BINARY} exited with {self.tsdb_proc.returncode}; "
                    f"see {self.log_path('victoria-metrics')}"
                )
            try:
                with urllib.request.urlopen(self.tsdb_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{TSDB_BINARY} did not answer on {self.tsdb_url} within {timeout:.0f}s; "
                    f"see {self.log_path('victoria-metrics')}"
                )
            time.sleep(0.05)

    def stop_tsdb(self) -> None:
        _stop(self.tsdb_proc, signal.SIGTERM, 10)
        self.tsdb_proc = None

    def start_idp(self, timeout: float = 15.0) -> None:
        """Secure clusters: the identity provider, before the members (they fetch its
        keys at start)."""
        if self.secure is None or (self.idp_proc is not None and self.idp_proc.poll() is None):
            return
        self.secure.idp_info.unlink(missing_ok=True)
        self.idp_proc = self._spawn(
            "idp", "lattice_test_harness.fake_idp", self.secure.idp_args(self.idp_port)
        )
        deadline = time.monotonic() + timeout
        while not self.secure.read_idp_info():
            if self.idp_proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(
                    f"the identity provider did not start; see {self.log_path('idp')} "
                    "(--secure needs the lattice-test-harness package)"
                )
            time.sleep(0.05)

    # --- whole cluster ------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        self.start_tsdb()
        self.start_idp()
        for m in self.members:
            self.start_member(m)
        leader = self.leader(timeout)
        self.ensure_defaults(leader)
        for vc in self.vclusters:
            self.start_scheduler(vc)
        if self.checkpoint_broker:
            self.start_broker()
        self.start_accounting(timeout)
        for a in self.agents:
            self._bootstrap(a)
            self.start_agent(a)
        self.wait_for_nodes(self.n_agents, timeout)

    def ensure_defaults(self, leader: Member) -> None:
        if self.secure is not None:  # the internal CA that signs the agents' certificates
            self._post(leader.rest_url + "/api/v1/admin/ca", {}, ok_conflict=True)
        self._post(leader.rest_url + "/api/v1/tenants", {"name": self.tenant}, ok_conflict=True)
        for vc in self.vclusters:
            st = DEV_SCHEDULER_TYPES.get(vc, "hpc-backfill")
            self._post(
                leader.rest_url + "/api/v1/vclusters",
                {"name": vc, "scheduler_type": st, "cycle_interval_seconds": self.cycle_interval},
                ok_conflict=True,
            )

    def wait_for_nodes(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        nodes: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            nodes = (self._get(self.rest_url + "/api/v1/nodes", quiet=True) or {}).get("nodes", [])
            if sum(1 for n in nodes if n["state"] == "Ready") >= count:
                return
            time.sleep(0.1)
        seen = ", ".join(f"{n['id']} {n['state']}" for n in nodes) or "none"
        raise ClusterError(
            f"{count} agents did not register within {timeout:.0f}s (nodes: {seen}); "
            f"see {self.base / 'logs'}" + self.diagnosis()
        )

    def stop(self) -> None:
        for a in self.agents:
            self.stop_agent(a)
        for p in self.schedulers.values():
            _stop(p, signal.SIGTERM, 10)
        self.schedulers.clear()
        self.stop_broker()
        self.stop_accounting()
        for m in self.members:
            self.stop_member(m)
        _stop(self.idp_proc, signal.SIGTERM, 5)
        self.idp_proc = None
        self.stop_tsdb()  # last: agents flush their telemetry into it on the way out
        self.kill_workloads()

    @property
    def cgroup_slice(self) -> str:
        """The cgroup parent of this cluster's agents (one ``<node>.slice`` each below)."""
        import hashlib

        return f"lattice-dev-{hashlib.sha1(str(self.base).encode()).hexdigest()[:10]}.slice"

    def remove_cgroups(self, root: Path = Path("/sys/fs/cgroup")) -> None:
        """Best effort: kill what is left in this cluster's cgroup scopes and remove them
        (v2: one tree under ``root``; v1: the same tree under each controller)."""
        tops = [root / self.cgroup_slice]
        if not (root / "cgroup.controllers").exists():
            with contextlib.suppress(OSError):
                tops = [c / self.cgroup_slice for c in root.iterdir() if c.is_dir()]
        for top in tops:
            if not top.is_dir():
                continue
            dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for d in [*dirs, top]:
                for _ in range(50):
                    with contextlib.suppress(OSError):
                        for pid in (d / "cgroup.procs").read_text().split():
                            with contextlib.suppress(ProcessLookupError, PermissionError):
                                os.kill(int(pid), signal.SIGKILL)
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)

    def kill_workloads(self) -> None:
        """Workloads outlive their agent by design; a dev cluster going away takes them along."""
        for a in self.agents:
            state = a.dir / "agent-state.json"
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(state.read_text())
                allocs = data.get("allocations", data) if isinstance(data, dict) else data
                items = allocs.values() if isinstance(allocs, dict) else allocs
                for rec in items:
                    pgid = rec.get("pgid") if isinstance(rec, dict) else None
                    if pgid:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(int(pgid), signal.SIGKILL)
        self.remove_cgroups()

    def cli_config(self) -> dict[str, Any]:
        cfg = {"endpoint": self.rest_url, "tenant": self.tenant, "vcluster": self.vclusters[0]}
        if self.secure is not None:
            cfg["ca_cert"] = str(self.secure.ca_cert)
        return cfg

    def write_cli_config(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.cli_config()))
        return path

    # --- tiny HTTP helpers (no event loop needed) ------------------------------------

    def auth_for(self, url: str) -> tuple[dict[str, str], Any]:
        """(headers, TLS context) of the cluster's own calls: a system-admin token and
        the site CA on a secure cluster (not for /healthz, which is public)."""
        if self.secure is None:
            return {}, None
        headers = (
            {}
            if url.endswith("/healthz")
            else {"Authorization": f"Bearer {self.secure.admin_token()}"}
        )
        return headers, self.secure.client_context()

    def _get(self, url: str, quiet: bool = False) -> Any:
        try:
            headers, context = self.auth_for(url)
            req = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(req, timeout=2, context=context) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            if quiet:
                return None
            raise

    def _post(self, url: str, body: dict[str, Any], ok_conflict: bool = False) -> Any:
        headers, context = self.auth_for(url)
        req = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=10, context=context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if ok_conflict and e.code == 409:
                return None
            raise ClusterError(
                f"POST {url} failed: {e.code} {e.read().decode(errors='replace')}"
            ) from None


def _stop(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
