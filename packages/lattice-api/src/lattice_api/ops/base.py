"""What every operation module shares: turning a rejected command into its error, and
finding an allocation the caller may see."""

from __future__ import annotations

from typing import Any

from lattice_common import commands as c
from lattice_common.errors import LatticeError, NotFound
from lattice_common.types import Allocation
from lattice_quorum import queries

from lattice_api import access
from lattice_api.auth import Identity


def raise_if_error(res: c.CommandResult) -> c.CommandResult:
    """The result of a committed command, or its typed error (with hint) raised."""
    if res.error is not None:
        raise LatticeError.from_dict(res.error)
    return res


def visible_allocation(quorum: Any, who: Identity, alloc_id: str) -> Allocation:
    """The allocation, when ``who`` may see it (lattice_api.access.can_read); NotFound
    otherwise, the same answer as for an id that does not exist (ids cannot be probed)."""
    quorum.require_caught_up()
    a = quorum.read(queries.allocation, alloc_id)
    if a is None or not access.can_read(who, a):
        raise NotFound(
            f"allocation {alloc_id} not found",
            hint="List your allocations with `lattice status`.",
        )
    return a


__all__ = ["raise_if_error", "visible_allocation"]
