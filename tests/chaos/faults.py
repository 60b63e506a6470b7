"""The chaos suite's faults: the failure-mode table's failures, by real mechanisms.

Each fault is a small class with ``inject(ctx, rng)`` and ``heal(ctx)``; both return a
dict of what they did and saw, which the run's summary keeps. ``unavailable(ctx)`` says
why a fault cannot run on this machine (it is then skipped with that reason, never
silently). Only one fault is active at a time, so a majority of the quorum is always
reachable once the fault is healed.

| name | mechanism |
| --- | --- |
| leader_kill | SIGKILL the current Raft leader's process group; restart it at heal |
| follower_kill | SIGKILL a follower's process group; restart it at heal |
| api_member_kill | SIGKILL the member the load driver last got an answer from (the API the clients talk to), restart it at once |
| agent_kill | SIGKILL a node agent's process group (its workloads live on, as under KillMode=process); restart it at heal |
| scheduler_kill | SIGKILL the vCluster scheduler; restart it at heal |
| partition | iptables DROP rules cut one member's Raft and gRPC traffic to and from its peers (matched by the member's port and group id); checked to block before the hold; removed at heal |
| disk_full | fill the member's own tmpfs Raft data directory to ENOSPC; free it at heal (restarting the member if it died) |
| clock_jump | restart an agent inside a time namespace with CLOCK_MONOTONIC moved by a day (forward) or by up to an hour (back); restart it normally at heal |
| corrupt_snapshot | stop a member, flip bytes in its raft.dump, start it: it must refuse to start or recover its state from its peers, never serve a corrupt state; a member that refuses is wiped and rejoins at heal |
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from chaoscluster import can_time_namespace

if TYPE_CHECKING:
    from chaosrun import ChaosContext
    from lattice_cli.devcluster import Member

FILLER = "chaos-filler"


def kill_group(proc: subprocess.Popen[bytes] | None) -> int | None:
    """SIGKILL the process group a component runs in (its own session); reaped."""
    if proc is None or proc.poll() is not None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.pid


def connects(port: int, gid: int | None = None, timeout: float = 1.0) -> bool:
    """Whether a TCP connect to 127.0.0.1:port succeeds from a process with group id
    ``gid`` (a fresh interpreter, so that the owner match sees that gid)."""
    code = (
        "import os,socket,sys\n"
        f"{f'os.setgid({gid})' if gid is not None else ''}\n"
        f"s=socket.socket();s.settimeout({timeout})\n"
        f"try:\n s.connect(('127.0.0.1',{port}));sys.exit(0)\n"
        "except OSError:\n sys.exit(1)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout + 10)
    return r.returncode == 0


class Firewall:
    """An iptables chain of the run's own, jumped to from OUTPUT (loopback traffic
    passes OUTPUT once, so one rule per direction is enough)."""

    def __init__(self, tag: str) -> None:
        self.chain = f"LCHAOS-{tag}"[:28]
        self.ready = False

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "iptables rules need root"
        if shutil.which("iptables") is None:
            return "no iptables binary"
        return None

    def _ipt(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)}: {r.stderr.strip()}")
        return r

    def setup(self) -> None:
        self._ipt("-N", self.chain, check=False)
        self._ipt("-F", self.chain)
        if self._ipt("-C", "OUTPUT", "-j", self.chain, check=False).returncode != 0:
            self._ipt("-I", "OUTPUT", "-j", self.chain)
        self.ready = True

    def flush(self) -> None:
        if self.ready:
            self._ipt("-F", self.chain, check=False)

    def teardown(self) -> None:
        if not self.ready:
            return
        self._ipt("-D", "OUTPUT", "-j", self.chain, check=False)
        self._ipt("-F", self.chain, check=False)
        self._ipt("-X", self.chain, check=False)
        self.ready = False

    def isolate(self, ports: list[int], gid: int, peer_ports: list[int]) -> None:
        """Drop what reaches ``ports`` or leaves from them (the member's listeners), and
        what the member (its group id) sends to its peers' listeners."""
        for p in ports:
            self._ipt("-A", self.chain, "-o", "lo", "-p", "tcp", "--dport", str(p), "-j", "DROP")
            self._ipt("-A", self.chain, "-o", "lo", "-p", "tcp", "--sport", str(p), "-j", "DROP")
        for p in peer_ports:
            self._ipt(
                "-A", self.chain, "-o", "lo", "-m", "owner", "--gid-owner", str(gid),
                "-p", "tcp", "--dport", str(p), "-j", "DROP",
            )  # fmt: skip


@dataclass
class FaultRecord:
    fault: str
    target: str
    injected_at: float
    healed_at: float | None = None
    inject: dict[str, Any] = field(default_factory=dict)
    heal: dict[str, Any] = field(default_factory=dict)
    settled_after: float | None = None
    unsettled: str = ""  # what was still wrong when settling gave up
    waited_for: str = ""  # the last thing settling waited for


class Fault:
    name: ClassVar[str] = ""

    def unavailable(self, ctx: ChaosContext) -> str | None:
        return None

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        raise NotImplementedError


def _member_label(m: Member) -> str:
    return f"member-{m.id}"


class _MemberKill(Fault):
    member: Member | None = None

    def pick(self, ctx: ChaosContext, rng: random.Random) -> Member:
        raise NotImplementedError

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        self.member = m = self.pick(ctx, rng)
        was_leader = ctx.leader_id() == m.id
        pid = kill_group(m.proc)
        return {"target": _member_label(m), "pid": pid, "was_leader": was_leader}

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        assert self.member is not None
        ctx.cluster.start_member(self.member)
        return {"restarted": _member_label(self.member)}


class LeaderKill(_MemberKill):
    name = "leader_kill"

    def pick(self, ctx: ChaosContext, rng: random.Random) -> Member:
        return ctx.leader_member(timeout=20)


class FollowerKill(_MemberKill):
    name = "follower_kill"

    def pick(self, ctx: ChaosContext, rng: random.Random) -> Member:
        leader = ctx.leader_member(timeout=20)
        return rng.choice([m for m in ctx.cluster.members if m is not leader])


class ApiMemberKill(_MemberKill):
    """The API and the quorum member share one process (lattice-server): this kills the
    one the clients were just talking to, mid-request, and restarts it at once (a
    supervisor's restart); clients must retry elsewhere with the same request id."""

    name = "api_member_kill"

    def pick(self, ctx: ChaosContext, rng: random.Random) -> Member:
        mid = ctx.load.last_member() if ctx.load is not None else None
        by_id = {m.id: m for m in ctx.cluster.members}
        return by_id.get(mid) if mid in by_id else rng.choice(ctx.cluster.members)  # type: ignore[return-value]


class AgentKill(Fault):
    name = "agent_kill"

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        self.agent = rng.choice(ctx.cluster.agents)
        pid = kill_group(self.agent.proc)
        return {"target": self.agent.node_id, "pid": pid}

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        ctx.cluster.start_agent(self.agent)
        return {"restarted": self.agent.node_id}


class SchedulerKill(Fault):
    name = "scheduler_kill"

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        self.vcluster = rng.choice(sorted(ctx.cluster.schedulers))
        pid = kill_group(ctx.cluster.schedulers[self.vcluster])
        return {"target": f"scheduler-{self.vcluster}", "pid": pid}

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        ctx.cluster.start_scheduler(self.vcluster)
        return {"restarted": f"scheduler-{self.vcluster}"}


class Partition(Fault):
    """One member cut off from its peers: Raft (pysyncobj, one TCP connection per pair)
    and gRPC (proposals a follower forwards to the leader, agents' and schedulers'
    streams). Its REST port stays reachable, as for a client on its side of the split:
    what it acknowledges there must still be committed by a majority."""

    name = "partition"

    def unavailable(self, ctx: ChaosContext) -> str | None:
        return Firewall.unavailable()

    def choose(self, leader: Any, members: list[Any], rng: random.Random) -> Any:
        """The member to cut off: the leader half of the time."""
        return leader if rng.random() < 0.5 else rng.choice(members)

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        cl = ctx.cluster
        leader = ctx.leader_member(timeout=20)
        self.member = m = self.choose(leader, cl.members, rng)
        peers = [p for p in cl.members if p is not m]
        gid = cl.member_gid(m.id)
        ctx.firewall.isolate(
            [m.raft_port, m.grpc_port],
            gid,
            [p.raft_port for p in peers] + [p.grpc_port for p in peers],
        )
        # the rules really block: the member cannot reach a peer, nobody reaches the
        # member's Raft port, and a peer still reaches another peer
        blocked_out = not connects(peers[0].raft_port, gid=gid)
        blocked_in = not connects(m.raft_port)
        others_ok = connects(peers[1].raft_port, gid=cl.member_gid(peers[0].id))
        if not (blocked_out and blocked_in and others_ok):
            ctx.firewall.flush()
            raise RuntimeError(
                f"partition rules do not work as meant: out blocked {blocked_out}, "
                f"in blocked {blocked_in}, peers connected {others_ok}"
            )
        return {"target": _member_label(m), "was_leader": m is leader, "verified": True}

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        # who claimed leadership just before the heal: the isolated member must not be
        # the only one, and the majority side must have one
        claims = ctx.leader_claims()
        ctx.firewall.flush()
        return {"leader_claims_before_heal": claims}


class DiskFull(Fault):
    name = "disk_full"

    def unavailable(self, ctx: ChaosContext) -> str | None:
        return ctx.cluster.mount_error

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        cl = ctx.cluster
        self.member = m = rng.choice(cl.members)
        d = cl.data_dir(m.id)
        self.filler = d / FILLER
        written = 0
        chunk = b"\0" * (1 << 20)
        with open(self.filler, "wb") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
            except OSError:
                pass
        # the tail end: fill the last partial block too
        with contextlib.suppress(OSError), open(self.filler, "ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        st = os.statvfs(d)
        return {
            "target": _member_label(m),
            "filled_bytes": written,
            "free_bytes_after": st.f_bavail * st.f_frsize,
        }

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        m = self.member
        rc = m.proc.poll() if m.proc is not None else None
        self.filler.unlink(missing_ok=True)
        out: dict[str, Any] = {"member_exited": rc is not None, "exit_code": rc}
        if rc is not None:
            out["log_tail"] = ctx.log_tail(_member_label(m))
            ctx.cluster.start_member(m)
            out["restarted"] = True
        return out


class ClockJump(Fault):
    """There is no way to move one process's wall clock here (time namespaces offset
    only CLOCK_MONOTONIC and CLOCK_BOOTTIME, and the agent has no clock hook), so the
    agent is restarted with its monotonic clock a day ahead or up to an hour behind the
    rest of the machine: its timers, the asyncio loop and every monotonic deadline it
    keeps jump, while the workloads it reattaches to keep running."""

    name = "clock_jump"

    def unavailable(self, ctx: ChaosContext) -> str | None:
        return can_time_namespace()

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        self.agent = a = rng.choice(ctx.cluster.agents)
        uptime = time.monotonic()
        back = -int(min(3600, uptime / 2))
        offset = 86400 if rng.random() < 0.5 or back > -60 else back
        kill_group(a.proc)
        ctx.cluster.clock_offsets[a.node_id] = offset
        ctx.cluster.start_agent(a)
        return {"target": a.node_id, "monotonic_offset_s": offset}

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        a = self.agent
        exited = a.proc.poll() if a.proc is not None else None
        kill_group(a.proc)
        ctx.cluster.clock_offsets.pop(a.node_id, None)
        ctx.cluster.start_agent(a)
        out: dict[str, Any] = {"agent_exited_while_jumped": exited is not None}
        if exited is not None:
            out["log_tail"] = ctx.log_tail(f"agent-{a.node_id}")
        return out


class CorruptSnapshot(Fault):
    name = "corrupt_snapshot"

    def inject(self, ctx: ChaosContext, rng: random.Random) -> dict[str, Any]:
        cl = ctx.cluster
        # not member 1: started with no Raft state it would bootstrap a second cluster
        self.member = m = rng.choice([x for x in cl.members if x.id != 1])
        kill_group(m.proc)
        dump = cl.data_dir(m.id) / "raft.dump"
        out: dict[str, Any] = {"target": _member_label(m)}
        if not dump.exists() or dump.stat().st_size < 64:
            out["corrupted"] = False
            out["why"] = "no raft.dump on disk yet"
        else:
            data = bytearray(dump.read_bytes())
            where = sorted(rng.sample(range(16, len(data)), k=min(8, len(data) - 16)))
            for i in where:
                data[i] ^= 0xFF
            dump.write_bytes(bytes(data))
            out.update(corrupted=True, size=len(data), flipped_at=where)
        self.corrupted = bool(out.get("corrupted"))
        cl.start_member(m)
        self.restarted_at = time.monotonic()
        return out

    def heal(self, ctx: ChaosContext) -> dict[str, Any]:
        m = self.member
        # a member starts in seconds on a loaded machine: wait until it has either
        # exited or answers before judging
        rc = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rc = m.proc.poll() if m.proc is not None else None
            if rc is not None or ctx.answers(m):
                break
            time.sleep(0.2)
        out: dict[str, Any] = {"refused_to_start": rc is not None, "exit_code": rc}
        log = ctx.log_tail(_member_label(m), lines=400)
        out["load_error_logged"] = "failed to load full dump" in log
        if self.corrupted and rc is None:
            out["problem"] = (
                f"{_member_label(m)} started on a corrupted raft.dump instead of refusing"
            )
        if rc is not None:
            out["log_tail"] = log[-1500:]
            # the operator's way back: move the damaged state aside, rejoin empty and
            # catch up from the peers
            d = ctx.cluster.data_dir(m.id)
            aside = m.dir / f"corrupt-{int(time.time())}"
            aside.mkdir()
            for f in d.iterdir():
                shutil.move(str(f), aside / f.name)
            ctx.cluster.start_member(m)
            out["rejoined_empty"] = True
        return out


class PartitionFollower(Partition):
    """A follower cut off from its peers (never the leader): the member that must
    catch up afterwards, from the log or a snapshot."""

    name = "partition-follower"

    def choose(self, leader: Any, members: list[Any], rng: random.Random) -> Any:
        return rng.choice([m for m in members if m is not leader])


ALL_FAULTS: dict[str, type[Fault]] = {
    f.name: f
    for f in (
        LeaderKill,
        FollowerKill,
        ApiMemberKill,
        AgentKill,
        SchedulerKill,
        Partition,
        PartitionFollower,
        DiskFull,
        ClockJump,
        CorruptSnapshot,
    )
}


#: faults with an open defect behind them, left out of the default (bounded) selection
KNOWN_DEFECTS: tuple[str, ...] = ()


def parse_faults(text: str | None, *, default: tuple[str, ...] | None = None) -> list[str]:
    """``LATTICE_CHAOS_FAULTS`` / ``--faults``: a comma-separated subset (empty: every
    fault, or ``default`` when given)."""
    if not text or not text.strip():
        return list(default) if default is not None else list(ALL_FAULTS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_FAULTS]
    if unknown:
        raise ValueError(
            f"unknown chaos fault(s) {unknown}\nHint: choose from {', '.join(ALL_FAULTS)}"
        )
    return names
