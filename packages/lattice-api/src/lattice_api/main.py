"""``lattice-server``: one quorum member and the API in one asyncio process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

from aiohttp import web
from lattice_common.agents import AgentChannels
from lattice_common.config import LatticeConfig, load_config
from lattice_common.logcrypt import open_sensitive_log_store  # log store: sensitive pool
from lattice_common.logstore import open_log_store  # log store
from lattice_common.net import split_host_port
from lattice_common.process import daemon_main
from lattice_quorum.member import QuorumMember

from lattice_api.auth import Authenticator
from lattice_api.cluster_metrics import register_cluster_metrics
from lattice_api.fabric import FabricManager
from lattice_api.grpc.server import build_grpc_server
from lattice_api.log_retention import LogRetention, RetentionPolicy  # log retention
from lattice_api.logs import LogProxy
from lattice_api.node_monitor import NodeMonitor
from lattice_api.oidc import OidcProvider
from lattice_api.operations import Operations
from lattice_api.ops.backup import BackupOps, BackupScheduler, prepare_recovery, restore_into
from lattice_api.rest.app import build_rest_app
from lattice_api.rotation import watch_api_secrets
from lattice_api.settings import ApiSettings
from lattice_api.tls import ServerTls

log = logging.getLogger("lattice.server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lattice-server",
        description="Run one Lattice quorum member (Raft + GlobalState) with the gRPC and REST API.",
    )
    p.add_argument("--config", help="YAML config file (default: built-in defaults + LATTICE_* env)")
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="initialise a new Raft cluster; only on the very first start of member 1",
    )
    p.add_argument(
        "--recover-from",
        metavar="FILE",
        help="with --bootstrap: start a fresh quorum holding the state of this backup "
        "(a path or s3://bucket/key); it is verified first (see lattice-api README)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --recover-from: move an existing quorum.data_dir aside instead of refusing",
    )
    p.add_argument("--log-level", default=os.environ.get("LATTICE_LOG_LEVEL", "info"))
    return p.parse_args(argv)


async def serve(
    cfg: LatticeConfig,
    *,
    bootstrap: bool = False,
    ready: asyncio.Event | None = None,
    recover_from: str = "",
    force: bool = False,
    config_path: str = "",
) -> None:
    q = cfg.quorum
    # a restore: the file verified and the data dir checked before anything starts
    recovery = await prepare_recovery(cfg, recover_from, bootstrap, force) if recover_from else None
    member = QuorumMember(
        node_id=q.node_id,
        bind=q.bind,
        peers={p.id: p.address for p in q.peers},
        data_dir=q.data_dir,
        bootstrap=bootstrap,
        append_entries_period=q.append_entries_period,
        auto_tick_period=q.auto_tick_period,
        raft_min_timeout=q.raft_min_timeout,
        raft_max_timeout=q.raft_max_timeout,
        commit_timeout=q.commit_timeout_seconds,
        log_compaction_min_entries=q.log_compaction_min_entries,
        log_compaction_min_time=q.log_compaction_min_time,
        raft_password=q.raft_password.get_secret_value() if q.raft_password else None,
    )
    loop = asyncio.get_running_loop()
    member.attach_loop(loop)
    if recovery is not None:  # the restored state committed before anyone can write
        await restore_into(member, recovery)
    api_addresses = {p.address: p.api_address for p in q.peers if p.api_address}
    api_addresses[q.bind] = cfg.api.grpc_listen
    secret = cfg.api.oidc_hmac_secret.get_secret_value() if cfg.api.oidc_hmac_secret else None
    agent_token = cfg.api.agent_token.get_secret_value() if cfg.api.agent_token else None
    oidc = (
        OidcProvider(cfg.api.oidc_issuer, cfg.api.oidc_client_id) if cfg.api.oidc_issuer else None
    )
    auth = Authenticator(hmac_secret=secret, agent_token=agent_token, oidc=oidc, site=cfg.tls.site)
    tls = ServerTls.from_config(cfg.api)
    if auth.dev_mode:
        log.warning(
            "NO AUTHENTICATION CONFIGURED: every caller is trusted as a system admin and "
            "identified by the x-lattice-user header. Set api.oidc_issuer (or "
            "api.oidc_hmac_secret / LATTICE_OIDC_HMAC_SECRET) outside development."
        )
    await auth.start()  # discovery and signing keys fetched before the first request
    na = cfg.node_agent
    monitor = NodeMonitor(
        member,
        heartbeat_timeout=na.heartbeat_timeout_seconds,
        grace_period=na.grace_period_seconds,
        sensitive_grace_period=na.sensitive_grace_period_seconds,
        borrowed_grace_period=na.borrowed_grace_period_seconds,
        max_prologue_retries=na.max_prologue_retries,
        heartbeat_interval=na.heartbeat_interval_seconds,
        heartbeat_burst=cfg.rate_limit.heartbeat_burst,
    )
    member.on_leadership(monitor.on_leadership)
    register_cluster_metrics(member, q.data_dir)  # /metrics: allocations, quotas, Raft disk
    settings = ApiSettings(
        budget_period_days=cfg.scheduling.budget_period_days,
        api_addresses=api_addresses,
        oidc_issuer=cfg.api.oidc_issuer,
        oidc_client_id=cfg.api.oidc_client_id,
        max_request_bytes=cfg.api.max_request_bytes,
        token_revalidation_interval=cfg.api.token_revalidation_interval_seconds,
        max_dag_size=cfg.scheduling.max_dag_size,
        uenv_registry=na.uenv_registry,
        uenv_signing_key=na.uenv_signing_key,
        rate_limit=cfg.rate_limit,
        audit_signing_key_path=cfg.api.audit_signing_key_path,
        audit_key_dir=q.data_dir,
        tls=cfg.tls,
        tsdb_endpoint=cfg.telemetry.tsdb_endpoint,
        telemetry_window_seconds=cfg.telemetry.aggregation_window_seconds,
        telemetry_mode=cfg.telemetry.mode,
        **_accounting_settings(cfg),
    )
    agents = AgentChannels(agent_token, ssl=tls.client if tls is not None else None)
    # log store: history; sensitive allocations' in the encrypted pool; retention
    log_store = open_log_store(cfg.storage)
    sensitive_log_store = open_sensitive_log_store(cfg.storage)
    retention = RetentionPolicy.from_storage(cfg.storage)
    logs = LogProxy(
        member, agents, log_store, sensitive_store=sensitive_log_store, retention=retention
    )
    log_sweeper = LogRetention(  # runs on the leader only
        member,
        {"ordinary": log_store, "sensitive": sensitive_log_store},
        retention,
        interval=cfg.storage.log_retention_interval_seconds,
    )
    fabric = FabricManager.from_config(cfg.network)
    ops = Operations(
        member,
        monitor=monitor,
        logs=logs,
        settings=settings,
        agents=agents,
        fabric=fabric,
        oidc=oidc,
        auth_mode=auth.mode,
    )
    # the history store and the leader's sweeper moving ended allocations into it
    history, history_sweeper = await open_history(cfg, member)
    ops.allocations.history = ops.usage.history = ops.accounting.history = history
    ops.usage.retention_seconds = cfg.storage.allocation_retention_hours * 3600.0
    if recovery is not None and member.is_leader:
        # elected while restoring, before these listened: tell them now
        monitor.on_leadership(True)
        ops.recorder.on_leadership(True)
    # backups: configured here (where, retention, S3 credentials); the leader's schedule
    ops.backup = BackupOps(
        member,
        audit=ops.recorder,
        config=cfg.backup,
        storage=cfg.storage,
        data_dir=q.data_dir,
        backup_dir=q.backup_dir,
        retention_count=q.snapshot_retention_count,
        site=cfg.tls.site,
        config_path=config_path,
    )
    backups = BackupScheduler(ops.backup)
    grpc = build_grpc_server(ops, auth)
    ghost, gport = split_host_port(cfg.api.grpc_listen, default_host="0.0.0.0")
    follow_ca = None
    if tls is not None:
        tls.trust_quorum_ca(member)
        ops.pki.on_change = lambda: tls.trust_quorum_ca(member)
        follow_ca = asyncio.create_task(tls.follow_ca(member))
    await grpc.start(ghost, gport, ssl=tls.grpc if tls is not None else None)
    runner = web.AppRunner(build_rest_app(ops, auth), access_log=None)
    await runner.setup()
    rhost, rport = split_host_port(cfg.api.rest_listen, default_host="0.0.0.0")
    site = web.TCPSite(
        runner, rhost, rport, reuse_address=True, ssl_context=tls.rest if tls is not None else None
    )
    await site.start()
    monitor.start()
    backups.start()
    log_sweeper.start()  # log retention
    history_sweeper.start()  # ended allocations -> the history store
    # secrets written as references are re-read and applied without restart
    secrets = watch_api_secrets(cfg, auth)
    log.info(
        "lattice-server member %s up: raft %s, gRPC %s, REST %s, %s",
        q.node_id,
        q.bind,
        cfg.api.grpc_listen,
        cfg.api.rest_listen,
        "no TLS" if tls is None else "mTLS on gRPC" if tls.mutual else "TLS",
    )
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        if follow_ca is not None:
            follow_ca.cancel()
        await monitor.stop()
        await backups.stop()
        await log_sweeper.stop()  # log retention
        await history_sweeper.stop()
        await history.close()
        if secrets is not None:
            await secrets.stop()
        grpc.close()
        await runner.cleanup()
        await ops.recorder.flush(timeout=2.0)  # what was recorded, appended if it can be
        await ops.recorder.close()
        await ops.launches.close()
        if ops.accounting.client is not None:
            await ops.accounting.client.close()
        if fabric is not None:
            await fabric.close()
        logs.close()
        member.close()


async def open_history(cfg: LatticeConfig, member: Any) -> tuple[Any, Any]:
    """The history store (``storage.history_database_url``; default SQLite
    ``history.db`` under ``quorum.data_dir``) and its sweeper (lattice_api.history_sweeper)."""
    from lattice_common.history import HistoryStore, sqlite_url

    from lattice_api.history_sweeper import HistorySweeper

    st = cfg.storage
    url = st.history_database_url or sqlite_url(str(Path(cfg.quorum.data_dir) / "history.db"))
    Path(cfg.quorum.data_dir).mkdir(parents=True, exist_ok=True)
    store = await HistoryStore.open(url)
    sweeper = HistorySweeper(
        member,
        store,
        retention_seconds=st.allocation_retention_hours * 3600.0,
        interval=st.history_sweep_interval_seconds,
        batch_size=st.history_batch_size,
        # budgeted tenants' allocations leave after the same retention: their usage stays
        # in the state as ledger totals (Tenant.retired_usage), kept one budget period
        budget_period_seconds=cfg.scheduling.budget_period_days * 86400.0,
    )
    return store, sweeper


def _accounting_settings(cfg: LatticeConfig) -> dict[str, Any]:
    """accounting.enabled: where lattice-accounting's internal API is, and its token."""
    ac = cfg.accounting
    if not ac.enabled:
        return {}
    token = ac.service_token.get_secret_value() if ac.service_token else ""
    return {
        "accounting_url": ac.service_url,
        "accounting_token": token,
        "accounting_timeout": ac.request_timeout_seconds,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    daemon_main(
        "lattice-server",
        args.log_level,
        lambda: serve(
            load_config(args.config),
            bootstrap=args.bootstrap,
            recover_from=args.recover_from or "",
            force=args.force,
            config_path=args.config or "",
        ),
    )


if __name__ == "__main__":
    main()
