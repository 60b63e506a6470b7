"""``lattice logs --since/--until/--node``: the window and the node go to the server
(``?since=&until=&node=``), which filters and then takes ``--tail`` of what is left;
against the real REST API over a LocalQuorum (``api`` in conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
from lattice_cli import main as cli_main
from typer.testing import CliRunner

cli_main.load_commands(["logs"])

pytestmark = pytest.mark.timeout(60)

T0 = 1772704800.0  # 2026-03-05T10:00:00Z


def run(*args: str) -> Any:
    return CliRunner().invoke(cli_main.app, list(args), catch_exceptions=False)


def test_window_node_and_tail_are_applied_by_the_server(api: Any) -> None:
    api.names()
    a = api.running(["n0", "n1"]).id
    for i in range(10):
        stream = "stderr" if i == 3 else "stdout"
        api.logs.add(a, f"line {i}", node_id=f"n{i % 2}", stream=stream, timestamp=T0 + i)

    res = run("logs", a, "--since", "2026-03-05T10:00:02Z", "--until", str(T0 + 7), "--tail", "3")
    assert res.exit_code == 0, res.output
    assert api.last()["query"] == {
        "tail": "3",
        "stream": "both",
        "since": repr(T0 + 2),
        "until": repr(T0 + 7),
    }
    assert res.stdout.splitlines() == [
        "[2026-03-05T10:00:05Z] n1: line 5",
        "[2026-03-05T10:00:06Z] n0: line 6",
        "[2026-03-05T10:00:07Z] n1: line 7",
    ]

    res = run("logs", a, "--node", "n1", "--until", str(T0 + 4), "--no-timestamps")
    assert res.exit_code == 0, res.output
    assert api.last()["query"] == {"stream": "both", "node": "n1", "until": repr(T0 + 4)}
    assert res.stdout.splitlines() == ["line 1"] and res.stderr.splitlines() == ["line 3"]

    res = run("logs", a, "-f", "--since", str(T0 + 8), "--stdout", "--no-timestamps")
    assert res.exit_code == 0, res.output
    sent = next(r for r in reversed(api.sent()) if r["path"].endswith("/logs/stream"))
    assert sent["path"] == f"/api/v1/allocations/{a}/logs/stream"
    assert sent["query"] == {"stream": "stdout", "since": repr(T0 + 8)}
    assert res.stdout.splitlines() == ["n0: line 8", "n1: line 9"]

    bad = run("logs", a, "--since", "last tuesday")
    assert bad.exit_code == 2 and "is not a time" in bad.stderr


def test_follow_says_so_when_the_allocation_goes_back_to_the_queue(api: Any) -> None:
    from lattice_common import commands as c

    api.names()
    a = api.running(["n0"]).id
    api.logs.add(a, "epoch 1", node_id="n0", timestamp=T0)
    # its node was lost while it ran: back to Pending, the output so far kept
    api.propose(c.RequeueAllocation(allocation_id=a, reason="node_failure"))

    res = run("logs", a, "-f", "--no-timestamps")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == ["epoch 1"]
    assert f"allocation {a} went back to the queue (node_failure)" in res.stderr
    assert f"Hint: `lattice logs {a} --follow` again once it runs" in res.stderr

    # an allocation that ended: nothing more to say
    done = api.ended().id
    res = run("logs", done, "-f", "--no-timestamps")
    assert res.exit_code == 0 and "queue" not in res.stderr, res.output
