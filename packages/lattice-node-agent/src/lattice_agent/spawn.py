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
* **As the submitting user.** The wrapper joins the cgroup and mounts the uenv as the
  agent (root); the command then runs under ``setpriv`` (``identity.RunAs.argv_prefix``)
  through a small user stage that makes the ``sbatch -o/-e`` links and enters the working
  directory as the user (so neither can reach what the user could not), then execs it.
  The log files are handed to the user (``/dev/stdout`` reopens them, the links need
  it); the exit file stays the wrapper's, written as root after the command. Running as
  the agent itself (``node_agent.run_as: agent``) adds nothing: no stage, no process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lattice_common.config import is_config_env
from lattice_common.types import Allocation
from lattice_common.uenv_registry import UenvView, apply_view

from lattice_agent.identity import IdentityError, RunAs, may_enter
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
    "working_dir",
]

_SHELL = "/bin/sh"
#: in the allocation's work dir: its agent socket (lattice_agent.hydra) and Hydra's host file
AGENT_SOCKET = "agent.sock"
HYDRA_HOST_FILE = "hydra-hosts"
NODES_FILE = "nodes"  # lattice_agent.membership writes it
RELEASING_FILE = "releasing"  # likewise: the nodes a pending scale-down will release
# argv: $0=lattice-wrapper $1=cwd $2=exit file $3=N, then N cgroup procs files, then the
# command (/bin/sh -c <entrypoint>). The wrapper first writes its own pid into every procs
# file (joins the allocation's cgroup; `echo` is a builtin, so nothing has forked yet and
# everything the job starts is born inside); a failed join ends it with 125 before the
# command runs. `trap : TERM USR1` catches SIGTERM and the checkpoint signal (SIGUSR1 to
# the process group) in the wrapper only (reset by exec in the child).
_WRAPPER = (
    "trap : TERM USR1; "
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
    "trap : TERM USR1; "
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
#: what the shell running a signal-protocol job's entrypoint does first
SIGNAL_TRAP = "trap : USR1; "
_WRAPPER_NAME = b"\0lattice-wrapper\0"
_ENTRY_SHELL = f"{_SHELL}\0-c\0{SIGNAL_TRAP}".encode()


def wrapper_process(cmdline: bytes) -> bool:
    """The wrapper, or a fork of it that has not exec'd yet, by /proc/<pid>/cmdline."""
    return _WRAPPER_NAME in cmdline


def agent_shell(cmdline: bytes) -> bool:
    """A process of the job that is the agent's, not the application's, by its
    /proc/<pid>/cmdline: the wrapper or the signal-protocol entrypoint shell, or a fork
    of either that has not exec'd yet (same command line, their traps still set)."""
    return wrapper_process(cmdline) or cmdline.startswith(_ENTRY_SHELL)


# Between the wrapper and the command when the job runs as another user, run by setpriv
# as that user: argv $0=lattice-user $1=cwd $2=N, then N (stream, log file, link)
# triples of sbatch -o/-e links, then the command. The links are made as the user (a
# pattern naming /etc/... fails as it would for the user), the cd is the kernel's own
# access check, and exec leaves no extra process behind.
_USER_STAGE = (
    "d=$1; n=$2; shift 2; "
    'while [ "$n" -gt 0 ]; do '
    '{ mkdir -p -- "${3%/*}/" && rm -f -- "$3" && { ln -- "$2" "$3" || ln -s -- "$2" "$3"; }; '
    '} 2>/dev/null || echo "[lattice] could not create $3 for $1" >&2; '
    "shift 3; n=$((n - 1)); done; "
    'cd -- "$d" 2>/dev/null || { echo "[lattice] the working directory $d is not '
    "accessible to the job's user\" >&2; exit 126; }; "
    'exec "$@"'
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
    view: UenvView | None = None,
    run_as: RunAs | None = None,
    scratch: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The agent's environment, then Hydra's, the spec's, the uenv view's, LATTICE_* and
    their SLURM_* twins.

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

    ``view``: the uenv view the spec asked for (``--view``, read from the image's
    ``meta/env.json``), applied after the spec's env so its prepend/append lists extend
    what the job would otherwise see (PATH, LD_LIBRARY_PATH, ...).

    ``run_as``: the user the job runs as; when that is not the agent, its HOME, USER,
    LOGNAME and SHELL replace the agent's and the spec's (they must say who the process
    is). ``scratch``: the allocation's scratch directory, as ``LATTICE_SCRATCH`` and
    ``TMPDIR``. ``extra_env``: more LATTICE_* variables of this run (the checkpoint
    variables of lattice_agent.checkpoint), set last.
    """
    # the agent's configuration and secrets (its token) stay with the agent
    env = {k: v for k, v in os.environ.items() if not is_config_env(k)}
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
    if view is not None:
        apply_view(env, view)
    if run_as is not None:
        env.update(run_as.environment())
    if scratch is not None:
        env["TMPDIR"] = env["LATTICE_SCRATCH"] = str(scratch)
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
            # the current node list, rewritten on scaling (lattice_agent.membership)
            "LATTICE_NODES_FILE": str(alloc_dir / NODES_FILE),
            # the nodes about to be released (checkpoint first), absent otherwise
            "LATTICE_RELEASING_FILE": str(alloc_dir / RELEASING_FILE),
        }
    )
    tags = alloc.spec.tags
    if tags.get("ntasks", "").isdigit():
        env["LATTICE_NPROCS"] = tags["ntasks"]
    if extra_env:
        env.update(extra_env)
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


def output_links(
    alloc: Allocation, paths: AllocPaths, cwd: str, node_id: str
) -> tuple[list[tuple[str, Path, Path]], list[str]]:
    """Where ``sbatch -o/-e`` wants the job's output (patterns like ``slurm-%j.out``
    expanded, relative to the working directory): (stream, log file, link) triples, and
    the patterns that could not be expanded, to be said in the job's stderr."""
    from lattice_common.slurm import SlurmSyntaxError, expand_output_pattern

    links: list[tuple[str, Path, Path]] = []
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
        links.append((stream, paths.log(stream), Path(cwd, name)))
    return links, problems


def link_output_files(alloc: Allocation, paths: AllocPaths, cwd: str, node_id: str) -> list[str]:
    """Make the job's output appear where ``sbatch -o/-e`` said: a hard link to the
    log file, so the file fills live (``tail -f`` works) while Lattice's logs read the
    same bytes; a symbolic link across filesystems. What could not be linked is
    returned, to be said in the job's stderr (never a silent loss). The agent does this
    only for jobs that run as the agent itself; for another user's job the user stage
    (``_USER_STAGE``) makes the same links as that user."""
    links, problems = output_links(alloc, paths, cwd, node_id)
    for stream, source, target in links:
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


def working_dir(
    submit_dir: str, paths: AllocPaths, run_as: RunAs | None = None, scratch: Path | None = None
) -> str:
    """The job's working directory: the submit directory when it exists here, else the
    allocation's work directory (for another user's job its scratch directory, when it
    has one: the agent's directories may be closed to users). A submit directory the
    user cannot enter ends the start (IdentityError) instead of running elsewhere."""
    if run_as is None or not run_as.switches:
        if submit_dir and os.path.isdir(submit_dir):
            return os.path.abspath(submit_dir)
        paths.work_dir.mkdir(parents=True, exist_ok=True)
        return str(paths.work_dir)
    if submit_dir and _maybe_dir(submit_dir):
        if may_enter(submit_dir, run_as) is False:
            raise IdentityError(
                f"the working directory {submit_dir} is not accessible to user "
                f"{run_as.name} (uid {run_as.uid})",
                hint="submit from a directory the user can enter on the compute nodes",
            )
        return os.path.abspath(submit_dir)
    if scratch is not None:
        return str(scratch)
    paths.work_dir.mkdir(parents=True, exist_ok=True)
    return str(paths.work_dir)


def _maybe_dir(path: str) -> bool:
    """A directory, or one the agent may not look at (root-squashed NFS: EACCES as
    root), which the user stage's ``cd`` then checks as the user."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except PermissionError:
        return True
    except (OSError, ValueError):
        return False


def _user_stage(run_as: RunAs, cwd: str, links: list[tuple[str, Path, Path]]) -> list[str]:
    """``setpriv ... -- /bin/sh -c <user stage> ...``: put in front of the command."""
    triples = [x for stream, source, target in links for x in (stream, str(source), str(target))]
    return [
        *run_as.argv_prefix(),
        _SHELL,
        "-c",
        _USER_STAGE,
        "lattice-user",
        cwd,
        str(len(links)),
        *triples,
    ]


#: Every signal back to its default action in the wrapper. An ignored disposition of the
#: agent's would survive exec into the workload; a caught one becomes the default at exec
#: anyway, so resetting them all is the same as finding the ignored ones, without asking
#: for each signal's disposition at every spawn. (SIGKILL and SIGSTOP cannot be changed.)
_RESET_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


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
    view: UenvView | None = None,
    container: Callable[[dict[str, str], str], list[str]] | None = None,
    run_as: RunAs | None = None,
    scratch: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Launched:
    """Start ``alloc``'s wrapper in a new session. Raises OSError/ValueError when it cannot.

    ``procs_files``: the ``cgroup.procs`` files of the allocation's cgroup scope (one on v2,
    one per controller on v1); the wrapper joins them before anything else runs.
    ``uenv``: (image, mount point): the wrapper runs in its own mount namespace and mounts
    the image there read-only; this returns once it is mounted and raises
    :class:`UenvMountError` with the cause (the wrapper reaped) when it could not be.
    ``view``: the uenv view whose variables go into the job's environment.
    ``container``: (environment, working directory) -> the container runtime's command
    line, run by the wrapper instead of ``/bin/sh -c <entrypoint>`` (an allocation with
    an OCI image: ``lattice_agent.oci``; the job's environment goes into its bundle).
    ``run_as``: the user the command runs as (None: the agent); a container runtime is
    never switched (its bundle names the user). ``scratch``: the allocation's scratch
    directory (``LATTICE_SCRATCH``/``TMPDIR``; another user's fallback working directory)."""
    spec = alloc.spec
    out_fd = err_fd = -1
    ready_r = ready_w = -1
    try:
        paths.work_dir.mkdir(parents=True, exist_ok=True)
        paths.stdout.parent.mkdir(parents=True, exist_ok=True)
        paths.exit_file.unlink(missing_ok=True)  # a requeued allocation may run here again
        submit_dir = spec.submit_dir
        cwd = working_dir(submit_dir, paths, run_as, scratch)
        env = environment(
            alloc,
            nodes,
            node_id,
            submit_dir or cwd,
            paths.work_dir,
            slurm_env=slurm_env,
            view=view,
            run_as=run_as,
            scratch=scratch,
            extra_env=extra_env,
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        out_fd = _high_fd(os.open(paths.stdout, flags, 0o640))
        err_fd = _high_fd(os.open(paths.stderr, flags, 0o640))
        # Append (a requeued run keeps the earlier output); tail only the new part.
        offsets = {"stdout": os.fstat(out_fd).st_size, "stderr": os.fstat(err_fd).st_size}
        entry = spec.entrypoint
        if spec.checkpointable and spec.checkpoint_protocol == "signal":
            # the shell running the entrypoint survives a SIGUSR1 sent to the group by
            # hand (a trap is reset by exec: the job gets the default); the checkpoint
            # signal itself goes only to the processes that catch it (checkpoint/signal.py)
            entry = SIGNAL_TRAP + entry
        command = [_SHELL, "-c", entry] if container is None else container(env, cwd)
        wrapper_cwd = cwd
        if run_as is not None and run_as.switches:
            # the job's own files: /dev/stdout reopens them, the sbatch -o links need them
            for fd in (out_fd, err_fd):
                os.fchown(fd, run_as.uid, run_as.gid)
            links, problems = output_links(alloc, paths, cwd, node_id)
            stage = _user_stage(run_as, cwd, links)
            if container is None:
                command = [*stage, *command]
                wrapper_cwd = str(paths.work_dir)  # root waits there; the user enters cwd
            elif links:  # the runtime itself must stay root: the links in a stage of their own
                subprocess.run(
                    [*stage, "true"],
                    stdin=subprocess.DEVNULL,
                    stdout=err_fd,
                    stderr=err_fd,
                    env=env,
                    timeout=30,
                    check=False,
                )
        else:
            problems = link_output_files(alloc, paths, cwd, node_id)
        for problem in problems:
            os.write(err_fd, f"[lattice] {problem}\n".encode())
        cgroup_args = [str(len(procs_files)), *(str(p) for p in procs_files)]
        file_actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_fd, 1),
            (os.POSIX_SPAWN_DUP2, err_fd, 2),
        ]
        if uenv is None:
            program = _SHELL
            argv = [_SHELL, "-c", _WRAPPER, "lattice-wrapper", wrapper_cwd, str(paths.exit_file)]
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
                wrapper_cwd,
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
            setsigdef=_RESET_SIGNALS,
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
