"""One chaos run: start a 3-member cluster with a scheduler and agents, drive a steady
submission load, inject the faults one at a time in a seeded order, heal, drain, capture
every member's final state and check the history.

``run_chaos`` is what tests/chaos/test_chaos.py (the bounded CI run) and ``scripts/chaos``
(a long run by hand: ``scripts/chaos --seed 42 --duration 1800``) both call.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaoscluster import start_chaos_cluster
from checker import FinalAlloc, History, Report, check
from faults import ALL_FAULTS, Fault, FaultRecord, Firewall, Partition, parse_faults
from lattice_cli.devcluster import Member
from lattice_test_harness.cluster import ClusterHandle
from loaddriver import LoadDriver, http, read_runs
from recorder import Recorder

SETTLE_TIMEOUT = 90.0


@dataclass
class ChaosResult:
    seed: int
    duration: float
    report: Report
    faults: list[FaultRecord]
    skipped: dict[str, str]
    load: dict[str, Any]
    recorder: dict[str, Any]
    wall_seconds: float
    base: str
    problems: list[str] = field(default_factory=list)  # faults that did not heal

    def summary(self) -> dict[str, Any]:
        injected: dict[str, int] = {}
        for f in self.faults:
            injected[f.fault] = injected.get(f.fault, 0) + 1
        return {
            "seed": self.seed,
            "duration_s": self.duration,
            "wall_s": round(self.wall_seconds, 1),
            "ok": self.report.ok and not self.problems,
            "check": self.report.summary(),
            "faults_injected": injected,
            "faults_skipped": self.skipped,
            "recovery_problems": self.problems,
            "load": self.load,
            "recorder": self.recorder,
            "fault_log": [asdict(f) for f in self.faults],
            "base_dir": self.base,
        }


class ChaosContext:
    """What a fault may use: the cluster, the load driver, the firewall chain."""

    def __init__(self, h: ClusterHandle, firewall: Firewall, recorder: Recorder) -> None:
        self.h = h
        self.cluster = h.cluster
        self.firewall = firewall
        self.recorder = recorder
        self.load: LoadDriver | None = None
        self.waited_for = ""

    def leader_claims(self) -> list[int]:
        return sorted(mid for mid, hh in self.recorder.health().items() if hh.get("is_leader"))

    def leader_id(self) -> int | None:
        claims = self.leader_claims()
        return claims[0] if len(claims) == 1 else None

    def leader_member(self, timeout: float = 20.0) -> Member:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mid = self.leader_id()
            if mid is not None:
                return self.cluster.members[mid - 1]
            time.sleep(0.1)
        raise RuntimeError(f"no single Raft leader within {timeout:.0f}s")

    def answers(self, m: Member) -> bool:
        """The member's REST API answers /healthz."""
        try:
            status, _ = http("GET", m.rest_url + "/healthz", timeout=1.0)
        except OSError:
            return False
        return status == 200

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.cluster.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> str:
        """Wait until every process runs, one leader exists, every member answers and
        every node is Ready; '' when so, else what is still wrong (``waited_for`` keeps
        the last thing waited for)."""
        cl = self.cluster
        deadline = time.monotonic() + timeout
        why = ""
        while time.monotonic() < deadline:
            dead = [
                f"member-{m.id}" for m in cl.members if m.proc is None or m.proc.poll() is not None
            ]
            dead += [
                f"agent-{a.node_id}"
                for a in cl.agents
                if a.proc is None or a.proc.poll() is not None
            ]
            dead += [f"scheduler-{v}" for v, p in cl.schedulers.items() if p.poll() is not None]
            health = self.recorder.health()
            leaders = [mid for mid, hh in health.items() if hh.get("is_leader")]
            why = ""
            if dead:
                why = f"exited: {dead}"
            elif len(health) < len(cl.members):
                why = f"members answering: {sorted(health)}"
            elif len(leaders) != 1:
                why = f"leaders: {leaders}"
            else:
                try:
                    url = cl.members[leaders[0] - 1].rest_url
                    status, data = http("GET", url + "/api/v1/nodes", timeout=5)
                    if status != 200:
                        raise OSError(f"GET /api/v1/nodes: {status} {str(data)[:200]}")
                    ready = [n["id"] for n in data["nodes"] if n["state"] == "Ready"]
                    if len(ready) < len(cl.agents):
                        why = f"nodes Ready: {sorted(ready)}"
                except (OSError, KeyError, TypeError) as e:
                    why = f"nodes: {e!r}"
            if not why:
                return ""
            self.waited_for = why
            time.sleep(0.5)
        return why


