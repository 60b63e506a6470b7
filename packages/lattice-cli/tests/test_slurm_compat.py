"""The Slurm migration surface: `lattice sbatch` over a corpus of realistic scripts against
the real API (each stored spec compared field by field with its expected translation),
squeue/sacct/history formats, scancel, srun refusals, salloc's refusals (salloc itself is a session: test_session_cluster.py), and `compat-aliases` in bash."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any

import pytest
from lattice_cli import slurm_cli
from lattice_cli.main import app, load_commands
from lattice_common.types import AllocationState
from typer.testing import CliRunner

load_commands()

GPU = {"gpu_type": "A100", "gpu_count": 4, "memory_gb": 512, "features": ["ib", "nvme"]}


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


@pytest.fixture
def cluster(api, monkeypatch, tmp_path):
    cfg = tmp_path / "lattice.yaml"
    cfg.write_text(
        "tenant: physics\nvcluster: hpc-batch\npartition_map:\n  gpu: ml-training\n"
        "qos_map:\n  gold: 8\n"
    )
    monkeypatch.setenv("LATTICE_CONFIG", str(cfg))
    monkeypatch.setenv("USER", "alice")
    monkeypatch.setenv("PROJECT_DATA", "/scratch/data")
    monkeypatch.chdir(tmp_path)
    api.names(tenants=("physics", "chem"), vclusters=("hpc-batch", "ml-training", "debug"))
    api.nodes(*(f"nid{i:03d}" for i in range(1, 9)), capabilities=GPU)
    return api


# (name, script, extra command-line args, expected spec fields, expected warnings,
#  expected task group (start, end, concurrency) or None). "{dep}" is a real allocation id.
CORPUS: list[tuple[str, str, list[str], dict[str, Any], list[str], Any]] = [
    (
        "basic",
        "#SBATCH -N 2\n#SBATCH -t 01:00:00\n#SBATCH -J basic\nsrun ./a.out\n",
        [],
        {"nodes": 2, "walltime_seconds": 3600, "name": "basic"},
        [],
        None,
    ),
    (
        "long-forms",
        "#SBATCH --nodes=4\n#SBATCH --time=2-00:00:00\n#SBATCH --job-name=lf\nhostname\n",
        [],
        {"nodes": 4, "walltime_seconds": 172800, "name": "lf"},
        [],
        None,
    ),
    (
        "partition-mapped",
        "#SBATCH -p gpu\n#SBATCH -t 30\nhostname\n",
        [],
        {"vcluster": "ml-training", "walltime_seconds": 1800},
        [],
        None,
    ),
    (
        "partition-by-name",
        "#SBATCH --partition=debug\n#SBATCH -t 10:00\nhostname\n",
        [],
        {"vcluster": "debug", "walltime_seconds": 600},
        [],
        None,
    ),
    ("account", "#SBATCH -A chem\n#SBATCH -t 5\nhostname\n", [], {"tenant": "chem"}, [], None),
    (
        "qos-default-map",
        "#SBATCH --qos=high\n#SBATCH -t 5\nhostname\n",
        [],
        {"preemption_class": 7},
        [],
        None,
    ),
    (
        "qos-site-map",
        "#SBATCH -q gold\n#SBATCH -t 5\nhostname\n",
        [],
        {"preemption_class": 8},
        [],
        None,
    ),
    (
        "qos-unmapped",
        "#SBATCH -q platinum\n#SBATCH -t 5\nhostname\n",
        [],
        {"preemption_class": 5},
        ["no preemption class is mapped"],
        None,
    ),
    (
        "gres",
        "#SBATCH --gres=gpu:4\n#SBATCH -t 1:00:00\npython train.py\n",
        [],
        {"constraints.gpu_count": 4},
        [],
        None,
    ),
    (
        "gres-typed",
        "#SBATCH --gres=gpu:A100:2\n#SBATCH -t 60\npython train.py\n",
        [],
        {"constraints.gpu_count": 2, "constraints.gpu_type": "A100"},
        [],
        None,
    ),
    (
        "mem-and-constraint",
        "#SBATCH --mem=256G\n#SBATCH -C ib&nvme\n#SBATCH -t 60\nhostname\n",
        [],
        {"constraints.memory_gb": 256, "constraints.features": ["ib", "nvme"]},
        [],
        None,
    ),
    (
        "ntasks",
        "#SBATCH --ntasks=16\n#SBATCH --ntasks-per-node=4\n#SBATCH -c 8\n#SBATCH -t 60\n"
        "srun ./mpi\n",
        [],
        {"nodes": 4, "tags.ntasks": "16", "tags.ntasks_per_node": "4", "tags.cpus_per_task": "8"},
        [],
        None,
    ),
    (
        "output-patterns",
        "#SBATCH -o logs/%x-%j.out\n#SBATCH -e logs/%x-%j.err\n#SBATCH -t 5\nhostname\n",
        [],
        {"tags.slurm_output": "logs/%x-%j.out", "tags.slurm_error": "logs/%x-%j.err"},
        [],
        None,
    ),
    (
        "array-throttle",
        "#SBATCH --array=0-9%2\n#SBATCH -t 10\n#SBATCH -o out_%A_%a.txt\n"
        "python task.py $SLURM_ARRAY_TASK_ID\n",
        [],
        {"tags.slurm_output": "out_%A_%a.txt"},
        [],
        (0, 9, 2, 1),
    ),
    ("array-step", "#SBATCH -a 1-7:3\n#SBATCH -t 10\n./run\n", [], {}, [], (1, 7, 0, 3)),
    (
        "dependency",
        "#SBATCH --dependency=afterok:{dep}\n#SBATCH -t 10\n./post\n",
        [],
        {"depends_on": [("{dep}", "success")]},
        [],
        None,
    ),
    (
        "dependency-any",
        "#SBATCH -d afterany:{dep}\n#SBATCH -t 10\n./post\n",
        [],
        {"depends_on": [("{dep}", "any")]},
        [],
        None,
    ),
    (
        "mail-and-exclusive",
        "#SBATCH --mail-type=END,FAIL\n#SBATCH --mail-user=a@b.org\n"
        "#SBATCH --exclusive\n#SBATCH -t 10\nhostname\n",
        [],
        {"nodes": 1},
        ["Lattice sends no mail", "Lattice sends no mail"],
        None,
    ),
    (
        "unsupported",
        "#SBATCH --licenses=matlab:1\n#SBATCH --mem-per-cpu=4G\n#SBATCH --hold\n"
        "#SBATCH --nodes 2\n#SBATCH -t 10\nhostname\n",
        [],
        {"nodes": 2},
        [
            "--licenses is not supported",
            "--mem-per-cpu is not supported",
            "--hold is not supported",
        ],
        None,
    ),
    (
        "export",
        "#SBATCH --export=ALL,OMP_NUM_THREADS=8,PROJECT_DATA\n#SBATCH -t 10\nhostname\n",
        [],
        {"env.OMP_NUM_THREADS": "8", "env.PROJECT_DATA": "/scratch/data"},
        ["do not inherit the submitting environment"],
        None,
    ),
    ("chdir", "#SBATCH -D /tmp\n#SBATCH -t 10\nhostname\n", [], {"submit_dir": "/tmp"}, [], None),
    (
        "cli-overrides",
        "#SBATCH -N 2\n#SBATCH -t 01:00:00\n#SBATCH -J from-script\n#SBATCH -p debug\nhostname\n",
        ["-N", "3", "--time=2:00:00", "-J", "from-cli", "-p", "gpu"],
        {"nodes": 3, "walltime_seconds": 7200, "name": "from-cli", "vcluster": "ml-training"},
        [],
        None,
    ),
    (
        "cli-only",
        "#!/bin/bash\nhostname\n",
        ["-N2", "-t30", "--gres=gpu:1", "--qos=low"],
        {
            "nodes": 2,
            "walltime_seconds": 1800,
            "constraints.gpu_count": 1,
            "preemption_class": 3,
            "entrypoint~": "/bin/bash ",
        },
        [],
        None,
    ),
    (
        "cli-ntasks-over-script",
        "#SBATCH --ntasks-per-node=2\n#SBATCH -N 1\n#SBATCH -t 5\n./x\n",
        ["--ntasks=8"],
        {"nodes": 4, "tags.ntasks": "8"},
        [],
        None,
    ),
    (
        "python-shebang",
        "#!/usr/bin/env python3\n#SBATCH -t 5\nprint('hi')\n",
        [],
        {"entrypoint~": "/usr/bin/env python3 "},
        [],
        None,
    ),
    (
        "directives-stop-at-first-command",
        "#SBATCH -N 2\nhostname\n#SBATCH -N 5\n",
        ["-t", "5"],
        {"nodes": 2},
        [],
        None,
    ),
]


def _field(spec: Any, path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_sbatch_corpus(cluster, tmp_path, case) -> None:
    name, script, extra, expected, warnings, group = case
    dep = cluster.pending(user="alice", vcluster="hpc-batch").id
    script = script.replace("{dep}", dep)
    path = tmp_path / f"{name}.sh"
    path.write_text(script)
    before = set(cluster.allocation_ids())
    r = run("sbatch", *extra, str(path), "arg1")
    assert r.exit_code == 0, r.output
    job_id = r.stdout.strip().removeprefix("Submitted batch job ")
    assert r.stdout.strip() == f"Submitted batch job {job_id}"
    got_warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(got_warnings) == len(warnings), got_warnings
    for want, line in zip(warnings, got_warnings, strict=True):
        assert want in line
    new = [a for i, a in cluster.quorum.state.allocations.items() if i not in before]
    if group:
        start, end, limit, step = group
        assert {a.task_group_id for a in new} == {job_id}
        assert sorted(a.task_index for a in new) == list(range(start, end + 1, step))
        assert all(a.task_group_concurrency == limit for a in new)
        alloc = min(new, key=lambda a: a.task_index)
        assert alloc.spec.env["SLURM_ARRAY_JOB_ID"] == job_id
    else:
        (alloc,) = new
        assert alloc.id == job_id
    spec = alloc.spec
    assert spec.user == "alice"
    assert spec.entrypoint.endswith(f"{path} arg1")
    defaults = {"tenant": "physics", "vcluster": "hpc-batch", "nodes": 1, "preemption_class": 5}
    for key, want in {**defaults, **expected}.items():
        if key == "depends_on":
            assert [(d.ref, d.condition) for d in spec.depends_on] == [
                (ref.replace("{dep}", dep), cond) for ref, cond in want
            ]
        elif key.endswith("~"):
            assert spec.entrypoint.startswith(want)
        else:
            assert _field(spec, key) == want, key


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 20


def test_sbatch_wrap_parsable_and_stdin(cluster) -> None:
    r = run("sbatch", "--parsable", "-N", "2", "-t", "5", "--wrap", "echo hi; hostname")
    assert r.exit_code == 0, r.output
    job_id = r.stdout.strip()
    spec = cluster.quorum.state.allocations[job_id].spec
    assert spec.name == "wrap" and spec.nodes == 2
    assert spec.entrypoint == "/bin/sh -c 'echo hi; hostname'"
    r = run("sbatch", "--parsable", input="#!/bin/bash\n#SBATCH -N 3\n#SBATCH -t 5\nhostname\n")
    assert r.exit_code == 0, r.output
    assert cluster.quorum.state.allocations[r.stdout.strip()].spec.nodes == 3


def test_sbatch_errors_are_clear(cluster, tmp_path) -> None:
    path = tmp_path / "j.sh"
    path.write_text("#SBATCH -t 5\nhostname\n")
    r = run("sbatch", "--no-such-flag", str(path))
    assert r.exit_code == 2 and "unrecognized option '--no-such-flag'" in r.stderr
    r = run("sbatch", "--array=1,2,7", str(path))
    assert r.exit_code == 2 and "--array=1,2,7" in r.stderr
    r = run("sbatch", str(tmp_path / "missing.sh"))
    assert r.exit_code == 2 and "not found" in r.stderr
    assert cluster.allocation_ids() == []


def test_submit_still_reads_the_same_directives(cluster, tmp_path) -> None:
    path = tmp_path / "j.sh"
    path.write_text("#SBATCH -N 2\n#SBATCH -o x.out\n#SBATCH -t 5\nhostname\n")
    r = run("-q", "submit", str(path))
    assert r.exit_code == 0, r.output
    spec = cluster.quorum.state.allocations[r.stdout.strip()].spec
    assert spec.nodes == 2 and spec.tags["slurm_output"] == "x.out"


# --------------------------------------------------------------------------- squeue & co


def test_squeue_default_format_and_codes(cluster) -> None:
    running = cluster.running(["nid001", "nid002"], name="train", vcluster="hpc-batch")
    pending = cluster.pending(name="wait", vcluster="hpc-batch")
    r = run("squeue")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "JOBID",
        "PARTITION",
        "NAME",
        "USER",
        "ST",
        "TIME",
        "NODES",
        "NODELIST(REASON)",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows[running.id][1:5] == ["hpc-batch", "train", "alice", "R"]
    assert rows[running.id][6:] == ["2", "nid[001-002]"]
    assert rows[pending.id][4] == "PD" and rows[pending.id][7].startswith("(")
    r = run("squeue", "-h", "-t", "R", "-o", "%i|%T|%D|%N|%u")
    assert r.stdout.strip() == f"{running.id}|RUNNING|2|nid[001-002]|alice"
    r = run("squeue", "-h", "-j", pending.id, "-o", "%i %t")
    assert r.stdout.split() == [pending.id, "PD"]
    r = run("squeue", "-o", "%Z")
    assert r.exit_code == 2 and "%Z is not supported" in r.stderr


def test_sacct_and_history(cluster) -> None:
    done = cluster.ended(AllocationState.COMPLETED, ran=3725, name="ok", vcluster="hpc-batch")
    timed = cluster.ended(
        AllocationState.FAILED,
        ran=60,
        exit_code=1,
        reason="walltime_exceeded",
        nodes=["nid003"],
        name="slow",
        vcluster="hpc-batch",
    )
    r = run(
        "sacct",
        "-P",
        "-n",
        "-j",
        f"{done.id},{timed.id}",
        "-o",
        "JobID,State,ExitCode,Elapsed,NodeList",
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        f"{done.id}|COMPLETED|0:0|01:02:05|nid[001-002]",
        f"{timed.id}|TIMEOUT|1:0|00:01:00|nid003",
    ]
    r = run("sacct", "-S", "today")
    assert r.stdout.splitlines()[0].split() == [
        "JobID",
        "JobName",
        "Partition",
        "Account",
        "NNodes",
        "State",
        "ExitCode",
    ]
    assert set(r.stdout.splitlines()[1]) == {"-", " "}
    r = run("sacct", "-s", "TO", "-P", "-n", "-o", "jobid")
    assert r.stdout.split() == [timed.id]
    r = run("history", "--since", "-1d")
    assert r.exit_code == 0, r.output
    head = r.stdout.splitlines()[0].split()
    assert head == [
        "JobID",
        "JobName",
        "User",
        "Partition",
        "State",
        "ExitCode",
        "Elapsed",
        "NNodes",
        "NodeList",
        "End",
    ]
    assert {line.split()[0] for line in r.stdout.splitlines()[2:]} == {done.id, timed.id}
    data = json.loads(run("history", "-o", "json").stdout)
    assert {a["id"] for a in data} == {done.id, timed.id}
    assert run("history", "--until", "-1d", "-o", "json").stdout.strip() == "[]"
    assert "cannot read the date" in run("history", "--since", "soon").stderr


def test_scancel_and_sinfo(cluster) -> None:
    a = cluster.pending(vcluster="hpc-batch")
    b = cluster.pending(vcluster="hpc-batch")
    r = run("scancel", a.id)
    assert r.exit_code == 0 and r.stdout == ""
    assert cluster.quorum.state.allocations[a.id].state == AllocationState.CANCELLED
    r = run("scancel", "-u", "alice")
    assert cluster.quorum.state.allocations[b.id].state == AllocationState.CANCELLED
    r = run("scancel", "nope")
    assert r.exit_code == 1
    r = run("sinfo")
    assert r.stdout.splitlines()[0].split() == [
        "PARTITION",
        "AVAIL",
        "TIMELIMIT",
        "NODES",
        "STATE",
        "NODELIST",
    ]
    assert "nid[001-008]" in r.stdout and "idle" in r.stdout
    r = run("sinfo", "-N", "-h")
    assert r.stdout.splitlines()[0].split()[:2] == ["nid001", "1"]


def test_srun_pty_and_salloc_refusals_say_what_to_use(cluster) -> None:
    r = run("srun", "--pty", "bash")
    assert r.exit_code == 2 and "lattice attach" in r.stderr
    r = run("srun", "--mpi=openmpi", "hostname")
    assert r.exit_code == 2 and "--mpi=openmpi is not supported" in r.stderr
    r = run("salloc", "--array=0-3", "-N", "2")
    assert r.exit_code == 2 and "salloc takes no --wrap, --array or --dependency" in r.stderr
    r = run("salloc", "--bogus-flag")
    assert r.exit_code == 2


def test_srun_outside_an_allocation_runs_a_job_and_prints_its_output(cluster, monkeypatch):
    import threading

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def finish() -> None:
        deadline = time.time() + 20
        while time.time() < deadline:
            ids = cluster.allocation_ids()
            if ids:
                a = cluster.api.start(ids[0], ["nid001", "nid002"], now=time.time())
                cluster.api.set_state(a.id, AllocationState.COMPLETED, exit_code=0, now=time.time())
                return
            time.sleep(0.05)

    t = threading.Thread(target=finish)
    t.start()
    r = run("srun", "-N", "2", "-t", "5", "-J", "probe", "hostname")
    t.join()
    assert r.exit_code == 0, r.output
    (alloc,) = cluster.quorum.state.allocations.values()
    assert alloc.spec.nodes == 2 and alloc.spec.name == "probe"
    assert alloc.spec.entrypoint == "hostname"


# --------------------------------------------------------------------------- pure parts


def test_srun_inside_an_allocation_maps_to_launch_flags() -> None:
    args = slurm_cli.parse_srun_argv(
        ["-n", "8", "--ntasks-per-node=4", "-l", "--mpi=pmix_v4", "./app", "-n", "3"]
    )
    assert args.settings == {"ntasks": "8", "ntasks_per_node": "4", "mpi": "pmix"}
    assert args.flags == {"label"} and args.command == ["./app", "-n", "3"]


def test_dates() -> None:
    now = time.time()
    assert slurm_cli.parse_date("-7d", now) == now - 7 * 86400
    assert slurm_cli.parse_date("2026-03-01T10:00:00Z", now) == 1772359200
    assert slurm_cli.parse_date("today", now, end=True) - slurm_cli.parse_date("today", now) in (
        82800,
        86400,
        90000,
    )


def test_compat_aliases_in_bash(clean_env) -> None:
    r = run("compat-aliases")
    assert r.exit_code == 0
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    checks = "; ".join(f"command -v {c} >/dev/null || exit 9" for c in slurm_cli.ALIASED)
    code = f'alias squeue="echo broken"; eval "$SNIPPET"; {checks}; type sbatch; sbatch --x'
    proc = subprocess.run(
        [bash, "-c", f'lattice() {{ echo "lattice $*"; }}; {code}'],
        env={"SNIPPET": r.stdout, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sbatch is a function" in proc.stdout
    assert proc.stdout.strip().endswith("lattice sbatch --x")
