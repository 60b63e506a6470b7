"""Per-allocation cgroups (spec: node agent, allocation flow step 8; crash recovery).

Every allocation runs in its own scope, ``<slice>/alloc-<id>.scope`` (``slice`` defaults to
``workload.slice``): on cgroup v2 one directory under the unified root, on cgroup v1 the same
relative path under every controller the agent uses. One interface, :class:`CgroupManager`,
three backends:

* :class:`CgroupsV2` — ``memory.max``, ``memory.swap.max`` (0: no swap beyond the limit),
  ``cpu.weight``/``cpu.max``, ``cpuset.cpus``/``cpuset.mems``, ``pids.max``; usage from
  ``memory.current``/``memory.peak``/``cpu.stat``/``pids.current``; OOM from
  ``memory.events`` (``oom_kill``); ``cgroup.kill`` empties a scope. Controllers are enabled
  in the parents' ``cgroup.subtree_control`` on the way down.
* :class:`CgroupsV1` — ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` to the
  same value where swap accounting exists), ``memory.max_usage_in_bytes`` for the peak,
  ``memory.oom_control`` (``oom_kill N``; kernels without that line: ``memory.failcnt``) for
  OOM, ``cpu.shares``/``cpu.cfs_quota_us``/``cpu.cfs_period_us``, ``cpuset.cpus``/``mems``
  (copied from the parent first: a v1 cpuset starts empty), ``pids.max``,
  ``devices.deny`` for the GPU device nodes the allocation was not given, ``cgroup.procs``.
* :class:`NoCgroups` — no cgroup filesystem: allocations run as bare process groups. Never
  silent: a warning at startup and the gauge ``lattice_agent_cgroups_available`` is 0.

A process joins a scope by writing its pid into every file of :meth:`CgroupManager.procs_files`;
the spawn wrapper does that for itself before it runs the user's command, so everything the
allocation forks is born inside. The scope of an allocation is a pure function of its id, so a
restarted agent finds it again without persisting anything.

Limits (:func:`limits_for`):

* memory: ``constraints.memory_gb`` is the request (Slurm's ``--mem``: the node must have it,
  and the allocation is confined to it); without one the allocation takes the whole node:
  capacity minus a reserve for the OS and the agent (``node_agent.cgroup_memory_reserve_percent``,
  default 5 %, at least ``cgroup_memory_reserve_min_gb``, default 1 GiB). Swap is not allowed
  beyond the limit.
* CPU: nodes are allocated exclusively today, so no quota (``cpu.max max`` / quota -1) and the
  default weight (v2 100, v1 shares 1024); the cpuset does the confining.
* cpuset: every CPU and memory node of the machine, unless the allocation carries an
  intra-node placement (``tags["cpuset"]``/``tags["cpuset_mems"]``, as cpulists).
* pids: ``node_agent.pids_max`` (default 4096) — a fork bomb stops there.
* devices (v1 only; v2 needs an eBPF program, not done): GPU device nodes
  (``/dev/nvidia<N>``) outside ``tags["gpus"]`` (comma-separated indices; absent = all GPUs,
  the whole node) are denied. No GPUs: nothing to deny.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lattice_common.types import Allocation

log = logging.getLogger("lattice.agent.cgroups")

__all__ = [
    "CgroupManager",
    "CgroupsV1",
    "CgroupsV2",
    "Limits",
    "NoCgroups",
    "Scope",
    "Usage",
    "detect",
    "limits_for",
    "memory_reserve_bytes",
]

GIB = 1 << 30
DEFAULT_SLICE = "workload.slice"
DEFAULT_PIDS_MAX = 4096
_SCOPE_RE = re.compile(r"^alloc-(.+)\.scope$")
_V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "cpuset", "pids", "devices", "freezer")
_V2_CONTROLLERS = ("memory", "cpu", "cpuset", "pids")


@dataclass(frozen=True)
class Limits:
    """What one allocation may use on this node (None: not limited / inherited)."""

    memory_bytes: int | None = None
    cpu_weight: int = 100  # v2 cpu.weight scale (1..10000); v1 shares = weight * 1024 / 100
    cpu_quota_cores: float | None = None  # None: no quota (exclusive node)
    cpus: str | None = None  # cpulist; None: all of the parent's
    mems: str | None = None  # memory-node list; None: all of the parent's
    pids_max: int | None = DEFAULT_PIDS_MAX
    allowed_gpus: frozenset[int] | None = None  # None: every GPU of the node


@dataclass(frozen=True)
class Scope:
    """One allocation's cgroup: its id and the directories (one on v2, one per v1 controller)."""

    alloc_id: str
    dirs: dict[str, Path] = field(default_factory=dict)  # controller ("" on v2) -> directory


