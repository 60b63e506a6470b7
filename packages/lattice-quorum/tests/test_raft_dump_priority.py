"""The full dump's forked writer yields the CPU to the member and its peers: it runs at
the lowest priority with the cyclic collector off, and the dump it writes still loads.
The writer reports what it sees from inside the child, while it pickles the state."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

from lattice_quorum.raft import SafeSyncObj
from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated
from test_raft_follower_commit import _addr


class Probe:
    """Pickled only by the dump writer: records the writer's priority and collector."""

    def __init__(self, report: str) -> None:
        self.report = report

    def __getstate__(self) -> dict[str, Any]:
        # written aside and renamed: the test polls for the file and reads it at once
        aside = Path(self.report + ".tmp")
        aside.write_text(
            f"{os.getpid()} {os.getpriority(os.PRIO_PROCESS, 0)} {int(gc.isenabled())}"
        )
        os.replace(aside, self.report)
        return {"report": self.report}


class Counter(SyncObjConsumer):
    def __init__(self, report: str) -> None:
        super().__init__()
        self.value = 0
        self.probe = Probe(report)

    @replicated
    def add(self, n: int) -> int:
        self.value += n
        return self.value


def _dump_with(cls: type[SyncObj], tmp_path: Path) -> tuple[int, int, bool, int]:
    report = tmp_path / f"{cls.__name__}.report"
    dump = tmp_path / f"{cls.__name__}.dump"
    conf = SyncObjConf(autoTick=False, fullDumpFile=str(dump), journalFile=None)
    counter = Counter(str(report))
    member = cls(_addr(), [], conf=conf, consumers=[counter])
    try:
        deadline = time.monotonic() + 15
        while not member._isLeader() and time.monotonic() < deadline:
            member.doTick(0.01)
        counter.add(5)
        while counter.value != 5 and time.monotonic() < deadline:
            member.doTick(0.01)
        member.forceLogCompaction()
        while not (dump.exists() and report.exists()) and time.monotonic() < deadline:
            member.doTick(0.01)
        pid, nice, gc_on = (int(x) for x in report.read_text().split())
    finally:
        member.destroy()
    loaded = Counter(str(tmp_path / "unused"))
    again = SyncObj(
        _addr(), [], conf=SyncObjConf(autoTick=False, fullDumpFile=str(dump)), consumers=[loaded]
    )
    try:
        again.doTick(0.01)  # pysyncobj loads its dump on the first tick
        return pid, nice, bool(gc_on), loaded.value
    finally:
        again.destroy()


def test_the_dump_writer_runs_niced_without_the_collector(tmp_path: Path) -> None:
    pid, nice, gc_on, value = _dump_with(SafeSyncObj, tmp_path)
    assert pid != os.getpid()  # written by a forked child
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 19)
    assert gc_on is False
    assert value == 5  # the dump is whole
    assert gc.isenabled()  # the member itself is untouched
    assert os.getpriority(os.PRIO_PROCESS, 0) < 19


def test_plain_pysyncobj_writes_its_dump_at_the_members_priority(tmp_path: Path) -> None:
    pid, nice, gc_on, value = _dump_with(SyncObj, tmp_path)
    assert pid != os.getpid()
    assert nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert gc_on is True
    assert value == 5
