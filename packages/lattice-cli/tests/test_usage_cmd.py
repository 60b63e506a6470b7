"""``lattice usage`` against the real REST API (over a LocalQuorum, in a thread: the
``api`` fixture) seeded with real work, its rendering, and its lazy registration. The
real command against a real cluster is in lattice-api's ``tests/test_usage.py``
(``cluster`` mark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import yaml
from lattice_cli import main as cli_main
from lattice_cli.commands.usage import hours, percent, tenant_text, user_text
from lattice_quorum import queries
from typer.testing import CliRunner

cli_main.load_commands(["usage"])  # main() does this for `lattice usage`; tests call `app`

NOW = 1_750_000_000.0

TENANT = {
    "tenant": "physics",
    "days": 90,
    "since": NOW - 90 * 86400,
    "until": NOW,
    "node_hours": 1234.5,
    "gpu_hours": 4938.0,
    "allocations": 12,
    "running_allocations": 2,
    "nodes_in_use": 6,
    "max_nodes": 200,
    "max_concurrent_allocations": None,
    "fair_share_target": 0.15,
    "fair_share_usage": 0.3,
    "budget_period_days": 90,
    "node_hours_used": 1234.5,
    "gpu_hours_used": 4938.0,
    "node_hours_budget": None,
    "gpu_hours_budget": 5000.0,
    "budget_fraction_used": 0.9876,
    "node_budget_fraction": None,
    "gpu_budget_fraction": 0.9876,
    "node_hours_remaining": None,
    "gpu_hours_remaining": 62.0,
    "budget_source": "internal",
    "users": [
        {
            "user": "alice",
            "node_hours": 1000.0,
            "gpu_hours": 4000.0,
            "allocations": 10,
            "running_allocations": 2,
            "nodes_in_use": 6,
        },
        {
            "user": "bob",
            "node_hours": 234.5,
            "gpu_hours": 938.0,
            "allocations": 2,
            "running_allocations": 0,
            "nodes_in_use": 0,
        },
    ],
}


def user_body(user: str, tenant: str, days: float) -> dict[str, Any]:
    return {
        "user": user,
        "tenant": tenant,
        "days": days,
        "since": NOW - days * 86400,
        "until": NOW,
        "node_hours": 10.25,
        "gpu_hours": 0.0,
        "allocations": 3,
        "running_allocations": 0,
        "nodes_in_use": 0,
        "tenants": [
            {
                "tenant": "physics",
                "node_hours": 10.25,
                "gpu_hours": 0.0,
                "allocations": 3,
                "running_allocations": 0,
                "nodes_in_use": 0,
            }
        ],
    }


HOUR = 3600.0


def seed_usage(api: Any) -> None:
    """The numbers of TENANT, by real work: in physics (200 nodes max, fair-share target
    15%, a 5,000 GPU-hour budget) alice ran 4 four-GPU nodes for 250 h and bob one for
    234.5 h (1,234.5 node-hours, 4,938 GPU-hours: 98.76% of the budget); alice has two
    allocations running on 6 CPU nodes since just now (they add node-seconds, not GPU-
    hours, before the CLI asks: the 2-decimal figures hold for 3 s); carol's 2,880.5
    node-hours in chem make physics' share of all node-hours 30%."""
    api.add_tenant("physics", max_nodes=200, fair_share_target=0.15, gpu_hours_budget=5000.0)
    api.names(["chem"], ["gpu-batch"])
    gpus = [f"g{i}" for i in range(1, 7)]
    api.nodes(*gpus, capabilities={"gpu_type": "GH200", "gpu_count": 4})
    api.ended(nodes=gpus[:4], ran=250 * HOUR, ago=10 * HOUR)
    api.ended(nodes=gpus[4:5], ran=234.5 * HOUR, ago=5.5 * HOUR, user="bob")
    api.ended(nodes=[f"c{i}" for i in range(10)], ran=288.05 * HOUR, user="carol", tenant="chem")
    api.running(["r1", "r2", "r3"], ran=0.0)
    api.running(["r4", "r5", "r6"], ran=0.0)


def served_tenant_usage(api: Any, printed: dict[str, Any]) -> dict[str, Any]:
    """What the server computed for the answer ``printed`` came from (its ``until``)."""
    return api.quorum.read(
        queries.tenant_usage,
        printed["tenant"],
        window_days=printed["days"],
        period_days=printed["budget_period_days"],
        now=printed["until"],
    )


def run(*args: str):
    return CliRunner().invoke(cli_main.app, list(args), catch_exceptions=False)


# --------------------------------------------------------------------------- commands


