"""``lattice-agent``: the per-node daemon."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from lattice_common.config import LatticeConfig, NodeAgentConfig, TlsConfig, load_config
from lattice_common.errors import ValidationError
from lattice_common.logcrypt import open_sensitive_log_store  # log store: sensitive pool
from lattice_common.logstore import open_log_store  # log store
from lattice_common.net import split_host_port
from lattice_common.process import daemon_main, run_until_signal, start_metrics
from pydantic import ValidationError as PydanticValidationError

from lattice_agent.identity import IdentityPolicy
from lattice_agent.oci import OciStore
from lattice_agent.scratch import Scratch

if TYPE_CHECKING:
    from lattice_agent.tls_identity import AgentTls

log = logging.getLogger("lattice.agent")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="lattice-agent",
        description="Run the Lattice node agent: register this node, heartbeat, and run "
        "the allocations the quorum assigns to it.",
    )
    p.add_argument(
        "--node-id", default=os.environ.get("LATTICE_NODE_ID"), help="node id (default: hostname)"
    )
    p.add_argument(
        "--quorum-endpoint",
        default=os.environ.get("LATTICE_QUORUM_ENDPOINT", "127.0.0.1:50051"),
        help="lattice-server gRPC address(es), comma-separated (default: %(default)s)",
    )
    p.add_argument("--config", help="YAML config file (node_agent section)")
    p.add_argument(
        "--listen", help="host:port for the agent's gRPC service (default: config; port 0 = any)"
    )
    p.add_argument("--advertise-host", default="", help="host the API uses to reach this agent")
    p.add_argument("--state-file", help="where running allocations are persisted")
    p.add_argument("--work-dir", help="per-allocation working directories")
    p.add_argument("--log-dir", help="per-allocation log files")
    p.add_argument("--heartbeat-interval", type=float, help="seconds between heartbeats")
    p.add_argument("--walltime-grace", type=float, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--group", type=int, default=0, help="dragonfly topology group of this node")
    p.add_argument(
        "--conformance-group",
        default="",
        help="report this conformance group instead of the computed fingerprint "
        "(dev and test clusters)",
    )
    p.add_argument(
        "--conformance-interval",
        type=float,
        help="seconds between conformance fingerprint recomputations (default: config, 6 h)",
    )
    p.add_argument(
        "--uenv-base-image-hash",
        help="uenv base image hash to include in the conformance fingerprint (default: config)",
    )
    p.add_argument("--home-vcluster", default="", help="vCluster whose pool this node belongs to")
    p.add_argument(
        "--feature",
        action="append",
        default=[],
        help="node feature (repeatable), e.g. nvme_scratch",
    )
    p.add_argument("--cpu-cores", type=int, help="override discovered CPU cores")
    p.add_argument("--memory-gb", type=int, help="override discovered memory")
    p.add_argument("--gpu-type", help="override discovered GPU type")
    p.add_argument("--gpu-count", type=int, help="override discovered GPU count")
    p.add_argument("--metrics-listen", help="host:port for /metrics; empty to disable")
    p.add_argument(
        "--cgroups",
        choices=("auto", "v2", "v1", "none"),
        help="per-allocation cgroup backend (default node_agent.cgroups)",
    )
    p.add_argument(
        "--cgroup-slice",
        help="parent of the alloc-<id>.scope cgroups (default node_agent.cgroup_slice); "
        "several agents on one host need one each",
    )
    p.add_argument(
        "--run-as",
        choices=("submitter", "agent"),
        help="who allocations run as: their submitting user (needs root) or this agent's "
        "own user, for development clusters (default node_agent.run_as)",
    )
    p.add_argument(
        "--scratch-root",
        help="per-allocation scratch directories <root>/<alloc_id> (default "
        "node_agent.scratch_root); several agents on one host need one each",
    )
    p.add_argument(
        "--cache-dir",
        help="node-local image caches: <dir>/uenv and <dir>/oci (default "
        "node_agent.uenv_cache_dir and oci_cache_dir); several agents on one host need one each",
    )
    p.add_argument(
        "--bootstrap-cert",
        help="bootstrap certificate (PEM) for first contact, exchanged for a quorum-CA "
        "certificate (default tls.cert, LATTICE_BOOTSTRAP_CERT)",
    )
    p.add_argument("--bootstrap-key", help="its key (default tls.key, LATTICE_BOOTSTRAP_KEY)")
    p.add_argument(
        "--bootstrap-ca",
        help="CA bundle lattice-server's certificate chains to; set = TLS "
        "(default tls.ca, LATTICE_BOOTSTRAP_CA)",
    )
    p.add_argument(
        "--cert-dir",
        help="where the quorum-CA certificate is kept between starts (default tls.cert_dir); "
        "several agents on one host need one each",
    )
    p.add_argument("--log-level", default=os.environ.get("LATTICE_LOG_LEVEL", "info"))
    return p.parse_args(argv)


def _listen_address(listen: str) -> tuple[str, int]:
    """``--listen``/``node_agent.grpc_listen`` as (host, port); an empty host is every interface."""
    try:
        return split_host_port(listen, default_host="0.0.0.0")
    except ValueError as e:
        raise ValidationError(
            f"agent listen address: {e}",
            hint="give --listen as host:port, e.g. 0.0.0.0:50053 (port 0 picks a free port)",
        ) from None


def _identities(
    args: argparse.Namespace, na: NodeAgentConfig, node_id: str
) -> tuple[IdentityPolicy, Scratch]:
    """Who allocations run as and where their scratch goes (flags over node_agent)."""
    mode = args.run_as or na.run_as
    if mode == "submitter" and os.geteuid() != 0:
        log.warning(
            "node_agent.run_as is 'submitter' but the agent is not root: allocations of "
            "other users will fail to start (use --run-as agent on development clusters)"
        )
    try:
        identities = IdentityPolicy(
            node_id=node_id,
            mode=mode,
            user_map=dict(na.user_map),
            root_vclusters=frozenset(na.root_vclusters),
        )
    except ValueError as e:
        raise ValidationError(str(e), hint="fix node_agent.user_map") from None
    scratch = Scratch(args.scratch_root or na.scratch_root, tmpfs_mb=na.scratch_tmpfs_mb)
    return identities, scratch


def _oci_store(na: NodeAgentConfig, cache_dir: Path) -> OciStore | None:
    """The OCI image store, or None (jobs with --image then fail their prologue with
    that cause) when a tool it needs is not installed."""
    from lattice_agent.oci import DEFAULT_INIT, OciError, OciStore

    missing = [t for t in ("crun", "skopeo", "umoci") if shutil.which(t) is None]
    if not os.path.exists(DEFAULT_INIT):
        missing.append(DEFAULT_INIT)
    if missing:
        log.info("OCI containers disabled on this node: %s not installed", ", ".join(missing))
        return None
    try:
        return OciStore(
            cache_dir,
            insecure=tuple(na.oci_insecure_registries),
            max_bytes=na.oci_cache_max_bytes,
        )
    except OciError as e:
        raise ValidationError(str(e), hint="fix node_agent.oci_cache_dir") from None


async def _identity(
    args: argparse.Namespace, cfg: LatticeConfig, node_id: str, token: str | None
) -> AgentTls | None:
    """The identity cascade (lattice_agent.tls_identity), flags over config."""
    from lattice_common.rpc import auth_metadata

    from lattice_agent.tls_identity import IdentityError, acquire

    updates = {
        "cert": args.bootstrap_cert,
        "key": args.bootstrap_key,
        "ca": args.bootstrap_ca,
        "cert_dir": args.cert_dir,
    }
    try:
        tls = cfg.tls.model_copy(update={k: v for k, v in updates.items() if v})
        tls = TlsConfig.model_validate(tls.model_dump())
    except PydanticValidationError as e:
        raise ValidationError(f"invalid TLS options: {e}") from None
    try:
        return await acquire(node_id, args.quorum_endpoint, tls, token, auth_metadata(token))
    except IdentityError as e:
        raise ValidationError(e.message, hint=e.hint) from None
    except OSError as e:
        raise ValidationError(
            f"cannot read a TLS file: {e}", hint="Check --bootstrap-cert/-key/-ca and tls.*."
        ) from None


async def run(args: argparse.Namespace) -> None:
    from lattice_common.rpc import Endpoints

    from lattice_agent.agent import Agent
    from lattice_agent.cgroups import announce as announce_cgroups
    from lattice_agent.cgroups import detect as detect_cgroups
    from lattice_agent.conformance import compute_fingerprint
    from lattice_agent.discovery import discover, hostname

    cfg = load_config(args.config)
    na = cfg.node_agent
    start_metrics(na.metrics_listen if args.metrics_listen is None else args.metrics_listen)
    listen_host, listen_port = _listen_address(args.listen or na.grpc_listen)
    token = cfg.api.agent_token.get_secret_value() if cfg.api.agent_token else None
    uenv_hash = (
        na.uenv_base_image_hash if args.uenv_base_image_hash is None else args.uenv_base_image_hash
    )

    def compute() -> str:
        return compute_fingerprint(uenv_base_image_hash=uenv_hash)

    # --conformance-group overrides the computed fingerprint (named groups in dev and
    # test clusters); without it the fingerprint is computed now and every interval
    conformance_group = args.conformance_group or compute()
    fingerprint_source = None if args.conformance_group else compute
    capabilities = discover(
        cpu_cores=args.cpu_cores,
        memory=args.memory_gb,
        gpu_type=args.gpu_type,
        gpu_count=args.gpu_count,
        features=args.feature,
    )
    cgroups = detect_cgroups(
        args.cgroups or na.cgroups,
        na.cgroup_root,
        slice_name=args.cgroup_slice or na.cgroup_slice,
        node_memory_bytes=capabilities.memory_gb * (1 << 30),
        reserve_percent=na.cgroup_memory_reserve_percent,
        reserve_min_bytes=int(na.cgroup_memory_reserve_min_gb * (1 << 30)),
        pids_max=na.pids_max or None,
    )
    announce_cgroups(cgroups)
    node_id = args.node_id or hostname()
    identities, scratch = _identities(args, na, node_id)
    from lattice_agent.uenv import UenvCache, UenvError, UenvRegistry

    try:  # a signing key that cannot be read stops the agent: never run unverified images
        registry = (
            UenvRegistry(na.uenv_registry, signing_key=na.uenv_signing_key or None)
            if na.uenv_registry
            else None
        )
    except UenvError as e:
        raise ValidationError(e.message, hint=e.hint) from None
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    uenv = UenvCache(
        registry,
        cache_dir / "uenv" if cache_dir else na.uenv_cache_dir,
        na.uenv_cache_max_bytes,
        mount_point=na.uenv_mount_point,
    )
    oci = _oci_store(na, cache_dir / "oci" if cache_dir else Path(na.oci_cache_dir))
    tls = await _identity(args, cfg, node_id, token)
    agent = Agent(
        node_id=node_id,
        endpoints=Endpoints(args.quorum_endpoint, ssl=tls.client if tls is not None else None),
        capabilities=capabilities,
        hostname=hostname(),
        group=args.group,
        conformance_group=conformance_group,
        fingerprint_source=fingerprint_source,
        conformance_interval=args.conformance_interval or na.conformance_interval_seconds,
        home_vcluster=args.home_vcluster,
        work_dir=Path(args.work_dir or na.work_dir),
        log_dir=Path(args.log_dir or na.log_dir),
        state_file=Path(args.state_file or na.state_file),
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=args.advertise_host,
        heartbeat_interval=args.heartbeat_interval or na.heartbeat_interval_seconds,
        walltime_grace=na.walltime_grace_seconds
        if args.walltime_grace is None
        else args.walltime_grace,
        ring_buffer_lines=na.ring_buffer_lines,
        token=token,
        pmi_fence_timeout=na.pmi_fence_timeout_seconds,
        pmi_tree_fanout=na.pmi_tree_fanout,
        slurm_env=cfg.compat.slurm_env,
        cgroups=cgroups,
        uenv=uenv,
        oci=oci,
        prologue_script=na.prologue_script,
        epilogue_script=na.epilogue_script,
        prologue_timeout=na.prologue_timeout_seconds,
        identities=identities,
        scratch=scratch,
        tls=tls,
        telemetry=cfg.telemetry,  # telemetry: TSDB endpoint, window, mode
        log_store=open_log_store(cfg.storage),  # log store: storage.log_store
        log_flush_interval=cfg.storage.log_flush_interval_seconds,  # log store
        sensitive_log_store=open_sensitive_log_store(cfg.storage),  # log store: encrypted
        checkpoint=cfg.checkpoint,  # checkpoints: root, timeout, max deferral
        checkpoint_storage=cfg.storage,  # checkpoints: an s3:// root's endpoint, credentials
    )
    await run_until_signal(agent.run())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    daemon_main("lattice-agent", args.log_level, lambda: run(args))


if __name__ == "__main__":
    main()
