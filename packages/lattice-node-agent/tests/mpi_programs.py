"""Real MPI programs for the PMI tests, compiled with the installed ``mpicc``.

Shared by ``test_pmi_mpich.py`` (the pure core behind a minimal threaded shell) and
``test_pmi_server.py`` (the asyncio shell), so both run the same MPICH client code.
``test_pmi2_libpmi.py`` uses the libpmi2 program at the end, a second, independent
PMI-2 client (Slurm's ``libpmi2``, built with plain ``cc -lpmi2``).
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


# --------------------------------------------------------------------------- libpmi2

CC = shutil.which("cc") or shutil.which("gcc")
#: Debian's libpmi2-0-dev installs the header as <slurm/pmi2.h>
LIBPMI2_INCLUDE = next(
    (
        d
        for d in (Path("/usr/include/slurm"), Path("/usr/local/include/slurm"))
        if (d / "pmi2.h").is_file()
    ),
    None,
)
needs_libpmi2 = pytest.mark.skipif(
    CC is None or LIBPMI2_INCLUDE is None,
    reason="cc or slurm/pmi2.h missing (apt-get install libpmi2-0-dev to run the libpmi2 tests)",
)

#: ``prog``: init, put, fence, get every other rank's key, job attributes, finalize.
#: ``prog abort``: rank 1 calls PMI2_Abort after a fence; the others block in a second fence.
LIBPMI2 = r"""
#include <pmi2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(call)                                                                 \
    do {                                                                            \
        int rc_ = (call);                                                           \
        if (rc_ != PMI2_SUCCESS) {                                                  \
            fprintf(stderr, "rank %d: %s failed rc=%d\n", rank, #call, rc_);        \
            fflush(stderr);                                                         \
            exit(3);                                                                \
        }                                                                           \
    } while (0)

int main(int argc, char **argv) {
    int spawned = -1, size = -1, rank = -1, appnum = -1;
    int abort_mode = argc > 1 && strcmp(argv[1], "abort") == 0;
    char jobid[PMI2_MAX_VALLEN], key[PMI2_MAX_KEYLEN], val[PMI2_MAX_VALLEN];
    char want[PMI2_MAX_VALLEN], universe[PMI2_MAX_ATTRVALUE], attr[PMI2_MAX_ATTRVALUE];
    int vallen = 0, found = 0;

    CHECK(PMI2_Init(&spawned, &size, &rank, &appnum));
    printf("rank %d size %d spawned %d appnum %d\n", rank, size, spawned, appnum);
    fflush(stdout);
    if (!PMI2_Initialized()) {
        fprintf(stderr, "rank %d: PMI2_Initialized() is false after PMI2_Init\n", rank);
        return 4;
    }
    CHECK(PMI2_Job_GetId(jobid, sizeof jobid));
    snprintf(key, sizeof key, "key-%d", rank);
    snprintf(val, sizeof val, "val-%d", rank);
    CHECK(PMI2_KVS_Put(key, val));
    CHECK(PMI2_KVS_Fence());

    if (abort_mode) {
        if (rank == 1) {
            printf("rank %d aborting\n", rank);
            fflush(stdout);
            PMI2_Abort(1, "boom");
            fprintf(stderr, "rank %d: PMI2_Abort returned\n", rank);
            return 5;
        }
        /* never completes: rank 1 aborts instead of entering the fence */
        PMI2_KVS_Fence();
        fprintf(stderr, "rank %d: second fence returned\n", rank);
        return 6;
    }

    for (int r = 0; r < size; r++) {
        if (r == rank)
            continue;
        snprintf(key, sizeof key, "key-%d", r);
        snprintf(want, sizeof want, "val-%d", r);
        memset(val, 0, sizeof val);
        vallen = -1;
        CHECK(PMI2_KVS_Get(jobid, PMI2_ID_NULL, key, val, sizeof val, &vallen));
        if (strcmp(val, want) != 0 || vallen != (int)strlen(want)) {
            fprintf(stderr, "rank %d: %s = '%s' (vallen %d), want '%s'\n", rank, key, val,
                    vallen, want);
            return 7;
        }
    }
    CHECK(PMI2_Info_GetJobAttr("universeSize", universe, sizeof universe, &found));
    if (!found || atoi(universe) != size) {
        fprintf(stderr, "rank %d: universeSize found=%d value '%s'\n", rank, found, universe);
        return 8;
    }
    found = 0;
    CHECK(PMI2_Info_GetJobAttr("PMI_process_mapping", attr, sizeof attr, &found));
    if (!found || strncmp(attr, "(vector,", 8) != 0) {
        fprintf(stderr, "rank %d: PMI_process_mapping found=%d value '%s'\n", rank, found, attr);
        return 9;
    }
    printf("rank %d universe %s mapping %s\n", rank, universe, attr);
    printf("rank %d ok\n", rank);
    fflush(stdout);
    CHECK(PMI2_Finalize());
    return 0;
}
"""


def compile_libpmi2(tmp_path: Path, name: str = "libpmi2_client", source: str = LIBPMI2) -> Path:
    """Build ``source`` against Slurm's libpmi2 (``cc -I<slurm include> ... -lpmi2``)."""
    assert CC is not None and LIBPMI2_INCLUDE is not None
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    binary = tmp_path / name
    proc = subprocess.run(
        [CC, "-std=gnu99", "-Wall", f"-I{LIBPMI2_INCLUDE}", str(src), "-o", str(binary), "-lpmi2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"libpmi2 program failed to compile:\n{proc.stderr}"
    return binary
