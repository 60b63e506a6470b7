"""Config loading: defaults, the example files, env overrides and error messages."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from lattice_common.config import (
    DefaultVCluster,
    LatticeConfig,
    PeerConfig,
    QuorumConfig,
    load_config,
)
from lattice_common.errors import ValidationError
from pydantic import BaseModel, SecretStr

REPO = Path(__file__).resolve().parents[3]
MINIMAL = REPO / "config" / "minimal.yaml"
PRODUCTION = REPO / "config" / "production.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text, encoding="utf-8")
    return p


# --- defaults and example files ------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config(None, env={})
    assert cfg == LatticeConfig()
    assert cfg.quorum.node_id == 1
    assert cfg.quorum.bind == "127.0.0.1:9000"
    assert cfg.quorum.data_dir == "/var/lib/lattice/raft"
    assert cfg.quorum.peers == []
    assert cfg.quorum.append_entries_period == 0.01
    assert cfg.quorum.raft_min_timeout < cfg.quorum.raft_max_timeout
    assert cfg.api.grpc_listen == "0.0.0.0:50051"
    assert cfg.api.rest_listen == "0.0.0.0:8080"
    assert cfg.api.oidc_client_id == "lattice"
    assert cfg.api.oidc_hmac_secret is None and cfg.api.agent_token is None
    assert cfg.api.max_request_bytes == 1_048_576
    assert cfg.scheduling.cycle_interval_seconds == 5.0
    assert cfg.scheduling.backfill_depth == 10
    assert cfg.scheduling.default_vclusters == [
        DefaultVCluster(name="default", scheduler_type="hpc-backfill")
    ]
    assert cfg.node_agent.heartbeat_interval_seconds == 10
    assert cfg.node_agent.heartbeat_timeout_seconds == 30
    assert cfg.node_agent.grace_period_seconds == 60
    assert cfg.node_agent.sensitive_grace_period_seconds == 300
    assert cfg.node_agent.borrowed_grace_period_seconds == 30
    assert cfg.node_agent.grpc_listen == "0.0.0.0:50053"
    assert cfg.telemetry.mode == "prod"
    assert (cfg.network.vni_pool_start, cfg.network.vni_pool_end) == (1000, 4095)
    assert cfg.accounting.enabled is False and cfg.accounting.buffer_size == 10000
    # the spec's per-user limits are on; no general request limit unless configured
    assert cfg.rate_limit.enabled is True and cfg.rate_limit.requests_per_minute == 0
    assert cfg.rate_limit.stream_logs_max_concurrent == 10 and cfg.rate_limit.overrides == {}
    assert cfg.secrets.vault_address == "" and cfg.secrets.refresh_interval_seconds == 300
    assert cfg.federation.enabled is False
    assert cfg.compat.slurm_env is True


def test_empty_file_is_valid(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == LatticeConfig()
    assert load_config(write(tmp_path, "# only a comment\n"), env={}) == LatticeConfig()


def test_section_with_all_keys_commented_out_is_empty(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "federation:\n  # enabled: true\n"), env={})
    assert cfg.federation.enabled is False


def test_minimal_example_loads() -> None:
    cfg = load_config(MINIMAL, env={})
    assert cfg.quorum.peers == []
    assert cfg.quorum.data_dir.startswith("./.lattice-dev")
    for listen in (cfg.api.grpc_listen, cfg.api.rest_listen, cfg.node_agent.grpc_listen):
        assert listen.startswith("127.0.0.1:")
    assert not cfg.api.tls_cert and not cfg.api.oidc_issuer
    assert not (cfg.accounting.enabled or cfg.federation.enabled or cfg.rate_limit.enabled)


def test_production_example_loads() -> None:
    cfg = load_config(PRODUCTION, env={})
    assert cfg.quorum.node_id == 1
    assert [(p.id, p.address) for p in cfg.quorum.peers] == [
        (2, "lattice-02:9000"),
        (3, "lattice-03:9000"),
    ]
    assert all(p.api_address for p in cfg.quorum.peers)
    assert cfg.quorum.other_peers == cfg.quorum.peers
    assert cfg.api.tls_ca  # mTLS in production
    assert cfg.api.oidc_hmac_secret is None and cfg.api.agent_token is None


def _missing_keys(model: type[BaseModel], data: Any, where: str) -> list[str]:
    missing: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{where}.{name}" if where else name
        if not isinstance(data, dict) or name not in data:
            missing.append(key)
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            missing += _missing_keys(ann, data[name], key)
    return missing


def test_production_example_lists_every_field() -> None:
    raw = yaml.safe_load(PRODUCTION.read_text(encoding="utf-8"))
    assert _missing_keys(LatticeConfig, raw, "") == []


def test_example_files_hold_no_secrets() -> None:
    for path in (MINIMAL, PRODUCTION):
        cfg = load_config(path, env={})
        assert cfg.api.oidc_hmac_secret is None
        assert cfg.api.agent_token is None
        assert cfg.accounting.waldur_token is None


# --- environment overrides -----------------------------------------------------------


def test_env_overrides_file_and_is_coerced(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduling:\n  cycle_interval_seconds: 10\n  backfill_depth: 5\n")
    cfg = load_config(path, env={"LATTICE_SCHEDULING__CYCLE_INTERVAL_SECONDS": "2"})
    assert cfg.scheduling.cycle_interval_seconds == 2.0
    assert isinstance(cfg.scheduling.cycle_interval_seconds, float)
    assert cfg.scheduling.backfill_depth == 5  # untouched by the environment


def test_env_names_are_case_insensitive() -> None:
    cfg = load_config(
        None,
        env={
            "lattice_node_agent__heartbeat_interval_seconds": "3",
            "LATTICE_API__GRPC_LISTEN": "127.0.0.1:1",
        },
    )
    assert cfg.node_agent.heartbeat_interval_seconds == 3.0
    assert cfg.api.grpc_listen == "127.0.0.1:1"


def test_env_bool_int_and_list_values() -> None:
    cfg = load_config(
        None,
        env={
            "LATTICE_ACCOUNTING__ENABLED": "true",
            "LATTICE_ACCOUNTING__WALDUR_URL": "http://waldur:8000/api/",
            "LATTICE_ACCOUNTING__BUFFER_SIZE": "500",
            "LATTICE_QUORUM__PEERS": '[{"id": 2, "address": "127.0.0.1:9001"}]',
        },
    )
    assert cfg.accounting.enabled is True
    assert cfg.accounting.buffer_size == 500
    assert cfg.quorum.peers == [PeerConfig(id=2, address="127.0.0.1:9001")]


def test_documented_secret_env_names() -> None:
    cfg = load_config(
        None, env={"LATTICE_OIDC_HMAC_SECRET": "hmac-1", "LATTICE_AGENT_TOKEN": "tok-1"}
    )
    assert isinstance(cfg.api.oidc_hmac_secret, SecretStr)
    assert cfg.api.oidc_hmac_secret.get_secret_value() == "hmac-1"
    assert cfg.api.agent_token is not None
    assert cfg.api.agent_token.get_secret_value() == "tok-1"


def test_section_form_wins_over_documented_short_name() -> None:
    cfg = load_config(
        None, env={"LATTICE_AGENT_TOKEN": "short", "LATTICE_API__AGENT_TOKEN": "explicit"}
    )
    assert cfg.api.agent_token is not None
    assert cfg.api.agent_token.get_secret_value() == "explicit"


def test_non_config_lattice_variables_are_ignored() -> None:
    env = {"LATTICE_TASK_INDEX": "3", "LATTICE_ENDPOINT": "x:1", "PATH": "/bin"}
    assert load_config(None, env=env) == LatticeConfig()


def test_process_environment_is_used_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LATTICE_SCHEDULING__BACKFILL_DEPTH", "42")
    assert load_config().scheduling.backfill_depth == 42


def test_env_error_names_the_variable() -> None:
    with pytest.raises(ValidationError) as info:
        load_config(None, env={"LATTICE_SCHEDULING__CYCLE_INTERVAL_SECONDS": "soon"})
    assert "scheduling.cycle_interval_seconds" in info.value.message
    assert "LATTICE_SCHEDULING__CYCLE_INTERVAL_SECONDS" in info.value.message


def test_unknown_env_field_is_an_error() -> None:
    with pytest.raises(ValidationError) as info:
        load_config(None, env={"LATTICE_SCHEDULING__CYCLE_INTERVAL": "2"})
    assert "scheduling.cycle_interval" in info.value.message
    assert "LATTICE_SCHEDULING__CYCLE_INTERVAL" in info.value.message
    assert "cycle_interval_seconds" in info.value.hint


def test_spec_spellings_are_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path, "rate_limits:\n  attach_max_concurrent: 10\ncompat:\n  set_slurm_env: false\n"
    )
    cfg = load_config(path, env={})
    assert cfg.rate_limit.attach_max_concurrent == 10
    assert cfg.compat.slurm_env is False


# --- errors --------------------------------------------------------------------------


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduling:\n  cycle_intervl_seconds: 3\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    err = info.value
    assert "scheduling.cycle_intervl_seconds" in err.message
    assert str(path) in err.message
    assert err.details["key"] == "scheduling.cycle_intervl_seconds"
    assert "Did you mean 'cycle_interval_seconds'" in err.hint


def test_unknown_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unknown key 'bogus_section'"):
        load_config(write(tmp_path, "bogus_section:\n  x: 1\n"), env={})


def test_bad_value_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduling:\n  cycle_interval_seconds: 0\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    err = info.value
    assert "scheduling.cycle_interval_seconds" in err.message
    assert "greater than 0" in err.message
    assert err.details["key"] == "scheduling.cycle_interval_seconds"
    assert err.details["value"] == "0"
    assert err.code == "invalid_argument"
    # never a raw pydantic dump
    assert "pydantic" not in err.render() and "errors.pydantic.dev" not in err.render()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("telemetry:\n  mode: verbose\n", "telemetry.mode"),
        ("quorum:\n  peers:\n    - id: 2\n      address: nohost\n", "quorum.peers[0].address"),
        ("quorum:\n  peers:\n    - id: 2\n", "quorum.peers[0].address"),
        ("quorum:\n  raft_min_timeout: 1.0\n", "raft_max_timeout"),
        ("network:\n  vni_pool_start: 5000\n", "vni_pool_end"),
        (
            "scheduling:\n  default_vclusters:\n    - name: x\n      scheduler_type: magic\n",
            "scheduler_type",
        ),
        ("api:\n  tls_cert: /a.crt\n", "tls_key"),
        ("api:\n  grpc_listen: 50051\n", "api.grpc_listen"),
    ],
)
def test_invalid_values_name_what_is_wrong(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_config(write(tmp_path, text), env={})
    assert key in info.value.message


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduling:\n  backfill_depth: -1\n  nope: 1\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    msg = info.value.message
    assert "2 configuration problems" in msg
    assert "scheduling.backfill_depth" in msg and "scheduling.nope" in msg
    assert len(info.value.details["problems"]) == 2


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ValidationError) as info:
        load_config(missing, env={})
    err = info.value
    assert str(missing) in err.message and "not found" in err.message
    assert err.details["path"] == str(missing)
    assert err.hint


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "api:\n  grpc_listen: [1, 2\nscheduling: {}\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    err = info.value
    assert "invalid YAML" in err.message and "line" in err.message
    assert err.details["line"] in (2, 3)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), env={})


# --- secrets -------------------------------------------------------------------------


def test_secret_not_in_repr_str_dump_or_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "s3cr3t-hmac-value"
    token = "agent-token-value"
    cfg = load_config(None, env={"LATTICE_OIDC_HMAC_SECRET": secret, "LATTICE_AGENT_TOKEN": token})
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("config: %s / %r", cfg, cfg.api)
    for text in (repr(cfg), str(cfg), repr(cfg.api), cfg.model_dump_json(), caplog.text):
        assert secret not in text and token not in text
    assert cfg.api.oidc_hmac_secret is not None
    assert cfg.api.oidc_hmac_secret.get_secret_value() == secret


def test_secret_not_in_error_messages(tmp_path: Path) -> None:
    path = write(tmp_path, "api:\n  agent_token: 123456789\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    assert "123456789" not in info.value.render()
    assert "api.agent_token" in info.value.message


def test_typo_of_secret_key_does_not_echo_value(tmp_path: Path) -> None:
    path = write(tmp_path, "api:\n  agent_tokn: hunter2-secret\n")
    with pytest.raises(ValidationError) as info:
        load_config(path, env={})
    assert "hunter2-secret" not in info.value.render()
    assert "api.agent_tokn" in info.value.message


# --- model helpers -------------------------------------------------------------------


def test_other_peers_skips_this_member() -> None:
    q = QuorumConfig(
        node_id=1,
        peers=[PeerConfig(id=1, address="a:9000"), PeerConfig(id=2, address="b:9000")],
    )
    assert [p.id for p in q.other_peers] == [2]


def test_duplicate_peer_ids_rejected() -> None:
    with pytest.raises(ValidationError, match="listed twice"):
        load_config(
            None,
            env={
                "LATTICE_QUORUM__PEERS": '[{"id": 2, "address": "a:1"}, {"id": 2, "address": "b:1"}]'
            },
        )


# --- the log store (storage.*) --------------------------------------------------------


def test_log_store_settings() -> None:
    st = load_config(None, env={}).storage
    assert (st.log_store, st.log_store_dir) == ("fs", "/var/lib/lattice/log-store")
    assert st.log_flush_interval_seconds == 10.0
    assert st.s3_access_key_id is None and st.s3_secret_access_key is None
    cfg = load_config(
        None,
        env={
            "LATTICE_STORAGE__LOG_STORE": "s3",
            "LATTICE_STORAGE__LOG_BUCKET": "logs",
            "LATTICE_STORAGE__S3_ACCESS_KEY_ID": "plain-key-id",
            "LATTICE_STORAGE__S3_SECRET_ACCESS_KEY": "env://SITE_S3_SECRET",
            "SITE_S3_SECRET": "s3-secret-value",
            "LATTICE_STORAGE__LOG_FLUSH_INTERVAL_SECONDS": "2.5",
        },
    )
    st = cfg.storage
    assert st.log_store == "s3" and st.log_flush_interval_seconds == 2.5
    assert st.s3_secret_access_key is not None
    assert st.s3_secret_access_key.get_secret_value() == "s3-secret-value"
    assert cfg.secret_refs == {"storage.s3_secret_access_key": "env://SITE_S3_SECRET"}
    assert "s3-secret-value" not in repr(cfg)
    with pytest.raises(ValidationError, match="log_bucket"):
        load_config(None, env={"LATTICE_STORAGE__LOG_STORE": "s3"})
    with pytest.raises(ValidationError, match="log_flush_interval_seconds"):
        load_config(None, env={"LATTICE_STORAGE__LOG_FLUSH_INTERVAL_SECONDS": "0"})
    with pytest.raises(ValidationError, match="log_store"):
        load_config(None, env={"LATTICE_STORAGE__LOG_STORE": "tape"})
