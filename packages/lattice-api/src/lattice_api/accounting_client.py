"""lattice-server's client of the lattice-accounting INTERNAL API.

Authenticated with ``accounting.service_token`` (never logged). Errors the service
returns come back as the same typed LatticeError (message, details, hint); a service
that cannot be reached is :class:`Unavailable` with a hint, which refuses submissions
(money gating is never skipped silently) but nothing else.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from lattice_common.errors import LatticeError, Unavailable


class AccountingClient:
    def __init__(self, url: str, token: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        query = {k: str(v) for k, v in (params or {}).items() if v not in (None, "")}
        try:
            async with self._http().request(
                method, self.url + path, params=query, json=body
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = None
                if resp.status >= 400:
                    if isinstance(data, dict) and isinstance(data.get("error"), dict):
                        raise LatticeError.from_dict(data["error"])
                    raise Unavailable(
                        f"the accounting service answered {resp.status}",
                        hint="See the lattice-accounting log.",
                    )
                return data if isinstance(data, dict) else {}
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise Unavailable(
                "the accounting service is unreachable",
                details={"Service": self.url, "Error": str(e) or type(e).__name__},
                hint="Accounting is enabled, so submissions need their reservation: start "
                "lattice-accounting (systemctl start lattice-accounting) and retry. "
                "Running work is not affected.",
            ) from None


__all__ = ["AccountingClient"]
