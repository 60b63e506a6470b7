"""Take part in Lattice's checkpoint protocols from inside a job, in a few lines.

The node agent tells every run of a job submitted with ``--checkpoint=...`` where to
write its checkpoint and how it will be asked (spec: Checkpoint Broker, Application
Protocol)::

    from lattice_sdk import checkpoint

    start = checkpoint.resume_path()         # None, or the checkpoint to resume from
    directory = checkpoint.directory()       # where to write the next one

Shared memory (``--checkpoint=shmem``): poll a flag between steps::

    with checkpoint.shmem() as flag:
        while work_left():
            step()
            if flag.requested():
                save(checkpoint.directory())
                flag.done()

gRPC callback (``--checkpoint=grpc``): register a function; the agent calls it, the
helper answers with the estimate, streams progress and may ask for deferral::

    def on_checkpoint(request: checkpoint.Request) -> None:
        save(request.directory)
        request.progress(1.0)

    checkpoint.serve(on_checkpoint, estimate=5.0)          # a background thread
    # optional: defer=lambda request: 30.0 asks to be asked again in 30 s while
    # request.deferral_left > 0 and not request.force

Signal (``--checkpoint=signal``): catch SIGUSR1, write into :func:`directory`, then
call :func:`signal_done` (it creates the sentinel file the agent waits for).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# --- the environment of a run --------------------------------------------------------

ENV_RESUME = "LATTICE_RESUME"
ENV_CHECKPOINT_PATH = "LATTICE_CHECKPOINT_PATH"
ENV_CHECKPOINT_DIR = "LATTICE_CHECKPOINT_DIR"
ENV_CHECKPOINT_ID = "LATTICE_CHECKPOINT_ID"
ENV_SENTINEL = "LATTICE_CHECKPOINT_SENTINEL"
ENV_SHM = "LATTICE_CHECKPOINT_SHM"
ENV_SOCKET = "LATTICE_CHECKPOINT_SOCKET"


class CheckpointUnavailable(RuntimeError):
    """The job was not started with this checkpoint protocol (its variable is missing)."""


def _env(name: str, protocol: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise CheckpointUnavailable(
            f"{name} is not set: this job was not submitted with --checkpoint={protocol}\n"
            f"Hint: submit it with `lattice submit --checkpoint={protocol} ...` or "
            f"`#LATTICE --checkpoint={protocol}`."
        )
    return value


def resume_path() -> Path | None:
    """The checkpoint this run resumes from (LATTICE_RESUME=1), or None on a fresh start."""
    path = os.environ.get(ENV_CHECKPOINT_PATH, "")
    return Path(path) if os.environ.get(ENV_RESUME) == "1" and path else None


def directory() -> Path:
    """Where this run's checkpoint goes (exists, writable)."""
    return Path(_env(ENV_CHECKPOINT_DIR, "signal|shmem|grpc"))


def signal_done() -> None:
    """Signal protocol: the checkpoint is complete (creates the sentinel file)."""
    sentinel = Path(_env(ENV_SENTINEL, "signal"))
    sentinel.touch()


# --- shared memory flag ------------------------------------------------------------------
# The region's layout is lattice_agent.checkpoint.shmem's (a test keeps them equal).

REGION_SIZE = 64
MAGIC = b"LTCK"
OFF_REQUESTED = 5
OFF_DONE = 6
OFF_FAILED = 7
OFF_PROGRESS = 8
OFF_ID = 16
ID_SIZE = 48