def _final_state(
    ctx: ChaosContext, timeout: float = 90.0
) -> tuple[dict[int, list[FinalAlloc]], int, int]:
    """Every member's allocations once all members are at the same revision twice in a
    row (nothing moves any more), the leader, and the nodes idle at the end."""
    cl = ctx.cluster
    deadline = time.monotonic() + timeout
    stable = 0
    last: tuple[int, ...] = ()
    while time.monotonic() < deadline and stable < 2:
        health = ctx.recorder.health()
        revs = tuple(health[m.id]["revision"] for m in cl.members if m.id in health)
        if len(revs) == len(cl.members) and len(set(revs)) == 1 and revs == last:
            stable += 1
        else:
            stable = 0
        last = revs
        time.sleep(1.0)
    leader = ctx.leader_member(timeout=30)
    final: dict[int, list[FinalAlloc]] = {}
    for m in cl.members:
        with contextlib.suppress(OSError):
            final[m.id] = [
                FinalAlloc(
                    a["id"],
                    a["spec"].get("request_id", ""),
                    a["state"],
                    tuple(a.get("assigned_nodes") or ()),
                    int(a.get("revision") or 0),
                    a.get("started_at"),
                    float(a["spec"].get("walltime_seconds") or 0),
                )
                for a in ctx.recorder.allocations(m.id, m.rest_url)
            ]
    idle = -1
    for _ in range(30):
        with contextlib.suppress(OSError):
            status, nodes = http("GET", leader.rest_url + "/api/v1/nodes", timeout=10)
            if status == 200:
                idle = sum(
                    1 for n in nodes["nodes"] if n["state"] == "Ready" and not n.get("owner")
                )
                break
        time.sleep(1)
    return final, leader.id, idle


