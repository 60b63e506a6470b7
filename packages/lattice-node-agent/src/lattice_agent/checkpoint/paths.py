"""Where an allocation's checkpoints go and what its processes are told (pure).

A checkpoint lives in ``{checkpoint_root}/{tenant}/{project}/{alloc}/checkpoints/{id}/``
(spec: Checkpoint Destinations, the POSIX form). Its id is fixed when the run starts
(``ckpt-N`` for the N-th run), so the signal protocol, which carries no data, can tell
the application where to write through the environment alone.
"""

from __future__ import annotations

from pathlib import Path

from lattice_common.types import Allocation

SENTINEL_NAME = "CHECKPOINT_DONE"
"""signal protocol: the file the application creates in the checkpoint directory when
the checkpoint is complete."""
SHM_NAME = "checkpoint.shm"
"""shmem protocol: the flag region in the allocation's directory."""
SOCKET_NAME = "ckpt.sock"
"""gRPC callback protocol: the agent's CheckpointRegistry socket in the allocation's
directory."""

# the environment of a run (names from the specification where it has them)
ENV_RESUME = "LATTICE_RESUME"
ENV_CHECKPOINT_PATH = "LATTICE_CHECKPOINT_PATH"  # the checkpoint to resume from
ENV_CHECKPOINT_DIR = "LATTICE_CHECKPOINT_DIR"  # where to write the next one
ENV_CHECKPOINT_ID = "LATTICE_CHECKPOINT_ID"
ENV_PROTOCOL = "LATTICE_CHECKPOINT_PROTOCOL"
ENV_SENTINEL = "LATTICE_CHECKPOINT_SENTINEL"
ENV_SHM = "LATTICE_CHECKPOINT_SHM"
ENV_SOCKET = "LATTICE_CHECKPOINT_SOCKET"


def run_index(a: Allocation) -> int:
    """Runs of ``a`` before this one: every requeue and every stop for a checkpoint
    (preemption, suspend) starts a new run."""
    return a.requeue_count + a.preempted_count


def checkpoint_id(a: Allocation) -> str:
    return f"ckpt-{run_index(a) + 1}"


def _component(name: str, fallback: str) -> str:
    """One safe path component: tenant and project names never climb out of the root."""
    name = name.replace("/", "_").replace("\0", "_").strip()
    return fallback if name in ("", ".", "..") else name


def allocation_root(root: Path, a: Allocation) -> Path:
    return (
        Path(root)
        / _component(a.spec.tenant, "default")
        / _component(a.spec.project, "default")
        / _component(a.id, "allocation")
    )


def checkpoint_dir(root: Path, a: Allocation) -> Path:
    """The directory this run's checkpoint is written to."""
    return allocation_root(root, a) / "checkpoints" / checkpoint_id(a)


def environment(root: Path | None, a: Allocation, alloc_dir: Path) -> dict[str, str]:
    """The LATTICE_* variables of a run: the checkpoint to resume from (LATTICE_RESUME=1,
    LATTICE_CHECKPOINT_PATH) when it was suspended with one, and for a checkpointable
    allocation where its next checkpoint goes and how it is asked for. ``root`` None:
    this node has no checkpoint root (only the resume variables)."""
    env: dict[str, str] = {}
    if a.resume_from_checkpoint and a.last_checkpoint is not None:
        env[ENV_RESUME] = "1"
        env[ENV_CHECKPOINT_PATH] = a.last_checkpoint.path
    if root is None or not a.spec.checkpointable:
        return env
    directory = checkpoint_dir(root, a)
    env[ENV_CHECKPOINT_DIR] = str(directory)
    env[ENV_CHECKPOINT_ID] = checkpoint_id(a)
    env[ENV_PROTOCOL] = a.spec.checkpoint_protocol
    if a.spec.checkpoint_protocol == "signal":
        env[ENV_SENTINEL] = str(directory / SENTINEL_NAME)
    elif a.spec.checkpoint_protocol == "shmem":
        env[ENV_SHM] = str(alloc_dir / SHM_NAME)
    elif a.spec.checkpoint_protocol == "grpc":
        env[ENV_SOCKET] = str(alloc_dir / SOCKET_NAME)
    return env


def directory_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for p in Path(path).rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            continue
    return total
