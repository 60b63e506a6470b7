"""Slurm job arrays (``sbatch --array``) and how they map onto Lattice task groups.

Why: ``#SBATCH --array=...`` is how Slurm users fan out work; Lattice's equivalent is a
task group (:mod:`lattice_common.taskgroup`: one ``START-END[:STEP]`` range plus a
concurrency limit). This module reads the full Slurm syntax so that scripts either
translate exactly or fail with a message naming what Lattice cannot express.

Syntax (Slurm's): a comma list of ``N``, ``A-B`` and ``A-B:S`` (inclusive, ``S >= 1``),
then optionally ``%N``, the most array tasks running at once. Items may overlap and come
in any order; like Slurm (which keeps a bitmap) the result is the sorted set of indices.

Limits: Slurm refuses indices >= ``MaxArraySize`` (slurm.conf, default 1001, so indices
0..1000); :data:`MAX_ARRAY_SIZE` keeps that default and ``max_array_size`` lets a site
mirror its own setting (at most Slurm's ceiling, 4,000,001). A throttle of ``%0`` is
refused, as :func:`~lattice_common.taskgroup.parse_task_group` refuses concurrency 0.
:func:`to_task_group` additionally applies the task-group limits by delegating to
``parse_task_group`` (which caps a group at ``taskgroup.MAX_TASKS`` tasks).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from lattice_common.errors import ValidationError
from lattice_common.slurm.errors import SlurmSyntaxError
from lattice_common.taskgroup import parse_task_group

MAX_ARRAY_SIZE = 1001
SLURM_MAX_ARRAY_SIZE = 4_000_001
MAX_TEXT = 10_000
_ITEM = re.compile(r"([0-9]{1,10})(?:-([0-9]{1,10})(?::([0-9]{1,10}))?)?\Z")
_THROTTLE = re.compile(r"[0-9]{1,9}\Z")
_HINT = "Use --array=N, A-B, A-B:STEP or a comma list of those, optionally ending %MAX_RUNNING."
_TG_HINT = (
    "Lattice task groups are one range START-END[:STEP][%CONCURRENCY]; submit several "
    "task groups for other index sets."
)


@dataclass(frozen=True)
class ArraySpec:
    """A parsed ``--array``: sorted unique indices and the ``%N`` throttle (None: none)."""

    indices: tuple[int, ...]
    throttle: int | None = None


def _error(message: str, hint: str = _HINT) -> SlurmSyntaxError:
    return SlurmSyntaxError(message, hint=hint)


def parse_array(text: str, *, max_array_size: int = MAX_ARRAY_SIZE) -> ArraySpec:
    """``"0-15:4,20%2"`` -> ``ArraySpec((0, 4, 8, 12, 20), 2)``.

    Raises :class:`SlurmSyntaxError` for malformed text, an empty range, a step of 0, a
    throttle of 0 or an index >= ``max_array_size``.
    """
    if not 1 <= max_array_size <= SLURM_MAX_ARRAY_SIZE:
        raise _error(f"max_array_size must be 1..{SLURM_MAX_ARRAY_SIZE}, not {max_array_size}")
    s = str(text).strip()
    if not s:
        raise _error("--array is empty")
    if len(s) > MAX_TEXT:
        raise _error(f"--array value is too long ({len(s)} characters)")
    body, sep, throttle_text = s.partition("%")
    throttle = None
    if sep:
        if not _THROTTLE.match(throttle_text):
            raise _error(f"invalid --array throttle {throttle_text!r} in {s!r}")
        throttle = int(throttle_text)
        if throttle < 1:
            raise _error(f"--array throttle must be at least 1 in {s!r}")
    indices: set[int] = set()
    for item in body.split(","):
        indices.update(_item_indices(item, s, max_array_size))
    return ArraySpec(tuple(sorted(indices)), throttle)


def _item_indices(item: str, whole: str, max_array_size: int) -> range:
    m = _ITEM.match(item)
    if not m:
        raise _error(f"invalid --array item {item!r} in {whole!r}")
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) is not None else start
    step = int(m.group(3)) if m.group(3) is not None else 1
    if end < start:
        raise _error(f"--array range {item!r} ends before it starts")
    if step < 1:
        raise _error(f"--array step must be at least 1 in {item!r}")
    if end >= max_array_size:
        raise _error(
            f"--array index {end} in {item!r} is too large: indices must be below "
            f"MaxArraySize ({max_array_size})",
            hint=f"Use indices 0..{max_array_size - 1}.",
        )
    return range(start, end + 1, step)


def to_task_group(spec: ArraySpec) -> tuple[int, int, int, int]:
    """The Lattice task group for ``spec``: (start, end, step, concurrency), as returned by
    :func:`~lattice_common.taskgroup.parse_task_group` (concurrency 0: no limit).

    ``end`` is the last index (``0-15:4`` -> (0, 12, 4, 0)). Raises
    :class:`SlurmSyntaxError` unless the indices form one arithmetic progression or when
    the group breaks a task-group limit.
    """
    idx = spec.indices
    if not idx:
        raise _error("--array has no indices", hint=_TG_HINT)
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if any(b - a != step for a, b in itertools.pairwise(idx)):
        shown = ",".join(map(str, idx[:8])) + (",..." if len(idx) > 8 else "")
        raise _error(
            f"--array indices {shown} are not one evenly spaced range, which is all a "
            "Lattice task group can express",
            hint=_TG_HINT,
        )
    text = f"{idx[0]}-{idx[-1]}:{step}"
    if spec.throttle is not None:
        text += f"%{spec.throttle}"
    try:
        return parse_task_group(text)
    except ValidationError as exc:
        raise SlurmSyntaxError(exc.message, details=exc.details, hint=exc.hint) from None
