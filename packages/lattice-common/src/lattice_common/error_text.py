"""How an error reads to a person: ``Error: <message>`` / ``  <Key>: <value>`` / ``Hint: <hint>``.

One implementation for every program that prints errors (the CLI, the SDK's exceptions,
the core's :class:`lattice_common.errors.LatticeError`, RM-Replay), so the format cannot
drift between them. Only ``typing`` is imported: the CLI and the SDK load this module on
every run and must not pay for msgspec or pydantic to print an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


def detail_label(key: object) -> str:
    """``gpu_hours_budget`` -> ``Gpu hours budget``: underscores become spaces and only the
    first letter is raised (``str.capitalize`` would lower the rest, e.g. of ``GPU``)."""
    label = str(key).replace("_", " ")
    return label[:1].upper() + label[1:]


def render_error(message: str, details: Mapping[str, Any] | None = None, hint: str = "") -> str:
    """The lines of an error for a person, joined with newlines (no trailing newline).

    ::

        Error: <message>
          <Key>: <value>        (one line per detail, in order)
        Hint: <hint>            (only when there is one)
    """
    lines = [f"Error: {message}"]
    for key, value in (details or {}).items():
        lines.append(f"  {detail_label(key)}: {value}")
    if hint:
        lines.append(f"Hint: {hint}")
    return "\n".join(lines)
