"""spawn.py: ids, job names, the LATTICE_*/SLURM_* environment and a real wrapper in its own
session that records the exit status in a file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from lattice_agent.spawn import (
    AllocPaths,
    check_alloc_id,
    environment,
    job_name,
    read_exit_file,
    spawn,
)
from lattice_common.types import Allocation, AllocationSpec

pytestmark = pytest.mark.timeout(30)


def make_alloc(aid: str, entrypoint: str, **spec: object) -> Allocation:
    return Allocation(
        id=aid, spec=AllocationSpec(entrypoint=entrypoint, tenant="t", vcluster="v", **spec)
    )


def wait_status(pid: int) -> int:
    deadline = time.monotonic() + 10
    while True:
        wpid, status = os.waitpid(pid, os.WNOHANG)
        if wpid == pid:
            return os.waitstatus_to_exitcode(status)
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x\0y", "x" * 201])
def test_ids_that_are_not_one_directory_name_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not usable as a directory name"):
        check_alloc_id(bad)


def test_usable_ids_pass() -> None:
    check_alloc_id("alloc-1.2_x")


@pytest.mark.parametrize(
    ("entrypoint", "name", "expected"),
    [
        ("/usr/bin/python train.py", "", "python"),
        ("echo 'unbalanced", "", "echo"),
        ("", "", "job"),
        ("sleep 1", "train", "train"),
    ],
)
def test_job_name(entrypoint: str, name: str, expected: str) -> None:
    assert job_name(make_alloc("a", entrypoint, name=name)) == expected


def test_environment_has_lattice_and_slurm_variables() -> None:
    alloc = make_alloc("a1", "run", env={"FOO": "bar", "LATTICE_ALLOC_ID": "spoofed"})
    env = environment(alloc, ["n0", "n1", "n2"], "n1", "/submit", Path("/work/a1"))
    assert env["FOO"] == "bar"
    assert env["LATTICE_ALLOC_ID"] == env["SLURM_JOB_ID"] == "a1"  # ours win over the spec's
    assert env["LATTICE_NODELIST"] == "n0,n1,n2"
    # Slurm's compressed hostlist form, as sbatch jobs see it
    assert env["SLURM_JOB_NODELIST"] == env["SLURM_NODELIST"] == "n[0-2]"
    assert env["SLURM_JOBID"] == "a1" and env["SLURM_JOB_NUM_NODES"] == "3"
    assert env["LATTICE_NNODES"] == env["SLURM_NNODES"] == "3"
    assert env["LATTICE_JOB_NAME"] == env["SLURM_JOB_NAME"] == "run"
    assert env["LATTICE_SUBMIT_DIR"] == env["SLURM_SUBMIT_DIR"] == "/submit"
    assert env["LATTICE_WORK_DIR"] == "/work/a1"
    assert env["LATTICE_NODE_ID"] == "n1"
    assert env["SLURM_NODEID"] == "1"
    assert "SLURM_NODEID" not in environment(alloc, ["n0"], "n9", "/s", Path("/w"))


def test_slurm_task_variables_come_from_the_sbatch_tags() -> None:
    alloc = make_alloc("a2", "run")
    alloc.spec.tags.update({"ntasks": "8", "ntasks_per_node": "4", "cpus_per_task": "16"})
    nodes = ["nid001", "nid002", "nid004"]
    env = environment(alloc, nodes, "nid002", "/s", Path("/w"))
    assert env["SLURM_NODELIST"] == "nid[001-002,004]"
    assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == env["LATTICE_NPROCS"] == "8"
    assert env["SLURM_NTASKS_PER_NODE"] == "4"
    assert env["SLURM_CPUS_PER_TASK"] == "16"
    plain = environment(make_alloc("a3", "run"), nodes, "nid002", "/s", Path("/w"))
    assert "SLURM_NTASKS" not in plain and "SLURM_CPUS_PER_TASK" not in plain


def test_slurm_variables_only_with_compat_slurm_env() -> None:
    alloc = make_alloc("a4", "run", env={"SLURM_ARRAY_TASK_ID": "3"})
    alloc.spec.tags["ntasks"] = "2"
    env = environment(alloc, ["n0", "n1"], "n0", "/s", Path("/w"), slurm_env=False)
    assert env["LATTICE_ALLOC_ID"] == "a4" and env["LATTICE_NPROCS"] == "2"
    ours = {k for k in env if k.startswith("SLURM_")} - {
        k for k in os.environ if k.startswith("SLURM_")
    }
    assert ours == {"SLURM_ARRAY_TASK_ID"}  # the task group's own env is the spec's


def test_read_exit_file(tmp_path: Path) -> None:
    f = tmp_path / "exit_code"
    assert read_exit_file(f) is None
    f.write_text("3\n")
    assert read_exit_file(f) == 3
    f.write_text("garbage")
    assert read_exit_file(f) is None


def test_paths_layout() -> None:
    p = AllocPaths.of("a1", Path("/w"), Path("/l"))
    assert p == AllocPaths(
        work_dir=Path("/w/a1"),
        stdout=Path("/l/a1/stdout.log"),
        stderr=Path("/l/a1/stderr.log"),
        exit_file=Path("/w/a1/exit_code"),
    )
    assert (p.log("stdout"), p.log("stderr")) == (p.stdout, p.stderr)


def test_spawn_runs_the_wrapper_in_its_own_session(tmp_path: Path) -> None:
    paths = AllocPaths.of("s1", tmp_path / "work", tmp_path / "logs")
    paths.stdout.parent.mkdir(parents=True)
    paths.stdout.write_text("earlier run\n")
    launched = spawn(
        make_alloc("s1", 'echo "$LATTICE_ALLOC_ID"; echo err >&2; pwd; exit 5'),
        ["n1"],
        "n1",
        paths,
    )
    assert os.getpgid(launched.pid) == launched.pid
    assert os.getsid(launched.pid) == launched.pid
    assert launched.offsets == {"stdout": len("earlier run\n"), "stderr": 0}
    assert launched.cwd == str(paths.work_dir)
    assert wait_status(launched.pid) == 5
    assert read_exit_file(paths.exit_file) == 5
    assert paths.stdout.read_text() == f"earlier run\ns1\n{paths.work_dir}\n"
    assert paths.stderr.read_text() == "err\n"


def test_the_job_starts_with_default_signal_dispositions(tmp_path: Path) -> None:
    """What the agent ignores (SIGHUP, SIGINT, SIGPIPE) or handles (SIGUSR2) is the
    default again in the job: an ignored disposition would otherwise survive exec."""
    import signal

    wanted = (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGUSR2)
    before = {s: signal.getsignal(s) for s in wanted}
    for s in wanted[:3]:
        signal.signal(s, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        paths = AllocPaths.of("sig", tmp_path / "work", tmp_path / "logs")
        launched = spawn(
            make_alloc("sig", "grep -E '^Sig(Ign|Cgt):' /proc/self/status"), [], "n1", paths
        )
        assert wait_status(launched.pid) == 0
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    masks = dict(line.split(":") for line in paths.stdout.read_text().splitlines())
    for name in ("SigIgn", "SigCgt"):
        mask = int(masks[name], 16)
        assert not [s.name for s in wanted if mask >> (s - 1) & 1], name


def test_spawn_uses_an_existing_submit_dir(tmp_path: Path) -> None:
    submit = tmp_path / "submit"
    submit.mkdir()
    paths = AllocPaths.of("s2", tmp_path / "work", tmp_path / "logs")
    launched = spawn(make_alloc("s2", "pwd", submit_dir=str(submit)), [], "n1", paths)
    assert launched.cwd == str(submit)
    assert wait_status(launched.pid) == 0
    assert paths.stdout.read_text() == f"{submit}\n"


def test_spawn_with_an_unusable_environment_raises(tmp_path: Path) -> None:
    paths = AllocPaths.of("s3", tmp_path / "work", tmp_path / "logs")
    with pytest.raises(ValueError):
        spawn(make_alloc("s3", "true", env={"BAD=NAME": "x"}), ["n1"], "n1", paths)


def test_sbatch_output_files_are_the_job_output_live(tmp_path: Path) -> None:
    submit = tmp_path / "submit"
    submit.mkdir()
    paths = AllocPaths.of("a1b2", tmp_path / "work", tmp_path / "logs")
    alloc = make_alloc(
        "a1b2",
        "echo out; echo err >&2",
        name="train",
        submit_dir=str(submit),
        tags={"slurm_output": "logs/%x-%j.out", "slurm_error": "logs/%x-%j.err"},
    )
    launched = spawn(alloc, ["n1"], "n1", paths)
    assert wait_status(launched.pid) == 0
    out, err = submit / "logs" / "train-a1b2.out", submit / "logs" / "train-a1b2.err"
    assert out.read_text() == "out\n" and err.read_text() == "err\n"
    assert out.stat().st_ino == paths.stdout.stat().st_ino  # the same file: it fills live


def test_an_output_file_that_cannot_be_made_is_said_in_stderr(tmp_path: Path) -> None:
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "blocked").write_text("a file, not a directory")
    paths = AllocPaths.of("c3d4", tmp_path / "work", tmp_path / "logs")
    alloc = make_alloc(
        "c3d4", "true", submit_dir=str(submit), tags={"slurm_output": "blocked/%j.out"}
    )
    launched = spawn(alloc, ["n1"], "n1", paths)
    assert wait_status(launched.pid) == 0
    assert f"[lattice] could not create {submit}/blocked/c3d4.out for stdout" in (
        paths.stderr.read_text()
    )
