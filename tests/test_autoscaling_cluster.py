"""Autoscaling end to end on a dev cluster: lattice-server, a scheduler, 5 real agents
and a real VictoriaMetrics, the allocation submitted with ``lattice submit --lifecycle
reactive ...`` (CLI subprocess).

The load generator pushes the allocation's ``cpu_utilization`` into the TSDB as the
agents do (percent of one core per node, ``agg="mean"``, labels alloc_id/node_id/...),
for every node the allocation holds, once a second: 0.9 of each node's cores ("busy")
or 0.05 ("idle"). Pushed samples rather than real CPU load: on this 2-core machine,
shared with other work, a real busy loop cannot hold a node above 0.8 reliably, and
every node of the test shares the same cores. The agents' own windows never close during
the test (``AGENT_WINDOWS_NEVER_CLOSE``) so that their measurements of the (sleeping) job
stay out of the way.

Short windows, per allocation: evaluated every second, 2 s above/below to act,
cooldown 4 s (the specification's defaults are 60 s / 2 min / 5 min / 3 min; every
one is per allocation, and the decision is the same function of the windows at any
scale). A busy allocation that is blocked (at max_nodes, or by the quota) says so at
its next evaluation after the cooldown, so the test waits for that word and then
holds a few evaluations more, rather than sleeping whole cooldowns. Shown:

* busy: 2 -> 3 -> 4, each step at least the cooldown after the previous one (the
  recorded decision times), never past max_nodes 4 while it stays busy;
* idle: back to 2 (the head node kept), one node at a time;
* the job is told: ``$LATTICE_NODES_FILE`` holds the current nodes and it gets SIGUSR2
  on each change (its trap writes what it read into its output);
* ``lattice status`` shows the nodes, target, bounds and the last decision with its
  reason;
* with the tenant's max_nodes at 3 it stops at 3, says why, and goes on to 4 when the
  quota is raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.victoria import AGENT_WINDOWS_NEVER_CLOSE, available

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not available(), reason="victoria-metrics not installed"),
]

INTERVAL, UP, DOWN, COOLDOWN = 1, 2, 2, 4
#: evaluations held after the block is reported, in which a scale-up past it would show
HOLD = 4 * INTERVAL

JOB = r"""
trap 'echo "membership: $(tr "\n" " " < "$LATTICE_NODES_FILE")"' USR2
echo "start: $(tr "\n" " " < "$LATTICE_NODES_FILE")"
while true; do sleep 1; done
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    env = dict(AGENT_WINDOWS_NEVER_CLOSE)
    h = make_cluster(tmp_path_factory.mktemp("autoscale"), members=1, agents=5, tsdb=True, env=env)
    yield h
    h.cluster.stop()


