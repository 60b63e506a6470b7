"""Spawning an allocation: its directories, environment, exit-status wrapper and session.

Everything here happens before the process exists; what comes back (:class:`Launched`) is
what the runtime must remember to find the process again after an agent restart.

* **Output goes to files, not pipes.** A pipe's read end lives in the agent; when the agent
  dies the workload gets ``SIGPIPE``/``EPIPE`` on its next write and its output is lost. So
  stdout and stderr are opened here as ``<log_dir>/<alloc>/stdout.log`` and ``stderr.log``
  (appended: a requeued run keeps the earlier output) and handed to the child as fds 1 and 2.
* **The exit status goes through a file.** Only the parent can ``waitpid()`` a child; after a
  restart the new agent can see a process vanish but not how it ended. The user's command
  therefore runs under a tiny ``/bin/sh`` wrapper that writes the real status to
  ``<work_dir>/<alloc>/exit_code`` when the command ends. The entrypoint is arbitrary user
  text: it is passed to ``/bin/sh -c`` as an argument (argv), never pasted into shell source,
  so quotes, ``$(...)`` and the like keep their ordinary shell meaning. The wrapper catches
  (does not ignore) ``SIGTERM``, so a group-wide SIGTERM lets the user command end and the
  wrapper still records its status; caught signals are reset to default on exec, so the
  user command sees the normal disposition.
* **Its own session.** ``setsid`` makes the wrapper's pid the pgid of everything the job
  starts, which is what the process-group control (``procgroup.py``) signals and reaps.
* **A uenv in its own mount namespace.** With a uenv image the wrapper is started by
  ``unshare --mount --propagation private`` and mounts the image read-only at the mount
  point before the command runs; spawn() waits for its "mounted" answer on a pipe. Only
  the job's processes see the mount, and it ends with the namespace (the last process).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import signal
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from lattice_common.types import Allocation

from lattice_agent.procgroup import proc_stat

__all__ = [
    "AGENT_SOCKET",
    "HYDRA_HOST_FILE",
    "AllocPaths",
    "Launched",
    "UenvMountError",
    "check_alloc_id",
    "environment",
    "job_name",
    "read_exit_file",
    "spawn",
]

_SHELL = "/bin/sh"
#: in the allocation's work dir: its agent socket (lattice_agent.hydra) and Hydra's host file
AGENT_SOCKET = "agent.sock"
HYDRA_HOST_FILE = "hydra-hosts"
# argv: $0=lattice-wrapper $1=cwd $2=exit file $3=N, then N cgroup procs files, then the
# command (/bin/sh -c <entrypoint>). The wrapper first writes its own pid into every procs
# file (joins the allocation's cgroup; `echo` is a builtin, so nothing has forked yet and
# everything the job starts is born inside); a failed join ends it with 125 before the
# command runs. `trap : TERM` catches SIGTERM in the wrapper only (reset by exec in the child).
_WRAPPER = (
    "trap : TERM; "
    "d=$1; f=$2; n=$3; shift 3; "
    'while [ "$n" -gt 0 ]; do '
    'echo "$$" > "$1" || { echo "[lattice] could not join cgroup $1" >&2; '
    'echo 125 > "$f"; exit 125; }; shift; n=$((n - 1)); done; '
    'cd "$d" || { echo 126 > "$f"; exit 126; }; '
    '"$@"; rc=$?; '
    'echo "$rc" > "$f"; exit "$rc"'
)
# The uenv variant, run by `unshare --mount --propagation private` (which execs it, so its
# pid is still the session leader): argv $1=cwd $2=exit file $3=image $4=mount point $5=N,
# then the procs files and the command. After joining the cgroup it mounts the image
# read-only in the job's own mount namespace and tells spawn() on fd 3 ("ok" or the
# error), then closes fd 3 so the job never inherits it. The namespace, and the mount,
# go away with the job's last process: nothing is ever mounted on the host.
_WRAPPER_UENV = (
    "trap : TERM; "
    "d=$1; f=$2; img=$3; mp=$4; n=$5; shift 5; "
    'while [ "$n" -gt 0 ]; do '
    'echo "$$" > "$1" || { echo "could not join cgroup $1" >&3; '
    'echo 125 > "$f"; exit 125; }; shift; n=$((n - 1)); done; '
    'err=$(mkdir -p "$mp" 2>&1 && mount -t squashfs -o loop,ro "$img" "$mp" 2>&1) || '
    '{ echo "could not mount uenv image $img at $mp: $err" >&3; echo 124 > "$f"; exit 124; }; '
    "echo ok >&3; exec 3>&-; "
    'cd "$d" || { echo 126 > "$f"; exit 126; }; '
    '"$@"; rc=$?; '
    'echo "$rc" > "$f"; exit "$rc"'
)
_UENV_MOUNT_TIMEOUT = 60.0  # seconds the wrapper may take to say whether the mount worked


class UenvMountError(OSError):
    """The wrapper could not mount the allocation's uenv image (the message says why)."""


