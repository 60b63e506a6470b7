"""``lattice-mpi-launcher``: the "ssh" Hydra (``mpirun``) uses inside a Lattice allocation.

Spec: Direct mpirun (Escape Hatch). The agent puts ``HYDRA_LAUNCHER=ssh``,
``HYDRA_LAUNCHER_EXEC=<this script>`` and ``HYDRA_HOST_FILE`` (the allocation's
nodes) into every allocation's environment, so a plain ``mpirun -np 4 ./prog``
starts its remote proxies through this program instead of ssh. MPICH 4.0.2's
Hydra runs, for every host it does not consider local (a host that is the
machine's own hostname or ``localhost`` is forked directly, no launcher)::

    lattice-mpi-launcher -x node-1 "/usr/bin/hydra_pmi_proxy" --control-port vm:45953 \\
        --rmk user --launcher ssh --launcher-exec <this script> --demux poll --pgid 0 \\
        --retries 10 --usize -2 --pmi-port 0 --gpus-per-proc -2 --proxy-id 1

Like ssh, the leading options are skipped, the next word is the host (a Lattice
node id; ``user@`` is dropped) and the rest is joined with spaces and run by
``/bin/sh -c`` on that node (the quotes Hydra puts around the proxy path are
meant for that shell). The command is started by the node's agent, reached
through this allocation's own agent socket (``$LATTICE_AGENT_SOCKET``, see
``lattice_agent.hydra``): jobs never hold the agents' token. The launcher relays
the command's stdout/stderr line by line, unbuffered, stays until it ends and
exits with its status; 255 (ssh's code) when it cannot start it at all.

Hydra's proxy connects back to ``mpiexec`` over TCP and serves PMI to its ranks
itself: on this path the agents are only the remote launcher, not the PMI server.

Not forwarded: the launcher's stdin (Hydra forwards ``mpirun``'s stdin to rank 0
over the proxy's control connection, not through the launcher) and the caller's
environment (as with ssh, the command gets the allocation's environment on the
node; Hydra passes ``mpirun``'s environment to the ranks itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Sequence

__all__ = ["SSH_FAILURE", "LauncherError", "connectable_path", "main", "parse_ssh_argv"]

#: ssh's exit status when the remote command could not be run
SSH_FAILURE = 255
#: the longest path ``AF_UNIX`` takes (sun_path is 108 bytes with its NUL)
UNIX_PATH_MAX = 107
#: ssh options that take an argument (``-o Opt``, ``-p 22``, or glued: ``-p22``)
_WITH_ARG = frozenset("BbcDEeFIiJLlmOoPpQRSWw")
#: ssh options without one (``-x``, ``-q``, clusters such as ``-xq``)
_FLAGS = frozenset("46AaCfGgKkMNnqsTtVvXxYy")

_NO_SOCKET = (
    "lattice-mpi-launcher: not inside a Lattice allocation (LATTICE_AGENT_SOCKET unset). "
    "Hint: it is Hydra's (mpirun's) remote launcher and only works in an allocation's "
    "environment, where the agent sets HYDRA_LAUNCHER_EXEC to it: run mpirun in a "
    "job (`lattice submit`), or start MPI ranks with `lattice launch`."
)


class LauncherError(Exception):
    """The command could not be started; the message is for the user."""


def parse_ssh_argv(argv: Sequence[str]) -> tuple[str, str]:
    """``(host, command)`` from ssh-style arguments (without the program name)."""
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            c = a[j]
            if c in _WITH_ARG:
                if j + 1 == len(a):  # the value is the next word
                    if i + 1 >= len(args):
                        raise LauncherError(f"option -{c} needs an argument")
                    i += 1
                break  # the rest of this word is the value
            if c not in _FLAGS:
                raise LauncherError(f"unknown option -{c}")
            j += 1
        i += 1
    if i >= len(args):
        raise LauncherError("no host given")
    host = args[i].rsplit("@", 1)[-1]
    command = " ".join(args[i + 1 :])
    if not host:
        raise LauncherError("no host given")
    if not command.strip():
        raise LauncherError(f"{host}: no command given (interactive sessions are not supported)")
    return host, command


def connectable_path(path: str) -> tuple[str, int | None]:
    """A path ``AF_UNIX`` accepts for ``path``, and the directory fd to close afterwards.

    Longer paths than ``sun_path`` holds go through ``/proc/self/fd/<dir fd>/<name>``.
    """
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        return path, None
    head, name = os.path.split(path)
    fd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{name}", fd


async def run(socket_path: str, alloc_id: str, host: str, command: str) -> int:
    """Start ``command`` on ``host`` through the agent socket; relay its output; its status."""
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError, StreamTerminatedError
    from lattice_common.proto.lattice import v1

    path, fd = connectable_path(socket_path)
    channel = Channel(path=path)
    stub = v1.NodeAgentServiceStub(channel)
    task_id = f"mpirun-{uuid.uuid4()}"
    out, err = sys.stdout.buffer, sys.stderr.buffer
    try:
        try:
            await stub.launch_processes(
                v1.LaunchProcessesRequest(
                    allocation_id=alloc_id,
                    task_id=task_id,
                    argv=["/bin/sh", "-c", command],
                    first_rank=0,
                    local_tasks=1,
                    world_size=1,
                    mpi="none",
                    node_ids=[host],
                    ranks_per_node=[1],
                ),
                timeout=60,
            )
            async for ev in stub.watch_launch(
                v1.WatchLaunchRequest(allocation_id=alloc_id, task_id=task_id)
            ):
                if ev.output is not None:
                    sink = err if ev.output.stream == "stderr" else out
                    sink.write(ev.output.line.encode("utf-8", "surrogateescape") + b"\n")
                    sink.flush()
                elif ev.node_done is not None:
                    done = ev.node_done
                    if done.aborted and done.failed_rank < 0 and done.reason:
                        # killed from outside (the allocation ended, ...); an ordinary
                        # non-zero exit of the command speaks for itself, as with ssh
                        err.write(f"lattice-mpi-launcher: {host}: {ev.node_done.reason}\n".encode())
                        err.flush()
                    return ev.node_done.exit_status
        except GRPCError as e:
            raise LauncherError(f"{host}: {e.message or e.status.name}") from None
        except (StreamTerminatedError, OSError) as e:
            raise LauncherError(f"{host}: agent socket {socket_path}: {e}") from None
        raise LauncherError(f"{host}: the agent ended the launch stream early")
    finally:
        channel.close()
        if fd is not None:
            os.close(fd)


async def _run_until_signalled(socket_path: str, alloc_id: str, host: str, command: str) -> int:
    """``run`` that ends (closing the stream, so the agent kills the command) on a signal."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    got: list[int] = []

    def stop(sig: int) -> None:
        got.append(sig)
        assert task is not None
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await run(socket_path, alloc_id, host, command)
    except asyncio.CancelledError:
        if got:
            return 128 + got[0]
        raise


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    code = _main(args)
    if argv is None:
        sys.exit(code)
    return code


def _main(args: list[str]) -> int:
    try:
        host, command = parse_ssh_argv(args)
    except LauncherError as e:
        print(f"lattice-mpi-launcher: {e}", file=sys.stderr)
        return SSH_FAILURE
    socket_path = os.environ.get("LATTICE_AGENT_SOCKET", "")
    alloc_id = os.environ.get("LATTICE_ALLOC_ID", "")
    if not socket_path or not alloc_id:
        print(_NO_SOCKET, file=sys.stderr)
        return SSH_FAILURE
    if not os.path.exists(socket_path):
        print(
            f"lattice-mpi-launcher: the agent socket {socket_path} does not exist. Hint: the "
            "allocation has ended on this node, or its agent is not running.",
            file=sys.stderr,
        )
        return SSH_FAILURE
    try:
        code = asyncio.run(_run_until_signalled(socket_path, alloc_id, host, command))
    except LauncherError as e:
        print(f"lattice-mpi-launcher: {e}", file=sys.stderr)
        return SSH_FAILURE
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    return code
