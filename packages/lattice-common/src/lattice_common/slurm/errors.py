"""The one error type the Slurm translators raise.

Translators read text written for Slurm (``#SBATCH`` values, ``SLURM_NODELIST``
strings); anything they cannot translate becomes a :class:`SlurmSyntaxError`, so callers
catch one type. It is a :class:`~lattice_common.errors.ValidationError` (rendered and
mapped to HTTP 400 / gRPC INVALID_ARGUMENT like every other bad input, with a hint) and
also a :class:`ValueError`, the conventional type for "bad value" in plain Python code.
"""

from __future__ import annotations

from lattice_common.errors import ValidationError


class SlurmSyntaxError(ValidationError, ValueError):
    """Slurm-syntax input that is malformed, too large, or has no Lattice equivalent."""
