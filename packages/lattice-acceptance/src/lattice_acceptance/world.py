"""The world of a scenario on a real local cluster, and the step helpers that more than
one step module needs. Not a test module: helpers only, no step definitions (each step
module binds its own steps).

A ``World`` either starts its own cluster with ``cluster_factory`` (one quorum member,
1 s scheduler cycles, one or more agents running real processes: test_scheduling_bdd.py,
test_fair_share_bdd.py) or runs on the step module's shared ``lattice_cluster``
(:meth:`World.on`: test_bad_input_bdd.py, test_task_groups_bdd.py,
test_node_agents_bdd.py). User actions go through the real
``lattice`` CLI (as the user the step names: the CLI sends ``$USER`` as the identity);
the REST API is read to observe states, nodes and timestamps precisely.

Jobs are batch scripts written to the scenario's temporary directory. Each script
appends its name to a shared ``order`` file when it starts (which job ran first) and
prints ``started NAME`` / ``finished NAME`` (what ``lattice logs`` shows); long ones wait
for a ``release`` file so that a step decides when they end. A step module's ``world``
fixture calls :meth:`World.clean_up` after the scenario: it releases and cancels
whatever still runs before the cluster is stopped.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lattice_common.types import CostWeights
from lattice_test_harness.cluster import TERMINAL, ApiError, ClusterHandle

# Several scheduler cycles (cycle_interval is 1 s in the harness).
OBSERVE_SECONDS = 3.0
# Generous: the machine running the suite may be small and busy.
TIMEOUT = 30.0

# The cost function's weights, by the names CostWeights gives them (the one source of
# weight names), and the `lattice admin vcluster set-weights` flag each one has.
WEIGHTS = tuple(f.name for f in msgspec.structs.fields(CostWeights))
WEIGHT_FLAGS = {w: "--" + w.replace("_", "-") for w in WEIGHTS}


@dataclass
class Job:
    name: str
    id: str
    dir: Path
    user: str
    first: dict[str, Any] = field(default_factory=dict)  # the record when first seen Running

    @property
    def release_file(self) -> Path:
        return self.dir / "release"


@dataclass
class World:
    make: Callable[..., ClusterHandle]
    workdir: Path
    _cluster: ClusterHandle | None = None
    jobs: dict[str, Job] = field(default_factory=dict)
    current: Job | None = None  # the job the scenario calls "the job"
    node: str = ""  # the node the scenario is about
    last: subprocess.CompletedProcess[str] | None = None
    weights: dict[str, float] = field(default_factory=dict)
    stored_before: int = 0  # how many allocations there were before a refused submission
    state_before: dict[str, Any] = field(default_factory=dict)  # ClusterHandle.state_view

    @property
    def cluster(self) -> ClusterHandle:
        assert self._cluster is not None, "no cluster started (missing Given step)"
        return self._cluster

    @property
    def order_file(self) -> Path:
        return self.workdir / "order"

    # --- cluster ----------------------------------------------------------------------

    @classmethod
    def on(cls, cluster: ClusterHandle, workdir: Path) -> World:
        """A world on a cluster that the step module's scenarios share (the module-scoped
        ``lattice_cluster``); its scenarios leave the nodes Ready and idle (see
        :meth:`wait_idle`)."""
        return cls(make=_shared_only, workdir=workdir, _cluster=cluster)

    def start_cluster(
        self,
        count: int,
        vclusters: tuple[str, ...] = ("default",),
        agent_homes: tuple[str, ...] = (),
        cycle_interval: float | None = None,
    ) -> None:
        """A cluster of ``count`` Ready, unowned nodes with these vClusters (and, with
        ``agent_homes``, the home vCluster of each node in order); ``cycle_interval``:
        the schedulers' periodic cycle (the harness's 1 s when None)."""
        extra = {} if cycle_interval is None else {"cycle_interval": cycle_interval}
        self._cluster = self.make(
            members=1, agents=count, vclusters=vclusters, agent_homes=agent_homes, **extra
        )
        self.check_nodes(count)
        if vclusters != ("default",):
            listed = json.loads(self.cli("admin", "vcluster", "list", "-o", "json").stdout)
            assert set(vclusters) <= {v["name"] for v in listed}, listed

    def check_nodes(self, count: int) -> None:
        """`lattice nodes` lists ``count`` nodes, every one Ready and unowned."""
        r = self.cli("nodes", "-o", "json")
        nodes = json.loads(r.stdout)
        assert len(nodes) == count, show(r)
        assert all(n["state"] == "Ready" and not n.get("owner") for n in nodes), show(r)

    def wait_idle(self, timeout: float = TIMEOUT) -> None:
        """Every node Ready and held by nobody (a shared cluster between scenarios)."""
        c = self.cluster
        c.wait_for(
            "every node Ready and idle",
            lambda: all(n["state"] == "Ready" and not n["owner"] for n in c.nodes()),
            timeout=timeout,
        )

    def clean_up(self) -> None:
        """Leave no job processes behind (runs before cluster_factory stops the cluster)."""
        if self._cluster is None:
            return
        c = self._cluster
        for job in self.jobs.values():
            job.release_file.touch()
        for job in self.jobs.values():
            try:
                if c.get(job.id)["state"] not in TERMINAL:
                    c.cancel(job.id)
            except ApiError:
                pass
        for job in self.jobs.values():
            c.wait_state(job.id, TERMINAL, timeout=TIMEOUT)

    # --- CLI --------------------------------------------------------------------------

    def cli(
        self, *args: str, user: str = "tester", ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        c = self.cluster
        c.user = user  # the CLI runs with USER=<user>, which the API takes as the identity
        try:
            r = c.cli(*args, cwd=self.workdir)
        finally:
            c.user = "tester"
        self.last = r
        if ok:
            assert r.returncode == 0, show(r)
        assert "Traceback" not in r.stderr, show(r)
        return r

    def submit(
        self,
        name: str,
        body: str = "",
        *,
        directives: tuple[str, ...] = (),
        user: str = "tester",
        until_released: bool = False,
    ) -> Job:
        """Write a batch script as a user would and `lattice submit` it."""
        d = self.workdir / name
        d.mkdir()
        script = d / f"{name}.sh"
        if until_released:
            body = f"while [ ! -e {d}/release ]; do sleep 0.1; done\n{body}"
        lines = [
            "#!/bin/bash",
            f"#LATTICE --name={name}",
            *(f"#LATTICE {x}" for x in directives),
            f"echo {name} >> {self.order_file}",
            f"echo started {name}",
            body.rstrip("\n"),
            f"echo finished {name}",
        ]
        script.write_text("\n".join(lines) + "\n")
        r = self.cli("submit", str(script), user=user)
        m = re.fullmatch(r"Submitted allocation (\S+)\n?", r.stdout)
        assert m, f"lattice submit did not print 'Submitted allocation <id>':\n{show(r)}"
        job = Job(name=name, id=m.group(1), dir=d, user=user)
        self.jobs[name] = job
        return job

    def release(self, name: str) -> None:
        """Let a job that runs until released finish."""
        self.jobs[name].release_file.touch()

    def status_field(self, alloc_id: str, name: str, *extra: str) -> str:
        r = self.cli("status", alloc_id, *extra)
        m = re.search(rf"^{re.escape(name)}:\s+(.*?)\s*$", r.stdout, re.MULTILINE)
        assert m, f"`lattice status {alloc_id}` has no {name!r} line:\n{show(r)}"
        return m.group(1)

    def node_field(self, node_id: str, name: str) -> str:
        r = self.cli("nodes", node_id)
        m = re.search(rf"^{re.escape(name)}:\s+(.*?)\s*$", r.stdout, re.MULTILINE)
        assert m, f"`lattice nodes {node_id}` has no {name!r} line:\n{show(r)}"
        return m.group(1)

    def set_weights(self, vcluster: str, weights: dict[str, float]) -> None:
        """`lattice admin vcluster set-weights` as an administrator; every weight not in
        ``weights`` is set to 0. Remembered in ``self.weights``."""
        self.weights = {w: 0.0 for w in WEIGHTS} | weights
        flags = [f"{WEIGHT_FLAGS[w]}={v:g}" for w, v in self.weights.items()]
        r = self.cli("admin", "vcluster", "set-weights", "--name", vcluster, *flags, user="admin")
        assert r.stdout.strip() == f"Updated weights of vCluster {vcluster}", show(r)

    def listed_weights(self, vcluster: str) -> dict[str, float]:
        """A vCluster's weights as `lattice admin vcluster list -o json` shows them."""
        r = self.cli("admin", "vcluster", "list", "-o", "json")
        (vc,) = [v for v in json.loads(r.stdout) if v["name"] == vcluster]
        return {w: vc["weights"][w] for w in WEIGHTS}

    # --- REST observation ---------------------------------------------------------------

    def get(self, name: str) -> dict[str, Any]:
        return self.cluster.get(self.jobs[name].id)

    def node_ids(self) -> list[str]:
        return sorted(n["id"] for n in self.cluster.nodes())

    def wait_running(self, job: Job) -> dict[str, Any]:
        a = self.cluster.wait_state(job.id, "Running", timeout=TIMEOUT)
        job.first = job.first or a
        return a

    def wait_end(self, name: str, state: str = "Completed") -> dict[str, Any]:
        a = self.cluster.wait_state(self.jobs[name].id, TERMINAL, timeout=TIMEOUT)
        assert a["state"] == state, f"{name} ended {a['state']}, not {state}: {a}"
        return a

    def wait_considered(self, job: Job) -> dict[str, Any]:
        """Wait until a scheduler cycle has looked at a job (it says why it waits)."""
        return self.cluster.wait_for(
            f"a pending reason for {job.name}",
            lambda: (a := self.cluster.get(job.id)).get("pending_reason") and a,
            timeout=TIMEOUT,
        )

    def observe(self, what: str, check: Callable[[], None]) -> None:
        """Run ``check`` repeatedly for OBSERVE_SECONDS; it must hold every time."""
        deadline = time.monotonic() + OBSERVE_SECONDS
        n = 0
        while time.monotonic() < deadline:
            check()
            n += 1
            time.sleep(0.1)
        assert n >= 3, f"could only check {what} {n} times"

    def started_order(self) -> list[str]:
        if not self.order_file.exists():
            return []
        return self.order_file.read_text().split()

    def server_metrics(self) -> str:
        """The server's metrics as an operator scrapes them (``GET /metrics``)."""
        with urllib.request.urlopen(self.cluster.cluster.rest_url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def server_metric(self, name: str) -> float:
        """The value of one unlabelled sample of the server's metrics (0 when absent)."""
        for line in self.server_metrics().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return float(value)
        return 0.0


def _shared_only(**kw: Any) -> ClusterHandle:
    raise AssertionError("this world runs on the step module's shared cluster")


class StateRecorder(threading.Thread):
    """Polls one allocation from submission on and keeps its distinct states, in order,
    so that a step sees states that last only a moment (or pass while it does other
    things)."""

    def __init__(self, cluster: ClusterHandle, alloc_id: str, seconds: float = 60.0) -> None:
        super().__init__(daemon=True, name=f"states-{alloc_id}")
        self.cluster = cluster
        self.alloc_id = alloc_id
        self.seconds = seconds
        self.states: list[str] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            while not self._stop_event.is_set() and time.monotonic() < deadline:
                s = self.cluster.get(self.alloc_id)["state"]
                if not self.states or self.states[-1] != s:
                    self.states.append(s)
                if s in TERMINAL:
                    return
                time.sleep(0.01)
        except BaseException as e:  # reported by the step that reads the states
            self.error = e

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def log_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    """`lattice logs` lines without their "[timestamp] " prefix."""
    return [re.sub(r"^\[[^\]]*\]\s?", "", ln) for ln in r.stdout.splitlines()]


def assert_rejected(r: subprocess.CompletedProcess[str], error: str) -> None:
    """A CLI run that failed cleanly, and its first ``Error:`` line says ``error``."""
    assert r.returncode != 0, show(r)
    assert "Traceback" not in r.stderr, show(r)
    assert "Submitted" not in r.stdout, show(r)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
    assert errors and error in errors[0], f"no 'Error: ...{error}...' line:\n{show(r)}"


def assert_hint_line(r: subprocess.CompletedProcess[str]) -> None:
    """The run's error output has a ``Hint:`` line that says something."""
    hints = [ln for ln in r.stderr.splitlines() if ln.startswith("Hint: ")]
    assert hints and len(hints[0]) > len("Hint: ") + 5, show(r)


def show(r: subprocess.CompletedProcess[str]) -> str:
    """A CLI run as an assertion message: the command, its exit status and its output."""
    return (
        f"$ {shlex.join(r.args)}\nexit {r.returncode}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}"
    )


def shared_world(cls: type[World] = World) -> Any:
    """The ``world`` fixture of a step module whose scenarios share its module-scoped
    ``lattice_cluster``: ``world = shared_world(World)``. After each scenario whatever
    still runs is released and cancelled and the nodes are left idle."""

    @pytest.fixture
    def world(lattice_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
        w = cls.on(lattice_cluster, tmp_path)
        yield w
        w.clean_up()
        w.wait_idle()

    return world


def module_world(cluster_fixture: str, cls: type[World] = World) -> Any:
    """The ``world`` fixture of a step module whose scenarios share a module-scoped
    cluster of its own, configured for its feature (the fixture named
    ``cluster_fixture``): ``world = module_world("history_cluster")``. After each
    scenario whatever still runs is released and cancelled."""

    @pytest.fixture
    def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
        w = cls.on(request.getfixturevalue(cluster_fixture), tmp_path)
        yield w
        w.clean_up()

    return world


def fresh_world(cls: type[World] = World) -> Any:
    """The ``world`` fixture of a step module whose scenarios each start their own
    cluster (``World.start_cluster`` through ``cluster_factory``): ``world =
    fresh_world(World)``."""

    @pytest.fixture
    def world(cluster_factory: Callable[..., ClusterHandle], tmp_path: Path) -> Iterator[World]:
        w = cls(make=cluster_factory, workdir=tmp_path / "work")
        w.workdir.mkdir()
        yield w
        w.clean_up()

    return world