@dataclass(frozen=True)
class AllocPaths:
    """Where one allocation's files live."""

    work_dir: Path
    stdout: Path
    stderr: Path
    exit_file: Path

    @classmethod
    def of(cls, alloc_id: str, work_root: Path, log_root: Path) -> AllocPaths:
        work_dir = work_root / alloc_id
        log_dir = log_root / alloc_id
        return cls(
            work_dir=work_dir,
            stdout=log_dir / "stdout.log",
            stderr=log_dir / "stderr.log",
            exit_file=work_dir / "exit_code",
        )

    def log(self, stream: str) -> Path:
        return self.stdout if stream == "stdout" else self.stderr


@dataclass(frozen=True)
class Launched:
    """A started wrapper: its pid (= pgid), kernel start time, cwd and log sizes at start."""

    pid: int
    proc_start: int | None
    cwd: str
    offsets: dict[str, int]


def check_alloc_id(alloc_id: str) -> None:
    """Refuse ids that are not usable as one directory name."""
    if (
        not alloc_id
        or alloc_id in (".", "..")
        or "/" in alloc_id
        or "\0" in alloc_id
        or len(alloc_id) > 200
    ):
        raise ValueError(f"allocation id not usable as a directory name: {alloc_id!r}")


def job_name(alloc: Allocation) -> str:
    """The spec's name, else the entrypoint's program name (as Slurm names batch jobs)."""
    if alloc.spec.name:
        return alloc.spec.name
    try:
        words = shlex.split(alloc.spec.entrypoint)
    except ValueError:
        words = alloc.spec.entrypoint.split()
    return os.path.basename(words[0]) if words else "job"


