"""``lattice-scheduler``: the scheduling loops of one or more vClusters (stateless)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from lattice_common.config import load_config
from lattice_common.errors import LatticeError
from lattice_common.process import daemon_main, run_until_signal, start_metrics
from lattice_common.rpc import Endpoints, RemoteQuorum, service_tls

if TYPE_CHECKING:  # the loop (prometheus, asyncio) loads only when the daemon starts
    from lattice_scheduler.loop import Scheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lattice-scheduler",
        description="Run the scheduling loop of one or more vClusters against a Lattice quorum.",
    )
    p.add_argument(
        "--vcluster",
        action="append",
        required=True,
        help="vCluster to schedule (repeat, or comma-separate, for several)",
    )
    p.add_argument(
        "--quorum-endpoint",
        default=os.environ.get("LATTICE_QUORUM_ENDPOINT", "127.0.0.1:50051"),
        help="lattice-server gRPC address(es), comma-separated (default: %(default)s)",
    )
    p.add_argument("--config", help="YAML config file (scheduling section)")
    p.add_argument(
        "--cycle-interval", type=float, help="seconds between cycles (default: config, 5)"
    )
    p.add_argument(
        "--metrics-listen", help="host:port for /metrics; empty to disable (default: config)"
    )
    p.add_argument("--log-level", default=os.environ.get("LATTICE_LOG_LEVEL", "info"))
    return p.parse_args(argv)


def build_scheduler(args: argparse.Namespace) -> Scheduler:
    """The scheduler the command line and config file describe (starts nothing but
    the metrics endpoint). ``scheduling.budget_period_days`` is the window of the
    budget penalty, as of the usage the API reports."""
    from lattice_scheduler.loop import Scheduler

    cfg = load_config(args.config)
    interval = args.cycle_interval or cfg.scheduling.cycle_interval_seconds
    if interval <= 0:
        raise LatticeError(
            "--cycle-interval must be greater than zero",
            hint="Give seconds between cycles, e.g. --cycle-interval 5.",
        )
    start_metrics(
        cfg.scheduling.metrics_listen if args.metrics_listen is None else args.metrics_listen
    )
    vclusters = [v.strip() for arg in args.vcluster for v in arg.split(",") if v.strip()]
    token = cfg.api.agent_token.get_secret_value() if cfg.api.agent_token else None
    trace = None
    if cfg.scheduling.trace_capture:
        from lattice_scheduler.trace_capture import TraceCapture

        if not cfg.scheduling.trace_path:
            raise LatticeError(
                "scheduling.trace_capture is on but scheduling.trace_path is empty",
                hint="Set scheduling.trace_path to a local JSONL file.",
            )
        trace = TraceCapture(cfg.scheduling.trace_path)
    from lattice_scheduler.autoscaler import Autoscaler

    quorum = RemoteQuorum(
        Endpoints(args.quorum_endpoint, ssl=service_tls(cfg.tls, "scheduler")), token=token
    )
    # reactive allocations: their metric from the TSDB the agents push to
    autoscaler = Autoscaler(
        quorum,
        vclusters,
        tsdb_url=cfg.telemetry.tsdb_endpoint,
        default_interval=cfg.scheduling.scaling_evaluation_interval_seconds,
        # a scale-down of a checkpointable allocation waits this long for its checkpoint
        release_timeout=cfg.checkpoint.checkpoint_timeout_seconds,
        # a borrowed node its home vCluster reclaims is given back within this grace
        borrowed_grace=cfg.node_agent.borrowed_grace_period_seconds,
    )
    return Scheduler(
        quorum,
        vclusters,
        cycle_interval=interval,
        trace=trace,
        budget_period_days=cfg.scheduling.budget_period_days,
        estimates=cfg.scheduling.start_estimates,
        estimate_budget_seconds=cfg.scheduling.estimate_budget_seconds,
        autoscaler=autoscaler,
    )


async def run(args: argparse.Namespace) -> None:
    await run_until_signal(build_scheduler(args).run())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    daemon_main("lattice-scheduler", args.log_level, lambda: run(args))


if __name__ == "__main__":
    main()
