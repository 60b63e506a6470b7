"""Slurm hostlists: ``node[001-003,007],gpu[1-2]`` <-> a list of node names.

Why: Slurm users, their scripts and their tools (``scontrol show hostnames``, MPI
launchers, prologs) exchange node sets in this compressed form, most visibly as
``SLURM_NODELIST``/``SLURM_JOB_NODELIST``. Lattice sets those variables in compat mode and
accepts hostlists wherever a Slurm user would type one, so it needs both directions.

Syntax (as Slurm's ``hostlist_create``): items are separated by commas or whitespace
outside brackets; a bracket holds a comma list of ``N`` or ``LO-HI`` (inclusive). The
zero-padding width of a range is the width of ``LO`` (``[08-10]`` -> 08, 09, 10;
``[8-10]`` -> 8, 9, 10). Several brackets in one item expand as a product, leftmost
slowest (``rack[1-2]-n[1-2]`` -> rack1-n1, rack1-n2, rack2-n1, rack2-n2). Steps, nested
brackets and Slurm's 3-D Cray coordinates are not supported and raise
:class:`SlurmSyntaxError`, as do unbalanced brackets, ``HI < LO`` and more than
:data:`MAX_HOSTS` names (checked before anything is generated, so huge ranges are cheap
to refuse).

Order: :func:`compress_hostlist` keeps the given order and duplicates, like ``scontrol
show hostlist`` (only *consecutive* names with the same prefix share a bracket, and a
range only joins numbers that expand back to the same text, so ``n9,n10`` -> ``n[9-10]``
but ``n09,n10`` -> ``n[09-10]`` and ``n1,n01`` -> ``n[1,01]``). Hence
``expand_hostlist(compress_hostlist(x)) == x`` for any valid names. ``sort=True`` gives
``scontrol show hostlistsorted``: duplicates dropped, ordered by prefix then number
(then width). :func:`slurm_env_nodelist` sorts, because Slurm builds ``SLURM_NODELIST``
from its node table, which is in that order on any normally named cluster.

One deliberate difference: a bracket group is written out plainly when that is shorter
(``a1,a2`` stays ``a1,a2``; Slurm would print ``a[1-2]``), so the compressed text is
never longer than the comma-joined names. Both forms expand identically everywhere.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from lattice_common.slurm.errors import SlurmSyntaxError

MAX_HOSTS = 100_000
MAX_TEXT = 1_000_000
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?\Z")
_NAME = re.compile(r"(.*?)([0-9]+)\Z", re.DOTALL)
_MAX_DIGITS = 18  # longer numeric suffixes are kept as plain names
_FORBIDDEN = set(",[]")
_HINT = "Write hostlists like node[001-004,007],gpu1 (ranges LO-HI inside brackets)."


def _error(message: str, hint: str = _HINT) -> SlurmSyntaxError:
    return SlurmSyntaxError(message, hint=hint)


def _split_items(text: str) -> list[str]:
    """Split on commas/whitespace outside brackets, checking the brackets balance."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _error(f"nested brackets in hostlist at position {i}: {text[:80]!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _error(f"unmatched ']' in hostlist at position {i}: {text[:80]!r}")
        elif depth == 0 and (ch == "," or ch.isspace()):
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _error(f"unclosed '[' in hostlist {text[:80]!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _bracket_ranges(body: str, item: str) -> list[tuple[int, int, int]]:
    """``"001-003,7"`` -> [(1, 3, 3), (7, 7, 1)] as (lo, hi, width)."""
    ranges = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if not m:
            raise _error(
                f"invalid range {part!r} in {item!r}: expected N or LO-HI (at most 18 digits)"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise _error(f"range {part!r} in {item!r} ends before it starts")
        ranges.append((lo, hi, len(lo_text)))
    return ranges


def _expand_item(item: str, budget: int, limit: int) -> list[str]:
    pieces = _BRACKET.split(item)  # literal, body, literal, body, ..., literal
    literals, bodies = pieces[0::2], pieces[1::2]
    for lit in literals:
        if "[" in lit or "]" in lit:
            raise _error(f"unbalanced brackets in {item!r}")
        if not lit.isprintable():
            raise _error(f"control characters in host name {item!r}")
    choices: list[list[tuple[int, int, int]]] = [_bracket_ranges(b, item) for b in bodies]
    count = 1
    for ranges in choices:
        count *= sum(hi - lo + 1 for lo, hi, _ in ranges)
        if count > budget:
            raise _error(
                f"hostlist expands to more than {limit} names",
                hint="Split the hostlist, or give a smaller range.",
            )
    numbers = [
        [f"{n:0{w}d}" for lo, hi, w in ranges for n in range(lo, hi + 1)] for ranges in choices
    ]
    out = []
    for combo in itertools.product(*numbers):
        parts = [literals[0]]
        for num, lit in zip(combo, literals[1:], strict=True):
            parts += [num, lit]
        out.append("".join(parts))
    return out


def expand_hostlist(text: str, *, limit: int = MAX_HOSTS) -> list[str]:
    """``"node[001-002],gpu1"`` -> ``["node001", "node002", "gpu1"]`` in written order.

    Duplicates are kept (as ``scontrol show hostnames``). Raises :class:`SlurmSyntaxError`
    for malformed text or more than ``limit`` (at most :data:`MAX_HOSTS`) names.
    """
    s = str(text)
    if len(s) > MAX_TEXT:
        raise _error(f"hostlist text is too long ({len(s)} characters)")
    limit = min(limit, MAX_HOSTS)
    out: list[str] = []
    for item in _split_items(s):
        out.extend(_expand_item(item, limit - len(out), limit))
    return out


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise _error(f"invalid host name {name!r}", hint="Host names are non-empty strings.")
    if _FORBIDDEN & set(name) or not name.isprintable() or any(c.isspace() for c in name):
        raise _error(
            f"host name {name!r} contains a comma, bracket, space or control character",
            hint="Such names cannot be written in a Slurm hostlist.",
        )
    return name


def _split_name(name: str) -> tuple[str, str | None]:
    m = _NAME.match(name)
    if not m or len(m.group(2)) > _MAX_DIGITS:
        return name, None
    return m.group(1), m.group(2)


def hostname_sort_key(name: str) -> tuple[str, int, int, int]:
    """Slurm's hostlist order: prefix, then number, then digit width; bare names first."""
    prefix, digits = _split_name(name)
    if digits is None:
        return (prefix, 0, 0, 0)
    return (prefix, 1, int(digits), len(digits))


def _render_group(prefix: str, numbers: list[str]) -> str:
    ranges: list[list[str]] = []  # [lo_text, hi_text]
    for num in numbers:
        if ranges:
            lo, hi = ranges[-1]
            if int(num) == int(hi) + 1 and num == str(int(num)).zfill(len(lo)):
                ranges[-1][1] = num
                continue
        ranges.append([num, num])
    plain = ",".join(prefix + n for n in numbers)
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return plain
    body = ",".join(lo if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
    bracketed = f"{prefix}[{body}]"
    return bracketed if len(bracketed) <= len(plain) else plain


def compress_hostlist(names: Iterable[str], *, sort: bool = False) -> str:
    """``["node001", "node002", "node003", "gpu1"]`` -> ``"node[001-003],gpu1"``.

    Keeps order and duplicates unless ``sort`` (then: unique, :func:`hostname_sort_key`
    order). Raises :class:`SlurmSyntaxError` for names a hostlist cannot carry.
    """
    checked = [_check_name(n) for n in names]
    if sort:
        checked = sorted(set(checked), key=hostname_sort_key)
    parts: list[str] = []
    group_prefix: str | None = None
    group: list[str] = []
    for name in checked:
        prefix, digits = _split_name(name)
        if digits is not None and prefix == group_prefix:
            group.append(digits)
            continue
        if group_prefix is not None:
            parts.append(_render_group(group_prefix, group))
        if digits is None:
            parts.append(name)
            group_prefix, group = None, []
        else:
            group_prefix, group = prefix, [digits]
    if group_prefix is not None:
        parts.append(_render_group(group_prefix, group))
    return ",".join(parts)


def slurm_env_nodelist(nodes: Iterable[str]) -> str:
    """The ``SLURM_NODELIST``/``SLURM_JOB_NODELIST`` value for an allocation's nodes:
    compressed, unique, in Slurm's node order (see the module docstring)."""
    return compress_hostlist(nodes, sort=True)
