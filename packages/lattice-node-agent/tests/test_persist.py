"""persist.py: the agent's state file (format, 0600, atomic replace, corrupt files set aside)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from lattice_agent import persist
from lattice_agent.lifecycle import Lifecycle, Status
from lattice_agent.persist import STATE_VERSION, SavedAlloc, StateFile, from_entry, to_entry
from lattice_agent.spawn import AllocPaths

KEYS = {
    "id", "pid", "pgid", "proc_start", "started_at", "walltime_seconds", "deadline", "work_dir",
    "stdout", "stderr", "exit_file", "phase", "exit_code", "reason", "finished_at",
    "stop_reason", "kill_signal",
        "peak_memory_bytes",
}  # fmt: skip


def saved(**life: object) -> SavedAlloc:
    fields: dict = {"status": Status.RUNNING, "walltime_seconds": 60.0, "deadline": 160.0}
    rec = Lifecycle(allocation_id="a1", started_at=100.0, **(fields | life))
    return SavedAlloc(rec, 4242, 4242, 987, AllocPaths.of("a1", Path("/w"), Path("/l")))


def test_entry_round_trip_keeps_the_format() -> None:
    s = saved(stop_reason="cancelled", kill_signal=15)
    entry = to_entry(s)
    assert set(entry) == KEYS
    assert (entry["id"], entry["phase"], entry["stdout"]) == ("a1", "running", "/l/a1/stdout.log")
    assert json.loads(json.dumps(entry)) == entry
    assert from_entry(entry) == s


def test_an_exited_entry_comes_back_exited() -> None:
    s = saved(status=Status.EXITED, exit_code=3, reason="", finished_at=120.0)
    back = from_entry(to_entry(s)).life
    assert (back.status, back.phase, back.exit_code, back.finished_at) == (
        Status.EXITED,
        "exited",
        3,
        120.0,
    )


def test_a_minimal_old_entry_gets_defaults() -> None:
    entry = {"id": "a", "pid": 7, "started_at": 1.0, "work_dir": "/w/a",
             "stdout": "/l/a/o", "stderr": "/l/a/e"}  # fmt: skip
    s = from_entry(entry)
    assert (s.pgid, s.paths.exit_file, s.life.status, s.life.walltime_seconds) == (
        7,
        Path("/w/a/exit_code"),
        Status.RUNNING,
        0.0,
    )
    with pytest.raises(KeyError):
        from_entry({"id": "a"})


def test_state_file_is_private_and_replaced_atomically(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "state" / "agent-state.json", node_id="n1", clock=lambda: 5.0)
    assert f.load() == []
    f.save([to_entry(saved())])
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    data = json.loads(f.path.read_text())
    assert (data["version"], data["node_id"], data["written_at"]) == (STATE_VERSION, "n1", 5.0)
    assert f.load() == [to_entry(saved())]
    f.save([])
    assert f.load() == []
    # beside it only its swap file (the previous version, written over next time)
    assert sorted(os.listdir(f.path.parent)) == [".agent-state.json.swap", "agent-state.json"]
    assert stat.S_IMODE(os.stat(f.path.parent / ".agent-state.json.swap").st_mode) == 0o600


def test_rewriting_the_state_file_takes_no_new_inode(tmp_path: Path) -> None:
    """Each save writes the swap file and exchanges it with the state file: the two
    inodes trade places, none is created or freed (a rename over the file freed one per
    save, which on ext4 costs ten times the exchange)."""
    f = StateFile(tmp_path / "agent-state.json", node_id="n1", clock=lambda: 5.0)
    f.save([])
    f.save([to_entry(saved())])
    inodes = {os.stat(f.path).st_ino, os.stat(tmp_path / ".agent-state.json.swap").st_ino}
    for i in range(5):
        f.save([to_entry(saved())] * (i % 3))  # longer and shorter than before
        assert f.load() == [to_entry(saved())] * (i % 3)
        assert os.stat(f.path).st_ino in inodes
        assert {os.stat(p).st_ino for p in tmp_path.iterdir()} == inodes


def test_a_failed_save_leaves_the_previous_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = StateFile(tmp_path / "agent-state.json", node_id="n1", clock=lambda: 5.0)
    f.save([to_entry(saved())])

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    f.save([])  # logged, not raised: the agent goes on
    monkeypatch.undo()
    assert f.load() == [to_entry(saved())]


def test_without_an_atomic_exchange_the_state_file_is_renamed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(persist, "_renameat2", False)  # a C library without renameat2
    f = StateFile(tmp_path / "agent-state.json", node_id="n1", clock=lambda: 5.0)
    f.save([to_entry(saved())])
    f.save([])
    assert f.load() == []
    assert os.listdir(tmp_path) == ["agent-state.json"]


def test_corrupt_state_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "agent-state.json"
    f = StateFile(path, node_id="n1", clock=lambda: 0.0)
    path.write_text("{not json")
    assert f.load() == []
    assert not path.exists()
    assert (tmp_path / "agent-state.json.corrupt").read_text() == "{not json"
    path.write_text(json.dumps({"allocations": [{"id": "x"}, "junk", 3]}))
    assert f.load() == [{"id": "x"}]  # non-objects are dropped; from_entry judges the rest


def test_state_file_stays_readable_and_its_directory_comes_back(tmp_path: Path) -> None:
    """The file keeps its indented, sorted layout for whoever reads it by hand, and a
    state directory removed while the agent runs is made again at the next save."""
    f = StateFile(tmp_path / "state" / "agent-state.json", node_id="n1", clock=lambda: 5.0)
    entries = [to_entry(saved()), to_entry(saved(status=Status.EXITED, exit_code=0))]
    f.save(entries)
    expected = {"allocations": entries, "node_id": "n1", "version": STATE_VERSION}
    assert f.path.read_text() == json.dumps(
        expected | {"written_at": 5.0}, indent=1, sort_keys=True
    )
    f.path.unlink()
    f.path.parent.rmdir()
    f.save([])
    assert f.load() == []
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
