"""OCI containers for allocations (``--image=registry/name:tag``): image cache and crun bundles.

The allocation runs in a container as the submitting user: read-only root filesystem, no new
privileges, a default seccomp profile, the allocation's own cgroup, the host's network
namespace, and its working directory and data mounts bound in.

**Why crun, in the foreground, with its cgroup manager disabled** (and not podman or runc).
The agent starts every allocation as a ``/bin/sh`` wrapper in its own session that first joins
the allocation's cgroup (v1: one directory per controller; v2 in production) and then runs
the command; that session outlives the agent, which signals it as a process group and finds
it again after a restart. ``crun --cgroup-manager=disabled run --bundle B NAME`` (no
``--detach``) is an ordinary child of the wrapper: it and the container's processes are born
inside the allocation's cgroup and stay there, so the limits, OOM detection and peak memory
the agent reads work unchanged, and crun's exit status is the container's. podman's conmon
double-forks out of the session (and podman creates its own cgroup); runc has no way to leave
cgroups alone: it always creates and joins ``<current cgroup>/<id>`` (on v1 a nested child,
whose OOM kills the parent's ``memory.oom_control`` does not count) and writes device rules
into it.

Three facts of crun (1.8) shape the rest:

* **crun starts the container's first process in a new session** (``setsid``, always), so a
  signal to the wrapper's process group reaches crun only. crun forwards every signal it gets
  to the container's pid 1, but in a pid namespace pid 1 ignores signals it installed no
  handler for (a plain ``sh`` or ``sleep`` would shrug off SIGTERM) and nothing would reap
  orphans. So pid 1 is a static init bound in from the host (``tini-static``, as docker's
  ``--init``/podman's catatonit): ``-g`` passes every signal on to the job's process group,
  ``-p SIGKILL`` kills it when crun dies (a SIGKILLed wrapper group), and when pid 1 ends the
  kernel kills everything else in the namespace. SIGTERM, grace, SIGKILL therefore behave as
  for bare jobs, with nothing left behind.
* **crun creates missing mount points inside ``root.path``** (the working directory, data
  mounts, ``/etc/hosts``) before it makes the root read-only, which would litter the image
  shared by every container of that digest. Each container's root is therefore an overlay:
  lower = the shared rootfs (never written), upper = a small tmpfs. The launch script
  (:meth:`OciStore.run_argv`) mounts both in a private mount namespace (``unshare --mount``),
  so nothing is ever mounted on the host and both go away with the container's last process,
  like a uenv mount (``spawn.py``).
* **crun refuses hybrid cgroup hosts whose v2 hierarchy holds a controller**, even with the
  cgroup manager disabled (its check comes before the manager choice): "cgroups in hybrid mode
  not supported, drop all controllers from cgroupv2". On such a host (v1 controllers under
  ``/sys/fs/cgroup/<controller>``, ``hugetlb`` on ``/sys/fs/cgroup/unified``) the launch script
  also unmounts ``/sys/fs/cgroup/unified`` in its private namespace: crun then sees a v1 host.
  The container never mounts cgroupfs, so nothing else differs. Pure v2 hosts skip this.

**Images** are pulled with skopeo and unpacked with umoci, cached by manifest digest:

* The tag is resolved on every pull (``skopeo inspect --raw``: the digest is the SHA-256 of
  the manifest bytes, what the registry reports as ``Docker-Content-Digest``); a reference
  by digest is not resolved at all. The content is then copied *by that digest*
  (``skopeo copy docker://NAME@DIGEST oci:<layout>:latest``; TLS verification off only for
  the registries listed as insecure), so a tag moved in between cannot slip in other content.
* Cache hit = the digest is unpacked already: one registry round trip, nothing copied.
* ``umoci raw unpack`` writes the rootfs once per digest (as root, ownership kept). Pulls
  stage in ``<cache>/tmp`` and rename into place under a per-digest ``flock``, so concurrent
  pulls of one image (threads or agents) download it once and nobody sees half an image; a
  crash leaves only a staging directory, removed by the next pull of that digest.
* Layer blobs are dropped after unpacking (the rootfs is what runs; keeping both would double
  the disk use); ``<cache>/layouts/<hex>`` keeps the index, manifest and image config as the
  record of what was pulled.
* Every use sets the last-use time (the metadata file's mtime); :meth:`OciStore.evict` removes
  the least recently used images above a byte limit, never a pinned one. Pins are files
  ``<cache>/pins/<alloc_id>`` holding the digest (they survive an agent restart).

Layout of ``cache_dir``: ``images/<hex>.json`` (digest, refs, image config, size),
``rootfs/<hex>/``, ``layouts/<hex>/``, ``pins/<alloc_id>``, ``locks/<hex>.lock``, ``tmp/``,
``bundles/<alloc_id>/`` (``config.json``, ``lower`` -> the shared rootfs, mount points
``rootfs`` and ``overlay``).

The agent's part (not here): pull in the prologue (a thread: :meth:`OciStore.pull` blocks)
with ``pin_for=alloc_id`` and record the digest on the allocation; :meth:`OciStore.bundle`
before the spawn; run :meth:`OciStore.run_argv` as the wrapper's command; after the reap
:meth:`OciStore.cleanup` (container state, bundle, pin).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lattice_common.image_ref import ImageRef, ImageRefError, parse_image_ref

__all__ = [
    "DEFAULT_INIT",
    "DEFAULT_INSECURE",
    "DEFAULT_STATE_ROOT",
    "INIT_PATH",
    "LAUNCH_FAILED",
    "ImageRef",
    "OciError",
    "OciImage",
    "OciStore",
    "container_name",
    "default_seccomp_profile",
    "parse_ref",
    "runtime_spec",
]

log = logging.getLogger("lattice.agent.oci")

#: registries reached without TLS verification (a local registry speaks plain HTTP)
DEFAULT_INSECURE = ("127.0.0.1", "localhost")
#: crun's state directory for Lattice containers (on /run: containers do not survive a reboot)
DEFAULT_STATE_ROOT = "/run/lattice/crun"
#: the host's static init, bound into every container as pid 1 (Debian package ``tini``)
DEFAULT_INIT = "/usr/bin/tini-static"
#: where the init appears inside the container
INIT_PATH = "/run/lattice-init"
#: exit status of the launch script when it cannot set up the container's root
LAUNCH_FAILED = 125
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_INSPECT_TIMEOUT = 120.0
_COPY_TIMEOUT = 3600.0  # multi-GB images over a slow link
_CRUN_TIMEOUT = 30.0
_UNIFIED = Path("/sys/fs/cgroup/unified")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ALLOC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# overlay options are comma separated and skopeo/umoci split "path:tag" at the colon
_UNSAFE_PATH_CHARS = set(",:= \t\n\\\"'")

# The launch script, run by `unshare --mount --propagation private` (which execs it, so it
# keeps the wrapper's pid, process group and cgroup). argv: $1 bundle, $2 "1" to hide the
# cgroup v2 mount of a hybrid host from crun, then crun's argv. It mounts the container's
# root (overlay of the shared rootfs under a tmpfs upper) in this private namespace only,
# then execs crun; a failed mount ends it with 125 before anything of the image runs.
_LAUNCH = (
    'b=$1; hybrid=$2; shift 2; fail() { echo "[lattice] container setup: $*" >&2; exit 125; }; '
    'mount -t tmpfs -o mode=0755,size=16m lattice-oci "$b/overlay" '
    '|| fail "cannot mount a tmpfs on $b/overlay"; '
    'mkdir "$b/overlay/upper" "$b/overlay/work" || fail "cannot create the overlay dirs"; '
    'mount -t overlay -o "lowerdir=$b/lower,upperdir=$b/overlay/upper,workdir=$b/overlay/work" '
    'lattice-oci "$b/rootfs" || fail "cannot mount the image overlay on $b/rootfs"; '
    'if [ "$hybrid" = 1 ]; then umount -l /sys/fs/cgroup/unified '
    '|| fail "cannot hide /sys/fs/cgroup/unified from crun"; fi; '
    'exec "$@"'
)

# Capabilities of a root container: docker's default set minus NET_RAW (the network is the
# host's) and MKNOD (crun's cgroup manager is disabled, so no device cgroup would stop a
# node for the host's disks). Anyone else gets none at all.
_ROOT_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
)
# runc's defaults: kernel interfaces a container has no business reading or writing.
_MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
_READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# (path, major, minor): what every program expects in /dev
_DEVICES = (
    ("/dev/null", 1, 3),
    ("/dev/zero", 1, 5),
    ("/dev/full", 1, 7),
    ("/dev/random", 1, 8),
    ("/dev/urandom", 1, 9),
    ("/dev/tty", 5, 0),
)

# Seccomp: allow by default (HPC codes use a long tail of syscalls), deny with EPERM what only
# administers the machine, escapes or inspects other processes: mounts and namespaces (the
# container's own would undo its confinement), modules, kexec, reboot, swap, keyrings, bpf
# and perf, ptrace and cross-process memory access, file handles (open_by_handle_at is the
# classic escape), I/O ports, accounting, the clock, userfaultfd. Names unknown to the
# native architecture would make crun warn into the job's stderr, so the x86-only ones are
# listed separately.
_DENY_COMMON = (
    "mount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "setns",
    "unshare",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "open_by_handle_at",
    "name_to_handle_at",
    "acct",
    "settimeofday",
    "clock_settime",
    "userfaultfd",
    "quotactl",
    "syslog",
    "lookup_dcookie",
)
_DENY_X86_64 = (
    "umount",
    "iopl",
    "ioperm",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "nfsservctl",
    "uselib",
    "_sysctl",
)
_SECCOMP_ARCHES = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
}
# clone(2) with any of these flags makes a namespace (CLONE_NEWUSER even unprivileged)
_CLONE_NS_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)


class OciError(Exception):
    """An image could not be resolved, pulled or run; the message is the cause for users."""


# ---------------------------------------------------------------------- references


def parse_ref(ref: str) -> ImageRef:
    """Parse and validate ``ref`` (``lattice_common.image_ref``); raises :class:`OciError`."""
    try:
        return parse_image_ref(ref)
    except ImageRefError as e:
        raise OciError(str(e)) from None


def container_name(alloc_id: str) -> str:
    """crun's container id for an allocation."""
    _check_alloc_id(alloc_id)
    return f"lattice-{alloc_id}"


