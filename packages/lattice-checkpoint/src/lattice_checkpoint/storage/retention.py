"""Checkpoint retention (spec: Data Retention, "Checkpoints | S3 | Configurable (default:
7 days after completion)").

An allocation's checkpoints are deleted once it has been terminal (Completed, Failed,
Cancelled) for the retention time. Allocations that are not terminal (Running,
Suspended: their next run resumes from a checkpoint; Pending after a requeue) and
checkpoints of allocations the quorum does not know are kept. Only ``checkpoints/`` is
deleted, never the allocation's output beside it. :func:`expired` decides (pure);
:func:`sweep_expired_checkpoints` applies it to a store.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

import msgspec
from lattice_common.types import Allocation
from prometheus_client import Counter

from lattice_checkpoint.storage.base import CheckpointStorageError, CheckpointStore
from lattice_checkpoint.storage.layout import AllocationKey, allocation_key

__all__ = [
    "DEFAULT_RETENTION_DAYS",
    "RETENTION_DELETED",
    "AllocationLookup",
    "SweepReport",
    "expired",
    "sweep_expired_checkpoints",
    "terminal_times",
]

_log = logging.getLogger(__name__)

AllocationLookup = Callable[[list[str]], Awaitable[Iterable[Allocation]]]

DEFAULT_RETENTION_DAYS = 7.0

RETENTION_DELETED = Counter(
    "lattice_checkpoint_retention_deleted_total",
    "Checkpoint files or objects deleted because their allocation ended longer ago than "
    "the retention",
)


def terminal_times(allocations: Iterable[Allocation]) -> dict[AllocationKey, float]:
    """When each terminal allocation ended, by its place in the layout (allocations
    without an end time are left out, so kept)."""
    return {
        allocation_key(a): a.finished_at
        for a in allocations
        if a.terminal and a.finished_at is not None
    }


def expired(
    stored: Iterable[AllocationKey],
    ended_at: Mapping[AllocationKey, float],
    now: float,
    retention_seconds: float,
) -> list[AllocationKey]:
    """The stored allocations whose checkpoints go: terminal (in ``ended_at``) for at
    least ``retention_seconds``. ``retention_seconds <= 0`` keeps everything."""
    if retention_seconds <= 0:
        return []
    return sorted({k for k in stored if k in ended_at and now - ended_at[k] >= retention_seconds})


class SweepReport(msgspec.Struct, kw_only=True):
    deleted: list[AllocationKey] = msgspec.field(default_factory=list)
    objects_deleted: int = 0
    errors: list[str] = msgspec.field(default_factory=list)


async def sweep_expired_checkpoints(
    store: CheckpointStore,
    allocations: Iterable[Allocation] | AllocationLookup,
    *,
    now: float,
    retention_seconds: float,
) -> SweepReport:
    """Delete the checkpoints :func:`expired` picks among what ``store`` holds.

    ``allocations``: the allocations to judge by, or an async lookup that is given the
    allocation ids found in the store and returns the records it knows of them. Terminal
    allocations leave the quorum's state for the history store (lattice_common.history)
    long before a 7-day retention ends, so the lookup should ask both. Listing failures
    raise CheckpointStorageError; a failed delete is reported and the sweep goes on (the
    next sweep tries again)."""
    report = SweepReport()
    if retention_seconds <= 0:
        return report
    stored = await store.list_allocations()
    if not stored:
        return report
    if callable(allocations):
        known = await allocations(sorted({k.alloc for k in stored}))
    else:
        known = allocations
    for key in expired(stored, terminal_times(known), now, retention_seconds):
        try:
            n = await store.delete_allocation(key)
        except CheckpointStorageError as e:
            report.errors.append(e.message)
            _log.warning("checkpoint retention: %s", e.message)
            continue
        report.deleted.append(key)
        report.objects_deleted += n
        RETENTION_DELETED.inc(n)
    return report
