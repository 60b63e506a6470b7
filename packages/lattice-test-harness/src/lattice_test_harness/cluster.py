"""Real local clusters for tests: processes on ephemeral loopback ports.

``ClusterHandle`` wraps lattice_cli.devcluster.LocalCluster (the same code behind
``lattice dev up``) with the small synchronous REST client and wait helpers tests need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lattice_cli.devcluster import LocalCluster

TERMINAL = ("Completed", "Failed", "Cancelled")

# what a restore need not give back: what only the leader's memory holds or the
# scheduler recomputes every cycle (pending reasons, estimates), and what a node reports
# with its heartbeats (not replicated: ADR-019), back once its agent reports again
VOLATILE_ALLOCATION_FIELDS = frozenset(
    {"pending_reasons", "estimated_start", "revision", "pending_reason"}
)
VOLATILE_NODE_FIELDS = frozenset(
    {
        "last_heartbeat",
        "health",
        "utilization",
        "heartbeat_age_seconds",
        "revision",
        "agent_identity",
        "telemetry",
    }
)


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"{status}: {err.get('message', body)}")
        self.status = status
        self.error = err


class ClusterHandle:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.user = "tester"

    # --- REST ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        try:
            return self.cluster.leader(timeout=10).rest_url
        except Exception:
            return self.cluster.rest_url

    def request(self, method: str, path: str, body: Any = None, url: str | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        target = (url or self.url) + path
        # a secure cluster: its admin token and its site CA (devcluster.auth_for)
        auth, context = self.cluster.auth_for(target)
        req = urllib.request.Request(
            target,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "x-lattice-user": self.user, **auth},
        )
        try:
            with urllib.request.urlopen(req, timeout=15, context=context) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = {"error": {"message": raw.decode(errors="replace")}}
            raise ApiError(e.code, parsed) from None

    def submit(self, entrypoint: str, **spec: Any) -> dict[str, Any]:
        body = {
            "entrypoint": entrypoint,
            "tenant": self.cluster.tenant,
            "vcluster": self.cluster.vclusters[0],
            "walltime": "10m",
            **spec,
        }
        return self.request("POST", "/api/v1/allocations", body)

    def get(self, alloc_id: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/allocations/{alloc_id}")

    def allocations(self, **query: str) -> list[dict[str, Any]]:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return self.request("GET", "/api/v1/allocations?all=true" + ("&" + qs if qs else ""))[
            "allocations"
        ]

    def nodes(self) -> list[dict[str, Any]]:
        return self.request("GET", "/api/v1/nodes")["nodes"]

    def node(self, node_id: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/nodes/{node_id}")

    def cancel(self, alloc_id: str) -> dict[str, Any]:
        return self.request("DELETE", f"/api/v1/allocations/{alloc_id}")

    def logs(self, alloc_id: str) -> list[str]:
        return [
            ln["line"]
            for ln in self.request("GET", f"/api/v1/allocations/{alloc_id}/logs")["lines"]
        ]

    # --- the replicated state, as a restore must give it back -------------------------

    def state_view(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Every allocation, node, tenant and vCluster as the API shows them, less the
        volatile fields (:data:`VOLATILE_ALLOCATION_FIELDS`, :data:`VOLATILE_NODE_FIELDS`)."""

        def without(d: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
            return {k: v for k, v in d.items() if k not in keys}

        return {
            "allocations": {
                a["id"]: without(a, VOLATILE_ALLOCATION_FIELDS) for a in self.allocations()
            },
            "nodes": {n["id"]: without(n, VOLATILE_NODE_FIELDS) for n in self.nodes()},
            "tenants": {t["name"]: t for t in self.request("GET", "/api/v1/tenants")["tenants"]},
            "vclusters": {
                v["name"]: v for v in self.request("GET", "/api/v1/vclusters")["vclusters"]
            },
        }

    @staticmethod
    def state_differences(
        before: dict[str, dict[str, dict[str, Any]]], after: dict[str, dict[str, dict[str, Any]]]
    ) -> list[str]:
        """What differs between two :meth:`state_view` answers, a line per record (a
        field that changed, a record missing or new); empty when they agree."""
        found = []
        for kind, records in before.items():
            now = after.get(kind, {})
            for key, record in records.items():
                if key not in now:
                    found.append(f"{kind} {key} missing")
                    continue
                diff = {f: (v, now[key].get(f)) for f, v in record.items() if now[key].get(f) != v}
                if diff:
                    found.append(f"{kind} {key} changed: {diff}")
            found += [f"{kind} {key} is new" for key in now if key not in records]
        return found

    # --- waiting ---------------------------------------------------------------------

    def wait_for(
        self, what: str, fn: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05
    ) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = fn()
            except (ApiError, OSError) as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(interval)
        raise AssertionError(
            f"timed out after {timeout}s waiting for {what} (last: {last!r})"
            + self.cluster.diagnosis()
        )

    def wait_state(
        self, alloc_id: str, states: str | tuple[str, ...], timeout: float = 20.0
    ) -> dict[str, Any]:
        wanted = (states,) if isinstance(states, str) else states
        return self.wait_for(
            f"{alloc_id} in {wanted}",
            lambda: (a := self.get(alloc_id))["state"] in wanted and a,
            timeout,
        )

    def states_seen(self, alloc_id: str, timeout: float = 20.0) -> list[str]:
        """The allocation's distinct states in order, as its watch stream delivers them
        (every committed change, so a state held for a few milliseconds, as a cached
        uenv's Staging, is not missed as polling can miss it), until it ends."""
        url = self.url + f"/api/v1/allocations/{alloc_id}/watch"
        auth, context = self.cluster.auth_for(url)
        req = urllib.request.Request(url, headers={"x-lattice-user": self.user, **auth})
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                for raw in resp:
                    if raw.strip():
                        s = json.loads(raw)["allocation"]["state"]
                        if not seen or seen[-1] != s:
                            seen.append(s)
                        if s in TERMINAL:
                            return seen
                    if time.monotonic() > deadline:
                        break
        except OSError as e:  # the read timed out, or the stream broke
            raise AssertionError(f"{alloc_id}: watch stream ended ({e}; seen {seen})") from None
        raise AssertionError(f"{alloc_id} did not finish within {timeout}s (seen {seen})")

    # --- CLI ----------------------------------------------------------------------------

    def cli_env(self) -> dict[str, str]:
        config = self.cluster.base / "cli-config.yaml"
        if not config.exists():  # LATTICE_CONFIG must name an existing file
            self.cluster.write_cli_config(config)
        env = dict(os.environ)
        env.update(
            {
                "LATTICE_ENDPOINT": self.cluster.rest_url,
                "LATTICE_TENANT": self.cluster.tenant,
                "LATTICE_VCLUSTER": self.cluster.vclusters[0],
                "LATTICE_CONFIG": str(config),
                "USER": self.user,
            }
        )
        return env

    def cli(
        self, *args: str, timeout: float = 60.0, cwd: str | Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lattice_cli.main", *args],
            capture_output=True,
            text=True,
            env=self.cli_env(),
            timeout=timeout,
            cwd=cwd,
        )


def process_group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie (the agent's own
    view of a group, lattice_agent.procgroup)."""
    from lattice_agent.procgroup import group_exists, group_members

    return group_exists(pgid) and any(st.state != "Z" for _, st in group_members(pgid))
