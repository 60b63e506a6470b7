"""Real MPI programs for the PMI tests, compiled with the installed ``mpicc``.

Shared by ``test_pmi_mpich.py`` (the pure core behind a minimal threaded shell) and
``test_pmi_server.py`` (the asyncio shell), so both run the same MPICH client code.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MPICC = shutil.which("mpicc")
needs_mpicc = pytest.mark.skipif(
    MPICC is None,
    reason="mpicc not installed (apt-get install mpich libmpich-dev to run the real-MPICH tests)",
)

ALLREDUCE = r"""
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int rank, size, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank=%d size=%d sum=%d\n", rank, size, sum);
    fflush(stdout);
    MPI_Finalize();
    return 0;
}
"""

ABORT = r"""
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int rank, x = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 1) {
        MPI_Abort(MPI_COMM_WORLD, 7);
    }
    /* never satisfied: rank 1 aborts instead of sending */
    MPI_Recv(&x, 1, MPI_INT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Finalize();
    return 0;
}
"""


def compile_mpi(tmp_path: Path, name: str, source: str) -> Path:
    assert MPICC is not None
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    binary = tmp_path / name
    subprocess.run(
        [MPICC, str(src), "-o", str(binary)], check=True, capture_output=True, timeout=120
    )
    return binary
