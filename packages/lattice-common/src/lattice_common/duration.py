"""Walltime and duration parsing: ``72h``, ``30m``, ``90s``, ``1d``, ``HH:MM:SS``,
``D-HH:MM:SS``, ``MM:SS`` and bare minutes (Slurm's ``--time=30``)."""

from __future__ import annotations

import re

from lattice_common.errors import ValidationError

_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SUFFIXED = re.compile(r"^([0-9]+)([smhd])$")
_HINT = "Use a duration like 90s, 30m, 72h, 1d, MM:SS, HH:MM:SS or D-HH:MM:SS."


def parse_duration(text: str, *, field: str = "walltime") -> int:
    """Return whole seconds. Raises ValidationError on anything else, including zero."""
    s = str(text).strip().lower()
    seconds = _parse(s)
    if seconds is None:
        raise ValidationError(f"invalid {field} {text!r}", details={field: text}, hint=_HINT)
    if seconds <= 0:
        raise ValidationError(
            f"{field} must be greater than zero", details={field: text}, hint=_HINT
        )
    return seconds


def _isnum(p: str) -> bool:
    # ASCII only: str.isdigit() is also true for "²" or "١", which int() rejects or misreads.
    return p.isascii() and p.isdigit()


def _parse(s: str) -> int | None:
    if not s or len(s) > 32:
        return None
    m = _SUFFIXED.match(s)
    if m:
        return int(m.group(1)) * _UNIT[m.group(2)]
    if _isnum(s):  # Slurm: bare number is minutes
        return int(s) * 60
    days = 0
    if "-" in s:
        d, _, s = s.partition("-")
        if not _isnum(d) or not s:
            return None
        days = int(d)
    parts = s.split(":")
    if not all((_isnum(p) and len(p) <= 2) or (i == 0 and _isnum(p)) for i, p in enumerate(parts)):
        return None
    nums = [int(p) for p in parts]
    if any(n >= 60 for n in nums[1:]):
        return None
    if len(parts) == 3:
        h, m_, sec = nums
    elif len(parts) == 2:
        if days:  # D-HH:MM
            h, m_, sec = nums[0], nums[1], 0
        else:  # MM:SS
            h, m_, sec = 0, nums[0], nums[1]
    elif len(parts) == 1 and days:  # D-HH
        h, m_, sec = nums[0], 0, 0
    else:
        return None
    if days and h >= 24:
        return None
    return days * 86400 + h * 3600 + m_ * 60 + sec


def format_duration(seconds: float | None) -> str:
    """HH:MM:SS (with D- prefix past a day), as Slurm prints it; em dash for none."""
    if seconds is None:
        return "—"
    total = max(0, int(seconds))
    d, rem = divmod(total, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    core = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{d}-{core}" if d else core