class Load:
    """Pushes the allocation's cpu_utilization for the nodes it holds, every second."""

    def __init__(self, h: ClusterHandle, alloc_id: str) -> None:
        self.h, self.alloc_id = h, alloc_id
        self.fraction = 0.0
        self.cores = {n["id"]: n["capabilities"].get("cpu_cores") or 1 for n in h.nodes()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        url = self.h.cluster.tsdb_url + "/api/v1/import/prometheus"
        while not self._stop.is_set():
            try:
                a = self.h.get(self.alloc_id)
                ts = int((time.time() - 1.5) * 1000)
                lines = "".join(
                    f'cpu_utilization{{alloc_id="{a["id"]}",node_id="{nid}",tenant="'
                    f'{a["spec"]["tenant"]}",vcluster="{a["spec"]["vcluster"]}",agg="mean"}} '
                    f"{self.fraction * 100 * self.cores.get(nid, 1)} {ts}\n"
                    for nid in a["assigned_nodes"]
                )
                req = urllib.request.Request(url, data=lines.encode(), method="POST")
                urllib.request.urlopen(req, timeout=5).close()
            except Exception:  # a busy moment: the next push comes in a second
                pass
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Watch:
    """Node counts and scale decisions of the allocation as they change."""

    def __init__(self, h: ClusterHandle, alloc_id: str) -> None:
        self.h, self.alloc_id = h, alloc_id
        self.sizes: list[int] = []
        self.events: dict[float, tuple[str, int]] = {}  # status.at -> (decision, target)
        self.max_seen = 0

    def poll(self) -> dict[str, Any]:
        a = self.h.get(self.alloc_id)
        n = len(a["assigned_nodes"])
        self.max_seen = max(self.max_seen, n)
        if not self.sizes or self.sizes[-1] != n:
            self.sizes.append(n)
        st = a.get("scaling_status") or {}
        if st.get("at") and st.get("last_decision"):
            self.events[float(st["at"])] = (st["last_decision"], int(st["target"]))
        return a

    def until(self, what: str, fn: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            a = self.poll()
            if fn(a):
                return a
            time.sleep(0.3)
        status = self.h.get(self.alloc_id).get("scaling_status")
        raise AssertionError(f"timed out waiting for {what}: sizes {self.sizes}, status {status}")

    def hold(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()
            time.sleep(0.3)


def submit(h: ClusterHandle, tmp: Any) -> str:
    script = tmp / "serve.sh"
    script.write_text(JOB)
    r = h.cli(
        "-q",
        "submit",
        "--lifecycle",
        "reactive",
        "--min-nodes",
        "2",
        "--max-nodes",
        "4",
        "--scale-metric",
        "cpu_utilization",
        "--scale-target",
        "0.8",
        "--scale-down-threshold",
        "0.25",
        "--scale-interval",
        str(INTERVAL),
        "--scale-up-window",
        str(UP),
        "--scale-down-window",
        str(DOWN),
        "--scale-cooldown",
        str(COOLDOWN),
        str(script),
        cwd=tmp,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def n_nodes(n: int) -> Any:
    return lambda a: len(a["assigned_nodes"]) == n


def test_scales_up_to_max_and_back_down(cluster: ClusterHandle, tmp_path: Any) -> None:
    alloc_id = submit(cluster, tmp_path)
    a = cluster.wait_state(alloc_id, "Running", timeout=60)
    assert len(a["assigned_nodes"]) == 2  # starts at min_nodes
    head = a["assigned_nodes"][0]
    load, w = Load(cluster, alloc_id), Watch(cluster, alloc_id)
    try:
        load.fraction = 0.9
        w.until("4 nodes", n_nodes(4), timeout=60)

        shown = [""]

        def blocked() -> bool:  # recorded at the first evaluation after the cooldown that
            w.poll()  # wants more (a loaded machine may take a while)
            shown[0] = out = cluster.cli("status", alloc_id).stdout
            return "Scaling blocked:" in out and "at max_nodes 4" in out

        try:
            cluster.wait_for("status says why it stays at 4", blocked, timeout=60, interval=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast status:\n{shown[0]}\nsizes {w.sizes}") from None
        w.hold(HOLD)  # still busy, past the cooldown: stays at max_nodes
        assert w.max_seen == 4
        ups = sorted(t for t, (d, _) in w.events.items() if d == "up")
        assert [w.events[t][1] for t in ups] == [3, 4]
        assert ups[1] - ups[0] >= COOLDOWN
        status = cluster.cli("status", alloc_id)
        assert status.returncode == 0, status.stderr
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("Nodes:"))
        assert "4 (target 4, min 2, max 4) — scaled up at " in line
        assert ": cpu_utilization 0.90 >= 0.80 for " in line

        load.fraction = 0.05
        a = w.until("2 nodes", n_nodes(2), timeout=60)
        assert a["assigned_nodes"][0] == head
        assert w.sizes[-3:] == [4, 3, 2]
        downs = sorted(t for t, (d, _) in w.events.items() if d == "down")
        assert downs[1] - downs[0] >= COOLDOWN
        assert a["scaling_status"]["reason"].startswith("cpu_utilization 0.05 <= 0.20")

        # the job was told each change: its nodes file and SIGUSR2
        lines = cluster.wait_for(
            "the job's membership lines",
            lambda: (
                (got := [ln for ln in cluster.logs(alloc_id) if "membership:" in ln])
                and len(got) >= 4
                and got
            ),
            timeout=30,
        )
        counts = [len(ln.split(":", 1)[1].split()) for ln in lines]
        assert counts[:4] == [3, 4, 3, 2], lines
    finally:
        load.stop()
        cluster.cancel(alloc_id)


def test_tenant_quota_stops_it_until_raised(cluster: ClusterHandle, tmp_path: Any) -> None:
    tenant = cluster.cluster.tenant
    cluster.request("PATCH", f"/api/v1/tenants/{tenant}", {"max_nodes": 3})
    alloc_id = submit(cluster, tmp_path)
    cluster.wait_state(alloc_id, "Running", timeout=60)
    load, w = Load(cluster, alloc_id), Watch(cluster, alloc_id)
    try:
        load.fraction = 0.9
        w.until("3 nodes", n_nodes(3), timeout=60)
        w.until(
            "the quota named as the block",
            lambda a: (
                (a.get("scaling_status") or {}).get("blocked")
                == f"tenant {tenant} holds 3 of max_nodes 3"
            ),
            timeout=60,
        )
        w.hold(HOLD)  # past the cooldown and still busy: a scale-up would show now
        assert w.max_seen == 3
        cluster.request("PATCH", f"/api/v1/tenants/{tenant}", {"max_nodes": 4})
        w.until("4 nodes once the quota grew", n_nodes(4), timeout=60)
    finally:
        load.stop()
        cluster.cancel(alloc_id)
        cluster.request("PATCH", f"/api/v1/tenants/{tenant}", {"max_nodes": None})
