"""``lattice watch`` and ``lattice telemetry``: the renderers (pure), then the installed
command in a subprocess against the real API with a real agent service on loopback
(its telemetry loop on a fixed source): NDJSON lines with ``-o json``, alert lines with
``--alerts-only``, plain lines when not a terminal, the mode switch and its answer, and
refusals printed the CLI's way."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from grpclib.server import Server
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import TelemetryLoop
from lattice_agent.telemetry.alerts import AlertRule
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_cli.commands.telemetry import mode_switched_text
from lattice_cli.watching import WatchView, event_lines, mode_text
from lattice_common.types import AllocationSpec
from lattice_test_harness.local_api import serve_local_api

pytestmark = pytest.mark.timeout(90)


def rec(event: str, node: str = "n1", **kw: Any) -> dict[str, Any]:
    base = {
        "allocation_id": "a1",
        "event": event,
        "node_id": node,
        "timestamp": 1_700_000_000.0,
        "telemetry_mode": "prod",
        "mode_until": None,
        "resolution_seconds": 30.0,
        "state": "Running",
        "samples": [],
        "alerts": [],
        "alert_events": [],
    }
    return {**base, **kw}


def sample(name: str, value: float, unit: str, agg: str = "mean") -> dict[str, Any]:
    return {"name": name, "node_id": "", "value": value, "unit": unit, "labels": {"agg": agg}}


ALERT = {
    "rule": "gpu_idle",
    "metric": "gpu_utilization",
    "node_id": "n2",
    "state": "firing",
    "value": 3.0,
    "comparison": "<",
    "threshold": 10.0,
    "for_seconds": 60.0,
    "since": 1_699_999_940.0,
    "timestamp": 1_700_000_000.0,
    "severity": "warning",
    "message": "GPU utilization below 10% for over 60 s (potential hang)",
}


# --- renderers ------------------------------------------------------------------------


def test_event_lines() -> None:
    m = rec(
        "metrics",
        samples=[
            sample("memory_used", 2.5e9, "bytes"),
            sample("cpu_utilization", 87.25, "percent"),
            sample("io_latency_p99", 12_000.0, "microseconds"),
        ],
    )
    (line,) = event_lines(m)
    assert line.endswith("n1 [prod · 30 s] CPU 87.2%  MEMORY 2.5 GB  IO_P99 12.0 ms")
    (only,) = event_lines(m, ["memory_used"])
    assert only.endswith("[prod · 30 s] MEMORY 2.5 GB")
    (a,) = event_lines(rec("alert", "n2", alert_events=[ALERT]))
    assert " n2 FIRING gpu_idle (warning): GPU utilization below 10% for over 60 s " in a
    assert a.endswith("[gpu_utilization = 3 < 10]")
    (lost,) = event_lines(
        rec("node_lost", "n3", alerts=["node n3: metrics stream lost (gone); retrying"])
    )
    assert "n3 NODE LOST: node n3: metrics stream lost (gone); retrying" in lost
    (mode,) = event_lines(
        rec("mode", telemetry_mode="debug", resolution_seconds=1.0, mode_until=1_700_000_300.0)
    )
    assert " n1 MODE debug · 1 s until " in mode
    (end,) = event_lines(rec("end", "", state="Completed"))
    assert end.endswith("a1 ended (Completed)")
    assert mode_text("", None) == "prod"


def test_watch_view() -> None:
    view = WatchView("a1")
    view.apply(rec("metrics", "n2", samples=[sample("cpu_utilization", 1.0, "percent")]))
    view.apply(
        rec(
            "metrics",
            "n1",
            samples=[
                sample("cpu_utilization", 90.0, "percent"),
                sample("gpu_utilization", 80.0, "percent"),
            ],
        )
    )
    view.apply(rec("alert", "n2", alert_events=[ALERT], alerts=[ALERT["message"]]))
    text = view.render(1_700_000_001.0)
    lines = text.splitlines()
    assert lines[0].startswith("a1 (Running) · 2 nodes · 1 alert firing · at ")
    assert lines[2].split() == ["NODE", "MODE", "GPU_UTIL", "CPU", "UPDATED"]
    assert lines[3].split()[:6] == ["n1", "prod", "·", "30", "s", "80.0%"]
    assert lines[4].split()[:7] == ["n2", "prod", "·", "30", "s", "—", "1.0%"]
    assert "ALERTS" in lines and "EVENTS" in lines
    assert any("FIRING gpu_idle" in ln for ln in lines)
    # mode switch, resolved alert, a node lost
    view.apply(rec("mode", "n1", telemetry_mode="debug", resolution_seconds=1.0))
    view.apply(rec("alert", "n2", alert_events=[{**ALERT, "state": "resolved", "value": 50.0}]))
    view.apply(rec("node_lost", "n2", telemetry_mode="", alerts=["node n2: lost"]))
    text = view.render(1_700_000_002.0)
    assert "0 alerts firing" in text and "ALERTS" not in text
    assert "debug · 1 s" in text and "LOST" in text
    view.apply(rec("end", "", state="Completed"))
    assert view.ended and view.state == "Completed"
    assert WatchView("a2").render(0).endswith("waiting for the first values ...")


def test_mode_switched_text() -> None:
    res = {
        "allocation_id": "a1",
        "telemetry_mode": "debug",
        "until": 1_700_000_000.0,
        "nodes": [
            {"node": "n1", "ok": True, "mode": "debug", "default_mode": "prod"},
            {"node": "n2", "ok": False, "error": {"message": "node n2 did not answer"}},
        ],
    }
    text = mode_switched_text(res)
    first, second = text.splitlines()
    assert first.startswith("Telemetry of a1 is now debug on 1 node until ")
    assert first.endswith("(then prod).")
    assert second == "  n2: not switched: node n2 did not answer"


# --- the command against the real API and a real agent ---------------------------------


class Fixed:
    name = "fixed"

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        return {t.alloc_id: {"cpu_utilization": 2.0, "memory_used": 1e9} for t in targets}

    def forget(self, alloc_id: str) -> None:
        pass


async def lattice(
    env: dict[str, str], *args: str, lines: int | None = None
) -> tuple[int, str, str]:
    """Run ``lattice ARGS``; with ``lines`` stop (SIGINT) after that many stdout lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lattice_cli.main",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    if lines is None:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode or 0, out.decode(), err.decode()
    got = [await asyncio.wait_for(proc.stdout.readline(), 20) for _ in range(lines)]
    proc.send_signal(2)
    _, err = await asyncio.wait_for(proc.communicate(), 10)
    return proc.returncode or 0, b"".join(got).decode(), err.decode()