def _drain(ctx: ChaosContext, timeout: float) -> None:
    """After the load stops: wait until nothing is left but terminal allocations."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, RuntimeError, KeyError):
            m = ctx.leader_member(timeout=10)
            active = [
                a
                for s in ("Pending", "Staging", "Running", "Checkpointing", "Suspended")
                for a in ctx.recorder.allocations(m.id, m.rest_url, s)
            ]
            if not active:
                return
        time.sleep(1.0)


def run_chaos(
    base: Path,
    *,
    seed: int,
    duration: float,
    faults: list[str],
    log: Any = print,
    agents: int = 3,
    hold: tuple[float, float] = (3.0, 9.0),
    gap: tuple[float, float] = (2.0, 6.0),
    every_fault_once: bool = True,
) -> ChaosResult:
    t_start = time.monotonic()
    rng = random.Random(seed)
    base.mkdir(parents=True, exist_ok=True)
    log(f"chaos: seed {seed}, duration {duration:.0f}s, faults {','.join(faults)}, dir {base}")
    h = start_chaos_cluster(base / "cluster", agents=agents)
    cl = h.cluster
    members = [(m.id, m.rest_url) for m in cl.members]
    recorder = Recorder(members)
    tag = hashlib.sha1(str(base).encode()).hexdigest()[:8]
    firewall = Firewall(tag)
    ctx = ChaosContext(h, firewall, recorder)
    instances: dict[str, Fault] = {}
    skipped: dict[str, str] = {}
    for name in faults:
        f = ALL_FAULTS[name]()
        why = f.unavailable(ctx)
        if why:
            skipped[name] = why
            log(f"chaos: skipping {name}: {why}")
        else:
            instances[name] = f
    if any(isinstance(f, Partition) for f in instances.values()):
        firewall.setup()
    records: list[FaultRecord] = []
    problems: list[str] = []
    load = LoadDriver(
        members,
        tenant=cl.tenant,
        vcluster=cl.vclusters[0],
        runs_file=base / "runs.log",
        seed=seed,
    )
    ctx.load = load
    try:
        recorder.start()
        load.start()
        time.sleep(3)  # some work in flight before the first fault
        names = list(instances)
        order: list[str] = []
        first_cycle = set(names)
        while names:
            elapsed = time.monotonic() - t_start
            if elapsed >= duration and not (every_fault_once and first_cycle):
                break
            if not order:
                order = names[:]
                rng.shuffle(order)
            name = order.pop()
            first_cycle.discard(name)
            fault = instances[name]
            rec = FaultRecord(name, "", time.time())
            try:
                rec.inject = fault.inject(ctx, rng)
                rec.target = str(rec.inject.get("target", ""))
                log(f"chaos: {time.monotonic() - t_start:6.1f}s inject {name} {rec.inject}")
                time.sleep(rng.uniform(*hold) if name != "api_member_kill" else 0.5)
                rec.heal = fault.heal(ctx)
                if rec.heal.get("problem"):
                    problems.append(f"{name}: {rec.heal['problem']}")
            except Exception as e:
                rec.heal = {
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-1500:],
                }
                problems.append(f"{name}: {type(e).__name__}: {e}")
                log(f"chaos: {name} failed: {e}")
            rec.healed_at = time.time()
            t_heal = time.monotonic()
            ctx.waited_for = ""
            rec.unsettled = ctx.settle()
            rec.waited_for = ctx.waited_for
            rec.settled_after = round(time.monotonic() - t_heal, 2)
            if rec.unsettled:
                problems.append(
                    f"{name} on {rec.target}: not recovered after {SETTLE_TIMEOUT:.0f}s: {rec.unsettled}"
                )
                log(f"chaos: {name} did not recover: {rec.unsettled}")
            log(
                f"chaos: {time.monotonic() - t_start:6.1f}s healed {name} {rec.heal} settled in {rec.settled_after}s"
            )
            records.append(rec)
            time.sleep(rng.uniform(*gap))
        log(f"chaos: {time.monotonic() - t_start:6.1f}s stopping the load")
        load.stop()
        firewall.flush()
        if why := ctx.settle():
            problems.append(f"after the run: not recovered: {why}")
        _drain(ctx, timeout=120)
        final, leader, idle = _final_state(ctx)
        recorder.stop()
        runs = read_runs(base / "runs.log")
        history = History(
            acks=list(load.acks),
            cancels=list(load.cancels),
            observations=list(recorder.observations),
            node_observations=list(recorder.node_observations),
            runs=runs,
            final=final,
            leader=leader,
            ended_at=time.time(),
            idle_nodes_at_end=idle,
            overlap_tolerance=cl.walltime_grace + 2 * 0.5 + 1.0,
        )
        (base / "history.json").write_text(
            json.dumps(
                {
                    "acks": [asdict(a) for a in history.acks],
                    "cancels": [asdict(c) for c in history.cancels],
                    "runs": [asdict(r) for r in runs],
                    "node_observations": [asdict(n) for n in history.node_observations],
                    "final": {m: [asdict(a) for a in fs] for m, fs in final.items()},
                    "leader": leader,
                }
            )
        )
        report = check(history)
    finally:
        recorder.stop()
        load.stop()
        firewall.teardown()
        cl.stop()
    load_stats = dict(load.stats)
    load_stats["acknowledged"] = len(load.acks)
    load_stats["cancels_acknowledged"] = len(load.cancels)
    load_stats["unexpected_rejections"] = load.rejections[:20]
    rec_stats = dict(recorder.stats)
    rec_stats["several_leaders_seen"] = recorder.leader_claims[:20]
    return ChaosResult(
        seed=seed,
        duration=duration,
        report=report,
        faults=records,
        skipped=skipped,
        load=load_stats,
        recorder=rec_stats,
        wall_seconds=time.monotonic() - t_start,
        base=str(base),
        problems=problems,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/chaos",
        description="A chaos run against a local 3-member Lattice cluster; prints the history "
        "checker's report, then a JSON summary as the last line.",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="fault order and targets (default: random)"
    )
    p.add_argument(
        "--duration", type=float, default=1800.0, help="seconds of faults (default 1800)"
    )
    p.add_argument(
        "--faults", default="", help=f"comma-separated subset of: {', '.join(ALL_FAULTS)}"
    )
    p.add_argument("--agents", type=int, default=3)
    p.add_argument(
        "--dir", default="", help="where the cluster and the records go (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the directory after a passing run")
    args = p.parse_args(argv)
    try:
        faults = parse_faults(args.faults)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="lattice-chaos-"))
    result = run_chaos(
        base, seed=seed, duration=args.duration, faults=faults, agents=args.agents,
        log=lambda s: print(s, flush=True),
    )  # fmt: skip
    summary = result.summary()
    print(result.report.text())
    for prob in result.problems:
        print(f"recovery problem: {prob}")
    if summary["ok"] and not args.keep and not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(summary, sort_keys=True, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
