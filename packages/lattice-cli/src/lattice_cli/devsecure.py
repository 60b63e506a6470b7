"""What `lattice dev up --secure` adds to a local cluster: a site PKI, an identity
provider, and the files each process needs, so the whole cluster runs as production
does: TLS on both API listeners, mTLS between components, OIDC tokens for people and
Raft traffic encrypted.

* a **site CA** (``tls/site-ca.crt``) that signs the members' certificates (kind api,
  for 127.0.0.1 and localhost) and the schedulers' (kind scheduler);
* the **fake IdP** of the test harness as a process (``python -m
  lattice_test_harness.fake_idp``): discovery, JWKS, PKCE and device logins (approved
  at once for the dev user), and client credentials for the cluster's own admin calls;
* after the quorum is up, the **internal CA** (``lattice admin ca init``) and one
  **bootstrap certificate** per agent, which each agent exchanges for its quorum-CA
  certificate at first contact;
* ``tls/raft.pw``, the Raft password, read through a ``file://`` reference.

Keys are written mode 0600 in a 0700 directory. Everything is for one machine's
development cluster: the IdP's client secret is a published test constant.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from lattice_common import pki

SITE = "dev"
SITE_CA_NAME = "Lattice dev site CA"


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


class SecureSetup:
    """The secure parts of one dev cluster under ``base/tls``."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "tls"
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.ca_cert = self.dir / "site-ca.crt"
        self.ca_key = self.dir / "site-ca.key"
        self.raft_password = self.dir / "raft.pw"
        if not self.ca_cert.exists():
            cert, key = pki.create_ca(SITE, now=time.time(), name=SITE_CA_NAME)
            _write(self.ca_key, key, 0o600)
            _write(self.ca_cert, cert, 0o644)
        if not self.raft_password.exists():
            _write(self.raft_password, secrets.token_urlsafe(32).encode(), 0o600)
        self.issuer = ""
        # the IdP's confidential client (its --info-file): the cluster's own admin calls
        self.service_client = ("", "")
        self._admin_token = ""
        self._admin_until = 0.0

    # --- certificates of the site PKI ------------------------------------------------

    def service_cert(self, kind: pki.Kind, name: str) -> tuple[Path, Path]:
        """A certificate of the site CA for a member or scheduler (kept across restarts)."""
        cert_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if not cert_path.exists():
            cert, key = pki.issue(
                self.ca_cert.read_bytes(),
                self.ca_key.read_bytes(),
                kind=kind,
                name=name,
                site=SITE,
                now=time.time(),
                lifetime=365 * 86400.0,
                hosts=["127.0.0.1", "localhost"],
            )
            _write(key_path, key, 0o600)
            _write(cert_path, cert, 0o644)
        return cert_path, key_path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_cert))

    # --- the identity provider ------------------------------------------------------------

    def admin_token(self) -> str:
        """A system-admin token by client credentials (the cluster's own setup calls)."""
        if self._admin_token and time.time() < self._admin_until - 30:
            return self._admin_token
        client, secret = self.service_client
        basic = base64.b64encode(f"{client}:{secret}".encode()).decode()
        req = urllib.request.Request(
            self.issuer.rstrip("/") + "/token",
            data=urllib.parse.urlencode(
                {"grant_type": "client_credentials", "scope": "admin"}
            ).encode(),
            headers={
                "Authorization": f"Basic {basic}",
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        self._admin_token = str(answer["access_token"])
        self._admin_until = time.time() + float(answer.get("expires_in") or 300)
        return self._admin_token

    def idp_args(self, port: int) -> list[str]:
        return ["--port", str(port), "--user", "alice", "--info-file", str(self.idp_info)]

    @property
    def idp_info(self) -> Path:
        return self.dir / "idp.json"

    def read_idp_info(self) -> bool:
        """Take the issuer and the service client from the IdP's info file (False until
        the IdP wrote it)."""
        try:
            info = json.loads(self.idp_info.read_text())
        except (OSError, ValueError):
            return False
        self.issuer = str(info["issuer"])
        self.service_client = (str(info["service_client"]), str(info["service_secret"]))
        return True

    # --- what the processes are given --------------------------------------------------

    def member_config(self, name: str) -> dict[str, Any]:
        cert, key = self.service_cert(pki.Kind.API, name)
        return {
            "api": {
                "tls_cert": str(cert),
                "tls_key": str(key),
                "tls_ca": str(self.ca_cert),
                "oidc_issuer": self.issuer,
                "oidc_client_id": "lattice",
            },
            "quorum": {"raft_password": f"file://{self.raft_password}"},
            "tls": {"site": SITE},
        }

    def scheduler_config(self, name: str) -> dict[str, Any]:
        cert, key = self.service_cert(pki.Kind.SCHEDULER, name)
        return {"tls": {"site": SITE, "ca": str(self.ca_cert), "cert": str(cert), "key": str(key)}}

    def bootstrap_agent(self, issue: Any, node_id: str, agent_dir: Path) -> list[str]:
        """A fresh bootstrap certificate for ``node_id`` signed by the internal CA
        (``issue(kind, name, csr_pem) -> {cert_pem, ...}``, an admin API call) and the
        agent flags that use it."""
        tls_dir = agent_dir / "tls"
        tls_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(tls_dir, 0o700)
        key = pki.generate_key()
        csr = pki.make_csr(key, pki.Kind.BOOTSTRAP, node_id, SITE)
        got = issue("bootstrap", node_id, csr.decode())
        _write(tls_dir / "bootstrap.key", pki.key_pem(key), 0o600)
        _write(tls_dir / "bootstrap.crt", got["cert_pem"].encode(), 0o644)
        return [
            "--bootstrap-cert",
            str(tls_dir / "bootstrap.crt"),
            "--bootstrap-key",
            str(tls_dir / "bootstrap.key"),
            "--bootstrap-ca",
            str(self.ca_cert),
            "--cert-dir",
            str(tls_dir / "node"),
        ]


__all__ = ["SITE", "SecureSetup"]
