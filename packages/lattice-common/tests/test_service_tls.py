"""Services (scheduler, checkpoint broker, accounting) build their client TLS from
``tls``: plaintext without a CA, a clear error naming the certificate to issue when the
files cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest
from lattice_common.config import TlsConfig
from lattice_common.errors import LatticeError
from lattice_common.rpc import service_tls


def test_no_ca_is_plaintext() -> None:
    assert service_tls(TlsConfig()) is None


def test_missing_files_name_the_certificate_kind_to_issue(tmp_path: Path) -> None:
    tls = TlsConfig(
        ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem")
    )
    with pytest.raises(LatticeError) as e:
        service_tls(tls, "checkpoint")
    assert "cannot load the TLS files" in e.value.message
    assert "lattice admin ca issue --kind checkpoint" in (e.value.hint or "")


def test_garbage_files_are_refused_the_same_way(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate")
    with pytest.raises(LatticeError) as e:
        service_tls(TlsConfig(ca=str(tmp_path / "ca.pem")))
    assert "a service certificate" in (e.value.hint or "")
