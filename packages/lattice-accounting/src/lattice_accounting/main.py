"""``lattice-accounting --config FILE``: the accounting service process.

Opens the ledger (``accounting.database_url``; by default SQLite ``ledger.db`` under
``accounting.data_dir``), serves the internal API for lattice-server on
``accounting.listen`` and Prometheus metrics on ``accounting.metrics_listen``, follows
the quorum's watch stream as an internal service (``api.agent_token``, or the service
certificate with mTLS, like the schedulers), and runs the job charger and the watchdog;
with ``accounting.provider: waldur`` also the Waldur feed and pusher.
With ``accounting.enabled: false`` it refuses to start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from lattice_common.config import load_config
from lattice_common.errors import FailedPrecondition, LatticeError
from lattice_common.process import daemon_main, run_until_signal, start_metrics

log = logging.getLogger("lattice.accounting")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lattice-accounting",
        description="Run the accounting service: ledger, reservation gate, job charger, "
        "watchdog (and the Waldur push with provider waldur).",
    )
    p.add_argument("--config", help="YAML config file (the accounting section)")
    p.add_argument(
        "--quorum-endpoint",
        default=os.environ.get("LATTICE_QUORUM_ENDPOINT", "127.0.0.1:50051"),
        help="lattice-server gRPC address(es), comma-separated (default: %(default)s)",
    )
    p.add_argument("--log-level", default=os.environ.get("LATTICE_LOG_LEVEL", "info"))
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    from aiohttp import web
    from lattice_common.net import split_host_port
    from lattice_common.rpc import Endpoints, RemoteQuorum, service_tls

    from lattice_accounting.api import build_app
    from lattice_accounting.binding import ServiceLedger
    from lattice_accounting.metrics import ServiceMetrics
    from lattice_accounting.service import AccountingService

    cfg = load_config(args.config)
    ac = cfg.accounting
    if not ac.enabled:
        raise FailedPrecondition(
            "accounting is not enabled",
            hint="Set accounting.enabled: true in the configuration to run lattice-accounting.",
        )
    if ac.service_token is None or not ac.service_token.get_secret_value():
        raise FailedPrecondition(
            "no accounting.service_token",
            hint="Set the same token on lattice-server and lattice-accounting "
            "(LATTICE_ACCOUNTING__SERVICE_TOKEN or a secret reference).",
        )
    if not ac.database_url:
        Path(ac.data_dir).mkdir(parents=True, exist_ok=True)
    start_metrics(ac.metrics_listen)
    # PostgreSQL: enough pooled connections for the API's concurrent reservations (an
    # overflow connection is opened and closed per request, the slowest part of a call)
    ledger = await ServiceLedger.open(ac.ledger_url, pool_size=32)
    token = cfg.api.agent_token.get_secret_value() if cfg.api.agent_token else None
    quorum = RemoteQuorum(Endpoints(args.quorum_endpoint, ssl=service_tls(cfg.tls)), token=token)
    svc = AccountingService(
        ledger,
        quorum,
        charge_interval=ac.charge_interval_seconds,
        reserve_ahead=ac.reserve_ahead_seconds,
        exhausted_grace=ac.funds_exhausted_grace_seconds,
        start_timeout=ac.reservation_start_timeout_seconds,
        orphan_grace=ac.reservation_orphan_grace_seconds,
        metrics=ServiceMetrics(),
    )
    history = None
    if cfg.storage.history_database_url:  # the quorum's history store, shared
        from lattice_common.history import HistoryStore

        history = svc.history = await HistoryStore.open(cfg.storage.history_database_url)
    pusher = None
    tasks = [asyncio.create_task(svc.follow()), asyncio.create_task(svc.run_charger())]
    if ac.provider == "waldur":
        from lattice_accounting.waldur.feed import AccountingFeed, build_pusher
        from lattice_accounting.waldur.metrics import WaldurMetrics

        Path(ac.disk_buffer_path).mkdir(parents=True, exist_ok=True)
        pusher = build_pusher(ac, metrics=WaldurMetrics())
        feed = AccountingFeed(pusher)
        tasks.append(asyncio.create_task(pusher.run()))
        tasks.append(asyncio.create_task(_follow_feed(feed, quorum)))
    runner = web.AppRunner(
        build_app(svc, ac.service_token.get_secret_value(), waldur=pusher), access_log=None
    )
    await runner.setup()
    host, port = split_host_port(ac.listen, default_host="127.0.0.1")
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    log.info(
        "lattice-accounting up: internal API %s, metrics %s, ledger %s, provider %s",
        ac.listen,
        ac.metrics_listen or "off",
        ledger.engine.dialect.name,
        ac.provider,
    )
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()
        await ledger.close()
        if history is not None:
            await history.close()


async def _follow_feed(feed: Any, quorum: Any) -> None:
    while True:
        try:
            await feed.run(quorum.watch())
        except asyncio.CancelledError:
            raise
        except LatticeError as e:
            log.warning("Waldur feed: quorum stream: %s", e.message)
        await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    daemon_main("lattice-accounting", args.log_level, lambda: run_until_signal(run(args)))


if __name__ == "__main__":
    main()