@dataclass(frozen=True)
class Usage:
    memory_current: int | None = None
    memory_peak: int | None = None
    cpu_seconds: float | None = None
    pids: int | None = None


def memory_reserve_bytes(capacity: int, percent: float = 5.0, min_bytes: int = GIB) -> int:
    """What a whole-node allocation leaves to the OS and the agent."""
    return max(int(capacity * percent / 100.0), int(min_bytes))


def allocation_gpus(tags: Mapping[str, str]) -> frozenset[int] | None:
    """The GPU indices an allocation was given (``tags["gpus"]``, comma-separated); None:
    every GPU of the node (no tag, or one that does not parse)."""
    text = tags.get("gpus", "").strip()
    if not text:
        return None
    try:
        return frozenset(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        return None


def limits_for(
    alloc: Allocation,
    *,
    node_memory_bytes: int,
    reserve_percent: float = 5.0,
    reserve_min_bytes: int = GIB,
    pids_max: int | None = DEFAULT_PIDS_MAX,
) -> Limits:
    """The limits of ``alloc`` on a node with ``node_memory_bytes`` (module docstring)."""
    spec = alloc.spec
    memory: int | None
    if spec.constraints.memory_gb > 0:
        memory = spec.constraints.memory_gb * GIB
    elif node_memory_bytes > 0:
        reserve = memory_reserve_bytes(node_memory_bytes, reserve_percent, reserve_min_bytes)
        memory = max(node_memory_bytes - reserve, GIB // 4)
    else:
        memory = None
    tags = spec.tags
    gpus = allocation_gpus(tags)
    return Limits(
        memory_bytes=memory,
        cpus=tags.get("cpuset") or None,
        mems=tags.get("cpuset_mems") or None,
        pids_max=pids_max if pids_max and pids_max > 0 else None,
        allowed_gpus=gpus,
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _keyed(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.events, memory.oom_control, cpu.stat) as a dict."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = int(parts[1])
    return out


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _copy_cpuset(parent: Path, d: Path) -> None:
    """Fill an empty v1 ``cpuset.cpus``/``cpuset.mems`` of ``d`` from its parent's."""
    for f in ("cpuset.cpus", "cpuset.mems"):
        mine = _read(d / f)
        if mine is not None and not mine.strip():
            _write(d / f, (_read(parent / f) or "").strip() or "\n")


def _pids(procs: Path) -> list[int]:
    text = _read(procs) or ""
    return [int(x) for x in text.split() if x.isdigit()]


def _kill_all(procs: Path, timeout: float) -> bool:
    """SIGKILL everything listed in ``procs`` until it is empty (True) or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids(procs)
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _rmdir(path: Path, timeout: float = 2.0) -> bool:
    """rmdir a cgroup (EBUSY while the kernel still releases dying tasks: retried)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if time.monotonic() >= deadline:
                log.warning("could not remove cgroup %s: %s", path, e)
                return False
            time.sleep(0.02)


class CgroupManager:
    """The interface (and the :class:`NoCgroups` behaviour: nothing is confined)."""

    available = False
    version = "none"

    def __init__(
        self,
        *,
        slice_name: str = DEFAULT_SLICE,
        node_memory_bytes: int = 0,
        reserve_percent: float = 5.0,
        reserve_min_bytes: int = GIB,
        pids_max: int | None = DEFAULT_PIDS_MAX,
    ) -> None:
        self.slice = slice_name.strip("/") or DEFAULT_SLICE
        self.node_memory_bytes = node_memory_bytes
        self.reserve_percent = reserve_percent
        self.reserve_min_bytes = reserve_min_bytes
        self.pids_max = pids_max

    def limits(self, alloc: Allocation) -> Limits:
        return limits_for(
            alloc,
            node_memory_bytes=self.node_memory_bytes,
            reserve_percent=self.reserve_percent,
            reserve_min_bytes=self.reserve_min_bytes,
            pids_max=self.pids_max,
        )

    @staticmethod
    def scope_name(alloc_id: str) -> str:
        return f"alloc-{alloc_id}.scope"

    def create(self, alloc_id: str, limits: Limits) -> Scope:
        return Scope(alloc_id)

    def scope(self, alloc_id: str) -> Scope:
        return Scope(alloc_id)

    def exists(self, scope: Scope) -> bool:
        return bool(scope.dirs) and all(d.is_dir() for d in scope.dirs.values())

    def procs_files(self, scope: Scope) -> list[Path]:
        return [d / "cgroup.procs" for d in scope.dirs.values()]

    def usage(self, scope: Scope) -> Usage:
        return Usage()

    def oom_killed(self, scope: Scope) -> bool:
        return False

    def remove(self, scope: Scope, timeout: float = 5.0) -> bool:
        return True

    def orphans(self, known_ids: set[str] | frozenset[str]) -> list[Scope]:
        return []

    def _scope_ids(self, slice_dir: Path) -> list[str]:
        try:
            names = sorted(p.name for p in slice_dir.iterdir() if p.is_dir())
        except OSError:
            return []
        return [m.group(1) for n in names if (m := _SCOPE_RE.match(n))]


class NoCgroups(CgroupManager):
    """No usable cgroup filesystem: allocations are bare process groups (said, not hidden)."""

    def __init__(self, why: str = "", **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.why = why


class CgroupsV2(CgroupManager):
    """The unified hierarchy: one directory per scope under ``root/slice``."""

    available = True
    version = "v2"

    def __init__(self, root: Path | str = "/sys/fs/cgroup", **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.root = Path(root)
        # the controllers were enabled down to the slice by this manager: a scope needs
        # only its own directory (a dozen control-file writes less per allocation)
        self._enabled = False

    @property
    def slice_dir(self) -> Path:
        return self.root / self.slice

    def scope(self, alloc_id: str) -> Scope:
        return Scope(alloc_id, {"": self.slice_dir / self.scope_name(alloc_id)})

    def _enable_controllers(self) -> None:
        """Turn the controllers on from the root down to the slice (what is available)."""
        available = set((_read(self.root / "cgroup.controllers") or "").split())
        wanted = [c for c in _V2_CONTROLLERS if c in available]
        d = self.root
        for part in Path(self.slice).parts:
            control = d / "cgroup.subtree_control"
            if wanted and control.exists():
                for c in wanted:
                    try:
                        _write(control, f"+{c}")
                    except OSError as e:
                        log.debug("could not enable %s in %s: %s", c, control, e)
            d = d / part
            d.mkdir(exist_ok=True)
        control = d / "cgroup.subtree_control"
        if control.exists():
            for c in wanted:
                with contextlib.suppress(OSError):
                    _write(control, f"+{c}")

    def create(self, alloc_id: str, limits: Limits) -> Scope:
        scope = self.scope(alloc_id)
        d = scope.dirs[""]
        if not self._enabled:
            self._enable_controllers()
            self._enabled = True
        try:
            d.mkdir(exist_ok=True)
            self._limit(d, limits)
        except OSError:
            # the slice went away, or its controllers were turned off (by the init
            # system) since they were enabled: enable them again, once
            self._enable_controllers()
            d.mkdir(exist_ok=True)
            self._limit(d, limits)
        return scope

    def _limit(self, d: Path, limits: Limits) -> None:
        if limits.memory_bytes is not None:
            _write(d / "memory.max", str(limits.memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
        _write(d / "cpu.weight", str(limits.cpu_weight))
        if limits.cpu_quota_cores is not None:
            period = 100000
            _write(d / "cpu.max", f"{int(limits.cpu_quota_cores * period)} {period}")
        else:
            _write(d / "cpu.max", "max 100000")
        if limits.cpus:
            _write(d / "cpuset.cpus", limits.cpus)
        if limits.mems:
            _write(d / "cpuset.mems", limits.mems)
        if limits.pids_max is not None:
            _write(d / "pids.max", str(limits.pids_max))

    def usage(self, scope: Scope) -> Usage:
        d = scope.dirs[""]
        cpu = _keyed(_read(d / "cpu.stat")).get("usage_usec")
        return Usage(
            memory_current=_read_int(d / "memory.current"),
            memory_peak=_read_int(d / "memory.peak"),
            cpu_seconds=cpu / 1e6 if cpu is not None else None,
            pids=_read_int(d / "pids.current"),
        )

    def oom_killed(self, scope: Scope) -> bool:
        d = scope.dirs[""]
        return _keyed(_read(d / "memory.events")).get("oom_kill", 0) > 0

    def remove(self, scope: Scope, timeout: float = 5.0) -> bool:
        d = scope.dirs[""]
        if not d.is_dir():
            return True
        kill = d / "cgroup.kill"
        if kill.exists():
            with contextlib.suppress(OSError):
                _write(kill, "1")
        emptied = _kill_all(d / "cgroup.procs", timeout)
        return _rmdir(d) and emptied

    def orphans(self, known_ids: set[str] | frozenset[str]) -> list[Scope]:
        return [self.scope(a) for a in self._scope_ids(self.slice_dir) if a not in known_ids]


class CgroupsV1(CgroupManager):
    """Legacy hierarchies: the same relative path under each controller's mount."""

    available = True
    version = "v1"

    def __init__(
        self,
        root: Path | str = "/sys/fs/cgroup",
        *,
        dev_dir: Path | str = "/dev",
        **kw: object,
    ) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.root = Path(root)
        self.dev_dir = Path(dev_dir)
        # cpuset parents (the slice) this manager has made and filled: a scope under one
        # needs only its own directory and copy
        self._cpuset_ready: set[Path] = set()
        # controllers mounted here; cpu and cpuacct are often one mount ("cpu,cpuacct")
        self.controllers: dict[str, Path] = {}
        seen: set[Path] = set()
        for c in _V1_CONTROLLERS:
            mount = self.root / c
            if not mount.is_dir():
                continue
            real = mount.resolve()
            if real in seen:
                continue
            seen.add(real)
            self.controllers[c] = mount

    def _controller(self, name: str) -> Path | None:
        """The mount that carries ``name`` (cpuacct may share cpu's)."""
        if name in self.controllers:
            return self.controllers[name]
        mount = self.root / name
        return mount if mount.is_dir() else None

    def scope(self, alloc_id: str) -> Scope:
        rel = Path(self.slice) / self.scope_name(alloc_id)
        return Scope(alloc_id, {c: m / rel for c, m in self.controllers.items()})

    def _mkdirs_cpuset(self, target: Path) -> None:
        """A v1 cpuset starts empty and refuses tasks: copy each parent's cpus/mems down.
        The levels above the scope are done once (the first scope under them); later
        scopes make and fill only their own directory, unless the slice went away."""
        parent = target.parent
        if parent in self._cpuset_ready:
            try:
                target.mkdir(exist_ok=True)
            except FileNotFoundError:
                self._cpuset_ready.discard(parent)
            else:
                _copy_cpuset(parent, target)
                return
        mount = self.controllers["cpuset"]
        d = mount
        for part in target.relative_to(mount).parts:
            parent, d = d, d / part
            d.mkdir(exist_ok=True)
            _copy_cpuset(parent, d)
        self._cpuset_ready.add(target.parent)

    def create(self, alloc_id: str, limits: Limits) -> Scope:
        scope = self.scope(alloc_id)
        for c, d in scope.dirs.items():
            if c == "cpuset":
                self._mkdirs_cpuset(d)
            else:
                d.mkdir(parents=True, exist_ok=True)
        dirs = scope.dirs
        if "memory" in dirs and limits.memory_bytes is not None:
            m = dirs["memory"]
            memsw = m / "memory.memsw.limit_in_bytes"
            # memsw >= limit must hold at every moment: raise memsw first when growing
            if memsw.exists():
                with contextlib.suppress(OSError):
                    _write(memsw, str(limits.memory_bytes))
            _write(m / "memory.limit_in_bytes", str(limits.memory_bytes))
            if memsw.exists():
                _write(memsw, str(limits.memory_bytes))  # no swap beyond the limit
        if "cpu" in dirs:
            cpu = dirs["cpu"]
            _write(cpu / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
            if limits.cpu_quota_cores is not None:
                period = _read_int(cpu / "cpu.cfs_period_us") or 100000
                _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpu_quota_cores * period)))
            else:
                _write(cpu / "cpu.cfs_quota_us", "-1")
        if "cpuset" in dirs:
            if limits.cpus:
                _write(dirs["cpuset"] / "cpuset.cpus", limits.cpus)
            if limits.mems:
                _write(dirs["cpuset"] / "cpuset.mems", limits.mems)
        if "pids" in dirs and limits.pids_max is not None:
            _write(dirs["pids"] / "pids.max", str(limits.pids_max))
        if "devices" in dirs:
            for rule in self.denied_devices(limits):
                _write(dirs["devices"] / "devices.deny", rule)
        return scope

    def denied_devices(self, limits: Limits) -> list[str]:
        """``devices.deny`` rules for the GPU device nodes the allocation was not given."""
        if limits.allowed_gpus is None:
            return []
        rules = []
        try:
            names = sorted(os.listdir(self.dev_dir))
        except OSError:
            return []
        for name in names:
            m = re.fullmatch(r"nvidia(\d+)", name)
            if not m or int(m.group(1)) in limits.allowed_gpus:
                continue
            try:
                st = os.stat(self.dev_dir / name)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode):
                rules.append(f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm")
        return rules

    def usage(self, scope: Scope) -> Usage:
        dirs = scope.dirs
        mem = dirs.get("memory")
        cpu_dir = dirs.get("cpuacct")
        if cpu_dir is None and "cpu" in dirs and (dirs["cpu"] / "cpuacct.usage").exists():
            cpu_dir = dirs["cpu"]
        ns = _read_int(cpu_dir / "cpuacct.usage") if cpu_dir is not None else None
        return Usage(
            memory_current=_read_int(mem / "memory.usage_in_bytes") if mem else None,
            memory_peak=_read_int(mem / "memory.max_usage_in_bytes") if mem else None,
            cpu_seconds=ns / 1e9 if ns is not None else None,
            pids=_read_int(dirs["pids"] / "pids.current") if "pids" in dirs else None,
        )

    def oom_killed(self, scope: Scope) -> bool:
        mem = scope.dirs.get("memory")
        if mem is None:
            return False
        ctl = _keyed(_read(mem / "memory.oom_control"))
        if "oom_kill" in ctl:
            return ctl["oom_kill"] > 0
        # kernels before 4.13 do not count kills: the limit was hit and the OOM state entered
        return ctl.get("under_oom", 0) > 0 or (_read_int(mem / "memory.failcnt") or 0) > 0

    def remove(self, scope: Scope, timeout: float = 5.0) -> bool:
        dirs = [d for d in scope.dirs.values() if d.is_dir()]
        emptied = all(_kill_all(d / "cgroup.procs", timeout) for d in dirs)
        removed = all([_rmdir(d) for d in dirs])
        return removed and emptied

    def orphans(self, known_ids: set[str] | frozenset[str]) -> list[Scope]:
        ids: set[str] = set()
        for mount in self.controllers.values():
            ids.update(self._scope_ids(mount / self.slice))
        return [self.scope(a) for a in sorted(ids) if a not in known_ids]


def detect(mode: str = "auto", root: Path | str = "/sys/fs/cgroup", **kw: object) -> CgroupManager:
    """The backend for this machine: v2 when ``root/cgroup.controllers`` exists (a pure
    unified hierarchy), else v1 when ``root/memory`` exists, else :class:`NoCgroups`.
    ``mode`` ``v2``/``v1``/``none`` forces one (config ``node_agent.cgroups``)."""
    root = Path(root)
    if mode == "none":
        return NoCgroups("disabled by configuration (node_agent.cgroups: none)", **kw)
    if mode == "v2" or (mode == "auto" and (root / "cgroup.controllers").exists()):
        return CgroupsV2(root, **kw)
    if mode == "v1" or (mode == "auto" and (root / "memory").is_dir()):
        return CgroupsV1(root, **kw)
    return NoCgroups(f"no cgroup filesystem at {root}", **kw)


def _available_gauge():  # created once, on first use (tests import this module freely)
    global _GAUGE
    if _GAUGE is None:
        from prometheus_client import Gauge

        _GAUGE = Gauge(
            "lattice_agent_cgroups_available",
            "1 when allocations run in per-allocation cgroups, 0 when they run unconfined",
        )
    return _GAUGE


_GAUGE = None


def announce(manager: CgroupManager) -> None:
    """Say at startup which backend confines allocations (never a silent fallback)."""
    _available_gauge().set(1 if manager.available else 0)
    if isinstance(manager, NoCgroups):
        log.warning(
            "cgroups unavailable (%s): allocations run as bare process groups without "
            "memory, cpuset, pids or device limits",
            manager.why or "no backend",
        )
    else:
        log.info("per-allocation cgroups: %s under %s", manager.version, manager.slice)
