"""CXI credentials from the Slingshot fabric manager, for the MPI ranks of one launch.

Why this module exists (spec: CXI Credential Management): on Slingshot, libfabric's CXI
provider only lets ranks talk to each other when they share a CXI service (a VNI plus an
auth key) that the fabric manager has set up on their nodes. When a user launches MPI
ranks inside an allocation (LaunchTasks), the API server:

1. asks the fabric manager to create a CXI service for the launch's nodes
   (``POST /fabric/cxi/services`` -> ``{"id", "vni", "svc_id"}``);
2. reads the service's auth key (``GET /fabric/cxi/services/{id}/auth`` -> ``{"auth_key"}``)
   and hands :class:`CxiCredentials` to the node agents, which set ``FI_CXI_DEFAULT_VNI``
   and ``FI_CXI_AUTH_KEY`` for the ranks;
3. revokes the service when the launch ends (``DELETE /fabric/cxi/services/{id}``).

A service created in step 1 whose key cannot be read is deleted at once, so a failed
launch leaves nothing behind on the fabric. Every failure (unreachable, timeout,
refused token, unexpected answer) is a :class:`~lattice_common.errors.Unavailable`
naming the fabric manager's URL and its HTTP status and body, with a hint; the bearer
token never appears in messages, details or ``repr``. Configured by
``network.fabric_manager_url`` and ``network.fabric_manager_token``
(``LATTICE_FABRIC_MANAGER_TOKEN``); an empty URL means no fabric manager and no
credentials (:meth:`FabricManager.from_config` returns ``None``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from lattice_common.config import NetworkConfig
from lattice_common.errors import Unavailable

__all__ = ["CxiCredentials", "FabricManager"]

log = logging.getLogger(__name__)

SERVICES_PATH = "/fabric/cxi/services"
_MAX_BODY_CHARS = 300


@dataclass(frozen=True)
class CxiCredentials:
    """One launch's CXI service: what the ranks need to use the fabric.

    ``service_id`` is the fabric manager's name for the service (used to revoke it),
    ``vni`` goes to ``FI_CXI_DEFAULT_VNI``, ``svc_id`` is the CXI service number on the
    NICs and ``auth_key`` (hex) goes to ``FI_CXI_AUTH_KEY``.
    """

    service_id: str
    vni: int
    svc_id: int
    auth_key: str

    def __repr__(self) -> str:  # the key is a credential: keep it out of logs
        return (
            f"CxiCredentials(service_id={self.service_id!r}, vni={self.vni}, "
            f"svc_id={self.svc_id}, auth_key='***')"
        )


class FabricManager:
    """Client of the fabric manager's CXI REST API (one aiohttp session, made on first use)."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 10.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"fabric manager URL must be http(s), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, network: NetworkConfig, *, timeout: float = 10.0) -> FabricManager | None:
        """The client for ``network.fabric_manager_url``, or ``None`` when it is empty."""
        if not network.fabric_manager_url:
            return None
        token = network.fabric_manager_token
        return cls(
            network.fabric_manager_url,
            token.get_secret_value() if token is not None else None,
            timeout=timeout,
        )

    @property
    def token(self) -> str | None:
        """The bearer token (``None``: requests carry no Authorization header)."""
        return self._token

    def __repr__(self) -> str:
        return f"FabricManager(base_url={self.base_url!r}, timeout={self.timeout})"

    async def provision(
        self,
        allocation_id: str,
        launch_id: str,
        nodes: list[str],
        vni: int | None = None,
    ) -> CxiCredentials:
        """Create the launch's CXI service on ``nodes`` and read its auth key.

        ``vni`` is the allocation's network-domain VNI; ``None`` lets the fabric manager
        pick one. If the key cannot be read the new service is deleted before raising.
        """
        body = {
            "allocation_id": allocation_id,
            "launch_id": launch_id,
            "nodes": list(nodes),
            "vni": vni,
        }
        created = await self._request("POST", SERVICES_PATH, body, expect=(200, 201))
        service_id = created.get("id") if isinstance(created, dict) else None
        if not isinstance(service_id, str) or not service_id:
            raise self._bad_answer("POST", SERVICES_PATH, created, "no service id")
        try:
            got_vni = created.get("vni")
            svc_id = created.get("svc_id")
            if not _is_int(got_vni) or not _is_int(svc_id):
                raise self._bad_answer("POST", SERVICES_PATH, created, "no integer vni/svc_id")
            auth_path = f"{_service_path(service_id)}/auth"
            auth = await self._request("GET", auth_path, None, expect=(200,))
            auth_key = auth.get("auth_key") if isinstance(auth, dict) else None
            if not isinstance(auth_key, str) or not _is_hex(auth_key):
                raise self._bad_answer("GET", auth_path, auth, "no hex auth_key")
        except BaseException:
            # Do not leak the service we just created (also on cancellation).
            await self._discard(service_id)
            raise
        return CxiCredentials(service_id=service_id, vni=got_vni, svc_id=svc_id, auth_key=auth_key)

    async def revoke(self, service_id: str) -> None:
        """Delete the CXI service; one already gone (404) is fine."""
        await self._request("DELETE", _service_path(service_id), None, expect=(200, 202, 204, 404))

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def __aenter__(self) -> FabricManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ---------------------------------------------------------------------

    async def _discard(self, service_id: str) -> None:
        try:
            await asyncio.shield(self.revoke(service_id))
        except (Unavailable, asyncio.CancelledError) as exc:
            log.warning(
                "could not delete CXI service %s after a failed provision: %s", service_id, exc
            )

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            )
        return self._session

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, *, expect: tuple[int, ...]
    ) -> Any:
        url = self.base_url + path
        session = self._get_session()
        try:
            async with session.request(method, url, json=body) as resp:
                text = await resp.text(errors="replace")
                status = resp.status
        except TimeoutError:
            raise Unavailable(
                f"fabric manager {self.base_url} did not answer {method} {path} "
                f"within {self.timeout:g} s",
                details={"url": url, "timeout_seconds": self.timeout},
                hint="Check that the fabric manager is running and not overloaded, "
                "or raise the client timeout.",
            ) from None
        except aiohttp.ClientError as exc:
            raise Unavailable(
                f"fabric manager {self.base_url} is unreachable ({method} {path}): "
                f"{self._redact(str(exc)) or type(exc).__name__}",
                details={"url": url},
                hint="Check network.fabric_manager_url and that the fabric manager is "
                "running and reachable from the API server.",
            ) from None
        if status not in expect:
            raise self._http_error(method, path, status, text)
        if status in (204, 404) or not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise self._bad_answer(method, path, text, "not JSON") from None

    def _http_error(self, method: str, path: str, status: int, text: str) -> Unavailable:
        body = self._short(text)
        if status in (401, 403):
            hint = (
                "Check LATTICE_FABRIC_MANAGER_TOKEN (network.fabric_manager_token): the "
                "fabric manager refused the bearer token."
            )
        elif status >= 500:
            hint = "The fabric manager failed; check its logs and health."
        else:
            hint = (
                "Check network.fabric_manager_url (it must be the fabric manager's base "
                "URL) and that its API version matches."
            )
        return Unavailable(
            f"fabric manager {self.base_url} answered {method} {path} with HTTP {status}: {body}",
            details={"url": self.base_url + path, "status": status, "body": body},
            hint=hint,
        )

    def _bad_answer(self, method: str, path: str, answer: Any, what: str) -> Unavailable:
        body = self._short(answer if isinstance(answer, str) else json.dumps(answer))
        return Unavailable(
            f"fabric manager {self.base_url} gave an unexpected answer to {method} {path} "
            f"({what}): {body}",
            details={"url": self.base_url + path, "body": body},
            hint="Check that network.fabric_manager_url points at a Slingshot fabric "
            "manager with the CXI services API.",
        )

    def _short(self, text: str) -> str:
        text = self._redact(text.strip())
        if len(text) > _MAX_BODY_CHARS:
            text = text[:_MAX_BODY_CHARS] + "..."
        return text or "(empty body)"

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text


def _service_path(service_id: str) -> str:
    return f"{SERVICES_PATH}/{quote(service_id, safe='')}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: str) -> bool:
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return bool(value)
