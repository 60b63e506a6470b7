"""The agent's PMI-2 server against Slurm's independent client library, ``libpmi2``.

Why a second client: MPICH's PMI-2 code and ours could share a misreading
of the protocol (frame alignment, ``thrid``, the PMI-1 ``init`` handshake,
reply keys); Slurm's ``libpmi2`` is a separate implementation, so a plain C
program linked with ``-lpmi2`` that completes init, put, fence, get and
finalize (and whose ``PMI2_Abort`` takes the launch down) shows that the
server speaks PMI-2 as clients other than MPICH expect it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from lattice_agent.pmi.server import LaunchResult, LocalLaunch
from lattice_agent.procgroup import group_members
from mpi_programs import compile_libpmi2, needs_libpmi2


def _assert_no_rank_left(result: LaunchResult) -> None:
    assert result.rank_pids
    for pid in result.rank_pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not group_members(pid), f"process group {pid} still has members"


async def _run(launch: LocalLaunch, timeout: float = 30.0) -> LaunchResult:
    return await asyncio.wait_for(launch.run(), timeout)


def _lines(result: LaunchResult, stream: str) -> list[str]:
    return sorted(o.prefixed for o in result.output if o.stream == stream)


@pytest.fixture(scope="module")
def libpmi2_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_libpmi2(tmp_path_factory.mktemp("libpmi2"))


@needs_libpmi2
@pytest.mark.parametrize("size", [2, 4])
async def test_libpmi2_init_put_fence_get_finalize(libpmi2_client: Path, size: int) -> None:
    launch = LocalLaunch(
        [str(libpmi2_client)], range(size), size, launch_id=f"l-pmi2-{size}", fence_timeout=20.0
    )
    result = await _run(launch)

    diag = (result, [o.prefixed for o in result.output])
    assert result.exit_status == 0, diag
    assert not result.aborted, diag
    assert result.rank_exit_codes == dict.fromkeys(range(size), 0), diag
    out = _lines(result, "stdout")
    for r in range(size):
        assert f"[{r}] rank {r} size {size} spawned 0 appnum 0" in out, diag
        assert f"[{r}] rank {r} universe {size} mapping (vector,(0,1,{size}))" in out, diag
        assert f"[{r}] rank {r} ok" in out, diag
    assert _lines(result, "stderr") == [], diag
    assert launch.launch.epoch == 1, "exactly one PMI2_KVS_Fence"
    assert launch.launch.finished, "every rank sent finalize"
    _assert_no_rank_left(result)


@needs_libpmi2
async def test_libpmi2_abort_kills_every_rank(libpmi2_client: Path) -> None:
    size = 3
    launch = LocalLaunch(
        [str(libpmi2_client), "abort"],
        range(size),
        size,
        launch_id="l-pmi2-abort",
        fence_timeout=20.0,
    )
    result = await _run(launch)

    diag = (result, [o.prefixed for o in result.output])
    assert result.aborted, diag
    assert result.abort_rank == 1, diag
    assert result.exit_status != 0, diag
    assert "boom" in result.reason, diag
    assert "[1] rank 1 aborting" in _lines(result, "stdout"), diag
    # the ranks blocked in the second fence were killed (SIGKILL -> 137)
    for r in (0, 2):
        assert result.rank_exit_codes[r] == 137, diag
    # neither PMI2_Abort nor the second fence may return to the program
    assert not any("returned" in line for line in _lines(result, "stderr")), diag
    _assert_no_rank_left(result)
