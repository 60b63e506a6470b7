"""Steps for features/autoscaling.feature: a reactive job on its own real cluster (3
agents, VictoriaMetrics, the agents' windows never closing so that only the scenario's
pushed load counts), submitted with the CLI's reactive flags; the load is the
allocation's cpu_utilization pushed for each node it holds, once a second."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.world import show
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.victoria import AGENT_WINDOWS_NEVER_CLOSE, available
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not available(), reason="victoria-metrics not installed"),
]

scenarios("autoscaling.feature")

TIMEOUT = 120.0


class World:
    def __init__(self, cluster: ClusterHandle, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.jobs: dict[str, str] = {}
        self.load: dict[str, float] = {}
        self.sizes: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._push, daemon=True)
        self._thread.start()

    def _push(self) -> None:
        url = self.cluster.cluster.tsdb_url + "/api/v1/import/prometheus"
        cores = {n["id"]: n["capabilities"].get("cpu_cores") or 1 for n in self.cluster.nodes()}
        while not self._stop.is_set():
            for name, alloc_id in list(self.jobs.items()):
                try:
                    a = self.cluster.get(alloc_id)
                    ts = int((time.time() - 1.5) * 1000)
                    lines = "".join(
                        f'cpu_utilization{{alloc_id="{alloc_id}",node_id="{n}",agg="mean"}} '
                        f"{self.load.get(name, 0.0) * 100 * cores.get(n, 1)} {ts}\n"
                        for n in a["assigned_nodes"]
                    )
                    req = urllib.request.Request(url, data=lines.encode(), method="POST")
                    urllib.request.urlopen(req, timeout=5).close()
                except Exception:  # a busy moment: the next push comes in a second
                    pass
            self._stop.wait(1.0)

    def nodes_of(self, name: str) -> int:
        n = len(self.cluster.get(self.jobs[name])["assigned_nodes"])
        seen = self.sizes.setdefault(name, [])
        if not seen or seen[-1] != n:
            seen.append(n)
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for alloc_id in self.jobs.values():
            try:
                self.cluster.cancel(alloc_id)
            except Exception:
                pass


@pytest.fixture(scope="module")
def scaling_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("bdd-autoscale")
    env = {
        **AGENT_WINDOWS_NEVER_CLOSE,
        "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(base / "checkpoints"),
    }
    h = make_cluster(base, agents=3, tsdb=True, env=env)
    yield h
    h.cluster.stop()


@pytest.fixture
def world(scaling_cluster: ClusterHandle, tmp_path: Path) -> Iterator[World]:
    w = World(scaling_cluster, tmp_path)
    yield w
    w.close()


def wait(what: str, fn: Any, timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@given(parsers.parse("a running Lattice cluster with {count:d} nodes and a TSDB"))
def running_cluster(world: World, count: int) -> None:
    wait(
        f"{count} Ready nodes",
        lambda: sum(n["state"] == "Ready" for n in world.cluster.nodes()) == count,
    )


@given(
    parsers.parse(
        'a reactive job "{name}" scaling on {metric} from {low:d} to {high:d} nodes '
        "with a {cooldown:d} s cooldown"
    )
)
def reactive_job(world: World, name: str, metric: str, low: int, high: int, cooldown: int) -> None:
    r = world.cluster.cli(
        "-q",
        "submit",
        "--lifecycle",
        "reactive",
        "--min-nodes",
        str(low),
        "--max-nodes",
        str(high),
        "--scale-metric",
        metric,
        "--scale-target",
        "0.8",
        "--scale-down-threshold",
        "0.25",
        "--scale-interval",
        "2",
        "--scale-up-window",
        "4",
        "--scale-down-window",
        "4",
        "--scale-cooldown",
        str(cooldown),
        "--name",
        name,
        "--",
        "sleep",
        "600",
        cwd=world.workdir,
    )
    assert r.returncode == 0, show(r)
    world.jobs[name] = r.stdout.strip()
    world.cluster.wait_state(world.jobs[name], "Running", timeout=TIMEOUT)


# a service of the signal protocol: on SIGUSR1 it takes 3 s to write its state, then
# creates the sentinel (the node it is losing is in $LATTICE_RELEASING_FILE meanwhile)
SIGNAL_APP = r"""
on_checkpoint() {
  sleep 3
  cp "$LATTICE_RELEASING_FILE" "$LATTICE_CHECKPOINT_DIR/releasing"
  touch "$LATTICE_CHECKPOINT_SENTINEL"
}
trap on_checkpoint USR1
while true; do sleep 0.2; done
"""


@given(
    parsers.parse(
        'a reactive job "{name}" that checkpoints by signal, scaling from {low:d} to '
        "{high:d} nodes with a {cooldown:d} s cooldown"
    )
)
def checkpointing_job(world: World, name: str, low: int, high: int, cooldown: int) -> None:
    script = world.workdir / f"{name}.sh"
    script.write_text(SIGNAL_APP)
    r = world.cluster.cli(
        "-q",
        "submit",
        "--lifecycle",
        "reactive",
        "--checkpoint",
        "signal",
        "--min-nodes",
        str(low),
        "--max-nodes",
        str(high),
        "--scale-metric",
        "cpu_utilization",
        "--scale-target",
        "0.8",
        "--scale-down-threshold",
        "0.25",
        "--scale-interval",
        "1",
        "--scale-up-window",
        "2",
        "--scale-down-window",
        "2",
        "--scale-cooldown",
        str(cooldown),
        "--name",
        name,
        str(script),
        cwd=world.workdir,
    )
    assert r.returncode == 0, show(r)
    world.jobs[name] = r.stdout.strip()
    world.cluster.wait_state(world.jobs[name], "Running", timeout=TIMEOUT)


@then(
    parsers.parse(
        '`lattice status` of "{name}" says its newest node is released after its checkpoint'
    )
)
def status_says_releasing(world: World, name: str) -> None:
    newest = world.cluster.get(world.jobs[name])["assigned_nodes"][-1]

    def releasing() -> str | None:
        out = world.cluster.cli("status", world.jobs[name]).stdout
        line = next((ln for ln in out.splitlines() if ln.startswith("Releasing:")), "")
        return line if "after its checkpoint" in line else None

    line = wait(f"{name} releasing a node", releasing)
    assert f" {newest} after its checkpoint, by " in line, line
    world.releasing = newest  # type: ignore[attr-defined]


@then(parsers.parse('"{name}" shrinks back to {count:d} nodes once its checkpoint is recorded'))
def shrinks_after_checkpoint(world: World, name: str, count: int) -> None:
    a = wait(
        f"{name} back on {count} nodes",
        lambda: (
            (x := world.cluster.get(world.jobs[name])) and len(x["assigned_nodes"]) == count and x
        ),
    )
    ck = a.get("last_checkpoint")
    assert ck, a
    gone = world.releasing  # type: ignore[attr-defined]
    assert gone not in a["assigned_nodes"]
    assert (Path(ck["path"]) / "releasing").read_text().split() == [gone]
    assert a["scaling_status"]["reason"].endswith(f"checkpoint {ck['id']} written first")


@then(parsers.parse('"{name}" runs on {count:d} nodes'))
def runs_on(world: World, name: str, count: int) -> None:
    assert world.nodes_of(name) == count


@when(parsers.parse('the load of "{name}" rises to {value:f}'))
@when(parsers.parse('the load of "{name}" falls to {value:f}'))
def set_load(world: World, name: str, value: float) -> None:
    world.load[name] = value


@then(parsers.parse('"{name}" grows to {count:d} nodes and no further'))
def grows(world: World, name: str, count: int) -> None:
    wait(f"{name} on {count} nodes", lambda: world.nodes_of(name) == count)
    end = time.monotonic() + 10
    while time.monotonic() < end:  # still busy: it stays at max_nodes
        assert world.nodes_of(name) == count
        time.sleep(0.3)


@then(
    parsers.parse(
        '`lattice status` of "{name}" says it scaled up because {metric} was at or above {target}'
    )
)
def status_says(world: World, name: str, metric: str, target: str) -> None:
    r = world.cluster.cli("status", world.jobs[name])
    assert r.returncode == 0, show(r)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("Nodes:"))
    assert "(target 3, min 2, max 3) — scaled up at " in line, line
    assert f": {metric} " in line and f" >= {target} for " in line, line


@then(parsers.parse('"{name}" shrinks back to {count:d} nodes'))
def shrinks(world: World, name: str, count: int) -> None:
    wait(f"{name} back on {count} nodes", lambda: world.nodes_of(name) == count)
    assert world.sizes[name] == [2, 3, 2], world.sizes[name]
