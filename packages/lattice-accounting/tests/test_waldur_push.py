"""The push to a real (fake) Waldur over HTTP: outages, slowness, errors, restarts, drops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from lattice_accounting.waldur.buffer import EventBuffer
from lattice_accounting.waldur.client import (
    WaldurAuthError,
    WaldurClient,
    WaldurServerError,
    WaldurTimeout,
    WaldurUnreachable,
)
from lattice_accounting.waldur.events import AccountingEvent, EventType
from lattice_accounting.waldur.metrics import WaldurMetrics
from lattice_accounting.waldur.pusher import WaldurPusher, backoff_delay
from lattice_test_harness.fake_waldur import FakeWaldur
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

pytestmark = pytest.mark.timeout(120)

TOKEN = "waldur-token-0123456789abcdef"


def started(i: int) -> AccountingEvent:
    return AccountingEvent(
        event_id=f"ev-{i:04d}",
        type=EventType.ALLOCATION_STARTED,
        timestamp=1000.0 + i,
        tenant="physics",
        project="lattice-sim",
        user="alice",
        vcluster="hpc-batch",
        allocation_id=f"a{i}",
        nodes=("n1",),
        gpus=4,
        started_at=1000.0 + i,
    )


def completed(i: int) -> AccountingEvent:
    return AccountingEvent(
        event_id=f"done-{i:04d}",
        type=EventType.ALLOCATION_COMPLETED,
        timestamp=5000.0 + i,
        tenant="physics",
        project="lattice-sim",
        user="alice",
        vcluster="hpc-batch",
        allocation_id=f"a{i}",
        nodes=("n1", "n2"),
        gpus=8,
        started_at=1000.0,
        ended_at=4600.0,
        node_hours=2.0,
        gpu_hours=8.0,
        state="Completed",
        exit_status=0,
    )


async def until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(pusher: WaldurPusher) -> AsyncIterator[WaldurPusher]:
    task = asyncio.create_task(pusher.run())
    try:
        yield pusher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def make(
    waldur: FakeWaldur,
    path: Path,
    *,
    memory: int = 10,
    disk_bytes: int = 1 << 20,
    alert: int = 1000,
    timeout: float = 5.0,
    registry: CollectorRegistry | None = None,
) -> WaldurPusher:
    m = WaldurMetrics(registry or CollectorRegistry())
    buf = EventBuffer(
        path, memory_max=memory, disk_max_bytes=disk_bytes, disk_alert_events=alert, metrics=m
    )
    client = WaldurClient(waldur.api_url, SecretStr(TOKEN), timeout=timeout)
    return WaldurPusher(
        client,
        buf,
        push_interval_seconds=0.05,
        batch_size=8,
        retry_initial_seconds=0.05,
        retry_max_seconds=0.3,
        metrics=m,
    )


@pytest.fixture
async def waldur() -> AsyncIterator[FakeWaldur]:
    async with FakeWaldur(token=TOKEN) as w:
        yield w


async def test_events_reach_waldur_as_orders_and_invoice_items(
    waldur: FakeWaldur, tmp_path: Path
) -> None:
    pusher = make(waldur, tmp_path)
    pusher.submit([started(1), completed(1)])
    assert await pusher.push_once() == 2
    assert waldur.backend_ids == ["ev-0001", "done-0001"]
    first = waldur.orders[0]
    assert first["type"] == "Create" and first["customer"] == "physics"
    assert first["project"] == "lattice-sim" and first["offering"] == "hpc-batch"
    assert first["attributes"]["gpus"] == 4 and first["attributes"]["user"] == "alice"
    assert waldur.orders[1]["type"] == "Terminate"
    (item,) = waldur.invoice_items["physics"]
    assert item["backend_id"] == "done-0001"
    assert (item["unit"], item["quantity"]) == ("gpu_hours", 8.0)
    st = pusher.status()
    assert st.reachable is True and st.last_push is not None and st.pushed == 2
    assert (st.buffered, st.wal_events, st.dropped, st.last_error) == (0, 0, 0, "")
    await pusher.client.close()


async def test_waldur_down_buffers_spills_to_disk_and_replays_in_order(
    waldur: FakeWaldur, tmp_path: Path
) -> None:
    reg = CollectorRegistry()
    pusher = make(waldur, tmp_path, memory=10, alert=20, registry=reg)
    async with running(pusher):
        pusher.submit([started(i) for i in range(5)])
        await until(lambda: len(waldur.orders) == 5, "the first events")
        await waldur.down()
        pusher.submit([started(i) for i in range(5, 45)])
        await until(lambda: pusher.status().consecutive_failures >= 2, "failed rounds")
        st = pusher.status()
        assert st.reachable is False and "cannot reach Waldur" in st.last_error
        assert st.buffered == 10 and st.wal_events == 30  # memory full, the rest on disk
        assert st.disk_alert and st.dropped == 0
        assert reg.get_sample_value("lattice_accounting_disk_buffer_alert") == 1
        assert reg.get_sample_value("lattice_accounting_events_buffered", {"where": "disk"}) == 30
        assert (
            reg.get_sample_value("lattice_accounting_push_errors_total", {"kind": "unreachable"})
            >= 2
        )
        await waldur.up()
        await until(lambda: len(waldur.orders) == 45, "the replay", timeout=60)
        await until(lambda: pusher.status().wal_events == 0, "an empty WAL")
    assert waldur.backend_ids == [f"ev-{i:04d}" for i in range(45)]
    st = pusher.status()
    assert st.reachable is True and st.buffered == 0 and not st.disk_alert
    assert list(tmp_path.glob("*.wal")) == []
    await pusher.client.close()


async def test_erroring_waldur_backs_off_and_then_delivers_everything_once(
    waldur: FakeWaldur, tmp_path: Path
) -> None:
    pusher = make(waldur, tmp_path)
    waldur.erroring(503)
    async with running(pusher):
        pusher.submit([started(i) for i in range(6)] + [completed(0)])
        await until(lambda: pusher.status().consecutive_failures >= 3, "failed rounds")
        assert "503" in pusher.status().last_error
        assert pusher.next_delay() > pusher.push_interval_seconds  # backing off
        assert waldur.orders == []
        waldur.erroring(0)
        await until(lambda: len(waldur.orders) == 7, "delivery after the errors")
        # the usage of the completed allocation is its own request, after its order
        await until(lambda: waldur.invoice_items.get("physics"), "the invoice item")
    assert waldur.backend_ids == [*(f"ev-{i:04d}" for i in range(6)), "done-0000"]
    assert len(waldur.invoice_items["physics"]) == 1
    await pusher.client.close()


async def test_a_retried_event_is_recorded_once(waldur: FakeWaldur, tmp_path: Path) -> None:
    pusher = make(waldur, tmp_path)
    pusher.submit([completed(7)])
    # the order goes through, the invoice item hits an error: the event is retried
    calls = {"n": 0}
    original = pusher.client.add_invoice_item

    async def flaky(invoice_id: str, item: dict) -> dict:
        calls["n"] += 1
        if calls["n"] == 1:
            waldur.erroring(500, count=1)
        return await original(invoice_id, item)

    pusher.client.add_invoice_item = flaky  # type: ignore[method-assign]
    with pytest.raises(WaldurServerError):
        await pusher.push_once()
    assert len(pusher.buffer) == 1  # not acknowledged
    assert await pusher.push_once() == 1
    assert waldur.backend_ids == ["done-0007"]  # the repeated order was a 409
    assert waldur.duplicates == 1
    assert len(waldur.invoice_items["physics"]) == 1
    await pusher.client.close()


async def test_slow_waldur_times_out_then_catches_up(waldur: FakeWaldur, tmp_path: Path) -> None:
    pusher = make(waldur, tmp_path, timeout=1.0)
    waldur.slow(3.0)
    pusher.submit([started(i) for i in range(3)])
    with pytest.raises(WaldurTimeout):
        await pusher.push_once()
    assert pusher.status().last_error.startswith("Waldur did not answer")
    waldur.slow(0.1)  # slow but within the timeout
    async with running(pusher):
        await until(lambda: len(pusher.buffer) == 0, "the slow delivery")
    # the request that timed out may have been recorded: never twice
    assert waldur.backend_ids == [f"ev-{i:04d}" for i in range(3)]
    await pusher.client.close()


async def test_restart_with_events_in_the_wal_replays_them(
    waldur: FakeWaldur, tmp_path: Path
) -> None:
    await waldur.down()
    first = make(waldur, tmp_path, memory=3)
    first.submit([started(i) for i in range(10)])
    with pytest.raises(WaldurUnreachable):
        await first.push_once()
    assert first.status().wal_events == 7
    await first.client.close()
    del first  # a crash: memory (ev-0000..2) is lost, the disk is not

    await waldur.up()
    second = make(waldur, tmp_path, memory=3)
    assert second.status().wal_events == 7
    second.submit([started(10)])  # queues behind the replay
    assert await second.push_once() == 8
    assert waldur.backend_ids == [f"ev-{i:04d}" for i in range(3, 11)]
    await second.client.close()


async def test_clean_shutdown_keeps_memory_too(waldur: FakeWaldur, tmp_path: Path) -> None:
    await waldur.down()
    first = make(waldur, tmp_path, memory=3)
    first.submit([started(i) for i in range(5)])
    first.buffer.close()
    await first.client.close()
    await waldur.up()
    second = make(waldur, tmp_path, memory=3)
    assert await second.push_once() == 5
    assert waldur.backend_ids == [f"ev-{i:04d}" for i in range(5)]
    await second.client.close()


async def test_drop_only_when_memory_and_disk_are_full(
    waldur: FakeWaldur, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = CollectorRegistry()
    await waldur.down()
    pusher = make(waldur, tmp_path, memory=5, disk_bytes=4096, alert=10, registry=reg)
    r = pusher.submit([started(i) for i in range(5)])
    assert r.dropped == 0 and pusher.status().buffered == 5
    with caplog.at_level(logging.ERROR):
        r = pusher.submit([started(i) for i in range(5, 200)])
    kept_on_disk = r.disk
    assert r.dropped == 195 - kept_on_disk > 0
    st = pusher.status()
    assert st.dropped == r.dropped
    assert reg.get_sample_value("lattice_accounting_events_dropped_total") == r.dropped
    assert "dropped" in caplog.text and "reconcile" in caplog.text
    await waldur.up()
    assert await pusher.push_once() == 5 + kept_on_disk
    # what fitted arrives in order; the dropped tail is missing, nothing else
    assert waldur.backend_ids == [f"ev-{i:04d}" for i in range(5 + kept_on_disk)]
    await pusher.client.close()


async def test_bad_token_is_an_auth_error_and_never_logged(
    waldur: FakeWaldur, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = "wrong-token-do-not-log-me"
    buf = EventBuffer(tmp_path, memory_max=5, disk_max_bytes=1 << 20, disk_alert_events=10)
    pusher = WaldurPusher(
        WaldurClient(waldur.url, SecretStr(bad)), buf, metrics=WaldurMetrics(CollectorRegistry())
    )
    assert bad not in repr(pusher.client)
    pusher.submit([started(1)])
    with caplog.at_level(logging.DEBUG), pytest.raises(WaldurAuthError) as e:
        await pusher.push_once()
    assert "401" in e.value.message and e.value.hint
    assert bad not in caplog.text and bad not in str(pusher.status().to_dict())
    assert waldur.orders == [] and len(buf) == 1
    # a rotated token is used from the next request on
    pusher.client.set_token(SecretStr(TOKEN))
    assert await pusher.push_once() == 1
    await pusher.client.close()


async def test_an_invalid_event_is_skipped_not_blocking(waldur: FakeWaldur, tmp_path: Path) -> None:
    reg = CollectorRegistry()
    pusher = make(waldur, tmp_path, registry=reg)
    bad = AccountingEvent(
        event_id="",  # Waldur refuses an order without backend_id (400)
        type=EventType.ALLOCATION_STARTED,
        timestamp=1.0,
        tenant="physics",
        allocation_id="broken",
    )
    pusher.submit([started(1), bad, started(2)])
    assert await pusher.push_once() == 2
    assert waldur.backend_ids == ["ev-0001", "ev-0002"]
    assert pusher.status().rejected == 1
    assert reg.get_sample_value("lattice_accounting_events_rejected_total") == 1
    await pusher.client.close()


def test_backoff_doubles_up_to_the_maximum() -> None:
    assert [backoff_delay(n, 1.0, 10.0) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert backoff_delay(1000, 1.0, 300.0) == 300.0
