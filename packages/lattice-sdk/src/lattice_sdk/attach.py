"""``AttachSession``: a terminal in a Running allocation over the API's WebSocket
(``GET /api/v1/allocations/{id}/attach``; see lattice_api.rest.attach for the frames).

::

    async with await client.attach(alloc_id) as term:
        await term.resize(40, 120)
        await term.send(b"ls\\n")
        async for chunk in term:          # output bytes (Stderr chunks without a tty)
            sys.stdout.buffer.write(chunk)
    print(term.exit_code)

aiohttp is imported only here (the WebSocket client), so other commands do not pay
for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from lattice_sdk.errors import LatticeError, error_from_response, unreachable

__all__ = ["AttachSession", "Stderr"]


class Stderr(bytes):
    """An output chunk from the command's stderr (only without a tty)."""


class AttachSession:
    """One open attach. Iterate for output; ``exit_code`` is set when the command ends
    (None if the session ended otherwise: the allocation stopped, the node was lost)."""

    def __init__(self, session: Any, ws: Any, node_id: str) -> None:
        self._session = session
        self._ws = ws
        self.node_id = node_id
        self.exit_code: int | None = None
        self.error: LatticeError | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        endpoint: str,
        target: str,
        headers: dict[str, str],
        *,
        ssl: Any = None,
        timeout: float | None = 30,
    ) -> AttachSession:
        import aiohttp

        session = aiohttp.ClientSession(headers=headers)
        try:
            ws = await session.ws_connect(
                endpoint + target,
                heartbeat=30.0,
                timeout=aiohttp.ClientWSTimeout(ws_close=5.0)
                if hasattr(aiohttp, "ClientWSTimeout")
                else 5.0,
                ssl=ssl if ssl is not None else True,
                max_msg_size=4 * 1024 * 1024,
            )
        except aiohttp.WSServerHandshakeError as e:
            await session.close()
            raw = (e.headers or {}).get("X-Lattice-Error") if e.headers else None
            raise error_from_response(
                e.status, e.message or "", raw, method="GET", url=endpoint + target
            ) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            await session.close()
            raise unreachable(endpoint, str(e) or type(e).__name__) from None
        except BaseException:
            await session.close()
            raise
        # the server's first frame says where we are attached
        node = ""
        try:
            first = await asyncio.wait_for(ws.receive(), timeout)
            if first.type == aiohttp.WSMsgType.TEXT:
                node = str(json.loads(first.data).get("attached", {}).get("node_id", ""))
        except BaseException:
            await ws.close()
            await session.close()
            raise
        return cls(session, ws, node)

    # ------------------------------------------------------------------ input

    async def send(self, data: bytes) -> None:
        """Input bytes (keystrokes; Ctrl-C is b"\\x03" on a tty)."""
        if data and not self._ws.closed:
            await self._ws.send_bytes(bytes(data))

    async def _control(self, msg: dict[str, Any]) -> None:
        if not self._ws.closed:
            await self._ws.send_str(json.dumps(msg))

    async def resize(self, rows: int, cols: int) -> None:
        await self._control({"resize": {"rows": int(rows), "cols": int(cols)}})

    async def signal(self, name: str) -> None:
        """INT, TSTP, QUIT (the foreground process group) or HUP (the whole session)."""
        await self._control({"signal": name.upper().removeprefix("SIG")})

    async def close_stdin(self) -> None:
        await self._control({"close_stdin": True})

    # ------------------------------------------------------------------ output

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._output()

    async def _output(self) -> AsyncIterator[bytes]:
        import aiohttp

        while True:
            frame = await self._ws.receive()
            if frame.type == aiohttp.WSMsgType.BINARY:
                yield frame.data
            elif frame.type == aiohttp.WSMsgType.TEXT:
                msg = json.loads(frame.data)
                if "stderr" in msg:
                    yield Stderr(base64.b64decode(msg["stderr"]))
                elif "exit_code" in msg:
                    self.exit_code = int(msg["exit_code"])
                elif "error" in msg:
                    err = msg["error"] or {}
                    self.error = LatticeError(
                        str(err.get("message") or "attach failed"),
                        code=str(err.get("code") or ""),
                        details=err.get("details") or {},
                        hint=str(err.get("hint") or ""),
                    )
            else:  # CLOSE, CLOSED, CLOSING, ERROR
                break
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Leave (the remote session is hung up unless it already ended). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._ws.close()
        finally:
            await self._session.close()

    async def __aenter__(self) -> AttachSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
