"""The rm-replay command: run, the Tuning Guide's spellings, errors without tracebacks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rm_replay.cli import main, rewrite_args
from rm_replay.model import RESULT_FILE
from rm_replay.trace import write_trace
from rmr_helpers import H, submit

INV = "node_classes:\n  - {name: n, count: 4, groups: 2}\n"
WEIGHTS = "hpc-batch:\n  priority: 0.2\n  wait_time: 0.25\n  fair_share: 0.25\n"
SWF = (
    "; UnixStartTime: 1772323200\n"
    "1 0 0 3600 128 -1 -1 128 7200 -1 1 1 1 -1 1 -1 -1 -1\n"
    "2 60 0 600 64 -1 -1 64 -1 -1 0 2 2 -1 2 -1 -1 -1\n"
)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    write_trace(
        tmp_path / "t.jsonl",
        [submit("a", 0, nodes=2, walltime=H), submit("b", 5, nodes=4, walltime=H), submit("c", 9)],
    )
    (tmp_path / "inv.yaml").write_text(INV)
    (tmp_path / "w.yaml").write_text(WEIGHTS)
    (tmp_path / "w.swf").write_text(SWF)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_run_writes_the_result(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = files / "res"
    code, _, err = run(
        capsys,
        "run",
        "--trace",
        str(files / "t.jsonl"),
        "--inventory",
        str(files / "inv.yaml"),
        "--weights",
        str(files / "w.yaml"),
        "--policy",
        "easy",
        "--seed",
        "4",
        "--budget-period-days",
        "7",
        "--out",
        str(out),
    )
    assert code == 0, err
    result = msgspec.json.decode((out / RESULT_FILE).read_bytes())
    assert (result["policy"], result["seed"], result["trace_name"]) == ("easy", 4, "t")
    assert len(result["jobs"]) == 3
    assert result["sim_config"]["default_vcluster"] == "hpc-batch"
    assert result["sim_config"]["budget_period_days"] == 7
    assert (out / "timing.json").is_file()
    assert "3 allocations" in err


def test_the_tuning_guide_spelling(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("base", "cand"):
        code, _, err = run(
            capsys,
            f"--trace={files / 't.jsonl'}",
            f"--weights={files / 'w.yaml'}",
            f"--nodes={files / 'inv.yaml'}",
            f"--output={files / name}",
            "--quiet",
        )
        assert code == 0, err
        assert (files / name / RESULT_FILE).is_file()
    if not (files / "base" / "metrics.json").is_file():
        pytest.skip("rm_replay.report did not write metrics.json")
    code, out, err = run(capsys, "--compare", str(files / "base"), str(files / "cand"))
    assert code == 0, err
    assert "RM-Replay Results" in out


def test_swf_input(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        "run",
        "--swf",
        str(files / "w.swf"),
        "--cores-per-node",
        "64",
        "--queue-map",
        "2=ml",
        "--inventory",
        str(files / "inv.yaml"),
        "--out",
        str(files / "swf"),
        "--no-report",
    )
    assert code == 0, err
    jobs = msgspec.json.decode((files / "swf" / RESULT_FILE).read_bytes())["jobs"]
    assert [(j["id"], j["nodes"], j["vcluster"], j["state"]) for j in jobs] == [
        ("1", 2, "default", "completed"),
        ("2", 1, "ml", "failed"),
    ]


def test_convert_swf_and_check(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        "convert-swf",
        str(files / "w.swf"),
        "--cores-per-node",
        "32",
        "-o",
        str(files / "c.jsonl"),
    )
    assert code == 0, err
    code, out, err = run(
        capsys,
        "check",
        "--trace",
        str(files / "c.jsonl"),
        "--inventory",
        str(files / "inv.yaml"),
        "--weights",
        str(files / "w.yaml"),
    )
    assert code == 0, err
    assert "2 submissions" in out and "4 nodes" in out and "weights hpc-batch" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            [
                "run",
                "--trace",
                "{d}/missing.jsonl",
                "--inventory",
                "{d}/inv.yaml",
                "--out",
                "{d}/o",
            ],
            "does not exist",
        ),
        (
            ["run", "--trace", "{d}/bad.jsonl", "--inventory", "{d}/inv.yaml", "--out", "{d}/o"],
            "bad.jsonl:2:",
        ),
        (
            [
                "run",
                "--swf",
                "{d}/bad.swf",
                "--cores-per-node",
                "8",
                "--inventory",
                "{d}/inv.yaml",
                "--out",
                "{d}/o",
            ],
            "bad.swf:1: expected 18 fields",
        ),
        (
            ["run", "--swf", "{d}/w.swf", "--inventory", "{d}/inv.yaml", "--out", "{d}/o"],
            "--cores-per-node",
        ),
        (
            [
                "run",
                "--trace",
                "{d}/t.jsonl",
                "--swf",
                "{d}/w.swf",
                "--inventory",
                "{d}/inv.yaml",
                "--out",
                "{d}/o",
            ],
            "exactly one",
        ),
        (["run", "--trace", "{d}/t.jsonl", "--out", "{d}/o"], "--inventory is required"),
        (["run", "--trace", "{d}/t.jsonl", "--inventory", "{d}/inv.yaml"], "--out is required"),
        (
            ["run", "--trace", "{d}/t.jsonl", "--inventory", "{d}/bad.yaml", "--out", "{d}/o"],
            "no count",
        ),
        (
            [
                "run",
                "--trace",
                "{d}/t.jsonl",
                "--inventory",
                "{d}/inv.yaml",
                "--weights",
                "{d}/badw.yaml",
                "--out",
                "{d}/o",
            ],
            "unknown cost weight",
        ),
        (
            [
                "run",
                "--trace",
                "{d}/t.jsonl",
                "--inventory",
                "{d}/inv.yaml",
                "--max-time",
                "soon",
                "--out",
                "{d}/o",
            ],
            "--max-time",
        ),
        (["run", "--trace", "{d}", "--inventory", "{d}/inv.yaml", "--out", "{d}/o"], "not a file"),
        (["check"], "nothing to check"),
    ],
)
def test_bad_input_is_an_error_with_a_hint(
    files: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    (files / "bad.jsonl").write_text(
        '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}\n{"ts": 1, "type": "submit", "alloc": {oops}}\n'
    )
    (files / "bad.swf").write_text("1 2 3\n")
    (files / "bad.yaml").write_text("node_classes:\n  - {name: x}\n")
    (files / "badw.yaml").write_text("hpc:\n  priorty: 0.2\n")
    code, _, err = run(capsys, *[a.format(d=files) for a in args])
    assert code == 2
    assert needle in err
    assert "Error:" in err and "Hint:" in err


def test_bad_option_values_exit_2(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "run", "--policy", "sjf", "--out", str(files / "o"))
    assert code == 2 and "sjf" in err
    code, _, err = run(capsys, "run", "--checkpoint-success-rate", "2", "--out", str(files / "o"))
    assert code == 2


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["convert-swf"]])
def test_help_everywhere(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    assert "Usage" in out or "usage" in out
    if command == ["run"]:
        for option in (
            "--trace",
            "--swf",
            "--inventory",
            "--weights",
            "--policy",
            "--seed",
            "--out",
        ):
            assert option in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("rm-replay ")


def test_rewrite_args() -> None:
    assert rewrite_args(["--compare", "a", "b"]) == ["compare", "a", "b"]
    assert rewrite_args(["--compare=a", "b"]) == ["compare", "a", "b"]
    assert rewrite_args(["--trace=x", "--output=o"]) == ["run", "--trace=x", "--output=o"]
    assert rewrite_args(["--help"]) == ["--help"]
    assert rewrite_args(["run", "--trace", "x"]) == ["run", "--trace", "x"]
    assert rewrite_args([]) == []


def test_delegated_commands_report_missing_modules(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, *a: object, **kw: object):
        if name == "rm_replay.regress":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", fake)
    code, _, err = run(capsys, "regress")
    assert code == 1 and "rm_replay.regress is missing" in err