def read_exit_file(path: Path) -> int | None:
    """The status the wrapper wrote, or None when it never did."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@functools.cache
def mpi_launcher() -> str:
    """Absolute path of the installed ``lattice-mpi-launcher`` ("" when it is not installed)."""
    name = "lattice-mpi-launcher"
    beside = Path(sysconfig.get_path("scripts")) / name  # the agent's own environment
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    return os.path.abspath(found) if found else ""


def environment(
    alloc: Allocation,
    nodes: list[str],
    node_id: str,
    submit_dir: str,
    alloc_dir: Path,
    *,
    slurm_env: bool = True,
) -> dict[str, str]:
    """The agent's environment, then Hydra's, the spec's, LATTICE_* and their SLURM_* twins.

    Hydra (``mpirun``) is pointed at the agents instead of ssh (spec: Direct mpirun):
    ``HYDRA_LAUNCHER=ssh`` with ``HYDRA_LAUNCHER_EXEC=lattice-mpi-launcher``, the
    allocation's nodes in ``HYDRA_HOST_FILE`` and ``LATTICE_AGENT_SOCKET``, the
    allocation's own agent socket the launcher talks to (both files are made by
    ``lattice_agent.hydra``). The spec's env may override the HYDRA_* ones.

    With ``slurm_env`` (config ``compat.slurm_env``) the SLURM_* twins are set too:
    SLURM_JOB_ID/SLURM_JOBID, SLURM_JOB_NAME, SLURM_SUBMIT_DIR, SLURM_NNODES/
    SLURM_JOB_NUM_NODES, SLURM_NODELIST/SLURM_JOB_NODELIST in Slurm's compressed hostlist
    form (``nid[001-004]``), SLURM_NODEID, and from the spec's tags (``lattice sbatch``
    records them) SLURM_NTASKS/SLURM_NPROCS, SLURM_NTASKS_PER_NODE and
    SLURM_CPUS_PER_TASK. SLURM_ARRAY_TASK_ID/SLURM_ARRAY_JOB_ID come with a task group's
    env (set by the quorum with LATTICE_TASK_INDEX).
    """
    env = dict(os.environ)
    launcher = mpi_launcher()
    if launcher:
        env.update(
            {
                "HYDRA_LAUNCHER": "ssh",
                "HYDRA_LAUNCHER_EXEC": launcher,
                "HYDRA_HOST_FILE": str(alloc_dir / HYDRA_HOST_FILE),
            }
        )
    env.update(alloc.spec.env)
    nodelist = ",".join(nodes)
    name = job_name(alloc)
    env.update(
        {
            "LATTICE_ALLOC_ID": alloc.id,
            "LATTICE_NODELIST": nodelist,
            "LATTICE_NNODES": str(len(nodes)),
            "LATTICE_JOB_NAME": name,
            "LATTICE_SUBMIT_DIR": submit_dir,
            "LATTICE_NODE_ID": node_id,
            "LATTICE_WORK_DIR": str(alloc_dir),
            "LATTICE_AGENT_SOCKET": str(alloc_dir / AGENT_SOCKET),
        }
    )
    tags = alloc.spec.tags
    if tags.get("ntasks", "").isdigit():
        env["LATTICE_NPROCS"] = tags["ntasks"]
    if not slurm_env:
        return env
    from lattice_common.slurm import slurm_env_nodelist

    try:
        hostlist = slurm_env_nodelist(nodes)
    except ValueError:  # a node name Slurm's syntax cannot carry: keep the plain list
        hostlist = nodelist
    env.update(
        {
            "SLURM_JOB_ID": alloc.id,
            "SLURM_JOBID": alloc.id,
            "SLURM_JOB_NODELIST": hostlist,
            "SLURM_NODELIST": hostlist,
            "SLURM_NNODES": str(len(nodes)),
            "SLURM_JOB_NUM_NODES": str(len(nodes)),
            "SLURM_JOB_NAME": name,
            "SLURM_SUBMIT_DIR": submit_dir,
        }
    )
    if node_id in nodes:
        env["SLURM_NODEID"] = str(nodes.index(node_id))
    for tag, names in (
        ("ntasks", ("SLURM_NTASKS", "SLURM_NPROCS")),
        ("ntasks_per_node", ("SLURM_NTASKS_PER_NODE",)),
        ("cpus_per_task", ("SLURM_CPUS_PER_TASK",)),
    ):
        value = tags.get(tag, "")
        if value.isdigit():
            env.update(dict.fromkeys(names, value))
    return env


#: sbatch -o / -e patterns, as lattice sbatch records them in the allocation's tags
OUTPUT_TAGS = {"slurm_output": "stdout", "slurm_error": "stderr"}


def link_output_files(alloc: Allocation, paths: AllocPaths, cwd: str, node_id: str) -> list[str]:
    """Make the job's output appear where ``sbatch -o/-e`` said (patterns like
    ``slurm-%j.out`` expanded, relative to the working directory): a hard link to the
    log file, so the file fills live (``tail -f`` works) while Lattice's logs read the
    same bytes; a symbolic link across filesystems. What could not be linked is
    returned, to be said in the job's stderr (never a silent loss)."""
    from lattice_common.slurm import SlurmSyntaxError, expand_output_pattern

    problems = []
    for tag, stream in OUTPUT_TAGS.items():
        template = alloc.spec.tags.get(tag)
        if not template:
            continue
        try:
            name = expand_output_pattern(
                template,
                job_id=alloc.task_group_id or alloc.id
                if alloc.task_index is not None
                else alloc.id,
                job_name=job_name(alloc),
                user=alloc.spec.user,
                array_job_id=alloc.task_group_id or None,
                array_index=alloc.task_index,
                node=node_id,
            )
        except SlurmSyntaxError as e:
            problems.append(f"output file {template!r}: {e.message}")
            continue
        target = Path(cwd, name)
        source = paths.log(stream)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except OSError:
                target.symlink_to(source)
        except OSError as e:
            problems.append(f"could not create {target} for {stream}: {e.strerror or e}")
    return problems


def _signals_to_reset() -> list[int]:
    """Signals the agent ignores; an ignored disposition would survive exec into the workload."""
    out = {signal.SIGPIPE, signal.SIGXFSZ}
    for s in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(s) == signal.SIG_IGN:
                out.add(s)
    return sorted(out)


def _high_fd(fd: int) -> int:
    """Keep our fds away from 0-2 so the dup2 file actions cannot clobber each other."""
    if fd > 2:
        return fd
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _unshare() -> str:
    found = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if not found:
        raise UenvMountError("cannot mount a uenv: unshare (util-linux) not found")
    return found


