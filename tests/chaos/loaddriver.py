"""The chaos run's steady load: a few threads submitting short jobs to the members'
REST API, each retried under the same request id until it is acknowledged, and now and
then cancelling one. Every acknowledgement (201 with an allocation id) and every
acknowledged cancel (2xx) is recorded: they are what the checker holds the cluster to.

The jobs write their own run records (start, a tick every half second, end; with the
allocation id, the node id the agent gave them, their pid and the wall time) to one
append-only file: those are the node-side records of what ran where.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from checker import Ack, CancelAck, Run

TICK = 0.5

# one line per record: "<event> <allocation> <node> <pid> <wall time>", written with a
# single append (atomic for lines this short)
JOB = (
    "sh -c '"
    'r() {{ echo "$1 $LATTICE_ALLOC_ID $LATTICE_NODE_ID $$ $(date +%s.%N)" >> "$CHAOS_RUNS"; }}; '
    "r start; n=0; "
    "while [ $n -lt {ticks} ]; do sleep {tick}; r tick; n=$((n+1)); done; "
    "r end; exit {code}'"
)


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", "x-lattice-user": "chaos"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")[:300]}


class LoadDriver:
    def __init__(
        self,
        members: list[tuple[int, str]],  # (member id, REST URL)
        *,
        tenant: str,
        vcluster: str,
        runs_file: Path,
        seed: int,
        threads: int = 3,
        pause: tuple[float, float] = (1.0, 4.0),
        cancel_ratio: float = 0.1,
        fail_ratio: float = 0.1,
    ) -> None:
        self.members = members
        self.tenant = tenant
        self.vcluster = vcluster
        self.runs_file = runs_file
        self.seed = seed
        self.n_threads = threads
        self.pause = pause
        self.cancel_ratio = cancel_ratio
        self.fail_ratio = fail_ratio
        self.acks: list[Ack] = []
        self.cancels: list[CancelAck] = []
        self.stats: Counter[str] = Counter()
        self.rejections: list[str] = []  # 4xx answers to a well-formed submission
        self._last_member: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def last_member(self) -> int | None:
        return self._last_member

    def start(self) -> None:
        self.runs_file.touch()
        for i in range(self.n_threads):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def _loop(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        i = 0
        while not self._stop.is_set():
            i += 1
            self._submit(rng, f"chaos-{self.seed}-{worker}-{i}", worker + i)
            if self.acks and rng.random() < self.cancel_ratio:
                with self._lock:
                    victim = rng.choice(self.acks[-10:]).alloc_id
                self._cancel(victim, worker + i)
            self._stop.wait(rng.uniform(*self.pause))

    def _submit(self, rng: random.Random, rid: str, k: int) -> None:
        code = 3 if rng.random() < self.fail_ratio else 0
        body = {
            "entrypoint": JOB.format(ticks=rng.randint(1, 8), tick=TICK, code=code),
            "tenant": self.tenant,
            "vcluster": self.vcluster,
            "walltime": "2m",
            "request_id": rid,
            "env": {"CHAOS_RUNS": str(self.runs_file)},
        }
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            mid, url = self.members[k % len(self.members)]
            k += 1
            self.stats["submit_attempts"] += 1
            try:
                status, data = http("POST", url + "/api/v1/allocations", body, timeout=10)
            except OSError:
                self.stats["submit_transport_errors"] += 1
                time.sleep(0.2)
                continue  # a dead or cut-off member: the same request id elsewhere
            if status == 201:
                with self._lock:
                    self.acks.append(Ack(rid, data["id"], time.time()))
                    self._last_member = mid
                return
            if status >= 500 or status == 429:
                self.stats[f"submit_{status}"] += 1
                time.sleep(0.2)
                continue
            with self._lock:
                self.rejections.append(f"{rid}: {status} {json.dumps(data)[:300]}")
            return
        self.stats["submit_never_acknowledged"] += 1

    def _cancel(self, alloc_id: str, k: int) -> None:
        for attempt in range(6):
            mid, url = self.members[(k + attempt) % len(self.members)]
            try:
                status, _ = http("DELETE", f"{url}/api/v1/allocations/{alloc_id}", timeout=10)
            except OSError:
                self.stats["cancel_transport_errors"] += 1
                continue
            if 200 <= status < 300:
                with self._lock:
                    self.cancels.append(CancelAck(alloc_id, time.time()))
                    self._last_member = mid
                return
            if status == 409:  # already ended: nothing to hold it to
                self.stats["cancel_already_ended"] += 1
                return
            self.stats[f"cancel_{status}"] += 1
            time.sleep(0.2)


def read_runs(path: Path) -> list[Run]:
    """The run records, one Run per (allocation, node, pid)."""
    spans: dict[tuple[str, str, int], list[Any]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 5 or parts[0] not in ("start", "tick", "end"):
            continue
        ev, aid, node, pid_s, t_s = parts
        try:
            pid, t = int(pid_s), float(t_s)
        except ValueError:
            continue
        key = (aid, node, pid)
        s = spans.setdefault(key, [t, t, False])
        s[0] = min(s[0], t)
        s[1] = max(s[1], t)
        s[2] = s[2] or ev == "end"
    return [Run(a, n, p, s[0], s[1], s[2]) for (a, n, p), s in spans.items()]