def test_own_usage_by_default(api: Any) -> None:
    seed_usage(api)
    result = run("usage")
    assert result.exit_code == 0, result.stderr
    request = api.last()
    assert request["path"] == "/api/v1/usage" and request["query"] == {}  # caller, period
    assert request["headers"]["x-lattice-user"] == "alice"
    out = result.stdout
    assert "User:" in out and "alice" in out and "Tenant:" in out and "all" in out
    assert "last 90 days" in out and "1,000.00" in out
    assert "TENANT" in out and "physics" in out


def test_tenant_usage_table(api: Any) -> None:
    seed_usage(api)
    result = run("usage", "--tenant", "physics", "--days", "30")
    assert result.exit_code == 0, result.stderr
    request = api.last()
    assert request["path"] == "/api/v1/tenants/physics/usage"
    assert request["query"] == {"days": "30"}
    out = result.stdout
    assert "Tenant:" in out and "physics" in out and "last 30 days" in out
    assert "1,234.50" in out and "4,938.00" in out
    assert "4,938.00 of 5,000.00 (98.8% used, 62.00 remaining)" in out
    assert "Budget used:" in out and "98.8%" in out
    assert "200 (6 in use)" in out and "no limit (2 running)" in out
    assert "30.0% of node-hours used (target 15.0%)" in out
    assert "USER" in out and "bob" in out and "234.50" in out


def test_json_and_yaml(api: Any) -> None:
    seed_usage(api)
    result = run("usage", "--tenant", "physics", "-o", "json")
    assert result.exit_code == 0
    printed = json.loads(result.stdout)
    assert printed == served_tenant_usage(api, printed)  # the server's record, as sent
    assert printed["gpu_hours"] == TENANT["gpu_hours"]
    assert printed["node_hours"] == pytest.approx(TENANT["node_hours"], abs=0.005)
    result = run("-o", "yaml", "usage", "--user", "bob", "--tenant", "physics", "--days", "7")
    assert result.exit_code == 0
    data = yaml.safe_load(result.stdout)
    assert (data["user"], data["tenant"], data["days"]) == ("bob", "physics", 7.0)
    assert api.last()["query"] == {"user": "bob", "tenant": "physics", "days": "7"}
    # -o wide from the root flag means the table here
    result = run("-o", "wide", "usage")
    assert result.exit_code == 0 and "User:" in result.stdout


def test_errors(api: Any) -> None:
    for days in ("0", "3651", "-5"):
        result = run("usage", "--days", days)
        assert result.exit_code == 2
        assert result.stderr.startswith("Error: --days must be between 1 and 3650")
        assert "Hint:" in result.stderr
    assert not api.requests  # rejected before any request
    result = run("usage", "--days", "many")
    assert result.exit_code == 2
    result = run("usage", "--tenant", "nobody")
    assert result.exit_code == 1
    assert result.stderr.startswith('Error: tenant "nobody" not found')
    assert "Hint: List tenants with `lattice admin tenant list`." in result.stderr


def test_unreachable_is_a_clean_error(clean_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("LATTICE_ENDPOINT", f"127.0.0.1:{port}")
    result = run("usage")
    assert result.exit_code == 1 and result.stderr.startswith("Error: cannot reach")


# --------------------------------------------------------------------------- rendering


def test_render_helpers() -> None:
    assert hours(1234.5) == "1,234.50" and hours(None) == "—" and hours(True) == "—"
    assert hours(0.0001) == "<0.01" and hours(0) == "0.00" and hours(0.006) == "0.01"
    assert percent(0.5) == "50.0%" and percent(None) == "—"
    no_budget = {
        **TENANT,
        "gpu_hours_budget": None,
        "budget_fraction_used": None,
        "users": [],
        "fair_share_target": 0.0,
    }
    text = tenant_text(no_budget)
    assert "no budget set" in text and "USER" not in text and "target" not in text
    exhausted = {**TENANT, "budget_fraction_used": 1.2}
    assert "120.0%  (exhausted)" in tenant_text(exhausted)
    one_day = user_text({**user_body("carol", "bio", 1), "tenants": []})
    assert "last 1 day " in one_day and "TENANT" not in one_day and "bio" in one_day


# --------------------------------------------------------------------------- registration


def _env(tmp_path: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"), **extra)
    return env


def test_registered_lazily(tmp_path: Any) -> None:
    assert cli_main.command_word(["-o", "json", "usage", "--tenant", "x"]) == "usage"
    code = (
        "import sys\n"
        "from lattice_cli.main import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('usage_cmd' if 'lattice_cli.commands.usage' in sys.modules else 'none', file=sys.stderr)\n"
    )

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env=_env(tmp_path, LATTICE_ENDPOINT="127.0.0.1:9"),
            timeout=60,
        )

    status = probe("status")
    assert status.stderr.strip().endswith("none"), status.stderr
    helped = probe("--help")
    assert "usage" in helped.stdout and helped.stderr.strip().endswith("usage_cmd")
    usage_help = probe("usage", "--help")
    for option in ("--tenant", "--user", "--days", "--output"):
        assert option in usage_help.stdout