def _ready_pipe() -> tuple[int, int]:
    """The wrapper's "mounted" pipe; the write end kept above fd 3 so the dup2 onto 3 is a
    real dup (which clears close-on-exec)."""
    import fcntl

    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        high = fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(w)
    return r, high


def _wait_mounted(pid: int, ready_r: int) -> None:
    """Read the wrapper's answer on the pipe; anything but "ok" -> reap it and raise."""
    import select

    data = b""
    deadline = time.monotonic() + _UENV_MOUNT_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([ready_r], [], [], left)[0]:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise UenvMountError(f"uenv mount did not finish in {_UENV_MOUNT_TIMEOUT:.0f}s")
        chunk = os.read(ready_r, 4096)
        if not chunk:
            break
        data += chunk
    answer = data.decode(errors="replace").strip()
    if answer == "ok":
        return
    _, status = os.waitpid(pid, 0)
    if not answer:
        answer = f"the wrapper ended before mounting the uenv (wait status {status})"
    raise UenvMountError(answer)


def spawn(
    alloc: Allocation,
    nodes: list[str],
    node_id: str,
    paths: AllocPaths,
    *,
    slurm_env: bool = True,
    procs_files: list[Path] | tuple[Path, ...] = (),
    uenv: tuple[Path, str] | None = None,
) -> Launched:
    """Start ``alloc``'s wrapper in a new session. Raises OSError/ValueError when it cannot.

    ``procs_files``: the ``cgroup.procs`` files of the allocation's cgroup scope (one on v2,
    one per controller on v1); the wrapper joins them before anything else runs.
    ``uenv``: (image, mount point): the wrapper runs in its own mount namespace and mounts
    the image there read-only; this returns once it is mounted and raises
    :class:`UenvMountError` with the cause (the wrapper reaped) when it could not be."""
    spec = alloc.spec
    out_fd = err_fd = -1
    ready_r = ready_w = -1
    try:
        paths.work_dir.mkdir(parents=True, exist_ok=True)
        paths.stdout.parent.mkdir(parents=True, exist_ok=True)
        paths.exit_file.unlink(missing_ok=True)  # a requeued allocation may run here again
        submit_dir = spec.submit_dir
        cwd = submit_dir if submit_dir and os.path.isdir(submit_dir) else str(paths.work_dir)
        cwd = os.path.abspath(cwd)
        env = environment(
            alloc, nodes, node_id, submit_dir or cwd, paths.work_dir, slurm_env=slurm_env
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        out_fd = _high_fd(os.open(paths.stdout, flags, 0o640))
        err_fd = _high_fd(os.open(paths.stderr, flags, 0o640))
        # Append (a requeued run keeps the earlier output); tail only the new part.
        offsets = {"stdout": os.fstat(out_fd).st_size, "stderr": os.fstat(err_fd).st_size}
        for problem in link_output_files(alloc, paths, cwd, node_id):
            os.write(err_fd, f"[lattice] {problem}\n".encode())
        command = [_SHELL, "-c", spec.entrypoint]
        cgroup_args = [str(len(procs_files)), *(str(p) for p in procs_files)]
        file_actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_fd, 1),
            (os.POSIX_SPAWN_DUP2, err_fd, 2),
        ]
        if uenv is None:
            program = _SHELL
            argv = [_SHELL, "-c", _WRAPPER, "lattice-wrapper", cwd, str(paths.exit_file)]
        else:
            image, mount_point = uenv
            program = _unshare()
            ready_r, ready_w = _ready_pipe()
            file_actions.append((os.POSIX_SPAWN_DUP2, ready_w, 3))
            argv = [
                program,
                "--mount",
                "--propagation",
                "private",
                _SHELL,
                "-c",
                _WRAPPER_UENV,
                "lattice-wrapper",
                cwd,
                str(paths.exit_file),
                str(image),
                mount_point,
            ]
        pid = os.posix_spawn(
            program,
            [*argv, *cgroup_args, *command],
            env,
            file_actions=file_actions,
            setsid=True,
            setsigmask=(),
            setsigdef=_signals_to_reset(),
        )
        if ready_w >= 0:
            os.close(ready_w)
            ready_w = -1
            _wait_mounted(pid, ready_r)
    finally:
        for fd in (out_fd, err_fd, ready_r, ready_w):
            if fd >= 0:
                os.close(fd)
    st = proc_stat(pid)
    return Launched(
        pid=pid, proc_start=st.starttime if st is not None else None, cwd=cwd, offsets=offsets
    )
