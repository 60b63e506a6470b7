"""Configuration of every Lattice process: pydantic models loaded from YAML.

Why this module exists: the server, schedulers, checkpoint broker and agents all read one
file (``/etc/lattice/config.yaml``; examples in ``config/minimal.yaml`` and
``config/production.yaml``), and each takes the sections it needs. Keeping the schema in
one place means one set of names and defaults, one set of checks, and one error format.

Rules:

* Every section and field has a default, so an empty file is a valid single-member dev
  configuration. Unknown keys are errors (a typo must not silently fall back to a
  default), and errors are :class:`~lattice_common.errors.ValidationError` naming the key,
  the value and where it came from, never a raw pydantic traceback.
* Environment variables override the file: ``LATTICE_<SECTION>__<FIELD>`` (double
  underscore between levels, case-insensitive), e.g.
  ``LATTICE_SCHEDULING__CYCLE_INTERVAL_SECONDS=2``. Values are strings parsed by the
  field's type (``"2"`` becomes ``2.0``, ``"true"`` becomes ``True``); a value starting
  with ``[`` or ``{`` is read as YAML/JSON, for list and mapping fields such as
  ``LATTICE_QUORUM__PEERS``. ``LATTICE_*`` names without a double underscore (those the
  agent sets inside allocations, ``LATTICE_ENDPOINT`` of the CLI, ...) are not config
  and are ignored, except the documented names:

  - ``LATTICE_OIDC_HMAC_SECRET`` -> ``api.oidc_hmac_secret``
  - ``LATTICE_AGENT_TOKEN`` -> ``api.agent_token``
  - ``LATTICE_FABRIC_MANAGER_TOKEN`` -> ``network.fabric_manager_token``
  - ``LATTICE_RAFT_PASSWORD`` -> ``quorum.raft_password``

  (the ``LATTICE_<SECTION>__...`` form of the same field wins if both are set).
* Secrets are :class:`pydantic.SecretStr`: they print as ``**********`` in ``repr``,
  ``str``, logs, ``model_dump_json`` and error messages; read them with
  ``.get_secret_value()`` at the one place that needs the clear text. Secrets belong in
  the environment (systemd ``EnvironmentFile=``), not in the YAML file.
* Relative paths (``data_dir``, ``state_file``, ...) are relative to the working
  directory of the process, as usual for command-line tools.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from lattice_common.errors import ValidationError
from lattice_common.net import http_url_or_empty, split_host_port
from lattice_common.secrets import SecretsConfig
from lattice_common.types import SchedulerType

__all__ = [
    "AccountingConfig",
    "ApiConfig",
    "CheckpointConfig",
    "CompatConfig",
    "DefaultVCluster",
    "FederationConfig",
    "FederationPeer",
    "LatticeConfig",
    "NetworkConfig",
    "NodeAgentConfig",
    "PeerConfig",
    "QuorumConfig",
    "RateLimitConfig",
    "RateLimitOverride",
    "SchedulingConfig",
    "SecretsConfig",
    "StorageConfig",
    "TelemetryAlertRule",
    "TelemetryConfig",
    "TlsConfig",
    "load_config",
]

ENV_PREFIX = "LATTICE_"
# Documented environment names that do not follow LATTICE_<SECTION>__<FIELD>.
SPECIAL_ENV: dict[str, tuple[str, ...]] = {
    "LATTICE_OIDC_HMAC_SECRET": ("api", "oidc_hmac_secret"),
    "LATTICE_AGENT_TOKEN": ("api", "agent_token"),
    "LATTICE_FABRIC_MANAGER_TOKEN": ("network", "fabric_manager_token"),
    "LATTICE_RAFT_PASSWORD": ("quorum", "raft_password"),
    "LATTICE_BOOTSTRAP_CERT": ("tls", "cert"),
    "LATTICE_BOOTSTRAP_KEY": ("tls", "key"),
    "LATTICE_BOOTSTRAP_CA": ("tls", "ca"),
    "LATTICE_SPIRE_SOCKET": ("tls", "spire_socket"),
}


def is_config_env(name: str) -> bool:
    """Whether an environment variable is Lattice configuration (an override or one of the
    documented secrets): the agent's own, never passed on to the jobs it starts."""
    from lattice_common.secrets import REFERENCED_ENV, SECRET_ID_ENV

    upper = name.upper()
    if upper == SECRET_ID_ENV or name in REFERENCED_ENV:
        return True  # the AppRole secret id, variables named by env:// references
    return upper.startswith(ENV_PREFIX) and ("__" in upper or upper in SPECIAL_ENV)


# Spellings used by the specification's examples, accepted and mapped to our names.
_KEY_ALIASES: dict[tuple[str, ...], dict[str, str]] = {
    (): {"rate_limits": "rate_limit"},
    ("compat",): {"set_slurm_env": "slurm_env"},
}
_HINT = "See config/production.yaml for every option, its meaning and its default."


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: node_agent.user_map values: "UID:GID", "UID" or a local user name (no ':' or space)
_USER_MAP_VALUE = re.compile(r"\d+:\d+|\d+|[^\s:]+")


def _check_host_port(value: str, *, allow_empty: bool = False, allow_port_zero: bool = True) -> str:
    """``host:port`` (IPv6 as ``[::1]:9000``). Port 0 means "pick a free port" for listeners."""
    value = value.strip()
    if not value and allow_empty:
        return value
    host, _ = split_host_port(value, allow_port_zero=allow_port_zero)
    if not host:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------
# quorum
# ---------------------------------------------------------------------------------------


