"""The ``lattice`` commands end to end against the real REST API (over a LocalQuorum, in
a thread: the ``api`` fixture), and the real console script.

In-process runs use typer's CliRunner; the subprocess tests run the installed entry point
(the way users do) for help output, exit codes and the connection-refused message.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import yaml
from lattice_cli.main import app, load_commands
from lattice_common import commands as c
from lattice_common.types import AllocationState
from typer.testing import CliRunner

load_commands()  # main() registers only the command it runs; these tests call `app` directly


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- submit


def test_submit_script_with_directives_and_overrides(api, tmp_path, monkeypatch):
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=4\n"
        "#SBATCH --time=24:00:00\n"
        "#SBATCH --job-name=from-script\n"
        "#SBATCH --account=physics\n"
        "#SBATCH --partition=gpu\n"
        "#SBATCH --gres=gpu:4\n"
        "#SBATCH --mail-user=me@example.com\n"
        "#LATTICE --uenv=prgenv-gnu/24.11:v1\n"
        "srun python train.py\n"
    )
    api.names(["physics"], ["gpu"])
    monkeypatch.chdir(tmp_path)
    result = run(
        "submit",
        "--nodes=8",
        "-C",
        "gpu_type=GH200",
        "--env",
        "A=1",
        "train.sh",
        "--",
        "--epochs",
        "3",
    )
    assert result.exit_code == 0, result.stderr
    [alloc_id] = api.allocation_ids()
    assert result.stdout.strip() == f"Submitted allocation {alloc_id}"
    stored = api.quorum.state.allocations[alloc_id].spec
    assert (stored.nodes, stored.walltime_seconds, stored.user) == (8, 86400, "alice")
    assert "warning:" in result.stderr and "--mail-user" in result.stderr
    body = api.last("POST")["json"]
    assert body["entrypoint"] == f"/bin/bash {script} --epochs 3"
    assert body["nodes"] == 8  # flag beats #SBATCH --nodes=4
    assert body["walltime"] == "24:00:00"
    assert body["name"] == "from-script"
    assert body["tenant"] == "physics"
    assert body["vcluster"] == "gpu"
    assert body["constraints"] == {"gpu_count": 4, "gpu_type": "GH200"}
    assert body["env"] == {"A": "1"}
    assert body["uenv"] == "prgenv-gnu/24.11:v1"
    assert body["submit_dir"] == str(tmp_path)
    assert len(body["request_id"]) == 32
    assert api.last("POST")["headers"]["x-lattice-user"] == "alice"


def test_submit_with_a_uenv_view(api, monkeypatch):
    api.names(["physics"], ["gpu"])
    base = ("submit", "--tenant", "physics", "--vcluster", "gpu", "-t", "1h")
    result = run(*base, "--uenv", "prgenv-gnu/24.11", "--view", "default", "--", "make")
    assert result.exit_code == 0, result.stderr
    body = api.last("POST")["json"]
    assert (body["uenv"], body["view"]) == ("prgenv-gnu/24.11", "default")
    [alloc_id] = api.allocation_ids()
    stored = api.quorum.state.allocations[alloc_id]
    assert (stored.spec.uenv, stored.spec.view) == ("prgenv-gnu/24.11:v1", "default")
    assert stored.uenv_sha256 == "ab" * 32  # resolved by the API at submit
    # a view without a uenv, and an unknown uenv: refused with a hint, nothing stored
    result = run(*base, "--view", "default", "--", "make")
    assert result.exit_code == 1
    assert "view 'default' given without a uenv" in result.stderr
    assert "Hint: A view is one of a uenv's environments" in result.stderr
    result = run(*base, "--uenv", "prgenv-gnu/25.1", "--", "make")
    assert result.exit_code == 1
    assert "uenv prgenv-gnu/25.1: not in the registry" in result.stderr
    assert "Hint: Pick one of the available versions of prgenv-gnu" in result.stderr
    assert api.allocation_ids() == [alloc_id]


def test_session_with_a_uenv_view(api):
    api.names(["physics"], ["gpu"])
    result = run(
        "session", "--tenant", "physics", "--vcluster", "gpu", "--no-attach",
        "--uenv", "prgenv-gnu/24.11:v1", "--view", "default",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    body = api.last("POST")["json"]
    assert (body["uenv"], body["view"]) == ("prgenv-gnu/24.11:v1", "default")


def test_submit_command_after_dashdash(api, monkeypatch):
    monkeypatch.setenv("LATTICE_TENANT", "ml-team")
    monkeypatch.setenv("LATTICE_VCLUSTER", "ml-training")
    api.names(["ml-team"], ["ml-training"])
    result = run("submit", "-N", "2", "-t", "72h", "--", "torchrun", "train.py", "--lr", "0.1")
    assert result.exit_code == 0, result.stderr
    body = api.last("POST")["json"]
    assert body["entrypoint"] == "torchrun train.py --lr 0.1"
    assert body["name"] == "torchrun"
    assert (body["tenant"], body["vcluster"]) == ("ml-team", "ml-training")
    assert api.last("POST")["headers"]["x-lattice-tenant"] == "ml-team"


def test_global_flags_beat_directives_and_env(api, tmp_path, monkeypatch):
    script = tmp_path / "job.sh"
    script.write_text(
        "#SBATCH --account=from-script\n#SBATCH -p from-script\n#SBATCH -t 10\nhostname\n"
    )
    monkeypatch.setenv("LATTICE_TENANT", "from-env")
    api.names(["from-script", "global", "local"], ["from-script", "gvc"])
    assert run("submit", str(script)).exit_code == 0
    body = api.last("POST")["json"]
    assert (body["tenant"], body["vcluster"]) == ("from-script", "from-script")
    assert (
        run("--tenant", "global", "--vcluster", "gvc", "submit", "-D", "sub", str(script)).exit_code
        == 0
    )
    body = api.last("POST")["json"]
    assert (body["tenant"], body["vcluster"]) == ("global", "gvc")
    assert body["submit_dir"] == os.path.abspath("sub")
    assert run("--tenant", "global", "submit", "--tenant", "local", str(script)).exit_code == 0
    assert api.last("POST")["json"]["tenant"] == "local"


def test_submit_quiet_json_and_dry_run(api, monkeypatch):
    monkeypatch.setenv("LATTICE_TENANT", "physics")
    monkeypatch.setenv("LATTICE_VCLUSTER", "gpu-batch")
    api.names()
    quiet = run("-q", "submit", "-t", "1h", "--", "hostname")
    assert quiet.stdout.strip() == api.allocation_ids()[0]
    as_json = run("submit", "-o", "json", "-t", "1h", "--", "hostname")
    data = json.loads(as_json.stdout)
    assert data["id"] == api.allocation_ids()[1] and data["state"] == "Pending"
    posts = len(api.sent("POST"))
    dry = run("submit", "--dry-run", "-t", "1h", "--requeue", "always", "--", "echo", "hi there")
    assert dry.exit_code == 0
    spec = json.loads(dry.stdout)
    assert spec["entrypoint"] == "echo 'hi there'" and spec["requeue_policy"] == "always"
    assert len(api.sent("POST")) == posts


def test_submit_server_validation_error(api):
    result = run("submit", "--", "hostname")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: walltime is required for a bounded (batch) allocation",
        "Hint: Pass --walltime, e.g. --walltime=2h or --walltime=01:30:00.",
    ]
    assert "Traceback" not in result.output


def test_submit_usage_errors(api, tmp_path):
    missing = run("submit", str(tmp_path / "nope.sh"))
    assert missing.exit_code == 2
    assert missing.stderr.startswith("Error: script")
    assert "Hint:" in missing.stderr and "--" in missing.stderr
    nothing = run("submit")
    assert nothing.exit_code == 2 and "nothing to submit" in nothing.stderr
    bad = run("submit", "-C", "colour=red", "--", "x")
    assert bad.exit_code == 2 and "unknown constraint" in bad.stderr
    bad_env = run("submit", "--env", "NOEQUALS", "--", "x")
    assert bad_env.exit_code == 2 and "KEY=VALUE" in bad_env.stderr
    script = tmp_path / "bad.sh"
    script.write_text("#LATTICE --nodes=zero\necho\n")
    directive = run("submit", str(script))
    assert directive.exit_code == 2 and "line 1" in directive.stderr
    binary = tmp_path / "a.out"
    binary.write_bytes(b"\x7fELF\0\0\0")
    assert run("submit", str(binary)).exit_code == 2
    assert not api.sent("POST")


# --------------------------------------------------------------------------- status


def test_status_table(api):
    api.names()
    running = api.running(["nid001", "nid002"])
    pending = api.pending(name="eval")
    result = run("status")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "ID",
        "NAME",
        "STATE",
        "NODES",
        "WALLTIME",
        "ELAPSED",
        "START_TIME",
        "VCLUSTER",
    ]
    assert lines[1].split()[:5] == [running.id, "train.sh", "Running", "2", "24:00:00"]
    assert lines[2].split()[:3] == [pending.id, "eval", "Pending"]
    assert lines[2].split()[5] == "—"
    assert api.last()["query"] == {}


def test_status_filters_and_formats(api):
    api.names()
    a1 = api.running(["nid001", "nid002"]).id
    result = run("status", "--state", "running", "--all", "--user", "bob", "--limit", "3")
    assert result.exit_code == 0
    assert api.last()["query"] == {
        "state": "running",
        "all": "true",
        "user": "bob",
        "limit": "3",
    }
    as_json = json.loads(run("-o", "json", "status").stdout)
    assert [a["id"] for a in as_json] == [a1]
    as_yaml = yaml.safe_load(run("status", "-o", "yaml").stdout)
    assert as_yaml[0]["spec"]["vcluster"] == "gpu-batch"
    wide = run("status", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-6:] == ["TENANT", "PROJECT", "UENV", "GPU_TYPE", "NODELIST", "REASON"]
    assert "nid[001-002]" in wide[1]
    assert run("-q", "status").stdout.split() == [a1]


def test_status_single_detail(api):
    api.names()
    api.nodes("nid001", "nid002")
    a1 = api.pending(nodes=2, max_requeue=3).id
    for _ in range(3):  # the node fails under it: back to the queue, up to max_requeue
        api.start(a1, ["nid001", "nid002"])
        api.propose(c.RequeueAllocation(allocation_id=a1, reason="node_failure"))
    api.start(a1, ["nid001", "nid002"])
    api.set_state(a1, AllocationState.FAILED, exit_code=1, reason="node_failure")
    result = run("status", a1)
    assert result.exit_code == 0
    fields = {
        k.strip(): v.strip() for k, v in (line.split(":", 1) for line in result.stdout.splitlines())
    }
    assert fields["State"] == "Failed"
    assert fields["Reason"] == "node_failure"
    assert fields["Exit code"] == "1"
    assert fields["Requeue count"] == "3"
    assert fields["Assigned nodes"] == "nid[001-002]"


def test_status_not_found(api):
    result = run("status", "nope")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "Error: allocation nope not found",
        "Hint: List your allocations with `lattice status`.",
    ]


def test_status_watch_single_stops_when_terminal(api):
    api.names()
    a1 = api.ended(AllocationState.COMPLETED, exit_code=0).id
    result = run("status", a1, "--watch", "--interval", "0.2")
    assert result.exit_code == 0
    assert "Completed" in result.stdout


def test_status_watch_list_until_ctrl_c(api, tmp_path):
    import signal

    api.names()
    a1 = api.running().id
    proc = subprocess.Popen(
        [*_lattice(), "status", "--watch", "--interval", "0.2", "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path, LATTICE_ENDPOINT=api.rest_url),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(api.requests) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    snapshots = [json.loads(line) for line in out.splitlines()]
    assert len(snapshots) >= 2
    assert all(s[0]["id"] == a1 for s in snapshots)
    assert "Traceback" not in err


def test_option_conversion_errors_are_usage_errors(api):
    assert run("status", "--limit", "0").exit_code == 2
    assert run("status", "--limit", "many").exit_code == 2
    assert run("status", "-o", "fancy").exit_code == 2
    assert run("status", "--interval", "abc").exit_code == 2
    assert run("status", "-o", "JSON").exit_code == 0  # case-insensitive choice
    assert run("submit", "--preemption-class", "11", "--", "x").exit_code == 2
    assert all(r["method"] == "GET" for r in api.requests)


# --------------------------------------------------------------------------- cancel, logs


def test_cancel_many_with_one_failure(api):
    api.names()
    a1 = api.running(["nid001", "nid002"]).id
    a2 = api.ended(AllocationState.COMPLETED, nodes=["nid003"]).id
    result = run("cancel", a1, a2, "a3")
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [f"Cancelled allocation {a1}"]
    assert f"Error: allocation {a2} already ended (Completed)" in result.stderr
    assert "Error: allocation a3 not found" in result.stderr
    assert api.quorum.state.allocations[a1].state == AllocationState.CANCELLED
    assert run("cancel", a1).exit_code == 1
    a4 = api.pending().id
    assert run("cancel", a4).exit_code == 0


def test_logs(api):
    api.names()
    a1 = api.running(["n1"]).id
    api.logs.add(a1, "Epoch 1/100", node_id="n1", timestamp=1772704812.0)
    api.logs.add(a1, "warn", stream="stderr", node_id="n1", timestamp=1772704813.0)
    result = run("logs", a1)
    assert result.exit_code == 0
    assert result.stdout == "[2026-03-05T10:00:12Z] Epoch 1/100\n"
    assert result.stderr == "[2026-03-05T10:00:13Z] warn\n"
    run("logs", a1, "--tail", "1", "--stderr")
    assert api.last()["query"] == {"tail": "1", "stream": "stderr"}
    followed = run("logs", a1, "-f", "--no-timestamps")
    assert followed.exit_code == 0
    assert followed.stdout == "Epoch 1/100\n" and followed.stderr == "warn\n"
    # the stream, then the allocation's state (still Running: nothing more to say)
    assert [r["path"] for r in api.sent()[-2:]] == [
        f"/api/v1/allocations/{a1}/logs/stream",
        f"/api/v1/allocations/{a1}",
    ]
    as_json = run("logs", a1, "-o", "json").stdout.splitlines()
    assert [json.loads(x)["line"] for x in as_json] == ["Epoch 1/100", "warn"]
    assert run("logs", "missing").exit_code == 1


# --------------------------------------------------------------------------- endpoint, config


def test_endpoint_flag_beats_env(api, monkeypatch):
    monkeypatch.setenv("LATTICE_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    assert run("status").exit_code == 1
    assert run("--endpoint", api.rest_url, "status").exit_code == 0


def test_config_file_and_token(api, clean_env, monkeypatch):
    config = clean_env / "cfg.yaml"
    config.write_text(f"endpoint: {api.rest_url}\ntenant: physics\ntoken: s3cret\n")
    monkeypatch.delenv("LATTICE_ENDPOINT")
    result = run("--config", str(config), "status")
    assert result.exit_code == 0, result.stderr
    headers = api.last()["headers"]
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["x-lattice-tenant"] == "physics"
    monkeypatch.setenv("LATTICE_CONFIG", str(config))
    assert run("--tenant", "other", "status").exit_code == 0
    assert api.last()["headers"]["x-lattice-tenant"] == "other"


def test_bad_config_is_a_clean_error(clean_env):
    config = clean_env / "cfg.yaml"
    config.write_text("endpoint: [oops\n")
    result = run("--config", str(config), "status")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: config file")
    missing = run("--config", str(clean_env / "missing.yaml"), "status")
    assert missing.exit_code == 1 and "does not exist" in missing.stderr


def test_version_and_help(clean_env):
    assert run("--version").stdout.strip() == "lattice 0.1.0"
    for args in (
        ["--help"],
        ["submit", "--help"],
        ["admin", "tenant", "create", "--help"],
        ["node", "--help"],
    ):
        assert run(*args).exit_code == 0


def test_every_command_and_option_has_help():
    from typer.main import get_command

    root = get_command(app)

    def walk(cmd, path):
        assert cmd.help or cmd.short_help, f"{path} has no help"
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help, f"{path} {param.opts} has no help"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(root, "lattice")


# --------------------------------------------------------------------------- real process


def _lattice() -> list[str]:
    exe = shutil.which("lattice", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "lattice_cli.main"]


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"), **extra)
    return env


def test_console_script_help(tmp_path):
    for args in (["--help"], ["submit", "--help"]):
        proc = subprocess.run(
            [*_lattice(), *args], capture_output=True, text=True, env=_env(tmp_path), timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert "Usage" in proc.stdout
    proc = subprocess.run(
        [*_lattice(), "submit", "--help"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    for option in (
        "--nodes", "--walltime", "--constraint", "--env", "--requeue", "--uenv", "--view",
    ):  # fmt: skip
        assert option in proc.stdout


def test_console_script_status_connection_refused(tmp_path):
    port = closed_port()
    proc = subprocess.run(
        [*_lattice(), "status"],
        capture_output=True,
        text=True,
        env=_env(tmp_path, LATTICE_ENDPOINT=f"127.0.0.1:{port}"),
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"Error: cannot reach the Lattice API at http://127.0.0.1:{port}")
    assert "Start a local cluster with `lattice dev up` or set LATTICE_ENDPOINT" in proc.stderr
    assert "Endpoint from: env:LATTICE_ENDPOINT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_does_not_import_heavy_modules(tmp_path):
    """Start-time guard: `lattice status` must not pull in pydantic, msgspec, aiohttp, rich,
    yaml, or any of lattice_common but the stdlib-only error renderer."""
    code = (
        "import sys\n"
        "from lattice_cli.main import main\n"
        "try:\n"
        "    main(['status'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('pydantic', 'msgspec', 'aiohttp', 'rich', 'yaml') if m in sys.modules]\n"
        "heavy += [m for m in sys.modules if m.startswith('lattice_common.')\n"
        "          and m != 'lattice_common.error_text']\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(tmp_path, LATTICE_ENDPOINT=f"127.0.0.1:{closed_port()}"),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_command_word():
    from lattice_cli import main as m

    assert m.command_word(["-o", "json", "status", "x"]) == "status"
    assert m.command_word(["--endpoint", "h:1", "dev", "up"]) == "dev"
    assert m.command_word(["--tenant", "t", "--vcluster", "v", "usage"]) == "usage"
    assert m.command_word(["--endpoint=h:1", "-q", "nodes"]) == "nodes"
    assert m.command_word(["--help"]) is None


def test_commands_are_imported_lazily(tmp_path):
    """`main` imports the module of the command it runs and no other; the root help and an
    unknown word import them all (help lists them, the error suggests one)."""
    from lattice_cli.main import COMMANDS

    code = (
        "import sys\n"
        "from lattice_cli.main import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "names = sorted(m for m in sys.modules if m.startswith('lattice_cli.commands.'))\n"
        "print(' '.join(names), file=sys.stderr)\n"
    )

    def imported(*args: str) -> set[str]:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env=_env(tmp_path, LATTICE_ENDPOINT=f"127.0.0.1:{closed_port()}"),
            timeout=60,
        )
        return set(proc.stderr.strip().splitlines()[-1].split())

    assert imported("-o", "json", "status") == {"lattice_cli.commands.status"}
    assert imported("cancel", "--help") == {"lattice_cli.commands.cancel"}
    assert imported("--tenant", "t", "admin", "--help") >= {"lattice_cli.commands.admin"}
    assert not any("commands.dev" in m or "commands.usage" in m for m in imported("admin"))
    for everything in (imported("--help"), imported("no-such-command")):
        assert set(COMMANDS.values()) <= everything


def test_command_table_matches_the_modules():
    """Every module under commands/ is in main's table and has register(app)."""
    import importlib
    import pkgutil

    import lattice_cli.commands
    from lattice_cli.main import COMMANDS

    found = {
        f"lattice_cli.commands.{m.name}"
        for m in pkgutil.iter_modules(lattice_cli.commands.__path__)
    }
    assert found == set(COMMANDS.values())
    for word, module in COMMANDS.items():
        assert callable(importlib.import_module(module).register), word
