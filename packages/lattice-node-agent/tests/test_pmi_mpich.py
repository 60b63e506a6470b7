"""Real MPICH against the pure PMI core, through a tiny in-test socket shell.

Why: the wire tests encode what we believe MPICH sends; this runs the
installed MPICH's own PMI client (``MPI_Init`` with ``PMI_FD``) against
``lattice_agent.pmi`` so a protocol misunderstanding fails here rather
than on a cluster.  The shell is deliberately minimal (one thread per
rank, single node, fence completed locally); it is not the agent's
server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

from lattice_agent.pmi import (
    Abort,
    Close,
    FenceReady,
    Launch,
    PmiDecoder,
    PmiProtocolError,
    Reply,
    block_process_mapping,
)
from mpi_programs import ALLREDUCE, compile_mpi, needs_mpicc

pytestmark = needs_mpicc


class MiniShell:
    """Serve one single-node launch over socketpairs; records every action."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.lock = threading.Lock()
        self.socks: dict[int, socket.socket] = {}
        self.actions: list[object] = []
        self.errors: list[str] = []

    def _apply(self, actions: list) -> None:
        for action in actions:
            self.actions.append(action)
            if isinstance(action, Reply):
                self.socks[action.rank].sendall(action.data)
            elif isinstance(action, FenceReady):
                # single node: the merged KVS is just our own puts
                self._apply(self.launch.fence_done(action.puts))
            elif isinstance(action, Abort):
                self.errors.append(f"abort from rank {action.rank}: {action.message}")

    def serve(self, rank: int) -> None:
        sock = self.socks[rank]
        decoder = PmiDecoder()
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            with self.lock:
                if not data:
                    self._apply(self.launch.connection_lost(rank))
                    return
                try:
                    msgs = decoder.feed(data)
                except PmiProtocolError as exc:
                    self._apply(self.launch.protocol_error(rank, exc))
                    return
                for msg in msgs:
                    actions = self.launch.handle(rank, msg)
                    self._apply(actions)
                    if any(isinstance(a, Close) for a in actions):
                        return


def _run_ranks(binary: Path, size: int, extra_env: dict[str, str]) -> tuple[MiniShell, list[str]]:
    launch = Launch(
        size=size,
        ranks_on_this_node=list(range(size)),
        kvsname="lattice_test_kvs",
        process_mapping=block_process_mapping([size]),
    )
    shell = MiniShell(launch)
    procs = []
    child_ends = []
    for rank in range(size):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        shell.socks[rank] = ours
        child_ends.append(theirs)
    threads = [threading.Thread(target=shell.serve, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for rank in range(size):
        fd = child_ends[rank].fileno()
        env = {
            **os.environ,
            **extra_env,
            "PMI_FD": str(fd),
            "PMI_RANK": str(rank),
            "PMI_SIZE": str(size),
            "PMI_SPAWNED": "0",
        }
        procs.append(
            subprocess.Popen(
                [str(binary)],
                env=env,
                pass_fds=(fd,),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        child_ends[rank].close()
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            outputs.append(out)
            assert p.returncode == 0, f"rank exited {p.returncode}: {out}\nactions={shell.actions}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for s in shell.socks.values():
            s.close()
    for t in threads:
        t.join(timeout=5)
    return shell, outputs


def test_real_mpich_two_ranks_allreduce(tmp_path: Path) -> None:
    binary = compile_mpi(tmp_path, "hello", ALLREDUCE)

    shell, outputs = _run_ranks(binary, 2, {})

    assert not shell.errors, shell.errors
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith("rank="))
    assert lines == ["rank=0 size=2 sum=3", "rank=1 size=2 sum=3"], outputs
    fences = [a for a in shell.actions if isinstance(a, FenceReady)]
    assert fences, "MPI_Init must go through at least one fence"
    assert shell.launch.finished
