"""Telemetry modes survive an agent restart: the loop saves its mode table after every
change in the agent's state directory and a new loop (the restarted agent) takes it back,
with the modes whose end passed meanwhile reverted; the mode table's restore on its own
(hypothesis); a corrupt file is moved aside, not trusted."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.telemetry.loop import ModeTable, TelemetryLoop
from lattice_agent.telemetry.samples import MODE_AUDIT, MODE_DEBUG, MODE_PROD


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def loop(path: Path, clock: Clock, mode: str = MODE_PROD) -> TelemetryLoop:
    return TelemetryLoop(lambda: [], [], mode=mode, clock=clock, modes_file=path)


def test_modes_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "agent-state.telemetry.json"
    clock = Clock(1000.0)
    first = loop(path, clock)
    assert first.set_mode("sens", MODE_AUDIT) is None  # until changed
    assert first.set_mode("dbg", MODE_DEBUG, 600) == 1600.0
    assert first.set_mode("short", MODE_DEBUG, 60) == 1060.0
    saved = json.loads(path.read_text())
    assert saved["default"] == MODE_PROD and set(saved["modes"]) == {"sens", "dbg", "short"}
    assert path.stat().st_mode & 0o777 == 0o600

    clock.t = 1100.0  # the agent was down 100 s: "short" ended meanwhile
    second = loop(path, clock)
    assert second.mode("sens") == MODE_AUDIT
    assert second.mode("dbg") == MODE_DEBUG and second.modes.until("dbg") == 1600.0
    assert second.mode("short") == MODE_PROD
    assert set(json.loads(path.read_text())["modes"]) == {"sens", "dbg"}

    second.set_mode("dbg", MODE_PROD)  # back to the default: gone from the file
    second.modes.forget("sens")  # the allocation left the node
    assert json.loads(path.read_text())["modes"] == {}
    clock.t = 1200.0
    assert loop(path, clock).modes.entries() == {}


def test_a_mode_that_ends_is_saved_as_ended(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    clock = Clock(0.0)
    first = loop(path, clock)
    first.set_mode("a", MODE_DEBUG, 10)
    clock.t = 11.0
    assert first.mode("a") == MODE_PROD  # reverted in memory ...
    assert json.loads(path.read_text())["modes"] == {}  # ... and on disk


def test_corrupt_file_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("{not json")
    fresh = loop(path, Clock(0.0))
    assert fresh.modes.entries() == {}
    assert (tmp_path / "m.json.corrupt").read_text() == "{not json"


modes = st.sampled_from([MODE_PROD, MODE_DEBUG, MODE_AUDIT])


@given(
    st.dictionaries(
        st.text("abc123", min_size=1, max_size=4),
        st.tuples(modes, st.none() | st.floats(0, 200)),
        max_size=10,
    ),
    st.floats(0, 200),
    modes,
)
def test_restore_keeps_exactly_the_live_modes(entries, now: float, default: str) -> None:
    saved = {aid: {"mode": m, "until": u} for aid, (m, u) in entries.items()}
    table = ModeTable(default)
    table.restore(saved, now)
    for aid, (m, u) in entries.items():
        live = u is None or now < u
        assert table.get(aid, now) == (m if live else default)
    assert all(not (m == default and u is None) for m, u in table._modes.values())
    assert (
        table.restore(
            {"x": {"mode": "loud"}, "y": "junk", "z": {"mode": MODE_AUDIT, "until": "soon"}}, now
        )
        == []
    )
