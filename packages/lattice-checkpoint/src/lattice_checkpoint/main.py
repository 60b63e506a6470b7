"""``lattice-checkpoint``: the checkpoint broker (stateless; see ``broker``)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from lattice_common.config import load_config
from lattice_common.errors import LatticeError
from lattice_common.process import daemon_main, run_until_signal, start_metrics
from lattice_common.rpc import Endpoints, RemoteQuorum, service_tls

if TYPE_CHECKING:  # the broker (prometheus, asyncio) loads only when the daemon starts
    from lattice_checkpoint.broker import Broker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lattice-checkpoint",
        description="Run the Lattice checkpoint broker: evaluate the checkpoint cost model "
        "for running allocations and send checkpoint hints through the quorum.",
    )
    p.add_argument("--config", help="YAML config file (checkpoint section)")
    p.add_argument(
        "--quorum-endpoint",
        default=os.environ.get("LATTICE_QUORUM_ENDPOINT", "127.0.0.1:50051"),
        help="lattice-server gRPC address(es), comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--evaluation-interval",
        type=float,
        help="seconds between evaluations (default: config checkpoint."
        "evaluation_interval_seconds, 30)",
    )
    p.add_argument(
        "--checkpoint-root",
        help="checkpoint destination the write probe writes to, a directory or "
        "s3://bucket/prefix (default: config "
        "checkpoint.checkpoint_root)",
    )
    p.add_argument(
        "--history-database-url",
        help="the quorum's history store, asked about allocations that left its state "
        "when checkpoint retention decides (default: config storage.history_database_url; "
        "without one, only allocations still in the state are judged)",
    )
    p.add_argument(
        "--metrics-listen", help="host:port for /metrics; empty to disable (default: config)"
    )
    p.add_argument("--log-level", default=os.environ.get("LATTICE_LOG_LEVEL", "info"))
    return p.parse_args(argv)


def build_broker(args: argparse.Namespace) -> Broker:
    """The broker the command line and config file describe (starts nothing but the
    metrics endpoint)."""
    from lattice_checkpoint import cost
    from lattice_checkpoint.broker import PROBE_BYTES, Broker, Retention
    from lattice_checkpoint.health import TsdbHealth
    from lattice_checkpoint.storage import open_checkpoint_store

    cfg = load_config(args.config)
    ck = cfg.checkpoint
    interval = (
        args.evaluation_interval
        if args.evaluation_interval is not None
        else ck.evaluation_interval_seconds
    )
    if interval <= 0:
        raise LatticeError(
            "--evaluation-interval must be greater than zero",
            hint="Give seconds between evaluations, e.g. --evaluation-interval 30.",
        )
    root = args.checkpoint_root or ck.checkpoint_root
    store = open_checkpoint_store(root, cfg.storage, probe_bytes=PROBE_BYTES)
    start_metrics(ck.metrics_listen if args.metrics_listen is None else args.metrics_listen)
    token = cfg.api.agent_token.get_secret_value() if cfg.api.agent_token else None
    quorum = RemoteQuorum(
        Endpoints(args.quorum_endpoint, ssl=service_tls(cfg.tls, "checkpoint")), token=token
    )
    return Broker(
        quorum,
        store,
        interval=interval,
        params=cost.ModelParams(
            node_mtbf_hours=ck.node_mtbf_hours,
            default_checkpoint_bytes_per_node=ck.default_checkpoint_gib_per_node * cost.GIB,
        ),
        storage_cost_gpu_hours_per_gb=ck.storage_cost_gpu_hours_per_gb,
        # ECC and thermal signals from the TSDB the agents push to; none without one
        health=TsdbHealth(cfg.telemetry.tsdb_endpoint) if cfg.telemetry.tsdb_endpoint else None,
        retention=Retention(store, ck.retention_days * 86400.0) if ck.retention_days > 0 else None,
    )


async def run(args: argparse.Namespace) -> None:
    broker = build_broker(args)
    url = args.history_database_url or load_config(args.config).storage.history_database_url
    if broker.retention is not None and url:
        from lattice_common.history import HistoryStore

        broker.retention.history = await HistoryStore.open(url)
    await run_until_signal(broker.run())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    daemon_main("lattice-checkpoint", args.log_level, lambda: run(args))


if __name__ == "__main__":
    main()
