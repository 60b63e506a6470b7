"""The eBPF telemetry source (spec: Telemetry Architecture, Layer 1): kernel-level metrics
per allocation from tracepoint programs, beside the /proc + cgroup collector (which stays:
it measures what this source does not, and it is all a node without eBPF has).

Programs (C, in ``infra/ebpf/``: ``lattice.h`` + ``sched.c``, ``blockio.c``, ``faults.c``,
``net.c``) are compiled and loaded with bcc — Debian's ``python3-bpfcc``, imported from
``/usr/lib/python3/dist-packages/bcc`` alone (the agent's interpreter is not Debian's, and
the PyPI package named ``bcc`` is unrelated) — on the first collection, in the worker
thread. ``scripts/bootstrap-ebpf`` installs what they need. Per allocation and collection:

* ``context_switches`` — per second: switches away from the allocation's tasks
  (voluntary + involuntary; ``sched:sched_switch``).
* ``runqueue_latency_p99`` — µs: p99 of the time its tasks waited runnable (woken or
  preempted) before running (``sched_wakeup``/``sched_wakeup_new`` -> ``sched_switch``).
* ``io_latency_p99`` — µs: p99 of its block requests' issue -> completion time
  (``block:block_rq_issue``/``block_rq_complete``; the owner is noted at
  ``block_bio_queue``, where the submitter is the current task). Writeback by the kernel's
  flusher threads has no owner and is not counted; ``O_DIRECT`` and ``fsync`` are.
* ``page_faults`` — per second: user page faults, minor and major
  (``exceptions:page_fault_user``; elsewhere than x86 the software perf event).
* ``network_tx_bytes`` / ``network_rx_bytes`` — bytes per second, only for allocations in
  a cgroup v2 scope: ``cgroup_skb`` programs on the scope (IP-layer bytes, loopback
  excluded); they then replace the /proc collector's values (later sources win).

Latency percentiles come from log2 histograms (nanoseconds) of the events between two
collections: exact to the bucket (a factor of 2), linear within it; an interval without
events leaves the metric out. Rates need two collections (the first sets the baseline).

Attribution (see ``lattice.h``): per allocation *slot*. ``bpf_get_current_cgroup_id()``
answers the task's cgroup in the v2 hierarchy; on a hybrid v1 node (allocation scopes in
the v1 controllers, ``/sys/fs/cgroup/unified`` holding no scopes) every task reads the
same id there, so cgroup ids cannot tell allocations apart. The agent therefore seeds the
programs with the allocation's processes — its scope's ``cgroup.procs`` when it has a
scope, else every process whose process group is in ``Target.pgids`` — and the kernel side
adds their threads on first sight and their children at fork (so a process that leaves
the process group stays counted). Allocations in a v2 scope are also matched by cgroup id
(the inode number of the scope directory), which catches processes before the agent sees
them.

Overhead (``lattice_agent_ebpf_overhead_percent{node_id}``): the share of the node's CPU
capacity spent on this source, every ``overhead_interval`` (10 s) of collections:

    (program run time + program runs x dispatch_ns + the agent's collection CPU time)
    / (wall time x online CPUs) x 100

Run time and run count are the kernel's own (``run_time_ns``/``run_cnt`` of each
program's fdinfo; bpf statistics are switched on with ``BPF_ENABLE_STATS`` for as long as
the source is loaded, and cost two clock reads per run themselves). ``dispatch_ns``
(:data:`DISPATCH_NS`, 90 ns) estimates what the statistics cannot see: the perf
tracepoint machinery around each run (trace record, entry, exit), calibrated as the
slowdown of a switch-bound benchmark minus the measured run time. The one-off compile
(about 0.25 s, logged) is not included. Without bpf statistics (kernels before 5.8 with
the sysctl off) only the agent's part is measured.

:func:`probe` says whether this can run here (root, bcc, kernel headers, tracefs, the C
sources) without raising; :func:`ebpf_source` is what the telemetry loop calls.
``LATTICE_TELEMETRY_EBPF=off`` switches the source off.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import Gauge

from lattice_agent.telemetry.members import by_process_group, scope_pids, target_pids
from lattice_agent.telemetry.samples import NETWORK_RX_BYTES, NETWORK_TX_BYTES, Target

log = logging.getLogger("lattice.agent.telemetry")

__all__ = [
    "BCC_DIR",
    "CONTEXT_SWITCHES",
    "DISPATCH_NS",
    "IO_LATENCY_P99",
    "OVERHEAD",
    "PAGE_FAULTS",
    "RUNQUEUE_LATENCY_P99",
    "EbpfSource",
    "ebpf_source",
    "hist_percentile",
    "load_bcc",
    "probe",
    "programs_dir",
]

#: catalog/metric names this source adds
CONTEXT_SWITCHES = "context_switches"
RUNQUEUE_LATENCY_P99 = "runqueue_latency_p99"
IO_LATENCY_P99 = "io_latency_p99"
PAGE_FAULTS = "page_faults"

OVERHEAD = Gauge(
    "lattice_agent_ebpf_overhead_percent",
    "Measured eBPF collection overhead: kernel run time of the telemetry programs plus the "
    "agent's collection CPU time, in percent of the node's CPU capacity",
    ["node_id"],
)

#: Debian's bcc (python3-bpfcc), pure Python over libbcc
BCC_DIR = Path("/usr/lib/python3/dist-packages/bcc")
TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
MODULES_DIR = Path("/lib/modules")
ENV_SWITCH = "LATTICE_TELEMETRY_EBPF"
ENV_PROGRAMS = "LATTICE_EBPF_PROGRAMS"

#: estimated kernel cost per program run outside the program (the perf tracepoint
#: dispatch: building the trace record, entering and leaving the program), which bpf
#: statistics do not see; calibrated on a 2-vCPU KVM guest (kernel 6.18) as the slowdown
#: of a one-CPU pipe ping-pong (740,000 switches/s) minus the measured run time
DISPATCH_NS = 90.0

# must match lattice.h
MAX_ALLOCS = 256
SLOTS = 40
_FIELDS = 4 + 2 * SLOTS  # u64s of struct alloc_stats
_PROGRAM_FILES = ("lattice.h", "sched.c", "blockio.c", "faults.c", "net.c")

# bpf(2): BPF_ENABLE_STATS (5.8+), BPF_STATS_RUN_TIME
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
_BPF_ENABLE_STATS = 32
_BPF_F_ALLOW_MULTI = 2
_BPF_NOEXIST = 1


# --------------------------------------------------------------------------- finding things


def programs_dir() -> Path | None:
    """Where the C sources are: ``$LATTICE_EBPF_PROGRAMS``, the repository's
    ``infra/ebpf`` (a checkout), else ``/usr/share/lattice/ebpf`` (a package)."""
    candidates = []
    if os.environ.get(ENV_PROGRAMS):
        candidates.append(Path(os.environ[ENV_PROGRAMS]))
    here = Path(__file__).resolve()
    if len(here.parents) > 5:
        candidates.append(here.parents[5] / "infra" / "ebpf")
    candidates.append(Path("/usr/share/lattice/ebpf"))
    for c in candidates:
        if all((c / f).is_file() for f in _PROGRAM_FILES):
            return c
    return None


_bcc_lock = threading.Lock()
_bcc_cache: dict[Path, ModuleType] = {}


def load_bcc(bcc_dir: Path = BCC_DIR) -> ModuleType:
    """Debian's ``bcc`` package, imported from ``bcc_dir`` only (nothing else of
    dist-packages becomes importable), as the private module ``_lattice_bcc``. Raises
    when it is missing or libbcc does not load."""
    bcc_dir = Path(bcc_dir)
    with _bcc_lock:
        if bcc_dir in _bcc_cache:
            return _bcc_cache[bcc_dir]
        init = bcc_dir / "__init__.py"
        if not init.is_file():
            raise ImportError(f"{init} not found")
        name = "_lattice_bcc" if bcc_dir == BCC_DIR else f"_lattice_bcc_{abs(hash(bcc_dir))}"
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(bcc_dir)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {bcc_dir}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its relative imports (.libbcc, .table) resolve here
        try:
            spec.loader.exec_module(module)
        except BaseException:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            raise
        _bcc_cache[bcc_dir] = module
        return module


def _tracefs(candidates: Sequence[Path]) -> Path | None:
    for d in candidates:
        if (d / "events" / "sched" / "sched_switch" / "format").is_file():
            return d
    return None


def probe(
    *,
    tracefs: Sequence[Path | str] | None = None,
    modules: Path | str = MODULES_DIR,
    bcc_dir: Path | str = BCC_DIR,
    euid: int | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[bool, str]:
    """Whether the eBPF source can run here: ``(True, "")`` or ``(False, why)``. Checks
    (parameters stand in for the real paths in tests): Linux, not switched off, root,
    the C sources, tracefs with the scheduler tracepoints, kernel headers under
    ``<modules>/<release>/build`` (or the kernel's own ``/sys/kernel/kheaders.tar.xz``),
    bcc importable. Never raises."""
    try:
        env = os.environ if environ is None else environ
        if env.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
            return False, f"switched off ({ENV_SWITCH}={env[ENV_SWITCH]})"
        if sys.platform != "linux":
            return False, f"not Linux ({sys.platform})"
        uid = os.geteuid() if euid is None else euid
        if uid != 0:
            return False, "not root (loading eBPF programs needs CAP_BPF and CAP_PERFMON)"
        if programs_dir() is None:
            return False, f"eBPF C sources not found (infra/ebpf; set {ENV_PROGRAMS})"
        dirs = [Path(p) for p in tracefs] if tracefs is not None else list(TRACEFS_DIRS)
        if _tracefs(dirs) is None:
            return False, (
                f"tracefs not mounted at {' or '.join(map(str, dirs))} "
                "(mount -t tracefs nodev /sys/kernel/tracing; scripts/bootstrap-ebpf)"
            )
        release = platform.release()
        build = Path(modules) / release / "build"
        if not build.is_dir() and not Path("/sys/kernel/kheaders.tar.xz").exists():
            return False, (
                f"no kernel headers for {release} at {build} (scripts/bootstrap-ebpf links "
                "Debian's linux-headers there)"
            )
        try:
            load_bcc(Path(bcc_dir))
        except Exception as e:
            return False, (
                f"bcc not importable from {bcc_dir} ({type(e).__name__}: {e}; "
                "apt-get install python3-bpfcc)"
            )
        return True, ""
    except Exception as e:  # a probe never raises
        return False, f"probe failed: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- pure helpers


def hist_percentile(counts: Sequence[int], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of a log2 histogram as the programs keep it (slot
    0: value 0; slot k: values in [2^(k-1), 2^k)), linear within the bucket it falls in;
    None when the histogram is empty."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = total * min(max(q, 0.0), 100.0) / 100.0
    seen = 0
    for k, n in enumerate(counts):
        if n <= 0:
            continue
        if seen + n >= rank:
            if k == 0:
                return 0.0
            lo, hi = float(1 << (k - 1)), float(1 << k)
            return lo + (hi - lo) * max(0.0, rank - seen) / n
        seen += n
    k = max(i for i, n in enumerate(counts) if n > 0)  # q == 100 with rounding
    return float(1 << k) if k else 0.0


@dataclass(frozen=True)
class _Snap:
    """One slot's cumulative counters at one collection (summed over CPUs)."""

    mono: float
    switches: int
    faults: int
    net_tx: int
    net_rx: int
    rq: tuple[int, ...]
    io: tuple[int, ...]

    @classmethod
    def of(cls, mono: float, v: Sequence[int]) -> _Snap:
        return cls(
            mono, v[0], v[1], v[2], v[3], tuple(v[4 : 4 + SLOTS]), tuple(v[4 + SLOTS : _FIELDS])
        )


def _delta(now: Sequence[int], prev: Sequence[int]) -> list[int]:
    return [max(0, a - b) for a, b in zip(now, prev, strict=True)]


def rates(prev: _Snap, now: _Snap, *, net: bool) -> dict[str, float]:
    """What one allocation did between two snapshots (module docstring)."""
    dt = now.mono - prev.mono
    if dt <= 0:
        return {}
    out = {
        CONTEXT_SWITCHES: max(0, now.switches - prev.switches) / dt,
        PAGE_FAULTS: max(0, now.faults - prev.faults) / dt,
    }
    rq = hist_percentile(_delta(now.rq, prev.rq), 99.0)
    if rq is not None:
        out[RUNQUEUE_LATENCY_P99] = rq / 1000.0
    io = hist_percentile(_delta(now.io, prev.io), 99.0)
    if io is not None:
        out[IO_LATENCY_P99] = io / 1000.0
    if net:
        out[NETWORK_TX_BYTES] = max(0, now.net_tx - prev.net_tx) / dt
        out[NETWORK_RX_BYTES] = max(0, now.net_rx - prev.net_rx) / dt
    return out


# --------------------------------------------------------------------------- the source


@dataclass
class _Alloc:
    slot: int
    seeded: set[int] = field(default_factory=set)
    cgroup_dir: Path | None = None  # its v2 scope, registered by cgroup id
    cgroup_id: int | None = None
    net_fd: int | None = None  # the scope directory's fd, net programs attached to it
    prev: _Snap | None = None
    net_since: float | None = None  # when the net programs were attached


class EbpfSource:
    """The ``ebpf`` telemetry source (:class:`~lattice_agent.telemetry.samples.Source`).

    ``on_state(False)`` is called when the programs fail to load (the source then answers
    nothing); the loop uses it for ``lattice_agent_telemetry_source{source="ebpf"}``.
    ``node_id`` labels the overhead gauge (default: the targets' node)."""

    name = "ebpf"

    def __init__(
        self,
        *,
        node_id: str = "",
        programs: Path | str | None = None,
        bcc_dir: Path | str = BCC_DIR,
        proc_root: Path | str = "/proc",
        overhead_interval: float = 10.0,
        dispatch_ns: float = DISPATCH_NS,
        on_state: Callable[[bool], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.programs = Path(programs) if programs is not None else programs_dir()
        self.bcc_dir = Path(bcc_dir)
        self.proc = Path(proc_root)
        self.overhead_interval = float(overhead_interval)
        self.dispatch_ns = float(dispatch_ns)
        self._on_state = on_state
        self._mono = monotonic
        self._lock = threading.RLock()
        self._bpf: Any = None
        self._bcc: ModuleType | None = None
        self._failed: str | None = None
        self._allocs: dict[str, _Alloc] = {}
        self._free: deque[int] = deque(range(MAX_ALLOCS))
        self._purge: list[int] = []
        self._full_said = False
        self._stats_fd: int | None = None
        self._kernel_measured = False
        self._user_cpu = 0.0  # CPU seconds of this source's collections (agent side)
        self._mark: tuple[float, int, float] | None = None  # (mono, kernel ns, user s)
        self.overhead_percent: float | None = None
        self.load_seconds: float | None = None
        self.fault_mode = ""

    # --- loading ------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._bpf is not None

    def start(self) -> bool:
        """Compile and load the programs (the first collection does it when not done);
        False when they cannot be (said once, ``on_state(False)``)."""
        with self._lock:
            if self._bpf is not None:
                return True
            if self._failed is not None:
                return False
            t0 = time.monotonic()
            try:
                self._load()
            except Exception as e:
                self._failed = f"{type(e).__name__}: {e}"
                log.error("telemetry: eBPF programs failed to load: %s", self._failed)
                self.close()
                if self._on_state is not None:
                    self._on_state(False)
                return False
            self.load_seconds = time.monotonic() - t0
            log.info(
                "telemetry: eBPF programs loaded in %.2f s (page faults via %s, bpf run-time "
                "statistics %s)",
                self.load_seconds,
                self.fault_mode,
                "on" if self._kernel_measured else "unavailable: overhead is the agent's part",
            )
            if self._on_state is not None:
                self._on_state(True)
            return True

    def _load(self) -> None:
        if self.programs is None:
            raise FileNotFoundError("eBPF C sources not found")
        bcc = load_bcc(self.bcc_dir)
        tracefs = _tracefs(TRACEFS_DIRS)
        fault_tp = (
            tracefs is not None
            and (tracefs / "events" / "exceptions" / "page_fault_user" / "format").is_file()
        )
        text = "\n".join((self.programs / f).read_text() for f in _PROGRAM_FILES)
        cflags = [f"-I{self.programs}", "-Wno-unused-function"]
        if fault_tp:
            cflags.append("-DLATTICE_FAULT_TRACEPOINT")
        b = bcc.BPF(text=text.encode(), cflags=cflags)  # tracepoint programs attach themselves
        self._bcc, self._bpf = bcc, b
        if fault_tp:
            self.fault_mode = "exceptions:page_fault_user"
        else:
            b.attach_perf_event(
                ev_type=bcc.PerfType.SOFTWARE,
                ev_config=bcc.PerfSWConfig.PAGE_FAULTS,
                fn_name=b"on_fault_perf",
                sample_period=1,
            )
            self.fault_mode = "perf software event page-faults"
        self._stats = b[b"stats"]
        self._tasks = b[b"tasks"]
        self._cgroups = b[b"cgroups"]
        self._config = b[b"config"]
        self._ncpu = len(bcc.utils.get_possible_cpus())
        # bcc swaps a per-CPU table's Leaf for an array of them; sLeaf is one
        self._leaf_size = ctypes.sizeof(getattr(self._stats, "sLeaf", self._stats.Leaf))
        if self._leaf_size != 8 * _FIELDS:
            raise RuntimeError(f"struct alloc_stats is {self._leaf_size} bytes, not {8 * _FIELDS}")
        self._buf = (ctypes.c_uint64 * (_FIELDS * self._ncpu))()
        self._net_fns: tuple[Any, Any] | None = None
        self._enable_stats()
        self._mark = (self._mono(), self._kernel_ns(), self._user_cpu)

    def _enable_stats(self) -> None:
        """bpf run-time statistics for as long as the source is loaded: BPF_ENABLE_STATS
        (the kernel turns them off again when our fd closes), else the sysctl as it is."""
        nr = _NR_BPF.get(platform.machine())
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            attr = (ctypes.c_uint32 * 2)(0, 0)  # BPF_STATS_RUN_TIME
            fd = libc.syscall(nr, _BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
            if fd >= 0:
                self._stats_fd = fd
                self._kernel_measured = True
                return
        with contextlib.suppress(OSError):
            self._kernel_measured = (
                Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip() == "1"
            )

    def close(self) -> None:
        """Detach everything and free the programs (the process's exit does it too, but
        cgroup attachments outlive the process: those are detached here)."""
        with self._lock:
            for a in self._allocs.values():
                self._detach_net(a)
            self._allocs.clear()
            self._free = deque(range(MAX_ALLOCS))
            self._purge.clear()
            if self._bpf is not None:
                with contextlib.suppress(Exception):
                    self._bpf.cleanup()
            self._bpf = None
            if self._stats_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._stats_fd)
                self._stats_fd = None

    # --- Source -------------------------------------------------------------------------

    def forget(self, alloc_id: str) -> None:
        with self._lock:
            a = self._allocs.pop(alloc_id, None)
            if a is not None:
                self._detach_net(a)
                self._purge.append(a.slot)  # map clean-up in the next collection's thread

    def io_histogram(self, alloc_id: str) -> tuple[int, ...] | None:
        """The allocation's block I/O latency histogram as of the last collection:
        cumulative counts since it was first measured here, log2 nanosecond slots as
        :func:`hist_percentile` reads them (``lattice diag``). None when it is not
        measured (yet)."""
        with self._lock:
            a = self._allocs.get(alloc_id)
            return a.prev.io if a is not None and a.prev is not None else None

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        t0 = time.thread_time()
        try:
            with self._lock:
                if not self.start():
                    return {}
                return self._collect(targets)
        finally:
            self._user_cpu += time.thread_time() - t0

    def _collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        if not self.node_id and targets:
            self.node_id = targets[0].labels.node_id
        self._do_purge()
        by_pgid: dict[int, list[int]] | None = None
        out: dict[str, dict[str, float]] = {}
        for t in targets:
            a = self._allocs.get(t.alloc_id)
            if a is None:
                if not self._free:
                    if not self._full_said:
                        log.warning(
                            "telemetry: more than %d allocations here: eBPF measures the first %d",
                            MAX_ALLOCS,
                            MAX_ALLOCS,
                        )
                        self._full_said = True
                    continue
                a = self._allocs[t.alloc_id] = _Alloc(self._free.popleft())
            v2 = self._v2_dir(t)
            if v2 != a.cgroup_dir:
                self._register_cgroup(a, v2)
            pids = scope_pids(t)
            if pids is None:
                if by_pgid is None:
                    by_pgid = by_process_group(self.proc)
                pids = target_pids(t, by_pgid)
            self._seed(a, pids)
            now = self._mono()
            snap = _Snap.of(now, self._read(a.slot))
            prev, a.prev = a.prev, snap
            if prev is None:
                continue
            net = a.net_since is not None and a.net_since <= prev.mono
            values = rates(prev, snap, net=net)
            if values:
                out[t.alloc_id] = values
        now = self._mono()
        if self._mark is not None and now - self._mark[0] >= self.overhead_interval:
            self.measure_overhead()
        return out

    # --- overhead -------------------------------------------------------------------------

    def _kernel_ns(self) -> int:
        """Kernel time so far of every program of ours: their run time (fdinfo
        ``run_time_ns``) plus ``dispatch_ns`` per run (fdinfo ``run_cnt``)."""
        total = 0
        fns = list(self._bpf.funcs.values()) if self._bpf is not None else []
        for fn in fns:
            with contextlib.suppress(OSError, ValueError), open(f"/proc/self/fdinfo/{fn.fd}") as f:
                for line in f:
                    if line.startswith("run_time_ns:"):
                        total += int(line.split()[1])
                    elif line.startswith("run_cnt:"):
                        total += int(int(line.split()[1]) * self.dispatch_ns)
        return total

    def measure_overhead(self) -> float | None:
        """The overhead (percent of the node's CPU capacity, module docstring) since the
        last measurement; sets the gauge. None before the programs are loaded."""
        with self._lock:
            if self._bpf is None or self._mark is None:
                return None
            now, kns, user = self._mono(), self._kernel_ns(), self._user_cpu
            m0, k0, u0 = self._mark
            self._mark = (now, kns, user)
            wall = now - m0
            if wall <= 0:
                return self.overhead_percent
            cpus = os.cpu_count() or 1
            used = max(0, kns - k0) / 1e9 + max(0.0, user - u0)
            self.overhead_percent = 100.0 * used / (wall * cpus)
            OVERHEAD.labels(self.node_id).set(self.overhead_percent)
            return self.overhead_percent

    # --- maps -----------------------------------------------------------------------------

    def _read(self, slot: int) -> list[int]:
        """The slot's struct alloc_stats summed over CPUs, as a list of u64s."""
        assert self._bcc is not None
        key = ctypes.c_int(slot)
        rc = self._bcc.libbcc.lib.bpf_lookup_elem(self._stats.map_fd, ctypes.byref(key), self._buf)
        if rc < 0:
            return [0] * _FIELDS
        words = list(self._buf)  # CPU after CPU
        return [sum(words[i::_FIELDS]) for i in range(_FIELDS)]

    def _seed(self, a: _Alloc, pids: Sequence[int]) -> None:
        assert self._bcc is not None
        info = self._tasks.Leaf(a.slot, 0, 0)
        update = self._bcc.libbcc.lib.bpf_update_elem
        for pid in pids:
            if pid in a.seeded:
                continue
            key = ctypes.c_uint32(pid)
            # BPF_NOEXIST: a task the kernel side already knows keeps its entry
            update(self._tasks.map_fd, ctypes.byref(key), ctypes.byref(info), _BPF_NOEXIST)
            a.seeded.add(pid)
        if len(a.seeded) > 4 * len(pids) + 64:  # forget pids long gone (reuse is rare)
            a.seeded &= set(pids)

    def _do_purge(self) -> None:
        """Free the slots of forgotten allocations: drop their tasks and cgroup entries
        first, so a slot never carries an old allocation's processes into a new one."""
        if not self._purge:
            return
        slots = set(self._purge)
        with contextlib.suppress(Exception):
            for k, v in list(self._tasks.items()):
                if v.slot in slots:
                    with contextlib.suppress(KeyError):
                        del self._tasks[k]
        with contextlib.suppress(Exception):
            for k, v in list(self._cgroups.items()):
                if v.value in slots:
                    with contextlib.suppress(KeyError):
                        del self._cgroups[k]
        self._set_cgroup_count()
        self._free.extend(self._purge)
        self._purge.clear()

    def _set_cgroup_count(self) -> None:
        with contextlib.suppress(Exception):
            n = len(list(self._cgroups.keys()))
            self._config[ctypes.c_int(0)] = ctypes.c_uint32(n)

    # --- cgroups v2 -------------------------------------------------------------------------

    @staticmethod
    def _v2_dir(t: Target) -> Path | None:
        if t.scope is None:
            return None
        d = t.scope.dirs.get("")
        return d if d is not None and d.is_dir() else None

    def _register_cgroup(self, a: _Alloc, d: Path | None) -> None:
        if a.cgroup_id is not None:
            with contextlib.suppress(Exception):
                del self._cgroups[ctypes.c_uint64(a.cgroup_id)]
        self._detach_net(a)
        a.cgroup_dir, a.cgroup_id = d, None
        if d is not None:
            try:
                a.cgroup_id = os.stat(d).st_ino  # the cgroup id on v2 (64-bit kernfs ids)
                self._cgroups[ctypes.c_uint64(a.cgroup_id)] = ctypes.c_uint32(a.slot)
            except Exception as e:
                log.warning("telemetry: eBPF: cgroup %s not registered: %s", d, e)
                a.cgroup_id = None
            else:
                self._attach_net(a, d)
        self._set_cgroup_count()

    def _attach_net(self, a: _Alloc, d: Path) -> None:
        assert self._bcc is not None
        bcc = self._bcc
        try:
            if self._net_fns is None:
                self._net_fns = (
                    self._bpf.load_func(b"net_egress", bcc.BPF.CGROUP_SKB),
                    self._bpf.load_func(b"net_ingress", bcc.BPF.CGROUP_SKB),
                )
            egress, ingress = self._net_fns
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except Exception as e:
            log.warning("telemetry: eBPF network programs not loaded: %s", e)
            return
        try:
            T = bcc.BPFAttachType
            bcc.BPF.attach_func(egress, fd, T.CGROUP_INET_EGRESS, _BPF_F_ALLOW_MULTI)
            try:
                bcc.BPF.attach_func(ingress, fd, T.CGROUP_INET_INGRESS, _BPF_F_ALLOW_MULTI)
            except Exception:
                with contextlib.suppress(Exception):
                    bcc.BPF.detach_func(egress, fd, T.CGROUP_INET_EGRESS)
                raise
        except Exception as e:
            os.close(fd)
            log.warning("telemetry: eBPF network programs not attached to %s: %s", d, e)
            return
        a.net_fd = fd
        a.net_since = self._mono()

    def _detach_net(self, a: _Alloc) -> None:
        if a.net_fd is None:
            return
        if self._bcc is not None and self._net_fns is not None:
            T = self._bcc.BPFAttachType
            egress, ingress = self._net_fns
            with contextlib.suppress(Exception):  # gone with its cgroup already: fine
                self._bcc.BPF.detach_func(egress, a.net_fd, T.CGROUP_INET_EGRESS)
            with contextlib.suppress(Exception):
                self._bcc.BPF.detach_func(ingress, a.net_fd, T.CGROUP_INET_INGRESS)
        with contextlib.suppress(OSError):
            os.close(a.net_fd)
        a.net_fd = None
        a.net_since = None


def ebpf_source(*, on_state: Callable[[bool], None] | None = None, **kw: Any) -> EbpfSource | None:
    """The eBPF source when :func:`probe` says it can run here, else None (the reason is
    logged; the loop then has the /proc collector only)."""
    ok, why = probe()
    if not ok:
        log.info("telemetry: eBPF source not used: %s", why)
        return None
    return EbpfSource(on_state=on_state, **kw)
