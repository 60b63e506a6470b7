"""What every operation module shares: turning a rejected command into its error."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.errors import LatticeError


def raise_if_error(res: c.CommandResult) -> c.CommandResult:
    """The result of a committed command, or its typed error (with hint) raised."""
    if res.error is not None:
        raise LatticeError.from_dict(res.error)
    return res


__all__ = ["raise_if_error"]
