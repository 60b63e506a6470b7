"""Settings of the API that come from the configuration, passed to constructors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lattice_common.config import RateLimitConfig, TlsConfig
from lattice_common.dag import DEFAULT_MAX_DAG_SIZE
from lattice_common.ledger import DEFAULT_BUDGET_PERIOD_DAYS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApiSettings:
    # scheduling.budget_period_days: the window budgets are judged over
    budget_period_days: float = DEFAULT_BUDGET_PERIOD_DAYS
    # raft address -> API gRPC address of that member, to point clients at the leader
    api_addresses: Mapping[str, str] = dataclasses.field(default_factory=dict)
    oidc_issuer: str = ""
    oidc_client_id: str = "lattice"
    max_request_bytes: int = 1_048_576
    # scheduling.max_dag_size: the most allocations one DAG submission may have
    max_dag_size: int = DEFAULT_MAX_DAG_SIZE
    # node_agent.uenv_registry / uenv_signing_key (the cluster shares one config file):
    # spec.uenv is resolved against the agents' registry at submit; "" = uenv refused
    uenv_registry: str = ""
    uenv_signing_key: str = ""
    # api.audit_signing_key_path (Ed25519 private key, PEM) signs audit entries; without
    # it a development key kept in audit_key_dir (quorum.data_dir), or, with neither, a
    # key for this process only (lattice_api.audit.load_signing_key)
    audit_signing_key_path: str = ""
    audit_key_dir: str = ""
    # rate_limit: per-user limits (lattice_api.ratelimit), checked by both transports
    rate_limit: RateLimitConfig = dataclasses.field(default_factory=RateLimitConfig)
    # api.token_revalidation_interval_seconds: long streams re-check their token
    token_revalidation_interval: float = 300.0
    # tls: the site in certificate names and the lifetimes of what the internal CA signs
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)
    # telemetry.tsdb_endpoint: the VictoriaMetrics URL `lattice top` reads (QueryMetrics);
    # "" = none (metrics are Unavailable). telemetry.aggregation_window_seconds and mode:
    # the resolution of prod data and what an answer without data says
    tsdb_endpoint: str = ""
    tsdb_timeout: float = 10.0
    telemetry_window_seconds: float = 30.0
    telemetry_mode: str = "prod"
    # accounting.enabled: where lattice-accounting's internal API is and its service token
    # (lattice_api.ops.accounting); "" = accounting off: no gate, accounting calls refused
    accounting_url: str = ""
    accounting_token: str = dataclasses.field(default="", repr=False)
    accounting_timeout: float = 5.0


__all__ = ["ApiSettings"]