class ShmemFlag:
    """The agent's flag region, mapped into this process."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, REGION_SIZE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if self._map[0:4] != MAGIC:
            self._map.close()
            raise CheckpointUnavailable(f"{path} is not a Lattice checkpoint flag region")

    def requested(self) -> bool:
        """Whether the agent asks for a checkpoint now (cheap: one byte read)."""
        return bool(self._map[OFF_REQUESTED])

    def checkpoint_id(self) -> str:
        return bytes(self._map[OFF_ID : OFF_ID + ID_SIZE]).rstrip(b"\0").decode()

    def progress(self, fraction: float) -> None:
        """Tell the agent how far the checkpoint is (0..1): a sign of life."""
        permille = max(0, min(1000, int(fraction * 1000)))
        self._map[OFF_PROGRESS : OFF_PROGRESS + 4] = struct.pack("<I", permille)

    def done(self) -> None:
        """The checkpoint is complete: clear the request, set done."""
        self._map[OFF_REQUESTED] = 0
        self._map[OFF_DONE] = 1

    def failed(self) -> None:
        self._map[OFF_REQUESTED] = 0
        self._map[OFF_FAILED] = 1

    def close(self) -> None:
        self._map.close()


@contextlib.contextmanager
def shmem(path: str | os.PathLike[str] | None = None) -> Iterator[ShmemFlag]:
    """The shared-memory flag of this run ($LATTICE_CHECKPOINT_SHM)."""
    flag = ShmemFlag(path if path is not None else _env(ENV_SHM, "shmem"))
    try:
        yield flag
    finally:
        flag.close()


# --- gRPC callback -------------------------------------------------------------------------


@dataclass
class Request:
    """One checkpoint request of the agent, handed to ``on_checkpoint``."""

    checkpoint_id: str
    directory: Path
    timeout_seconds: float
    force: bool
    deferral_left: float
    _updates: list[float] = field(default_factory=list, repr=False)

    def progress(self, fraction: float) -> None:
        """Report progress (0..1) to the agent: a sign of life while it is slow."""
        self._updates.append(max(0.0, min(1.0, fraction)))


class _Served:
    def __init__(
        self, thread: threading.Thread, stop: Callable[[], None], socket_path: str
    ) -> None:
        self.thread = thread
        self._stop = stop
        self.socket_path = socket_path

    def close(self) -> None:
        self._stop()
        self.thread.join(timeout=5)


def _socket_path() -> str:
    """The application's own endpoint, beside the agent's socket."""
    here = Path(os.environ.get("LATTICE_WORK_DIR") or tempfile.gettempdir())
    return str(here / f"ckpt-app-{os.getpid()}.sock")


_UNIX_PATH_MAX = 107


@contextlib.contextmanager
def _reachable(path: str) -> Iterator[str]:
    """A path ``AF_UNIX`` accepts for ``path``: itself, or (longer than a socket address
    holds) ``/proc/self/fd/<its directory>/<name>`` while the directory is held open."""
    if len(os.fsencode(path)) <= _UNIX_PATH_MAX:
        yield path
        return
    head, name = os.path.split(path)
    fd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def serve(
    on_checkpoint: Callable[[Request], None],
    *,
    estimate: float = 10.0,
    defer: Callable[[Request], float] | None = None,
    socket_path: str | None = None,
) -> _Served:
    """Serve this job's checkpoint endpoint in a background thread and register it with
    the agent ($LATTICE_CHECKPOINT_SOCKET). ``on_checkpoint(request)`` runs in that
    thread and writes the checkpoint into ``request.directory``; returning means done,
    raising means failed. ``estimate``: seconds it usually takes (sent first).
    ``defer(request)`` > 0 asks the agent to ask again after that many seconds; the
    agent grants deferral up to its max_deferral, then sends ``force=True``."""
    from grpclib.client import Channel
    from grpclib.server import Server
    from lattice_common.proto.lattice import v1

    registry = _env(ENV_SOCKET, "grpc")
    own = socket_path or _socket_path()
    ready = threading.Event()
    failure: list[BaseException] = []
    holder: dict[str, object] = {}

    class _Callback(v1.CheckpointCallbackBase):
        async def checkpoint(self, message: v1.CheckpointCallbackRequest):  # type: ignore[override]
            req = Request(
                checkpoint_id=message.checkpoint_id,
                directory=Path(message.checkpoint_dir),
                timeout_seconds=message.timeout_seconds,
                force=message.force,
                deferral_left=message.deferral_left_seconds,
            )
            if defer is not None and not req.force and req.deferral_left > 0:
                wait = float(defer(req))
                if wait > 0:
                    yield v1.CheckpointCallbackUpdate(defer_seconds=wait)
                    return
            yield v1.CheckpointCallbackUpdate(estimate_seconds=max(estimate, 0.001))
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(None, on_checkpoint, req)
            sent = 0
            while not work.done():
                await asyncio.sleep(0.05)
                while sent < len(req._updates):
                    yield v1.CheckpointCallbackUpdate(progress=max(req._updates[sent], 0.001))
                    sent += 1
            try:
                work.result()
            except Exception as e:  # the application could not checkpoint
                yield v1.CheckpointCallbackUpdate(error=str(e) or type(e).__name__)
                return
            yield v1.CheckpointCallbackUpdate(progress=1.0, done=True)

    async def main() -> None:
        import socket

        with contextlib.suppress(FileNotFoundError):
            os.unlink(own)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _reachable(own) as bind_path:
            sock.bind(bind_path)
            os.chmod(bind_path, 0o600)
        server = Server([_Callback()])
        await server.start(sock=sock)
        stop = asyncio.Event()
        holder["stop"] = lambda: loop.call_soon_threadsafe(stop.set)
        # register (the agent's socket exists before the job starts; retry briefly)
        for _ in range(50):
            with _reachable(registry) as reach:
                channel = Channel(path=reach)
                try:
                    resp = await v1.CheckpointRegistryStub(channel).register(
                        v1.RegisterCheckpointEndpointRequest(
                            allocation_id=os.environ.get("LATTICE_ALLOC_ID", ""),
                            socket_path=own,
                        ),
                        timeout=5,
                    )
                    if not resp.accepted:
                        raise CheckpointUnavailable(
                            f"the agent refused the endpoint: {resp.message}"
                        )
                    break
                except OSError:
                    await asyncio.sleep(0.1)
                finally:
                    channel.close()
        else:
            raise CheckpointUnavailable(f"could not reach the agent's checkpoint socket {registry}")
        ready.set()
        await stop.wait()
        server.close()
        await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(own)

    loop = asyncio.new_event_loop()

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as e:
            failure.append(e)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="lattice-checkpoint", daemon=True)
    thread.start()
    ready.wait(timeout=30)
    if failure:
        raise failure[0]

    def stop() -> None:
        fn = holder.get("stop")
        if callable(fn):
            fn()

    return _Served(thread, stop, own)