class PeerConfig(_Section):
    """Another quorum member (the spec's example lists the other members, not this one)."""

    id: int = Field(ge=1, description="Raft node id of that member")
    address: str = Field(description="that member's Raft address, host:port")
    api_address: str = Field(
        default="",
        description="that member's gRPC API host:port, used to forward proposals to the leader",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return _check_host_port(v, allow_port_zero=False)

    @field_validator("api_address")
    @classmethod
    def _api_address(cls, v: str) -> str:
        return _check_host_port(v, allow_empty=True, allow_port_zero=False)


class QuorumConfig(_Section):
    """This Raft member (pysyncobj) and its peers. A single member with no peers is dev mode."""

    node_id: int = Field(default=1, ge=1, description="this member's Raft node id")
    bind: str = Field(default="127.0.0.1:9000", description="this member's Raft address")
    data_dir: str = Field(
        default="/var/lib/lattice/raft", description="Raft journal and snapshots (fast disk)"
    )
    peers: list[PeerConfig] = Field(default_factory=list, description="the other members")
    append_entries_period: float = Field(default=0.01, gt=0, description="seconds")
    auto_tick_period: float = Field(default=0.002, gt=0, description="seconds")
    # the specification's Raft heartbeat timeout (500 ms): a follower that hears nothing
    # from its leader for a random 0.5-1.0 s starts an election. Shorter timeouts
    # deposed healthy leaders whenever a busy machine held a member's threads that long
    raft_min_timeout: float = Field(default=0.5, gt=0, description="election timeout, seconds")
    raft_max_timeout: float = Field(default=1.0, gt=0, description="election timeout, seconds")
    commit_timeout_seconds: float = Field(
        default=5.0, gt=0, description="how long a proposal waits to commit before Unavailable"
    )
    log_compaction_min_entries: int = Field(
        default=20000, ge=1, description="snapshot after this many journal entries ..."
    )
    log_compaction_min_time: float = Field(
        default=300.0, gt=0, description="... and at least this many seconds apart"
    )
    snapshot_retention_count: int = Field(
        default=5, ge=1, description="local snapshots kept (spec: raft.snapshot_retention_count)"
    )
    backup_dir: str = Field(
        default="/var/lib/lattice/backups", description="where admin backups are written"
    )
    raft_password: SecretStr | None = Field(
        default=None,
        description="shared secret that encrypts and authenticates Raft peer traffic "
        "(pysyncobj password: Fernet, key by PBKDF2); the same on every member; a "
        "reference (env://, file://, vault://) or the value; env LATTICE_RAFT_PASSWORD. "
        "Unset = plaintext, unauthenticated Raft (dev only)",
    )

    @field_validator("bind")
    @classmethod
    def _bind(cls, v: str) -> str:
        return _check_host_port(v)

    @field_validator("raft_password")
    @classmethod
    def _raft_password(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("must not be empty (leave it unset for an unencrypted dev quorum)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> QuorumConfig:
        if self.raft_min_timeout >= self.raft_max_timeout:
            raise ValueError(
                f"raft_min_timeout ({self.raft_min_timeout}) must be less than "
                f"raft_max_timeout ({self.raft_max_timeout})"
            )
        seen: set[int] = set()
        for p in self.peers:
            if p.id in seen:
                raise ValueError(f"peer id {p.id} is listed twice")
            seen.add(p.id)
        return self

    @property
    def other_peers(self) -> list[PeerConfig]:
        """Peers other than this member (a config may list itself too; that entry is skipped)."""
        return [p for p in self.peers if p.id != self.node_id]


# ---------------------------------------------------------------------------------------
# api
# ---------------------------------------------------------------------------------------


class ApiConfig(_Section):
    """Public gRPC and REST listeners and authentication (spec: Authentication & Authorization)."""

    grpc_listen: str = "0.0.0.0:50051"
    rest_listen: str = "0.0.0.0:8080"
    oidc_issuer: str = Field(default="", description="IdP URL; enables JWKS (RS256/ES256)")
    oidc_client_id: str = Field(default="lattice", description="expected `aud` claim")
    oidc_hmac_secret: SecretStr | None = Field(
        default=None, description="HS256 secret, dev/break-glass; env LATTICE_OIDC_HMAC_SECRET"
    )
    agent_token: SecretStr | None = Field(
        default=None, description="bearer token agents present without mTLS; LATTICE_AGENT_TOKEN"
    )
    tls_cert: str = Field(default="", description="server certificate PEM path; empty = no TLS")
    tls_key: str = Field(default="", description="server key PEM path")
    tls_ca: str = Field(default="", description="CA PEM path; set = require client certs (mTLS)")
    max_request_bytes: int = Field(default=1_048_576, ge=1024)
    token_revalidation_interval_seconds: float = Field(
        default=300.0,
        ge=0,
        description="long streams re-check their bearer token this often and end when it "
        "no longer validates; 0 = never",
    )
    audit_signing_key_path: str = Field(
        default="",
        description="Ed25519 private key (PEM) that signs audit log entries, the same file "
        "on every member; empty = a development key kept in quorum.data_dir",
    )

    @field_validator("grpc_listen", "rest_listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _check_host_port(v)

    @model_validator(mode="after")
    def _tls_pair(self) -> ApiConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca (mTLS) needs tls_cert and tls_key")
        return self


# ---------------------------------------------------------------------------------------
# scheduling
# ---------------------------------------------------------------------------------------


class DefaultVCluster(_Section):
    """A vCluster created at bootstrap when the state has none."""

    name: str = Field(min_length=1)
    scheduler_type: str = "hpc-backfill"

    @field_validator("scheduler_type")
    @classmethod
    def _scheduler_type(cls, v: str) -> str:
        allowed = [s.value for s in SchedulerType]
        if v not in allowed:
            raise ValueError(f"unknown scheduler_type {v!r}; expected one of {', '.join(allowed)}")
        return v


class SchedulingConfig(_Section):
    """vCluster scheduling loops (spec: Scheduling Cycle Tuning, Backfill Tuning)."""

    cycle_interval_seconds: float = Field(
        default=5.0, gt=0, description="5s interactive/small, 15s batch, 30s very large"
    )
    backfill_depth: int = Field(default=10, ge=0, description="0 = no backfill; 10-20 typical")
    reference_wait_seconds: float = Field(
        default=3600.0, gt=0, description="wait time at which f2 (wait_time) saturates"
    )
    default_vclusters: list[DefaultVCluster] = Field(
        default_factory=lambda: [DefaultVCluster(name="default", scheduler_type="hpc-backfill")]
    )
    scaling_evaluation_interval_seconds: float = Field(
        default=60.0, gt=0, description="reactive allocations' metric evaluation interval"
    )
    budget_period_days: int = Field(
        default=90, ge=1, le=3650, description="rolling window of the internal budget ledger"
    )
    start_estimates: bool = Field(
        default=True, description="publish estimated start times of pending allocations"
    )
    estimate_budget_seconds: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="CPU per cycle for simulating queues forward (at most 20% of the interval)",
    )
    # Most allocations one DAG workflow may have; a larger submission is refused with
    # the limit named (lattice_common.dag.validate_dag), nothing stored.
    max_dag_size: int = Field(default=1000, ge=1, description="allocations per DAG at most")
    trace_capture: bool = Field(default=False, description="record cycles for RM-Replay")
    trace_path: str = Field(default="", description="where captured traces are written")
    metrics_listen: str = Field(default="0.0.0.0:9102", description="empty = no metrics")

    @field_validator("metrics_listen")
    @classmethod
    def _metrics(cls, v: str) -> str:
        return _check_host_port(v, allow_empty=True)

    @model_validator(mode="after")
    def _unique(self) -> SchedulingConfig:
        names = [v.name for v in self.default_vclusters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"default_vclusters lists {', '.join(dupes)} more than once")
        if self.trace_capture and not self.trace_path:
            raise ValueError("trace_capture needs trace_path")
        return self


# ---------------------------------------------------------------------------------------
# node agent
# ---------------------------------------------------------------------------------------


class NodeAgentConfig(_Section):
    """Per-node daemon and the quorum's view of node liveness (spec: Node Lifecycle)."""

    heartbeat_interval_seconds: float = Field(default=10.0, gt=0)
    heartbeat_timeout_seconds: float = Field(
        default=30.0, gt=0, description="no heartbeat this long -> Degraded"
    )
    sensitive_heartbeat_timeout_seconds: float = Field(
        default=120.0, gt=0, description="longer degradation window for sensitive nodes"
    )
    grace_period_seconds: float = Field(default=60.0, ge=0, description="Degraded -> Down")
    sensitive_grace_period_seconds: float = Field(default=300.0, ge=0)
    borrowed_grace_period_seconds: float = Field(default=30.0, ge=0)
    walltime_grace_seconds: float = Field(
        default=30.0, ge=0, description="SIGTERM -> SIGKILL at walltime, cancel and preemption"
    )
    max_prologue_retries: int = Field(
        default=3,
        ge=1,
        description="prologue failures (each on another node) before an allocation is Failed",
    )
    prologue_script: str = Field(
        default="",
        description="site hook run on every node in Staging (node health checks, data "
        "staging); non-zero exit = prologue failure",
    )
    epilogue_script: str = Field(
        default="",
        description="site hook run after an allocation's processes ended (GPU reset, "
        "cleanups); failures are logged and counted, the node is not held",
    )
    prologue_timeout_seconds: float = Field(
        default=300.0, gt=0, description="a prologue not done this long fails on that node"
    )
    state_file: str = "/var/lib/lattice/agent-state.json"
    work_dir: str = "/var/lib/lattice/allocations"
    log_dir: str = "/var/log/lattice/allocations"
    ring_buffer_lines: int = Field(default=10000, ge=1, description="live-tail lines per alloc")
    grpc_listen: str = "0.0.0.0:50053"
    metrics_listen: str = Field(default="0.0.0.0:9103", description="empty = no metrics")
    conformance_interval_seconds: float = Field(
        default=21600.0, gt=0, description="recompute the conformance fingerprint this often"
    )
    uenv_base_image_hash: str = Field(
        default="", description="uenv base image hash, part of the conformance fingerprint"
    )
    pmi_fence_timeout_seconds: float = Field(
        default=60.0, gt=0, description="a launch's PMI fence not done this long -> aborted"
    )
    pmi_tree_fanout: int = Field(
        default=128,
        ge=2,
        description="launches on more nodes than this use a two-level fence tree, not a star",
    )
    cgroups: Literal["auto", "v2", "v1", "none"] = Field(
        default="auto",
        description="per-allocation cgroups: auto = v2 if <root>/cgroup.controllers, else v1 "
        "if <root>/memory, else none (logged, lattice_agent_cgroups_available 0)",
    )
    cgroup_root: str = Field(default="/sys/fs/cgroup", description="cgroup filesystem mount")
    cgroup_slice: str = Field(
        default="workload.slice",
        description="parent of the alloc-<id>.scope cgroups, relative to the root (v1: to "
        "each controller); several agents on one host need one each",
    )
    cgroup_memory_reserve_percent: float = Field(
        default=5.0,
        ge=0,
        lt=100,
        description="whole-node jobs (no memory_gb) get capacity minus this share ...",
    )
    cgroup_memory_reserve_min_gb: float = Field(
        default=1.0, ge=0, description="... but at least this much is left to the OS and agent"
    )
    pids_max: int = Field(
        default=4096, ge=0, description="processes+threads per allocation (0 = no limit)"
    )
    # uenv SquashFS environments (lattice_agent.uenv, lattice_common.uenv_registry): a
    # registry (directory or http(s) URL) with index.json (name/version[:tag] -> {file,
    # sha256, size, signature}), images copied into a node-local cache (verified against
    # sha256, LRU-evicted above the limit, in-use images kept) and mounted read-only in the
    # allocation's own mount namespace. The API reads the same two registry settings (one
    # config file for the cluster) to resolve spec.uenv at submit.
    uenv_registry: str = Field(
        default="",
        description="uenv registry: a directory or an http(s):// URL serving index.json; "
        "empty = uenv disabled (on this node, and refused at submit by the API)",
    )
    uenv_signing_key: str = Field(
        default="",
        description="PEM file with the site's Ed25519 public key: when set, every uenv index "
        "entry must carry a base64 signature of the image's sha256 hex, else it is refused",
    )
    uenv_cache_dir: str = Field(
        default="/var/cache/lattice/uenv", description="node-local cache of uenv images"
    )
    uenv_cache_max_bytes: int = Field(
        default=50 * 1024**3, ge=0, description="LRU eviction above this many cached bytes"
    )
    uenv_mount_point: str = Field(
        default="/user-environment", description="where a job sees its uenv image (read-only)"
    )
    # OCI images (lattice_agent.oci): pulled with skopeo, unpacked once per digest with
    # umoci, run by crun inside the allocation's cgroup and process group.
    oci_cache_dir: str = Field(
        default="/var/cache/lattice/oci", description="node-local cache of OCI images"
    )
    oci_cache_max_bytes: int = Field(
        default=100 * 1024**3, ge=0, description="LRU eviction above this many cached bytes"
    )
    oci_insecure_registries: list[str] = Field(
        default_factory=lambda: ["127.0.0.1", "localhost"],
        description="registry hosts reached over plain HTTP (loopback test registries)",
    )
    # Who allocations run as (lattice_agent.identity) and their scratch space
    # (lattice_agent.scratch).
    run_as: Literal["submitter", "agent"] = Field(
        default="submitter",
        description="submitter = every process of an allocation runs as its submitting user "
        "(the agent must be root); agent = as the agent's own user (development clusters)",
    )
    user_map: dict[str, str] = Field(
        default_factory=dict,
        description="submitting user -> 'UID:GID', 'UID' or a local user name; consulted "
        "before NSS (users whose login name differs from their account on the nodes)",
    )
    root_vclusters: list[str] = Field(
        default_factory=list, description="vClusters whose allocations may run as root"
    )
    scratch_root: str = Field(
        default="/scratch/local",
        description="per-allocation scratch <scratch_root>/<alloc_id> (LATTICE_SCRATCH, "
        "TMPDIR), the user's, wiped at the end; must not be writable by users",
    )
    scratch_tmpfs_mb: int = Field(
        default=0,
        ge=0,
        description="> 0: a tmpfs of that many MiB is mounted on each scratch directory "
        "instead of a plain directory (nodes without local disks)",
    )

    @field_validator("grpc_listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _check_host_port(v)

    @field_validator("metrics_listen")
    @classmethod
    def _metrics(cls, v: str) -> str:
        return _check_host_port(v, allow_empty=True)

    @field_validator("user_map", mode="before")
    @classmethod
    def _user_map(cls, v: Any) -> Any:
        # YAML reads `alice: 1000` as an int; the same grammar as lattice_agent.identity
        if not isinstance(v, Mapping):
            return v
        out = {}
        for user, target in v.items():
            text = str(target).strip() if isinstance(target, int | str) else ""
            if isinstance(target, bool) or not _USER_MAP_VALUE.fullmatch(text):
                raise ValueError(
                    f"user_map[{user!r}] = {target!r}: expected 'UID:GID', 'UID' or a user name"
                )
            out[str(user)] = text
        return out


# ---------------------------------------------------------------------------------------
# storage, telemetry
# ---------------------------------------------------------------------------------------


class StorageConfig(_Section):
    """Where logs and checkpoints persist (spec: Data Plane, Checkpoint Destinations)."""

    s3_endpoint: str = Field(default="", description="S3-compatible endpoint URL; empty = none")
    s3_region: str = ""
    log_bucket: str = Field(default="", description="persistent logs: s3://BUCKET/{tenant}/...")
    checkpoint_bucket: str = Field(default="", description="checkpoints; empty = log_bucket")
    nfs_path: str = Field(default="", description="POSIX scratch/checkpoint root; empty = none")
    # the log store (lattice_common.logstore): agents flush allocation output into it,
    # the API reads it when an agent cannot answer
    log_store: Literal["fs", "s3", "none"] = Field(
        default="fs",
        description="fs = a directory (log_store_dir), s3 = log_bucket at s3_endpoint, "
        "none = logs live only on the nodes",
    )
    log_store_dir: str = Field(
        default="/var/lib/lattice/log-store",
        description="root of the fs log store; shared storage when the API and the agents "
        "are on different machines",
    )
    log_flush_interval_seconds: float = Field(
        default=10.0, gt=0, description="agents flush new output as a chunk this often"
    )
    s3_access_key_id: SecretStr | None = Field(
        default=None, description="S3 access key id (a secret reference); unset = AWS chain"
    )
    s3_secret_access_key: SecretStr | None = Field(
        default=None, description="S3 secret access key (a secret reference)"
    )
    # retention (lattice_api.log_retention, on the quorum leader): what ended longer ago
    # is deleted from the log store; 0 = kept forever
    log_retention_days: float = Field(
        default=30.0, ge=0, description="logs of ended allocations (spec default: 30 days)"
    )
    debug_trace_retention_days: float = Field(
        default=7.0, ge=0, description="debug-mode telemetry traces (spec default: 7 days)"
    )
    log_retention_interval_seconds: float = Field(
        default=3600.0, gt=0, description="how often the leader sweeps the log stores"
    )
    # terminal allocations leave the quorum's state after this long, into the history
    # store (lattice_common.history; the leader's lattice_api.history_sweeper)
    allocation_retention_hours: float = Field(
        default=24.0,
        ge=0,
        description="hours a terminal allocation stays in the quorum's state before it "
        "moves to the history store (0 = never moves)",
    )
    history_database_url: str = Field(
        default="",
        description="the history store: postgresql+asyncpg://... or sqlite+aiosqlite:///path; "
        '"" = SQLite history.db under quorum.data_dir (one member, or members sharing it)',
    )
    history_sweep_interval_seconds: float = Field(
        default=60.0, gt=0, description="how often the leader moves allocations to the history"
    )
    history_batch_size: int = Field(
        default=500, ge=1, description="allocations moved per quorum command"
    )
    # the sensitive pool (spec: Sensitive Workloads, Observability Constraints): logs and
    # traces of sensitive allocations, encrypted with sensitive_log_key
    # (lattice_common.logcrypt); never written to the ordinary log store
    sensitive_log_store: Literal["fs", "s3", "none"] = Field(
        default="none",
        description="fs = sensitive_log_store_dir, s3 = sensitive_log_bucket at s3_endpoint, "
        "none = sensitive output stays on its nodes",
    )
    sensitive_log_store_dir: str = Field(
        default="/var/lib/lattice/sensitive-log-store",
        description="root of the fs sensitive pool (a dedicated, access-logged file system)",
    )
    sensitive_log_bucket: str = Field(
        default="", description="the sensitive pool's bucket (dedicated, access-logged)"
    )
    sensitive_log_key: SecretStr | None = Field(
        default=None,
        description="AES-256 key of the sensitive pool: 32 bytes as base64 or 64 hex digits "
        "(a secret reference, e.g. vault://lattice/sensitive-log-key)",
    )
    sensitive_log_retention_days: float = Field(
        default=2557.0,
        ge=0,
        description="the sensitive data retention policy (default 7 years, the regulatory "
        "audit retention; 0 = forever)",
    )

    @model_validator(mode="after")
    def _log_store(self) -> StorageConfig:
        if self.log_store == "s3" and not self.log_bucket:
            raise ValueError("log_store is s3 but log_bucket is empty")
        if self.log_store == "fs" and not self.log_store_dir:
            raise ValueError("log_store is fs but log_store_dir is empty")
        if self.sensitive_log_store == "s3" and not self.sensitive_log_bucket:
            raise ValueError("sensitive_log_store is s3 but sensitive_log_bucket is empty")
        if self.sensitive_log_store == "s3" and self.sensitive_log_bucket == self.log_bucket:
            raise ValueError("sensitive_log_bucket must differ from log_bucket (a dedicated pool)")
        if self.sensitive_log_store == "fs" and not self.sensitive_log_store_dir:
            raise ValueError("sensitive_log_store is fs but sensitive_log_store_dir is empty")
        if (
            self.sensitive_log_store == "fs"
            and self.log_store == "fs"
            and os.path.abspath(self.sensitive_log_store_dir) == os.path.abspath(self.log_store_dir)
        ):
            raise ValueError("sensitive_log_store_dir must differ from log_store_dir")
        if self.sensitive_log_store != "none" and self.sensitive_log_key is None:
            raise ValueError(
                "sensitive_log_store is set but sensitive_log_key is not (sensitive logs are "
                "never written unencrypted)"
            )
        return self


class TelemetryAlertRule(_Section):
    """One threshold rule the node agents evaluate on every collection of every
    allocation (spec: Alert Generation): the alert fires once ``metric`` has been below
    (``<``) or above (``>``) ``threshold`` on every collection for ``for_seconds`` (0: at
    the first), and resolves at the first collection where it is not (or has no value)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the alert's name")
    metric: str = Field(
        pattern=r"^[a-z][a-z0-9_]{0,63}$",
        description="a metric the agents collect, in its unit (io_latency_p99: microseconds)",
    )
    comparison: Literal["<", ">"] = Field(description="fires below (<) or above (>) threshold")
    threshold: float = Field(allow_inf_nan=False)
    for_seconds: float = Field(default=0.0, ge=0, description="how long before it fires")
    severity: Literal["warning", "critical"] = "warning"
    message: str = Field(default="", description="shown with the alert; empty = generated")


def _spec_alert_rules() -> list[TelemetryAlertRule]:
    """The specification's four rules (Alert Generation)."""
    return [
        TelemetryAlertRule(
            name="gpu_idle",
            metric="gpu_utilization",
            comparison="<",
            threshold=10,
            for_seconds=60,
            message="GPU utilization below 10% for over 60 s (potential hang)",
        ),
        TelemetryAlertRule(
            name="gpu_memory_high",
            metric="gpu_memory_utilization",
            comparison=">",
            threshold=95,
            severity="critical",
            message="GPU memory above 95% (OOM risk)",
        ),
        TelemetryAlertRule(
            name="network_errors",
            metric="network_error_rate",
            comparison=">",
            threshold=0.1,
            message="network error rate above 0.1%",
        ),
        TelemetryAlertRule(
            name="io_latency",
            metric="io_latency_p99",
            comparison=">",
            threshold=10_000,
            message="I/O p99 latency above 10 ms",
        ),
    ]


class TelemetryConfig(_Section):
    """TSDB and the node agents' aggregation mode (spec: Telemetry)."""

    tsdb_endpoint: str = Field(default="", description="VictoriaMetrics URL; empty = none")
    mode: Literal["prod", "debug", "audit"] = "prod"
    aggregation_window_seconds: float = Field(default=30.0, gt=0, description="prod mode")
    debug_auto_revert_seconds: float = Field(
        default=1800.0, gt=0, description="debug mode reverts to prod after this long"
    )
    debug_trace_retention_days: int = Field(default=7, ge=1)
    alert_rules: list[TelemetryAlertRule] = Field(
        default_factory=_spec_alert_rules,
        description="the agents' threshold alerts (lattice watch); the whole set: "
        "default the specification's four",
    )

    @field_validator("alert_rules")
    @classmethod
    def _unique_rule_names(cls, v: list[TelemetryAlertRule]) -> list[TelemetryAlertRule]:
        seen: set[str] = set()
        for rule in v:
            if rule.name in seen:
                raise ValueError(f"two alert rules are named {rule.name!r}")
            seen.add(rule.name)
        return v


# ---------------------------------------------------------------------------------------
# backups of the quorum state
# ---------------------------------------------------------------------------------------


class BackupConfig(_Section):
    """Scheduled snapshots of the quorum state (spec: Disaster Recovery; lattice_api.ops.backup).
    The leader writes ``snap-<UTC timestamp>.bin`` and ``snap-latest.bin`` to
    ``destination``; S3 uses the endpoint and credentials of ``storage``."""

    schedule_interval_seconds: float = Field(
        default=3600.0, ge=0, description="snapshot this often (leader only); 0 = off"
    )
    destination: str = Field(
        default="",
        description="a directory or s3://bucket/prefix for scheduled snapshots; empty = "
        "quorum.backup_dir (where `lattice admin backup create` writes without --to)",
    )
    retention_count: int | None = Field(
        default=None,
        ge=1,
        description="snap-<timestamp>.bin files kept, older ones deleted; unset = "
        "quorum.snapshot_retention_count (5)",
    )


# ---------------------------------------------------------------------------------------
# checkpoint broker, network
# ---------------------------------------------------------------------------------------


class CheckpointConfig(_Section):
    """Checkpoint broker (spec: Checkpoint Broker, Preemption)."""

    evaluation_interval_seconds: float = Field(
        default=30.0, gt=0, description="cost model re-evaluated per running allocation"
    )
    checkpoint_timeout_seconds: float = Field(
        default=600.0, gt=0, description="no completion after a hint -> forced preemption"
    )
    storage_probe_interval_seconds: float = Field(
        default=60.0, gt=0, description="write probe of the checkpoint destination"
    )
    checkpoint_root: str = Field(
        default="/var/lib/lattice/checkpoints",
        description="agents write checkpoints under {root}/{tenant}/{project}/{alloc}/"
        "checkpoints/{id}/; shared by all nodes so a job resumes anywhere",
    )
    max_deferral_seconds: float = Field(
        default=300.0, ge=0, description="gRPC callback: deferral granted at most, then forced"
    )
    # lattice_checkpoint.storage.retention: checkpoints of ended allocations
    retention_days: float = Field(
        default=7.0,
        ge=0,
        description="checkpoints of terminal allocations are deleted this long after they "
        "ended (spec default: 7 days); 0 = kept forever",
    )
    metrics_listen: str = Field(default="0.0.0.0:9104", description="empty = no metrics")
    # the broker's cost model (lattice_checkpoint.cost)
    node_mtbf_hours: float = Field(
        default=1000.0,
        gt=0,
        description="a healthy node's mean time between failures: the base of the failure "
        "probability that weighs recompute_saved",
    )
    storage_cost_gpu_hours_per_gb: float = Field(
        default=0.0001, ge=0, description="storage_cost of one GB of checkpoint, in GPU-hours"
    )
    default_checkpoint_gib_per_node: float = Field(
        default=1.0,
        gt=0,
        description="checkpoint size per node when neither the nodes' GPU memory nor an "
        "earlier checkpoint of the allocation tells",
    )

    @field_validator("metrics_listen")
    @classmethod
    def _metrics(cls, v: str) -> str:
        return _check_host_port(v, allow_empty=True)


class NetworkConfig(_Section):
    """Network domains and the Slingshot VNI pool (spec: Network Domains).

    VNIs 1 (management) and 2 (telemetry) are reserved; 3-999 are kept for future use.
    """

    vni_pool_start: int = Field(default=1000, ge=3, le=65535)
    vni_pool_end: int = Field(default=4095, ge=3, le=65535)
    domain_grace_period_seconds: float = Field(
        default=300.0, ge=0, description="empty domain keeps its VNI this long"
    )
    max_domains_per_tenant: int = Field(default=50, ge=1)
    fabric_manager_url: str = Field(
        default="", description="Slingshot fabric manager base URL; empty = no CXI credentials"
    )
    fabric_manager_token: SecretStr | None = Field(
        default=None, description="fabric manager bearer token; env LATTICE_FABRIC_MANAGER_TOKEN"
    )

    @field_validator("fabric_manager_url")
    @classmethod
    def _fabric_manager_url(cls, v: str) -> str:
        return http_url_or_empty(v)

    @model_validator(mode="after")
    def _range(self) -> NetworkConfig:
        if self.vni_pool_start > self.vni_pool_end:
            raise ValueError(
                f"vni_pool_start ({self.vni_pool_start}) must not exceed "
                f"vni_pool_end ({self.vni_pool_end})"
            )
        return self


# ---------------------------------------------------------------------------------------
# accounting, rate limits, federation, compat
# ---------------------------------------------------------------------------------------


#: the specification's nested ``accounting.waldur`` keys -> the flat field they set
_WALDUR_KEYS = {
    "api_url": "waldur_url",
    "url": "waldur_url",
    "token": "waldur_token",
    "token_secret_ref": "waldur_token_secret_ref",
    "push_interval_seconds": "push_interval_seconds",
    "buffer_size": "buffer_size",
    "disk_buffer_path": "disk_buffer_path",
    "disk_buffer_max_events": "disk_buffer_max_events",
    "disk_buffer_max_bytes": "disk_buffer_max_bytes",
}


class AccountingConfig(_Section):
    """Waldur accounting push (spec: Accounting via Waldur). Off = no accounting code runs.

    The specification's form ``waldur: {api_url, token_secret_ref, push_interval_seconds,
    buffer_size, disk_buffer_path, disk_buffer_max_events}`` is accepted and sets the
    flat fields below (``api_url`` -> ``waldur_url``, ``token_secret_ref`` ->
    ``waldur_token_secret_ref``)."""

    enabled: bool = False
    # who receives the accounting events: "waldur" (push to Waldur) or "none" (nothing
    # leaves the cluster)
    provider: Literal["none", "waldur"] = "waldur"
    waldur_url: str = Field(default="", description="Waldur API base URL")
    waldur_token: SecretStr | None = Field(
        default=None, description="API token; env LATTICE_ACCOUNTING__WALDUR_TOKEN, not the file"
    )
    waldur_token_secret_ref: str = Field(default="", description="e.g. vault://lattice/waldur")
    push_interval_seconds: float = Field(default=60.0, gt=0)
    buffer_size: int = Field(default=10000, ge=1, description="in-memory event buffer")
    disk_buffer_path: str = "/var/lib/lattice/accounting-wal"
    disk_buffer_max_events: int = Field(default=100000, ge=1)
    # the disk buffer is full at this size: events that fit neither in memory nor on
    # disk are dropped (lattice_accounting_events_dropped_total)
    disk_buffer_max_bytes: int = Field(default=1 << 30, ge=4096)
    # --- the lattice-accounting service (ledger, reservation gate, charger, watchdog) ---
    # the ledger's database: "" = SQLite file ledger.db under data_dir (development);
    # postgresql+asyncpg://... in production
    database_url: str = ""
    data_dir: str = "/var/lib/lattice/accounting"
    # the service's INTERNAL HTTP API (lattice-server only), and where lattice-server
    # finds it ("" = http://<listen>)
    listen: str = "127.0.0.1:9106"
    url: str = ""
    # shared by lattice-server and lattice-accounting; env LATTICE_ACCOUNTING__SERVICE_TOKEN
    # or a secret reference, never logged
    service_token: SecretStr | None = Field(default=None, description="internal API token")
    metrics_listen: str = "0.0.0.0:9105"
    charge_interval_seconds: float = Field(default=60.0, gt=0)
    # ranged/unbounded allocations reserve (and keep topped up) this far ahead
    reserve_ahead_seconds: float = Field(default=3600.0, gt=0)
    # a running allocation whose charge cannot be covered is cancelled after this
    funds_exhausted_grace_seconds: float = Field(default=60.0, ge=0)
    # a bound reservation whose allocation has not started after this gives its money
    # back (the allocation stays queued and is charged from the project when it runs)
    reservation_start_timeout_seconds: float = Field(default=86400.0, gt=0)
    # a reservation whose allocation never appeared in the quorum (the API died between
    # reserve and propose) is released after this
    reservation_orphan_grace_seconds: float = Field(default=120.0, gt=0)
    # lattice-server's timeout for one call to the internal API
    request_timeout_seconds: float = Field(default=5.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _spec_form(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "waldur" not in data:
            return data
        nested = data["waldur"]
        if nested is None:
            nested = {}
        if not isinstance(nested, dict):
            raise ValueError("accounting.waldur must be a mapping")
        out = {k: v for k, v in data.items() if k != "waldur"}
        for key, value in nested.items():
            name = _WALDUR_KEYS.get(key)
            if name is None:
                raise ValueError(
                    f"unknown key accounting.waldur.{key} "
                    f"(known: {', '.join(sorted(_WALDUR_KEYS))})"
                )
            if name in out:
                raise ValueError(f"give either accounting.{name} or accounting.waldur.{key}")
            out[name] = value
        return out

    @model_validator(mode="after")
    def _url(self) -> AccountingConfig:
        if self.enabled and self.provider == "waldur" and not self.waldur_url:
            raise ValueError("accounting is enabled but waldur_url is empty")
        return self

    @property
    def service_url(self) -> str:
        """Where lattice-server reaches the internal API."""
        return (self.url or f"http://{self.listen}").rstrip("/")

    @property
    def ledger_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{Path(self.data_dir) / 'ledger.db'}"


class RateLimitOverride(_Section):
    """One user's limits where they differ from the section's (unset = the default)."""

    requests_per_minute: int | None = Field(default=None, ge=0)
    attach_max_concurrent: int | None = Field(default=None, ge=1)
    stream_logs_max_concurrent: int | None = Field(default=None, ge=1)
    stream_metrics_max_concurrent: int | None = Field(default=None, ge=1)
    query_metrics_per_minute: int | None = Field(default=None, ge=1)
    diagnostics_per_minute: int | None = Field(default=None, ge=1)
    compare_per_minute: int | None = Field(default=None, ge=1)


class RateLimitConfig(_Section):
    """Per-user API rate limits (spec: Rate Limiting, observability chapter) and the
    per-node heartbeat limit (spec: Security, Denial of Service). Users are the token's
    subject; tenant and system admins share the same limits unless ``overrides`` names
    them; node agents and schedulers (the agent token) are not users and not limited."""

    enabled: bool = Field(default=True, description="off = no per-user limits")
    requests_per_minute: int = Field(
        default=0, ge=0, description="every other call, per user; 0 = no general limit"
    )
    attach_max_concurrent: int = Field(default=5, ge=1, description="Attach sessions")
    stream_logs_max_concurrent: int = Field(default=10, ge=1, description="StreamLogs")
    stream_metrics_max_concurrent: int = Field(default=5, ge=1, description="StreamMetrics")
    query_metrics_per_minute: int = Field(default=60, ge=1, description="QueryMetrics")
    diagnostics_per_minute: int = Field(default=30, ge=1, description="Diagnostics")
    compare_per_minute: int = Field(default=10, ge=1, description="Compare")
    overrides: dict[str, RateLimitOverride] = Field(
        default_factory=dict, description="user (OIDC subject) -> limits set by an admin"
    )
    heartbeat_burst: int = Field(
        default=10,
        ge=0,
        description="heartbeats a node may send at once; refilled one per "
        "node_agent.heartbeat_interval_seconds; 0 = no heartbeat limit",
    )


class FederationPeer(_Section):
    name: str = Field(min_length=1, description="peer site name")
    endpoint: str = Field(min_length=1, description="peer federation broker host:port")
    workspace: str = Field(default="", description="shared Sovra workspace")


class FederationConfig(_Section):
    """Sovra cross-site federation (spec: Federation). Off = no federation code runs."""

    enabled: bool = False
    site_name: str = ""
    sovra_workspace: str = ""
    peers: list[FederationPeer] = Field(default_factory=list)
    catalog_sync_interval_seconds: float = Field(default=3600.0, gt=0)
    peer_stale_after_seconds: float = Field(default=7200.0, gt=0)
    peer_unreachable_after_seconds: float = Field(default=86400.0, gt=0)


class CompatConfig(_Section):
    """Slurm compatibility (spec: Slurm Migration)."""

    slurm_env: bool = Field(
        default=True, description="set SLURM_* variables in allocations (spec: set_slurm_env)"
    )
    sbatch_directives: bool = Field(default=True, description="honour #SBATCH in scripts")
    qos_map: dict[str, int] = Field(
        default_factory=dict, description="--qos name -> preemption class"
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        return _apply_aliases(data, ("compat",))

    @field_validator("qos_map")
    @classmethod
    def _classes(cls, v: dict[str, int]) -> dict[str, int]:
        for name, klass in v.items():
            if not 0 <= klass <= 10:
                raise ValueError(f"preemption class for qos {name!r} must be 0..10, got {klass}")
        return v


# ---------------------------------------------------------------------------------------
# the whole file
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# secrets
# ---------------------------------------------------------------------------------------


class TlsConfig(_Section):
    """Certificates between components (spec: internal service authentication). The
    servers' side is ``api.tls_cert``/``tls_key``/``tls_ca``; this section is the
    clients' side (agents, schedulers, the checkpoint broker) and the internal CA's
    naming and lifetimes. Empty ``ca`` = plaintext to lattice-server."""

    site: str = Field(
        default="local",
        pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
        description="site name in certificate names: {name}.{site}.lattice.internal",
    )
    ca: str = Field(default="", description="CA bundle (PEM) the servers' certificates chain to")
    cert: str = Field(
        default="",
        description="this component's certificate (PEM); for an agent its bootstrap "
        "certificate (LATTICE_BOOTSTRAP_CERT)",
    )
    key: str = Field(default="", description="its private key (PEM, mode 0600)")
    spire_socket: str = Field(
        default="/run/spire/agent.sock",
        description="SPIFFE Workload API socket; agents use an X.509-SVID from it when present",
    )
    cert_dir: str = Field(
        default="/var/lib/lattice/agent/tls",
        description="where an agent keeps the certificate the quorum CA issued it",
    )
    agent_cert_lifetime_seconds: float = Field(
        default=3 * 86400.0, gt=0, description="node agent certificates (spec: 3 days)"
    )
    bootstrap_cert_lifetime_seconds: float = Field(
        default=3600.0, gt=0, le=3600.0, description="bootstrap certificates (at most 1 h)"
    )
    service_cert_lifetime_seconds: float = Field(
        default=365 * 86400.0, gt=0, description="scheduler, broker and API certificates"
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls.cert and tls.key must be set together")
        if self.cert and not self.ca:
            raise ValueError("tls.cert needs tls.ca (the CA the servers' certificates chain to)")
        return self


class LatticeConfig(_Section):
    """The whole configuration file. Every section is optional."""

    quorum: QuorumConfig = Field(default_factory=QuorumConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    node_agent: NodeAgentConfig = Field(default_factory=NodeAgentConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    accounting: AccountingConfig = Field(default_factory=AccountingConfig)
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    compat: CompatConfig = Field(default_factory=CompatConfig)
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    backup: BackupConfig = Field(default_factory=BackupConfig)

    #: "section.field" -> the reference it was resolved from (set by load_config)
    _secret_refs: dict[str, str] = pydantic.PrivateAttr(default_factory=dict)

    @property
    def secret_refs(self) -> dict[str, str]:
        """The secret fields that were written as references, and those references
        (what lattice_common.secrets.SecretResolver.watch takes for rotation)."""
        return self._secret_refs

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        data = _apply_aliases(data, ())
        if isinstance(data, dict):
            # `section:` with every key commented out is YAML null: treat it as empty.
            data = {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data


def _apply_aliases(data: Any, where: tuple[str, ...]) -> Any:
    aliases = _KEY_ALIASES.get(where)
    if not aliases or not isinstance(data, dict):
        return data
    out = dict(data)
    for alias, name in aliases.items():
        if alias in out:
            if name in out:
                prefix = ".".join(where) + "." if where else ""
                raise ValueError(f"give either {prefix}{name} or {prefix}{alias}, not both")
            out[name] = out.pop(alias)
    return out


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    resolve_secrets: bool = True,
) -> LatticeConfig:
    """Read ``path`` (YAML; ``None`` = no file, defaults only), apply ``LATTICE_*``
    overrides from ``env`` (``None`` = ``os.environ``; pass ``{}`` to ignore the
    environment) and validate. Raises :class:`ValidationError` on any problem.

    Secret fields written as references (``env://``, ``file://``, ``vault://``) are
    resolved here, through lattice_common.secrets (``env`` is where env:// and
    ``VAULT_SECRET_ID`` are read); ``cfg.secret_refs`` keeps the references."""
    environ = os.environ if env is None else env
    source = os.fspath(path) if path is not None else None
    data = _read_yaml(source) if source is not None else {}
    data = _canonical(data)
    env_sources = _apply_env(data, environ)
    try:
        cfg = LatticeConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _convert(exc, source, env_sources) from None
    if resolve_secrets:
        from lattice_common.secrets import SecretResolver, resolve_config_secrets

        cfg._secret_refs = resolve_config_secrets(cfg, SecretResolver(cfg.secrets, env=environ))
    return cfg


def _read_yaml(source: str) -> dict[str, Any]:
    p = Path(source)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(
            f"configuration file {source} not found",
            details={"path": source},
            hint="Pass --config with an existing file; config/minimal.yaml is a starting point.",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValidationError(
            f"cannot read configuration file {source}: {reason}",
            details={"path": source},
            hint="Check that the path is a readable UTF-8 text file.",
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" at line {line}" if line else ""
        details: dict[str, Any] = {"path": source}
        if line:
            details["line"] = line
            details["column"] = mark.column + 1
        raise ValidationError(
            f"invalid YAML in {source}{where}: {problem}",
            details=details,
            hint="Check indentation (spaces, not tabs) and quoting around that line.",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValidationError(
            f"configuration file {source} must contain a mapping of sections, "
            f"not {type(data).__name__}",
            details={"path": source},
            hint=_HINT,
        )
    return data


def _canonical(data: dict[str, Any]) -> dict[str, Any]:
    """Map the specification's alternative spellings before env overrides are merged."""
    try:
        data = _apply_aliases(data, ())
        if isinstance(data.get("compat"), dict):
            data["compat"] = _apply_aliases(data["compat"], ("compat",))
    except ValueError as exc:
        raise ValidationError(f"invalid configuration: {exc}", hint=_HINT) from None
    return data


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Merge overrides into ``data`` in place; return dotted key -> environment name."""
    overrides: list[tuple[int, str, tuple[str, ...], str]] = []
    for name, value in env.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        if upper in SPECIAL_ENV:
            overrides.append((0, name, SPECIAL_ENV[upper], value))
            continue
        rest = upper[len(ENV_PREFIX) :]
        if "__" not in rest:
            continue  # not a config override (LATTICE_TASK_INDEX, LATTICE_ENDPOINT, ...)
        parts = tuple(p.lower() for p in rest.split("__"))
        if not all(parts):
            raise ValidationError(
                f"malformed configuration variable {name}",
                details={"variable": name},
                hint="Use LATTICE_<SECTION>__<FIELD>, e.g. LATTICE_SCHEDULING__BACKFILL_DEPTH=20.",
            )
        parts = _canonical_path(parts)
        overrides.append((1, name, parts, value))
    sources: dict[str, str] = {}
    # Documented short names first so that the explicit section form wins.
    for _, name, parts, value in sorted(overrides, key=lambda o: (o[0], o[1])):
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValidationError(
                    f"cannot apply {name}: {'.'.join(parts[: depth + 1])} is not a section",
                    details={"variable": name},
                    hint=_HINT,
                )
            node = child
        node[parts[-1]] = _env_value(value)
        sources[".".join(parts)] = name
    return sources


def _canonical_path(parts: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for part in parts:
        out.append(_KEY_ALIASES.get(tuple(out), {}).get(part, part))
    return tuple(out)


def _env_value(value: str) -> Any:
    stripped = value.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.safe_load(stripped)
        except yaml.YAMLError:
            return value  # let the field's validator report it
    return value


_SECRETISH = ("secret", "token", "password")


def _convert(
    exc: pydantic.ValidationError, source: str | None, env_sources: dict[str, str]
) -> ValidationError:
    problems: list[str] = []
    first_key = ""
    first_value: Any = None
    first_hint = ""
    all_env = True
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        key = _dotted(loc)
        extra = err.get("type") == "extra_forbidden"
        env_name = _env_source(loc, env_sources, below=extra)
        all_env = all_env and env_name is not None
        origin = f" (from {env_name})" if env_name else ""
        if extra:
            text = f"unknown key '{key}'{origin}"
            value_shown = None
            hint = _suggest(loc)
        else:
            msg = str(err.get("msg", "invalid value"))
            msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            # (the ``secrets`` section itself holds addresses and names, not secrets)
            secret = any(s in str(p).lower() for p in loc if p != "secrets" for s in _SECRETISH)
            value_shown = "**********" if secret else _short(err.get("input"))
            if err.get("type") == "missing":
                text = f"{key}: required field is missing{origin}"
            elif isinstance(err.get("input"), dict) and err.get("type") in (
                "value_error",
                "assertion_error",
            ):
                # A cross-field check on a whole section: the message names the fields.
                text = f"{key}: {msg}{origin}" if key else f"{msg}{origin}"
                value_shown = None
            elif "got " in msg:  # our own validators already quote the value
                text = f"{key}: {msg}{origin}"
            else:
                text = f"{key}: {msg} (got {value_shown}){origin}"
            hint = _HINT
        problems.append(text)
        if not first_key:
            first_key, first_value, first_hint = key, value_shown, hint
    where = f" in {source}" if source and not all_env else ""
    if len(problems) == 1:
        message = f"invalid configuration{where}: {problems[0]}"
    else:
        message = f"{len(problems)} configuration problems{where}: " + "; ".join(problems)
    details: dict[str, Any] = {"key": first_key}
    if first_value is not None:
        details["value"] = first_value
    if source:
        details["path"] = source
    if len(problems) > 1:
        details["problems"] = problems
    return ValidationError(message, details=details, hint=first_hint or _HINT)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _env_source(
    loc: tuple[Any, ...], env_sources: dict[str, str], *, below: bool = False
) -> str | None:
    """The variable that set ``loc`` (or a section above it). With ``below``, also one that
    set a key under it: an unknown section or key created only by the environment."""
    names = [str(p) for p in loc if not isinstance(p, int)]
    for n in range(len(names), 0, -1):
        hit = env_sources.get(".".join(names[:n]))
        if hit:
            return hit
    if below and names:
        prefix = ".".join(names) + "."
        for key, name in env_sources.items():
            if key.startswith(prefix):
                return name
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the last element of ``loc`` (for "did you mean")."""
    model: type[BaseModel] = LatticeConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        inner = _model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _suggest(loc: tuple[Any, ...]) -> str:
    model = _model_at(loc)
    if model is None or not loc:
        return _HINT
    valid = list(model.model_fields)
    section = _dotted(loc[:-1]) or "the top level"
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    did_you_mean = f"Did you mean '{close[0]}'? " if close else ""
    return f"{did_you_mean}Valid keys in {section}: {', '.join(valid)}."