async def test_watch_and_telemetry_commands(tmp_path: Path) -> None:
    async with serve_local_api() as api:  # development mode: the caller is $USER
        api.add_tenant("physics")
        api.add_vcluster("batch")
        api.add_node("n1")
        spec = AllocationSpec(
            entrypoint="sleep 600",
            tenant="physics",
            vcluster="batch",
            user="alice",
            walltime_seconds=3600,
        )
        alloc = api.submit(spec)
        api.start(alloc.id, ["n1"])
        pending = api.submit(spec).id
        loop = TelemetryLoop(
            lambda: [Target(AllocLabels(alloc.id, "n1", "physics", "alice"))],
            [Fixed()],
            window_seconds=1.0,
            interval=0.2,
            alert_rules=[AlertRule("cpu_idle", "cpu_utilization", "<", 10.0, 0.4, message="idle")],
        )
        server = Server(
            [
                NodeAgentService(
                    "n1", cast(Any, None), tmp_path, telemetry=loop, allocation={alloc.id: 1}.get
                )
            ]
        )
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        api.add_node("n1", agent_address=f"127.0.0.1:{port}")
        task = asyncio.create_task(loop.run())
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
        env.update(
            LATTICE_ENDPOINT=api.rest_url,
            USER="alice",
            HOME=str(tmp_path),
            XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        )
        try:
            rc, out, err = await lattice(
                env, "watch", alloc.id, "--alerts-only", "-o", "json", lines=1
            )
            assert rc == 0, err  # Ctrl-C ends a watch normally
            alert = json.loads(out)
            assert alert["event"] == "alert" and alert["node_id"] == "n1"
            assert alert["alert_events"][0]["rule"] == "cpu_idle"

            rc, out, err = await lattice(
                env, "watch", alloc.id, "--metrics", "memory_used", lines=2
            )
            first, second = out.splitlines()
            assert "n1 [prod · 1 s] MEMORY 1.0 GB" in first and "CPU" not in first
            assert "MEMORY 1.0 GB" in second

            rc, out, err = await lattice(
                env, "telemetry", "--alloc", alloc.id, "--mode", "debug", "--duration", "2s"
            )
            assert rc == 0, err
            assert out.startswith(f"Telemetry of {alloc.id} is now debug on 1 node until ")
            assert loop.mode(alloc.id) == "debug"
            rc, out, err = await lattice(
                env, "telemetry", "--alloc", alloc.id, "--mode", "prod", "-o", "json"
            )
            assert json.loads(out)["nodes"][0]["mode"] == "prod" and loop.mode(alloc.id) == "prod"

            rc, out, err = await lattice(env, "telemetry", "--alloc", alloc.id, "--mode", "loud")
            assert rc == 2 and "unknown telemetry mode 'loud'" in err
            rc, out, err = await lattice(env, "watch", pending)
            assert rc == 1 and "is Pending: it has no live metrics until it runs" in err
            assert "Hint:" in err
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.close()
            await server.wait_closed()
