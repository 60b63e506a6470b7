"""The cluster the chaos suite breaks: lattice_cli.devcluster.LocalCluster (3 members,
a scheduler, agents as real processes on loopback) with three additions the faults need.

* Each member runs with a group id of its own, so that a packet filter rule can match
  the member's outgoing connections (``iptables -m owner --gid-owner``) and cut it off
  from its peers while everything else on loopback keeps flowing.
* Each member's Raft data directory (``member-N/raft``: raft.journal, raft.dump) is a
  small tmpfs of its own, so that it can be filled to ENOSPC without touching the disk
  the rest of the machine uses.
* An agent can be started inside a time namespace whose CLOCK_MONOTONIC (and the
  asyncio loop's clock) is offset (``unshare --time --monotonic``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from lattice_cli.devcluster import LocalCluster
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import FAST

DATA_DIR_MB = 64


def can_mount() -> str | None:
    """Why the data directories cannot be tmpfs mounts here (None: they can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount binary"
    return None


def can_time_namespace() -> str | None:
    """Why an agent cannot get a clock offset here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare binary"
    if not Path("/proc/self/ns/time").exists():
        return "the kernel has no time namespaces"
    r = subprocess.run(
        ["unshare", "--time", "--monotonic", "100", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return None if r.returncode == 0 else f"unshare --time failed: {r.stderr.strip()}"


class ChaosCluster(LocalCluster):
    def __init__(self, base_dir: str | os.PathLike[str], **kw: Any) -> None:
        super().__init__(base_dir, **kw)
        digest = int(hashlib.sha1(str(self.base).encode()).hexdigest()[:6], 16)
        self.gid_base = 47000 + (digest % 1000) * 8  # two clusters on one host differ
        self.clock_offsets: dict[str, int] = {}  # node id -> monotonic offset at next start
        self.mounted: list[Path] = []
        self.mount_error = can_mount()

    def member_gid(self, member_id: int) -> int:
        return self.gid_base + member_id

    def data_dir(self, member_id: int) -> Path:
        return self.members[member_id - 1].dir / "raft"

    def _mount_data_dirs(self) -> None:
        if self.mount_error:
            return
        for m in self.members:
            d = m.dir / "raft"
            d.mkdir(parents=True, exist_ok=True)
            if os.path.ismount(d):
                continue
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DATA_DIR_MB}m,mode=0700", "tmpfs", str(d)],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                self.mount_error = f"mount -t tmpfs failed: {r.stderr.strip()}"
                return
            self.mounted.append(d)

    def start(self, timeout: float = 30.0) -> None:
        self._mount_data_dirs()
        super().start(timeout)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for d in self.mounted:
                subprocess.run(["umount", "-l", str(d)], capture_output=True)
            self.mounted.clear()

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", module, *args]
        group = None
        if name.startswith("member-") and os.geteuid() == 0:
            group = self.member_gid(int(name.split("-")[1]))
        if name.startswith("agent-"):
            offset = self.clock_offsets.get(name.removeprefix("agent-"))
            if offset:
                argv = ["unshare", "--time", "--monotonic", str(offset), "--fork", *argv]
        logf = open(self.log_path(name), "ab")  # noqa: SIM115 (kept open by the child)
        try:
            return subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                group=group,
            )
        finally:
            logf.close()


def start_chaos_cluster(base: Path, *, agents: int = 3, **kw: Any) -> ClusterHandle:
    """A 3-member chaos cluster with the test harness's fast timings, frequent Raft
    snapshots (so that a raft.dump exists to corrupt)."""
    env = {
        "LATTICE_QUORUM__LOG_COMPACTION_MIN_ENTRIES": "200",
        "LATTICE_QUORUM__LOG_COMPACTION_MIN_TIME": "15",
        **kw.pop("env", {}),
    }
    c = ChaosCluster(base, **{**FAST, "members": 3, "agents": agents, "env": env, **kw})
    try:
        c.start()
    except Exception:
        with contextlib.suppress(Exception):
            c.stop()
        raise
    return ClusterHandle(c)
