"""Pure translators from Slurm syntax to Lattice: hostlists, job arrays, dependencies
and output filename patterns.

Plain functions on plain data, no I/O, so the CLI, the API's compat layer and the node
agent (which sets ``SLURM_*`` variables) share one reading of Slurm's formats. Every
function raises only :class:`SlurmSyntaxError` (a ``ValueError`` and a
:class:`~lattice_common.errors.ValidationError`) on bad input.
"""

from lattice_common.slurm.array import MAX_ARRAY_SIZE, ArraySpec, parse_array, to_task_group
from lattice_common.slurm.dependency import (
    CONDITIONS,
    DependencyClause,
    parse_dependency,
    split_job_ref,
    to_depends_on,
)
from lattice_common.slurm.errors import SlurmSyntaxError
from lattice_common.slurm.hostlist import (
    MAX_HOSTS,
    compress_hostlist,
    expand_hostlist,
    hostname_sort_key,
    slurm_env_nodelist,
)
from lattice_common.slurm.patterns import NO_ARRAY_INDEX, expand_output_pattern

__all__ = [
    "CONDITIONS",
    "MAX_ARRAY_SIZE",
    "MAX_HOSTS",
    "NO_ARRAY_INDEX",
    "ArraySpec",
    "DependencyClause",
    "SlurmSyntaxError",
    "compress_hostlist",
    "expand_hostlist",
    "expand_output_pattern",
    "hostname_sort_key",
    "parse_array",
    "parse_dependency",
    "slurm_env_nodelist",
    "split_job_ref",
    "to_depends_on",
    "to_task_group",
]
