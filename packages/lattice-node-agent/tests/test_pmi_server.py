"""The asyncio PMI shell (``lattice_agent.pmi.server``) against real MPICH ranks.

Why real MPICH: the shell's job is the plumbing around the pure core
(socketpairs, process groups, the fence hand-off, aborts); only real
``MPI_Init``/``MPI_Abort`` traffic shows that the plumbing neither
deadlocks nor leaves ranks behind.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from lattice_agent.pmi import FenceReady
from lattice_agent.pmi.server import FENCE_TIMEOUT_REASON, LaunchResult, LocalLaunch, OutputLine
from lattice_agent.procgroup import group_members
from mpi_programs import ABORT, ALLREDUCE, compile_mpi, needs_mpicc


def _assert_no_rank_left(result: LaunchResult) -> None:
    assert result.rank_pids
    for pid in result.rank_pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # nothing else is left in the rank's process group either
        assert not group_members(pid), f"process group {pid} still has members"


async def _run(launch: LocalLaunch, timeout: float = 30.0) -> LaunchResult:
    return await asyncio.wait_for(launch.run(), timeout)


@needs_mpicc
async def test_four_ranks_allreduce(tmp_path: Path) -> None:
    binary = compile_mpi(tmp_path, "allreduce", ALLREDUCE)
    fences: list[int] = []

    async def fence(ready: FenceReady) -> Mapping[str, str]:
        fences.append(ready.epoch)
        return ready.puts

    launch = LocalLaunch([str(binary)], range(4), 4, launch_id="l-allreduce", fence=fence)
    result = await _run(launch)

    assert result.exit_status == 0, (result, [o.prefixed for o in result.output])
    assert not result.aborted
    assert result.rank_exit_codes == {0: 0, 1: 0, 2: 0, 3: 0}
    lines = sorted(o.prefixed for o in result.output if o.stream == "stdout")
    assert lines == [f"[{r}] rank={r} size=4 sum=10" for r in range(4)], result.output
    assert fences and fences[0] == 0, "MPI_Init must go through the fence callable"
    assert launch.launch.finished
    _assert_no_rank_left(result)


@needs_mpicc
async def test_mpi_abort_kills_every_rank(tmp_path: Path) -> None:
    binary = compile_mpi(tmp_path, "abort", ABORT)
    launch = LocalLaunch([str(binary)], range(3), 3, launch_id="l-abort")
    result = await _run(launch)

    assert result.aborted
    assert result.exit_status == 7, result
    assert result.abort_rank == 1
    # the ranks stuck in MPI_Recv were killed (SIGKILL -> 137)
    assert result.rank_exit_codes[0] == 137
    assert result.rank_exit_codes[2] == 137
    _assert_no_rank_left(result)


@needs_mpicc
async def test_fence_timeout_aborts_launch(tmp_path: Path) -> None:
    binary = compile_mpi(tmp_path, "allreduce", ALLREDUCE)

    async def never(ready: FenceReady) -> Mapping[str, str]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    launch = LocalLaunch(
        [str(binary)], range(2), 2, launch_id="l-timeout", fence=never, fence_timeout=1.0
    )
    result = await _run(launch)

    assert result.aborted
    assert result.exit_status != 0
    assert result.reason == FENCE_TIMEOUT_REASON
    _assert_no_rank_left(result)


async def test_non_mpi_program_output_prefixed(tmp_path: Path) -> None:
    seen: list[OutputLine] = []
    launch = LocalLaunch(
        ["/bin/echo", "hi"], [0, 1], 2, launch_id="l-echo", cwd=tmp_path, on_output=seen.append
    )
    result = await _run(launch)

    assert result.exit_status == 0
    assert result.rank_exit_codes == {0: 0, 1: 0}
    assert sorted(o.prefixed for o in seen) == ["[0] hi", "[1] hi"]
    assert all(o.stream == "stdout" for o in seen)
    _assert_no_rank_left(result)


async def test_env_and_exit_status(tmp_path: Path) -> None:
    script = (
        'echo "$PMI_RANK $PMI_SIZE $PMI_SPAWNED $LATTICE_LAUNCH_ID '
        '$LATTICE_LOCAL_RANK $LATTICE_LOCAL_SIZE $LATTICE_NPROCS ${PMI_FD:+fd}"; '
        'echo err >&2; [ "$PMI_RANK" = 3 ] && exit 5; exit 0'
    )
    launch = LocalLaunch(
        ["/bin/sh", "-c", script], [2, 3], 8, launch_id="l-env", kill_on_bad_exit=False
    )
    result = await _run(launch)

    assert result.exit_status == 5
    assert result.rank_exit_codes == {2: 0, 3: 5}
    assert not result.aborted
    out = sorted(o.prefixed for o in result.output if o.stream == "stdout")
    assert out == ["[2] 2 8 0 l-env 0 2 8 fd", "[3] 3 8 0 l-env 1 2 8 fd"]
    err = sorted(o.prefixed for o in result.output if o.stream == "stderr")
    assert err == ["[2] err", "[3] err"]


async def test_failed_rank_ends_the_launch(tmp_path: Path) -> None:
    exits: list[tuple[int, int]] = []
    script = '[ "$PMI_RANK" = 1 ] && exit 3; exec sleep 60'
    launch = LocalLaunch(
        ["/bin/sh", "-c", script],
        [0, 1],
        2,
        launch_id="l-bad",
        on_rank_exit=lambda rank, code: exits.append((rank, code)),
    )
    result = await asyncio.wait_for(launch.run(), 20)

    assert result.aborted and result.abort_rank == 1
    assert result.exit_status == 3
    assert result.reason == "rank 1 exited with code 3"
    assert result.rank_exit_codes == {0: 137, 1: 3}
    assert sorted(exits) == [(0, 137), (1, 3)]
    _assert_no_rank_left(result)


async def test_pmi_off_sets_no_pmi_variables(tmp_path: Path) -> None:
    launch = LocalLaunch(
        ["/bin/sh", "-c", 'echo "${PMI_FD:-none} ${PMI_RANK:-none} $LATTICE_RANK"'],
        [4],
        5,
        launch_id="l-nopmi",
        pmi=False,
    )
    result = await _run(launch)
    assert result.exit_status == 0
    assert [o.prefixed for o in result.output] == ["[4] none none 4"]


async def test_cancel_kills_ranks(tmp_path: Path) -> None:
    launch = LocalLaunch(["/bin/sleep", "60"], [0, 1], 2, launch_id="l-cancel")
    task = asyncio.create_task(launch.run())
    for _ in range(100):
        await asyncio.sleep(0.02)
        if all(r.proc is not None for r in launch._rank.values()) and len(launch._rank) == 2:
            break
    pids = [r.proc.pid for r in launch._rank.values() if r.proc is not None]
    assert len(pids) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not group_members(pid)


async def test_missing_executable(tmp_path: Path) -> None:
    launch = LocalLaunch([str(tmp_path / "nope")], [0], 1, launch_id="l-missing")
    result = await _run(launch)
    assert result.aborted
    assert result.exit_status == 127
    assert "could not start" in result.reason
