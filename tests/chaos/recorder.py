"""The chaos run's history recorder: polls the members' REST API in a thread.

Every half second: each member's /healthz (who claims leadership, at which revision),
the non-terminal allocations (one request per state) and the nodes, from the leader
(or any member that answers while there is none); every 15 s the whole allocation list.
An allocation is recorded when its (revision, state) is new for that member; a response
in which two allocations hold one node is kept whole, as the evidence.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from checker import HOLDING, NodeObservation, Observation
from loaddriver import http

ACTIVE_STATES = ("Pending", "Staging", "Running", "Checkpointing", "Suspended")


class Recorder:
    def __init__(self, members: list[tuple[int, str]], interval: float = 0.5) -> None:
        self.members = members
        self.interval = interval
        self.observations: list[Observation] = []
        self.node_observations: list[NodeObservation] = []
        self.leader_claims: list[tuple[float, list[int]]] = []  # when several claim it
        self.stats: Counter[str] = Counter()
        self.current_leader: int | None = None
        self._seen: set[tuple[str, int, str, int]] = set()
        self._node_last: dict[str, tuple[str, str]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="recorder")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    # --- one member ----------------------------------------------------------------------

    def health(self) -> dict[int, dict[str, Any]]:
        out = {}
        for mid, url in self.members:
            try:
                status, data = http("GET", url + "/healthz", timeout=1.0)
            except OSError:
                continue
            if status == 200 and isinstance(data, dict):
                out[mid] = data
        return out

    def allocations(self, mid: int, url: str, state: str | None = None) -> list[dict[str, Any]]:
        q = "?all=true" + (f"&state={state}" if state else "")
        status, data = http("GET", url + "/api/v1/allocations" + q, timeout=10)
        if status != 200:
            raise OSError(f"member {mid}: {status}")
        return data["allocations"]

    def record(self, mid: int, allocs: list[dict[str, Any]], at: float) -> None:
        obs = [
            Observation(
                at,
                mid,
                a["id"],
                int(a.get("revision") or 0),
                a["state"],
                tuple(a.get("assigned_nodes") or ()),
                a.get("spec", {}).get("request_id", ""),
            )
            for a in allocs
        ]
        holders: dict[str, set[str]] = {}
        for o in obs:
            if o.state in HOLDING:
                for n in o.nodes:
                    holders.setdefault(n, set()).add(o.alloc_id)
        conflict = any(len(v) > 1 for v in holders.values())
        with self._lock:
            for o in obs:
                key = (o.alloc_id, o.revision, o.state, mid)
                if conflict or key not in self._seen:
                    self._seen.add(key)
                    self.observations.append(o)

    # --- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        last_full = 0.0
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self._poll(full=t0 - last_full > 15)
                if t0 - last_full > 15:
                    last_full = t0
            except Exception as e:  # a member died mid-request: next round
                self.stats[f"poll_error {type(e).__name__}"] += 1
            self._stop.wait(max(0.05, self.interval - (time.monotonic() - t0)))

    def _poll(self, full: bool) -> None:
        health = self.health()
        claims = sorted(mid for mid, h in health.items() if h.get("is_leader"))
        if len(claims) > 1:
            self.leader_claims.append((time.time(), claims))
        self.current_leader = claims[0] if len(claims) == 1 else None
        if not health:
            self.stats["no_member_answers"] += 1
            return
        mid = self.current_leader or next(iter(health))
        url = dict(self.members)[mid]
        if full:
            self.record(mid, self.allocations(mid, url), time.time())
        else:
            for state in ACTIVE_STATES:
                at = time.time()
                self.record(mid, self.allocations(mid, url, state), at)
        status, data = http("GET", url + "/api/v1/nodes", timeout=10)
        if status == 200:
            now = time.time()
            for n in data["nodes"]:
                cur = (n["state"], n.get("owner") or "")
                if self._node_last.get(n["id"]) != cur:
                    self._node_last[n["id"]] = cur
                    self.node_observations.append(NodeObservation(now, n["id"], *cur))
        self.stats["polls"] += 1
