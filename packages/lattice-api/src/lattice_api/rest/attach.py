"""REST route of interactive attach (see lattice_api.ops.attach): a WebSocket, so a
browser terminal (xterm.js) can attach as well as the SDK and CLI.

``GET /api/v1/allocations/{id}/attach?node=&command=ARG&command=ARG&tty=&rows=&cols=``
(``command`` repeated: the argv; none = the user's shell; ``tty`` default true).
Every check is made before the upgrade: a refusal is an ordinary HTTP error (403, 409,
429, ...) with the ``{"error": {...}}`` body, and the same envelope as compact JSON in
the ``X-Lattice-Error`` header (WebSocket clients rarely see a failed handshake's body).

After the upgrade:

* client -> server: binary frames are stdin bytes; text frames are JSON control
  messages: ``{"resize": {"rows": R, "cols": C}}``, ``{"signal": "INT"}`` (INT, TSTP,
  QUIT, HUP), ``{"close_stdin": true}``, ``{"keepalive": true}``;
* server -> client: first ``{"attached": {"node_id": N}}``, then binary frames of
  output (stdout; the PTY's when tty), ``{"stderr": BASE64}`` (without a tty), and
  last ``{"exit_code": N}`` or ``{"error": {...}}``; then the server closes.

The socket is pinged every 30 s (a client that stops answering is a disconnect); the
API sends the agent a keepalive every 30 s meanwhile. Closing the socket hangs the
remote session up (SIGHUP, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any

import aiohttp
from aiohttp import web
from lattice_common.errors import LatticeError, ValidationError
from lattice_common.proto.lattice import v1

from lattice_api.http import ACTIVE_STREAMS, error_response, query_int, who
from lattice_api.operations import Operations
from lattice_api.ops.attach import KEEPALIVE_INTERVAL, SIGNALS, AttachCall


def control_message(text: str) -> v1.AttachInput | None:
    """A text frame as the AttachInput it asks for (None: nothing to send)."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ValidationError("control frames are JSON objects") from None
    if not isinstance(data, dict):
        raise ValidationError("control frames are JSON objects")
    if "resize" in data:
        r = data["resize"] or {}
        rows, cols = int(r.get("rows", 0)), int(r.get("cols", 0))
        if not (0 < rows <= 10000 and 0 < cols <= 10000):
            raise ValidationError(f"bad terminal size {rows}x{cols}")
        return v1.AttachInput(resize=v1.TerminalSize(rows=rows, cols=cols))
    if "signal" in data:
        name = str(data["signal"]).upper().removeprefix("SIG")
        if name not in SIGNALS:
            raise ValidationError(f"unknown signal {data['signal']!r}; use {', '.join(SIGNALS)}")
        return v1.AttachInput(signal=name)
    if data.get("close_stdin"):
        return v1.AttachInput(close_stdin=True)
    if data.get("keepalive"):
        return None  # the API keeps the agent's side alive itself
    if "stdin" in data:  # text input from clients that cannot send binary frames
        return v1.AttachInput(stdin=str(data["stdin"]).encode())
    raise ValidationError(f"unknown control message {sorted(data)}")


def _refusal(err: LatticeError) -> web.Response:
    resp = error_response(err)
    resp.headers["X-Lattice-Error"] = json.dumps({"error": err.to_dict()}, ensure_ascii=True)
    return resp


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    attach_ops = ops.attach

    async def attach(request: web.Request) -> web.StreamResponse:
        q = request.query
        tty = q.get("tty", "true").lower() not in ("0", "false", "no")
        try:
            call = await attach_ops.open(
                who(request),
                request.match_info["id"],
                node_id=q.get("node", ""),
                command=q.getall("command", []),
                tty=tty,
                rows=query_int(q, "rows") or 0,
                cols=query_int(q, "cols") or 0,
            )
        except LatticeError as e:
            return _refusal(e)
        ws = web.WebSocketResponse(heartbeat=KEEPALIVE_INTERVAL, max_msg_size=4 * 1024 * 1024)
        ACTIVE_STREAMS.labels("attach").inc()
        try:
            await ws.prepare(request)
            await ws.send_str(json.dumps({"attached": {"node_id": call.node_id}}))
            await _relay(ws, call)
        finally:
            ACTIVE_STREAMS.labels("attach").dec()
            await call.close()
            if not ws.closed:
                with contextlib.suppress(Exception):
                    await ws.close()
        return ws

    router.add_get("/api/v1/allocations/{id}/attach", attach)


async def _relay(ws: web.WebSocketResponse, call: AttachCall) -> None:
    async def inbound() -> None:
        async for frame in ws:
            if frame.type == aiohttp.WSMsgType.BINARY:
                await call.send(v1.AttachInput(stdin=frame.data))
            elif frame.type == aiohttp.WSMsgType.TEXT:
                try:
                    msg = control_message(frame.data)
                except (ValidationError, ValueError, TypeError) as e:
                    err = e if isinstance(e, LatticeError) else ValidationError(str(e))
                    await ws.send_str(json.dumps({"warning": err.to_dict()}))
                    continue
                if msg is not None:
                    await call.send(msg)
            elif frame.type == aiohttp.WSMsgType.ERROR:
                return

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_INTERVAL)
            await call.send(v1.AttachInput(keepalive=True))

    async def outbound() -> None:
        try:
            while (out := await call.recv()) is not None:
                if out.stdout is not None:
                    if out.stdout:
                        await ws.send_bytes(out.stdout)
                elif out.stderr is not None:
                    await ws.send_str(json.dumps({"stderr": base64.b64encode(out.stderr).decode()}))
                elif out.exit_code is not None:
                    await ws.send_str(json.dumps({"exit_code": out.exit_code}))
                elif out.error is not None:
                    await ws.send_str(json.dumps({"error": _error_dict(out.error)}))
        except LatticeError as e:
            await ws.send_str(json.dumps({"error": e.to_dict()}))

    tasks = [
        asyncio.create_task(inbound(), name="attach-in"),
        asyncio.create_task(outbound(), name="attach-out"),
        asyncio.create_task(keepalive(), name="attach-keepalive"),
    ]
    try:
        # the remote side ending, or the client leaving, ends the attach
        await asyncio.wait(tasks[:2], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _error_dict(e: v1.ErrorDetail) -> dict[str, Any]:
    return {"code": e.code, "message": e.message, "details": dict(e.details), "hint": e.hint}
