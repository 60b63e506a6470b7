"""The Waldur push end to end on a real dev cluster (lattice-server, a scheduler, an agent
and lattice-accounting with ``provider: waldur`` as processes) against the harness's fake
Waldur over real HTTP: while Waldur is down, scheduling and running work go on, the
events wait in memory and spill to the on-disk WAL; once Waldur is back they all arrive,
once each, in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from lattice_test_harness.fake_waldur import FakeWaldur

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

TOKEN = "waldur-e2e-token"
TERMINAL = ("Completed", "Failed", "Cancelled")


class ThreadedWaldur:
    """The fake Waldur on an event loop of its own (the test is synchronous)."""

    def __init__(self) -> None:
        self.fake = FakeWaldur(token=TOKEN)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.call(self.fake.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def waldur() -> Iterator[ThreadedWaldur]:
    w = ThreadedWaldur()
    try:
        yield w
    finally:
        w.close()


def test_waldur_down_then_back_every_event_once_in_order(cluster_factory, waldur) -> None:
    url = waldur.call(waldur.fake.start())
    waldur.call(waldur.fake.down())  # down from the start: nothing can be pushed
    h = cluster_factory(
        members=1,
        agents=1,
        accounting=True,
        accounting_options={
            "provider": "waldur",
            "waldur_url": url + "/api/",
            "waldur_token": TOKEN,
            "push_interval_seconds": 0.5,
            "buffer_size": 2,  # the rest spills to the WAL
            "charge_interval_seconds": 1.0,
        },
    )
    jobs = [h.submit(f"echo job-{i}", walltime="1m") for i in range(4)]
    for j in jobs:  # scheduling and running are not held up by the push
        assert h.wait_state(j["id"], TERMINAL, timeout=60)["state"] == "Completed"

    def waiting() -> dict[str, Any] | None:
        st = h.request("GET", "/api/v1/admin/accounting/status")
        w = st.get("waldur") or {}
        return st if w.get("wal_events", 0) >= 2 and w.get("last_error") else None

    status = h.wait_for("events spilled to the WAL while Waldur is down", waiting, timeout=30)
    assert status["waldur"]["pushed"] == 0 and status["waldur"]["reachable"] is False

    waldur.call(waldur.fake.up())
    ids = {j["id"] for j in jobs}

    def delivered() -> list[dict[str, Any]] | None:
        orders = [
            o for o in waldur.fake.orders if o.get("attributes", {}).get("allocation_id") in ids
        ]
        kinds = [o["attributes"]["event"] for o in orders]
        return orders if kinds.count("allocation.completed") == len(ids) else None

    orders = h.wait_for("every job's events delivered", delivered, timeout=60)
    assert waldur.fake.duplicates == 0
    per_job: dict[str, list[str]] = {}
    for o in orders:
        per_job.setdefault(o["attributes"]["allocation_id"], []).append(o["attributes"]["event"])
    assert per_job == {a: ["allocation.started", "allocation.completed"] for a in ids}
    stamps = [o["attributes"]["timestamp"] for o in orders]
    assert stamps == sorted(stamps)  # replayed in the order they happened
    ids_seen = [o["backend_id"] for o in waldur.fake.orders]
    assert len(ids_seen) == len(set(ids_seen))
    after = h.request("GET", "/api/v1/admin/accounting/status")["waldur"]
    assert after["buffered"] == 0 and after["wal_events"] == 0
