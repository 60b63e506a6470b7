"""The ``accounting`` section as the specification writes it, the token from a secret
reference, and the pusher built from it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from lattice_accounting.waldur.events import AccountingEvent, EventType
from lattice_accounting.waldur.feed import build_pusher
from lattice_accounting.waldur.metrics import WaldurMetrics
from lattice_common.config import load_config
from lattice_common.errors import FailedPrecondition, ValidationError
from lattice_test_harness.fake_waldur import FakeWaldur
from prometheus_client import CollectorRegistry

SECRET_VALUE = "waldur-secret-from-a-file-0123456789"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "waldur-token"
    p.write_text(SECRET_VALUE + "\n")
    os.chmod(p, 0o600)
    return p


def test_defaults_are_the_specifications() -> None:
    acc = load_config(None, env={}).accounting
    assert acc.enabled is False and acc.provider == "waldur"
    assert acc.push_interval_seconds == 60 and acc.buffer_size == 10000
    assert acc.disk_buffer_path == "/var/lib/lattice/accounting-wal"
    assert acc.disk_buffer_max_events == 100000


def test_the_spec_form_loads_and_the_token_comes_from_the_reference(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ref = token_file(tmp_path)
    cfg_path = write(
        tmp_path,
        f"""
accounting:
  enabled: true
  provider: "waldur"
  waldur:
    api_url: "https://waldur.example.com/api/"
    token_secret_ref: "file://{ref}"
    push_interval_seconds: 30
    buffer_size: 500
    disk_buffer_path: "{tmp_path / "wal"}"
    disk_buffer_max_events: 2000
""",
    )
    with caplog.at_level(logging.DEBUG):
        cfg = load_config(cfg_path, env={})
    acc = cfg.accounting
    assert acc.waldur_url == "https://waldur.example.com/api/"
    assert acc.push_interval_seconds == 30 and acc.buffer_size == 500
    assert acc.disk_buffer_max_events == 2000
    assert acc.waldur_token is not None and acc.waldur_token.get_secret_value() == SECRET_VALUE
    assert cfg.secret_refs == {"accounting.waldur_token": f"file://{ref}"}
    # never in a repr, a dump or a log line
    assert SECRET_VALUE not in repr(cfg) and SECRET_VALUE not in cfg.model_dump_json()
    assert SECRET_VALUE not in caplog.text


def test_spec_form_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as e:
        load_config(write(tmp_path, "accounting:\n  waldur:\n    api_ur: x\n"), env={})
    assert "accounting.waldur.api_ur" in e.value.message
    with pytest.raises(ValidationError) as e:
        load_config(
            write(tmp_path, "accounting:\n  waldur_url: http://a/\n  waldur:\n    api_url: x\n"),
            env={},
        )
    assert "either" in e.value.message
    with pytest.raises(ValidationError) as e:
        load_config(write(tmp_path, "accounting:\n  enabled: true\n"), env={})
    assert "waldur_url is empty" in e.value.message
    with pytest.raises(ValidationError):
        load_config(write(tmp_path, "accounting:\n  provider: sap\n"), env={})
    # provider none: enabled without a Waldur
    acc = load_config(
        write(tmp_path, "accounting:\n  enabled: true\n  provider: none\n"), env={}
    ).accounting
    assert acc.enabled and acc.provider == "none"


async def test_build_pusher_from_the_config_pushes_to_waldur(tmp_path: Path) -> None:
    ref = token_file(tmp_path)
    async with FakeWaldur(token=SECRET_VALUE) as waldur:
        cfg = load_config(
            write(
                tmp_path,
                f"""
accounting:
  enabled: true
  waldur:
    api_url: "{waldur.url}"
    token_secret_ref: "file://{ref}"
    disk_buffer_path: "{tmp_path / "wal"}"
""",
            ),
            env={},
        ).accounting
        pusher = build_pusher(cfg, metrics=WaldurMetrics(CollectorRegistry()))
        pusher.submit(
            [
                AccountingEvent(
                    event_id="cfg-1",
                    type=EventType.NODE_CLAIMED,
                    timestamp=1.0,
                    tenant="physics",
                    user="alice",
                    nodes=("n1",),
                )
            ]
        )
        assert await pusher.push_once() == 1
        assert waldur.backend_ids == ["cfg-1"]
        assert pusher.push_interval_seconds == 60
        await pusher.client.close()


def test_build_pusher_refuses_what_is_not_enabled(tmp_path: Path) -> None:
    cfg = load_config(None, env={}).accounting
    with pytest.raises(FailedPrecondition) as e:
        build_pusher(cfg)
    assert "accounting.enabled" in e.value.hint
    cfg = load_config(
        write(tmp_path, "accounting:\n  enabled: true\n  waldur_url: http://w/api/\n"), env={}
    ).accounting
    with pytest.raises(FailedPrecondition) as e:
        build_pusher(cfg)
    assert "token" in e.value.message and "secret_ref" in e.value.hint
