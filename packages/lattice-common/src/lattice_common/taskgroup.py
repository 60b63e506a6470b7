"""Task group (job array) ranges as users write them: ``0-99%20``, ``1-9:2``, ``5``.

``START-END`` (inclusive), optional ``:STEP``, optional ``%CONCURRENCY`` (at most that
many tasks running at once), like Slurm's ``--array``.
"""

from __future__ import annotations

import re

from lattice_common.errors import ValidationError

MAX_TASKS = 10_000
_RANGE = re.compile(r"^(\d{1,7})(?:-(\d{1,7}))?(?::(\d{1,7}))?(?:%(\d{1,7}))?$")
_HINT = "Use START-END[:STEP][%CONCURRENCY], e.g. --task-group=0-99%20."


def parse_task_group(text: str) -> tuple[int, int, int, int]:
    """Return (start, end, step, concurrency); concurrency 0 means no limit."""
    m = _RANGE.match(str(text).strip())
    if not m:
        raise ValidationError(f"invalid task group {text!r}", hint=_HINT)
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) is not None else start
    step = int(m.group(3)) if m.group(3) is not None else 1
    concurrency = int(m.group(4)) if m.group(4) is not None else 0
    if end < start or step < 1:
        raise ValidationError(
            f"invalid task group {text!r}: END must be >= START and STEP >= 1", hint=_HINT
        )
    count = len(range(start, end + 1, step))
    if count > MAX_TASKS:
        raise ValidationError(
            f"task group {text!r} has {count} tasks; at most {MAX_TASKS} are allowed",
            details={"tasks": count, "limit": MAX_TASKS},
            hint="Split the work into several task groups.",
        )
    if m.group(4) is not None and concurrency < 1:
        raise ValidationError(f"task group concurrency must be at least 1 in {text!r}", hint=_HINT)
    return start, end, step, concurrency