def _check_alloc_id(alloc_id: str) -> None:
    # the id becomes a file name (pins, bundles) and crun's container id
    if not isinstance(alloc_id, str) or not _ALLOC_ID.fullmatch(alloc_id):
        raise OciError(f"allocation id {alloc_id!r} not usable for a container")


def _check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise OciError(f"not a sha256 digest: {digest!r}")
    return digest.split(":", 1)[1]


# ---------------------------------------------------------------------- images


@dataclass(frozen=True)
class OciImage:
    """A pulled image: the reference asked for, its manifest digest, the shared rootfs and the
    image config's ``config`` section (Env, Cmd, Entrypoint, WorkingDir, User, ...)."""

    ref: str
    digest: str
    rootfs: Path
    config: dict[str, Any] = field(default_factory=dict, hash=False)


# ---------------------------------------------------------------------- runtime spec


def default_seccomp_profile(machine: str | None = None) -> dict[str, Any]:
    """The default profile (allow, deny list -> EPERM) for ``machine`` (default: this one)."""
    machine = machine or platform.machine()
    names = list(_DENY_COMMON)
    if machine == "x86_64":
        names += _DENY_X86_64
    syscalls: list[dict[str, Any]] = [
        {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        # glibc falls back to clone(2) on ENOSYS, where the flags below can be checked
        # (clone3 passes them in memory, out of seccomp's reach)
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    if machine in _SECCOMP_ARCHES:  # clone's flags are argument 0 there (not on s390x)
        syscalls += [
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EPERM,
                "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
            }
            for flag in _CLONE_NS_FLAGS
        ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(_SECCOMP_ARCHES.get(machine, ())),
        "syscalls": syscalls,
    }


def merge_env(image_env: Iterable[str], env: dict[str, str]) -> list[str]:
    """The image's Env, then ``env`` on top, by name (getenv() returns the first of two
    entries, so a plain append would let the image win); PATH defaults to the usual one."""
    merged: dict[str, str] = {}
    for item in image_env:
        key, sep, value = item.partition("=")
        if sep and key:
            merged[key] = value
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in str(value):
            raise OciError(f"environment variable {key!r} not usable in a container")
        merged[key] = str(value)
    merged.setdefault("PATH", DEFAULT_PATH)
    return [f"{k}={v}" for k, v in merged.items()]


def _command(image: OciImage, argv: Sequence[str]) -> list[str]:
    """``argv``, else the image's Entrypoint + Cmd (as ``docker run IMAGE`` would)."""
    command = list(argv) or [
        *(image.config.get("Entrypoint") or []),
        *(image.config.get("Cmd") or []),
    ]
    if not command:
        raise OciError(f"image {image.ref}: defines no command and the allocation gave none")
    return command


def _bind_mount(src: str, dst: str, readonly: bool) -> dict[str, Any]:
    options = ["rbind", "rprivate", "ro" if readonly else "rw", "nosuid"]
    with contextlib.suppress(OSError):
        mode = os.stat(src).st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            options.append("nodev")  # device nodes (GPUs) must stay usable
    return {"destination": dst, "type": "bind", "source": src, "options": options}


def _check_bind(src: str, dst: str) -> None:
    for path in (src, dst):
        if not path.startswith("/") or ".." in Path(path).parts or "\0" in path:
            raise OciError(f"bind {src} -> {dst}: paths must be absolute, without '..'")
    if os.path.normpath(dst) == "/":
        raise OciError(f"bind {src} -> {dst}: cannot replace the container's root")
    if not os.path.exists(src):
        raise OciError(f"bind {src} -> {dst}: {src} does not exist on this node")


def _user_mounts(binds: Sequence[tuple[str, str, bool]], cwd: str) -> list[dict[str, Any]]:
    """The binds plus the working directory (always writable), parents before children."""
    by_dst: dict[str, tuple[str, bool]] = {}
    for src, dst, readonly in binds:
        _check_bind(src, dst)
        by_dst[os.path.normpath(dst)] = (src, bool(readonly))
    cwd = os.path.normpath(cwd)
    src, _ = by_dst.get(cwd, (cwd, False))
    _check_bind(src, cwd)
    by_dst[cwd] = (src, False)  # the job writes its output there
    ordered = sorted(by_dst.items(), key=lambda item: (item[0].count("/"), item[0]))
    return [_bind_mount(src, dst, ro) for dst, (src, ro) in ordered]


def _system_mounts(init: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        # no size: tmpfs' default (half the RAM); MPI/NCCL shared memory lives here and its
        # pages are charged to the allocation's memory cgroup like any other memory
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"],
        },
        {
            "destination": INIT_PATH,
            "type": "bind",
            "source": init,
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
    ]
    # host network namespace: the host's name resolution goes with it
    for path in ("/etc/hosts", "/etc/resolv.conf"):
        if os.path.exists(path):
            mounts.append(
                {
                    "destination": path,
                    "type": "bind",
                    "source": path,
                    "options": ["rbind", "ro", "nosuid", "nodev"],
                }
            )
    return mounts


def _capabilities(uid: int) -> dict[str, list[str]]:
    caps = list(_ROOT_CAPS) if uid == 0 else []
    return {
        "bounding": caps,
        "effective": caps,
        "permitted": caps,
        "inheritable": [],
        "ambient": [],
    }


def runtime_spec(
    image: OciImage,
    *,
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    binds: Sequence[tuple[str, str, bool]] = (),
    groups: Sequence[int] = (),
    init: str = DEFAULT_INIT,
    hostname: str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The OCI runtime spec (1.0) of one container; ``root.path`` is the bundle's ``rootfs``
    (the overlay the launch script mounts over the shared rootfs)."""
    if not cwd.startswith("/"):
        raise OciError(f"working directory {cwd!r} must be an absolute path")
    if uid < 0 or gid < 0:
        raise OciError(f"uid/gid {uid}:{gid} not usable in a container")
    return {
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs", "readonly": True},
        "hostname": hostname or socket.gethostname(),
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": [int(g) for g in groups]},
            # tini as pid 1: signals on to the job's process group, dies with crun
            "args": [INIT_PATH, "-g", "-p", "SIGKILL", "--", *_command(image, argv)],
            "env": merge_env(image.config.get("Env") or [], env),
            "cwd": os.path.normpath(cwd),
            "capabilities": _capabilities(uid),
            "noNewPrivileges": True,
        },
        "mounts": [*_system_mounts(init), *_user_mounts(binds, cwd)],
        "linux": {
            # no network namespace (the host's: fabrics, MPI) and no cgroup namespace (the
            # container is in the allocation's cgroup; crun touches no cgroup at all)
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "devices": [
                {
                    "path": p,
                    "type": "c",
                    "major": ma,
                    "minor": mi,
                    "fileMode": 0o666,
                    "uid": 0,
                    "gid": 0,
                }
                for p, ma, mi in _DEVICES
            ],
            "maskedPaths": list(_MASKED_PATHS),
            "readonlyPaths": list(_READONLY_PATHS),
            "seccomp": default_seccomp_profile(),
        },
        "annotations": dict(annotations or {}),
    }


# ---------------------------------------------------------------------- helpers


def _run(argv: list[str], what: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise OciError(f"{what}: {argv[0]} is not installed on this node") from None
    except subprocess.TimeoutExpired:
        raise OciError(f"{what}: no answer within {timeout:.0f} s") from None


def _tool_message(stderr: bytes) -> str:
    """The last line of a Go tool's log (``time=... level=fatal msg="..."`` -> the msg)."""
    lines = [ln for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        return "no error message"
    line = lines[-1]
    m = re.search(r'msg="((?:[^"\\]|\\.)*)"', line)
    return m.group(1).replace('\\"', '"') if m else line.strip()


def _registry_error(ref: str, image: ImageRef, stderr: bytes) -> OciError:
    """A user-facing cause for a failed skopeo call."""
    detail = _tool_message(stderr)
    low = detail.lower()
    reg = image.registry
    if "manifest unknown" in low:
        return OciError(f"image {ref}: not found in registry (manifest unknown)")
    if "name unknown" in low or "repository name not known" in low:
        return OciError(f"image {ref}: repository not found in registry (name unknown)")
    if "unauthorized" in low or "authentication required" in low or "denied" in low:
        return OciError(f"image {ref}: registry {reg} refused access (unauthorized)")
    if "http response to https client" in low:
        return OciError(
            f"image {ref}: registry {reg} speaks plain HTTP; list {image.hostname} as insecure"
        )
    if "x509" in low or "certificate" in low:
        return OciError(f"image {ref}: TLS verification of registry {reg} failed ({detail})")
    if any(
        s in low
        for s in ("connection refused", "no such host", "i/o timeout", "unreachable", "dial tcp")
    ):
        return OciError(f"image {ref}: registry {reg} unreachable ({detail})")
    if "digest" in low and ("mismatch" in low or "does not match" in low):
        return OciError(f"image {ref}: content does not match its digest ({detail})")
    return OciError(f"image {ref}: {detail}")


def _disk_usage(root: Path) -> int:
    """Bytes allocated under ``root`` (du: hard links once, symlinks not followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _blob(layout: Path, digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algorithm / hexdigest


def _read_layout(layout: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, image config) of the only image of an OCI layout written by skopeo."""
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    return manifest, config


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _hybrid_v2_controllers(unified: Path = _UNIFIED) -> bool:
    """A hybrid cgroup host whose v2 hierarchy holds a controller (crun refuses those)."""
    try:
        return bool((unified / "cgroup.controllers").read_text().strip())
    except OSError:
        return False


def _remove_tree(path: Path, graveyard: Path) -> None:
    """Move ``path`` aside first (atomic: nobody sees half of it), then delete it."""
    if not path.exists() and not path.is_symlink():
        return
    graveyard.mkdir(parents=True, exist_ok=True)
    aside = graveyard / f"{path.name}.gone.{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------- the store


class OciStore:
    """The node's image cache (pull, pins, eviction) and its crun containers (bundles, argv,
    state). Blocking: the agent calls :meth:`pull` in a thread."""

    def __init__(
        self,
        cache_dir: Path | str,
        *,
        insecure: tuple[str, ...] = DEFAULT_INSECURE,
        crun: str = "crun",
        state_root: Path | str | None = None,
        skopeo: str = "skopeo",
        umoci: str = "umoci",
        init: str = DEFAULT_INIT,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(cache_dir).absolute()
        bad = _UNSAFE_PATH_CHARS & set(str(self.dir))
        if bad:
            raise OciError(
                f"image cache {self.dir}: path must not contain {''.join(sorted(bad))!r}"
            )
        self.insecure = tuple(insecure)
        self.crun = crun
        self.state_root = Path(state_root if state_root is not None else DEFAULT_STATE_ROOT)
        self.skopeo = skopeo
        self.umoci = umoci
        self.init = init
        self.max_bytes = max_bytes
        self._clock = clock
        #: the launch script hides /sys/fs/cgroup/unified from crun (see the module doc)
        self.hybrid_cgroups = _hybrid_v2_controllers()

    # -------------------------------------------------------------- paths

    def _meta_path(self, digest: str) -> Path:
        return self.dir / "images" / f"{_check_digest(digest)}.json"

    def rootfs_path(self, digest: str) -> Path:
        return self.dir / "rootfs" / _check_digest(digest)

    def layout_path(self, digest: str) -> Path:
        return self.dir / "layouts" / _check_digest(digest)

    def bundle_path(self, alloc_id: str) -> Path:
        _check_alloc_id(alloc_id)
        return self.dir / "bundles" / alloc_id

    # -------------------------------------------------------------- pull

    def pull(self, ref: str, *, pin_for: str | None = None) -> OciImage:
        """The image for ``ref``, pulled and unpacked unless its digest is cached already.
        ``pin_for``: pin it for that allocation under the same lock (so an eviction between
        the pull and a separate :meth:`pin` cannot remove it). Raises :class:`OciError`."""
        image = parse_ref(ref)
        if pin_for is not None:
            _check_alloc_id(pin_for)
        digest = image.digest or self.resolve(ref)
        with self._lock(digest):
            meta = self._read_meta(digest)
            if meta is None:
                meta = self._fetch(ref, image, digest)
            self._record_use(digest, meta, ref)
            if pin_for is not None:
                self.pin(pin_for, digest)
        if self.max_bytes is not None:
            self.evict(self.max_bytes, keep=(digest,))
        return OciImage(
            ref=ref, digest=digest, rootfs=self.rootfs_path(digest), config=meta["config"]
        )

    def resolve(self, ref: str) -> str:
        """The manifest digest ``ref`` points to now (one registry round trip)."""
        image = parse_ref(ref)
        if image.digest:
            return image.digest
        argv = [
            self.skopeo,
            "inspect",
            "--raw",
            *self._tls("--tls-verify=false", image),
            f"docker://{ref}",
        ]
        done = _run(argv, f"image {ref}", _INSPECT_TIMEOUT)
        if done.returncode != 0:
            raise _registry_error(ref, image, done.stderr)
        return "sha256:" + hashlib.sha256(done.stdout).hexdigest()

    def _tls(self, flag: str, image: ImageRef) -> list[str]:
        return [flag] if image.hostname in self.insecure else []

    def _fetch(self, ref: str, image: ImageRef, digest: str) -> dict[str, Any]:
        """Copy, unpack and publish ``digest`` (caller holds its lock)."""
        hexdigest = _check_digest(digest)
        tmp = self.dir / "tmp"
        for stale in tmp.glob(f"{hexdigest}.*"):  # a crashed pull of this digest
            shutil.rmtree(stale, ignore_errors=True)
        stage = tmp / f"{hexdigest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        stage.mkdir(parents=True)
        try:
            layout, rootfs = stage / "layout", stage / "rootfs"
            copy = [
                self.skopeo,
                "copy",
                "--quiet",
                *self._tls("--src-tls-verify=false", image),
                f"docker://{image.by_digest(digest)}",
                f"oci:{layout}:latest",
            ]
            done = _run(copy, f"image {ref}", _COPY_TIMEOUT)
            if done.returncode != 0:
                raise _registry_error(ref, image, done.stderr)
            unpack = [self.umoci, "raw", "unpack", "--image", f"{layout}:latest", str(rootfs)]
            done = _run(unpack, f"image {ref}: unpacking", _COPY_TIMEOUT)
            if done.returncode != 0:
                raise OciError(f"image {ref}: cannot unpack: {_tool_message(done.stderr)}")
            manifest, config = _read_layout(layout)
            self._check_platform(ref, config)
            for layer in manifest.get("layers", []):  # the rootfs is what runs
                _blob(layout, layer["digest"]).unlink(missing_ok=True)
            meta = {
                "digest": digest,
                "refs": [],
                "config": config.get("config") or {},
                "platform": f"{config.get('os', '')}/{config.get('architecture', '')}",
                "size": _disk_usage(rootfs) + _disk_usage(layout),
                "pulled_at": self._clock(),
            }
            for src, dst in (
                (layout, self.layout_path(digest)),
                (rootfs, self.rootfs_path(digest)),
            ):
                _remove_tree(dst, tmp)  # leftovers of a crash between renames
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.rename(src, dst)
            self._meta_path(digest).parent.mkdir(parents=True, exist_ok=True)
            _write_json(self._meta_path(digest), meta)  # last: from now on a cache hit
            log.info("image %s pulled as %s (%d bytes)", ref, digest, meta["size"])
            return meta
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _check_platform(self, ref: str, config: dict[str, Any]) -> None:
        arch = config.get("architecture")
        host = _ARCH.get(platform.machine(), platform.machine())
        if arch and arch != host:
            raise OciError(
                f"image {ref}: built for {config.get('os', 'linux')}/{arch}, this node is {host}"
            )

    def _read_meta(self, digest: str) -> dict[str, Any] | None:
        """The metadata of a complete cached image, else None."""
        try:
            meta = json.loads(self._meta_path(digest).read_text())
        except (OSError, ValueError):
            return None
        if not self.rootfs_path(digest).is_dir():  # removed behind our back: pull again
            self._meta_path(digest).unlink(missing_ok=True)
            return None
        return meta

    def _record_use(self, digest: str, meta: dict[str, Any], ref: str) -> None:
        path = self._meta_path(digest)
        if ref not in meta["refs"]:
            meta["refs"] = [*meta["refs"], ref]
            _write_json(path, meta)
        now = self._clock()
        os.utime(path, (now, now))

    @contextlib.contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        # Lock files are never removed: unlinking one while another process waits on it
        # would let a third lock a new file and both proceed.
        locks = self.dir / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            locks / f"{_check_digest(digest)}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -------------------------------------------------------------- pins, eviction, status

    def pin(self, alloc_id: str, digest: str) -> None:
        """Keep ``digest`` in the cache while ``alloc_id`` uses it."""
        _check_alloc_id(alloc_id)
        _check_digest(digest)
        pins = self.dir / "pins"
        pins.mkdir(parents=True, exist_ok=True)
        _write_text_atomic(pins / alloc_id, digest + "\n")

    def unpin(self, alloc_id: str) -> None:
        _check_alloc_id(alloc_id)
        (self.dir / "pins" / alloc_id).unlink(missing_ok=True)

    def pins(self) -> dict[str, str]:
        """alloc_id -> pinned digest."""
        out: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for pin in (self.dir / "pins").iterdir():
                with contextlib.suppress(OSError):
                    if not pin.name.startswith("."):
                        out[pin.name] = pin.read_text().strip()
        return out

    def _entries(self) -> list[tuple[str, dict[str, Any], float]]:
        """(digest, metadata, last use) of every cached image, least recently used first."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for path in (self.dir / "images").glob("*.json"):
                try:
                    meta = json.loads(path.read_text())
                    out.append((str(meta["digest"]), meta, path.stat().st_mtime))
                except (OSError, ValueError, KeyError):
                    continue
        out.sort(key=lambda e: e[2])
        return out

    def evict(self, max_bytes: int, *, keep: Iterable[str] = ()) -> list[str]:
        """Remove least recently used images until the cache holds at most ``max_bytes``;
        pinned digests and those in ``keep`` stay. Returns the removed digests."""
        entries = self._entries()
        total = sum(int(meta.get("size", 0)) for _, meta, _ in entries)
        keep = set(keep)
        removed: list[str] = []
        for digest, meta, _ in entries:
            if total <= max_bytes:
                break
            if digest in keep or digest in self.pins().values():
                continue
            with self._lock(digest):
                if digest in self.pins().values():  # pinned while we waited
                    continue
                self._remove_image(digest)
            total -= int(meta.get("size", 0))
            removed.append(digest)
            log.info("image cache: evicted %s (%s)", digest, ", ".join(meta.get("refs", [])))
        if total > max_bytes:
            log.warning(
                "image cache %s: %d bytes pinned or in use, above %d", self.dir, total, max_bytes
            )
        return removed

    def _remove_image(self, digest: str) -> None:
        self._meta_path(digest).unlink(missing_ok=True)  # first: no longer a cache hit
        for path in (self.rootfs_path(digest), self.layout_path(digest)):
            _remove_tree(path, self.dir / "tmp")

    def status(self) -> list[dict[str, Any]]:
        """Cached images, most recently used first."""
        pins = self.pins()
        out = []
        for digest, meta, last_used in reversed(self._entries()):
            by = sorted(a for a, d in pins.items() if d == digest)
            out.append(
                {
                    "digest": digest,
                    "refs": list(meta.get("refs", [])),
                    "size": int(meta.get("size", 0)),
                    "last_used": last_used,
                    "pinned": bool(by),
                    "pinned_by": by,
                    "platform": meta.get("platform", ""),
                }
            )
        return out

    # -------------------------------------------------------------- containers

    def bundle(
        self,
        alloc_id: str,
        image: OciImage,
        *,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str,
        uid: int,
        gid: int,
        binds: Sequence[tuple[str, str, bool]] = (),
        groups: Sequence[int] = (),
    ) -> Path:
        """Write ``<cache>/bundles/<alloc_id>`` for a fresh start (stale state of an earlier
        run of that id is removed first) and return it. ``argv`` empty: the image's
        Entrypoint + Cmd. ``env`` goes over the image's Env (pass the allocation's variables,
        not the agent's PATH). ``binds``: (host path, container path, read-only); ``cwd`` is
        bound read-write at the same path unless a bind names it (made writable)."""
        name = container_name(alloc_id)
        if not os.access(self.init, os.X_OK):
            raise OciError(f"container init {self.init} not found on this node (install tini)")
        if not image.rootfs.is_dir():
            raise OciError(f"image {image.ref}: {image.digest} is no longer in the image cache")
        if self.running(alloc_id):
            raise OciError(f"container {name} is already running")
        spec = runtime_spec(
            image,
            argv=argv,
            env=env,
            cwd=cwd,
            uid=uid,
            gid=gid,
            binds=binds,
            groups=groups,
            init=self.init,
            annotations={
                "org.lattice.allocation": alloc_id,
                "org.lattice.image.ref": image.ref,
                "org.lattice.image.digest": image.digest,
            },
        )
        self._delete_state(alloc_id)
        path = self.bundle_path(alloc_id)
        _remove_tree(path, self.dir / "tmp")
        for sub in ("rootfs", "overlay"):  # mount points of the launch script
            (path / sub).mkdir(parents=True)
        (path / "lower").symlink_to(image.rootfs)
        _write_json(path / "config.json", spec)
        return path

    def run_argv(self, alloc_id: str, bundle: Path | str) -> list[str]:
        """The command the allocation's wrapper runs: the launch script in a private mount
        namespace, which execs ``crun ... run --bundle B lattice-<id>`` in the foreground.
        Exit status: the container's (tini: 128+N when the job died of signal N), or 125 when
        the root could not be mounted."""
        return [
            shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin") or "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            _LAUNCH,
            "lattice-oci",
            str(bundle),
            "1" if self.hybrid_cgroups else "0",
            *self._crun_base(),
            "run",
            "--bundle",
            str(bundle),
            container_name(alloc_id),
        ]

    def _crun_base(self) -> list[str]:
        return [self.crun, "--root", str(self.state_root), "--cgroup-manager=disabled"]

    def state(self, alloc_id: str) -> dict[str, Any] | None:
        """crun's state of the allocation's container (None: there is none)."""
        name = container_name(alloc_id)
        if not (self.state_root / name).exists():
            return None
        done = _run([*self._crun_base(), "state", name], f"container {name}", _CRUN_TIMEOUT)
        if done.returncode != 0:
            return None
        try:
            return json.loads(done.stdout)
        except ValueError:
            return None

    def running(self, alloc_id: str) -> bool:
        state = self.state(alloc_id)
        return state is not None and state.get("status") in ("created", "running", "paused")

    def cleanup(self, alloc_id: str) -> None:
        """Kill and delete the container, remove its bundle, unpin its image. Idempotent."""
        self._delete_state(alloc_id)
        _remove_tree(self.bundle_path(alloc_id), self.dir / "tmp")
        self.unpin(alloc_id)

    def _delete_state(self, alloc_id: str) -> None:
        name = container_name(alloc_id)
        if not (self.state_root / name).exists():
            return
        done = _run(
            [*self._crun_base(), "delete", "--force", name], f"container {name}", _CRUN_TIMEOUT
        )
        if (self.state_root / name).exists():
            raise OciError(f"container {name}: crun delete failed: {_tool_message(done.stderr)}")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)
