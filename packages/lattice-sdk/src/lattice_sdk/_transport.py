"""How bytes get to the API: two interchangeable HTTP transports.

* ``aiohttp`` (the default): a pooled ``aiohttp.ClientSession``; the right choice for
  notebooks, agents and anything that makes many calls.
* ``asyncio``: a minimal HTTP/1.1 client on ``asyncio.open_connection`` from the standard
  library, one connection per request (``Connection: close``). It exists for the ``lattice``
  command: importing aiohttp costs ~0.3 s, which alone would blow the CLI's start-time
  budget, while a command makes one or two requests.

Both only move bytes: the client builds targets and bodies, and maps statuses to errors.
Neither is imported until the client opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lattice_sdk.errors import LatticeError, unreachable

_CHUNK = 64 * 1024


class Response:
    __slots__ = ("body", "reason", "status")

    def __init__(self, status: int, reason: str, body: bytes) -> None:
        self.status = status
        self.reason = reason
        self.body = body


class Stream:
    """An open streaming response: status known, body still arriving."""

    status: int
    reason: str

    def chunks(self) -> AsyncIterator[bytes]:  # pragma: no cover - interface
        raise NotImplementedError

    async def read(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return b"".join(parts)

    async def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def _cause(exc: BaseException, timeout: float | None) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"timed out after {timeout:g}s" if timeout else "timed out"
    import socket

    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host ({exc.strerror or exc})"
    if isinstance(exc, ConnectionResetError | BrokenPipeError | asyncio.IncompleteReadError):
        return "connection lost"
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower():
        return "connection refused"
    return text


# --------------------------------------------------------------------------- asyncio


class AsyncioTransport:
    """HTTP/1.1 over asyncio streams; understands Content-Length, chunked and read-to-EOF."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        headers: dict[str, str],
        timeout: float | None,
        ssl_context: Any = None,
    ) -> None:
        self.scheme = scheme
        self.host = host.strip("[]")
        self.port = port
        self.headers = headers
        self.timeout = timeout
        self.ssl_context = ssl_context
        host_part = f"[{self.host}]" if ":" in self.host else self.host
        self.endpoint = f"{scheme}://{host_part}:{port}"
        self._host_header = f"{host_part}:{port}"

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        ssl_arg: Any = None
        if self.scheme == "https":
            if self.ssl_context is None:
                import ssl

                self.ssl_context = ssl.create_default_context()
            ssl_arg = self.ssl_context
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=ssl_arg, limit=1 << 20),
                self.timeout,
            )
        except (TimeoutError, OSError) as exc:
            raise unreachable(self.endpoint, _cause(exc, self.timeout)) from exc

    def _head(
        self, method: str, target: str, body: bytes | None, extra: dict[str, str] | None = None
    ) -> bytes:
        lines = [
            f"{method} {target} HTTP/1.1",
            f"Host: {self._host_header}",
            "Connection: close",
            "Accept-Encoding: identity",
        ]
        headers = {**self.headers, **extra} if extra else self.headers
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines.append("Content-Type: application/json")
            lines.append(f"Content-Length: {len(body)}")
        elif method in ("POST", "PUT", "PATCH"):
            lines.append("Content-Length: 0")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _open(
        self, method: str, target: str, body: bytes | None, extra: dict[str, str] | None = None
    ) -> _AsyncioStream:
        reader, writer = await self._connect()
        try:
            writer.write(self._head(method, target, body, extra))
            if body:
                writer.write(body)
            await writer.drain()
            status, reason, headers = await _read_head(reader)
            while 100 <= status < 200:  # informational responses carry no body
                status, reason, headers = await _read_head(reader)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, OSError | asyncio.IncompleteReadError | ValueError):
                raise unreachable(self.endpoint, _cause(exc, self.timeout)) from exc
            raise
        no_body = method == "HEAD" or status in (204, 304)
        return _AsyncioStream(self.endpoint, reader, writer, status, reason, headers, no_body)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """``headers``: sent with this request only (e.g. a fresh Authorization)."""

        async def go() -> Response:
            stream = await self._open(method, target, body, headers)
            try:
                return Response(stream.status, stream.reason, await stream.read())
            finally:
                await stream.close()

        try:
            return await asyncio.wait_for(go(), self.timeout)
        except TimeoutError as exc:
            raise unreachable(self.endpoint, _cause(exc, self.timeout)) from exc

    async def open_stream(
        self, method: str, target: str, headers: dict[str, str] | None = None
    ) -> Stream:
        try:
            return await asyncio.wait_for(self._open(method, target, None, headers), self.timeout)
        except TimeoutError as exc:
            raise unreachable(self.endpoint, _cause(exc, self.timeout)) from exc

    async def close(self) -> None:
        return None


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("server closed the connection without a response")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"malformed HTTP status line {line[:80]!r}")
    status, reason = int(parts[1]), (parts[2] if len(parts) > 2 else "")
    headers: dict[str, str] = {}
    while True:
        raw = await reader.readline()
        if not raw:
            raise ConnectionResetError("connection closed inside the response headers")
        text = raw.decode("latin-1").rstrip("\r\n")
        if not text:
            break
        key, _, value = text.partition(":")
        key = key.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return status, reason, headers


class _AsyncioStream(Stream):
    def __init__(
        self,
        endpoint: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        reason: str,
        headers: dict[str, str],
        no_body: bool,
    ) -> None:
        self.endpoint = endpoint
        self.reader = reader
        self.writer = writer
        self.status = status
        self.reason = reason
        self.headers = headers
        self.no_body = no_body

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.no_body:
            return
        reader = self.reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise asyncio.IncompleteReadError(b"", None)
                    size_text = size_line.split(b";", 1)[0].strip()
                    if not size_text:
                        continue
                    size = int(size_text, 16)
                    if size == 0:
                        while (await reader.readline()).strip():  # trailers
                            pass
                        return
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield data
            elif "content-length" in self.headers:
                remaining = int(self.headers["content-length"])
                while remaining > 0:
                    data = await reader.read(min(remaining, _CHUNK))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    remaining -= len(data)
                    yield data
            else:
                while data := await reader.read(_CHUNK):
                    yield data
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise unreachable(self.endpoint, "connection lost while reading the response") from exc

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, asyncio.CancelledError):
            pass


# --------------------------------------------------------------------------- aiohttp


class AiohttpTransport:
    """Pooled transport on aiohttp (imported here, when a client first opens)."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        headers: dict[str, str],
        timeout: float | None,
        ssl_context: Any = None,
    ) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        host = host.strip("[]")
        host_part = f"[{host}]" if ":" in host else host
        self.endpoint = f"{scheme}://{host_part}:{port}"
        self.timeout = timeout
        self.ssl_context = ssl_context
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            auto_decompress=True,
        )

    def _ssl(self) -> Any:
        return self.ssl_context if self.ssl_context is not None else True

    def _wrap(self, exc: BaseException) -> LatticeError:
        aiohttp = self._aiohttp
        if isinstance(exc, aiohttp.ClientConnectorError):
            cause = _cause(exc.os_error, self.timeout)
        elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
            cause = "connection lost while reading the response"
        else:
            cause = _cause(exc, self.timeout)
        return unreachable(self.endpoint, cause)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        aiohttp = self._aiohttp
        headers = dict(headers or {})
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(
                method, self.endpoint + target, data=body, headers=headers, ssl=self._ssl()
            ) as resp:
                return Response(resp.status, resp.reason or "", await resp.read())
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._wrap(exc) from exc

    async def open_stream(
        self, method: str, target: str, headers: dict[str, str] | None = None
    ) -> Stream:
        aiohttp = self._aiohttp
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeout, sock_connect=self.timeout, sock_read=None
        )
        try:
            resp = await self._session.request(
                method, self.endpoint + target, timeout=timeout, ssl=self._ssl(), headers=headers
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise self._wrap(exc) from exc
        return _AiohttpStream(self, resp)

    async def close(self) -> None:
        await self._session.close()


class _AiohttpStream(Stream):
    def __init__(self, transport: AiohttpTransport, resp: Any) -> None:
        self.transport = transport
        self.resp = resp
        self.status = resp.status
        self.reason = resp.reason or ""

    async def chunks(self) -> AsyncIterator[bytes]:
        aiohttp = self.transport._aiohttp
        try:
            async for data in self.resp.content.iter_any():
                yield data
        except (aiohttp.ClientError, OSError) as exc:
            raise self.transport._wrap(exc) from exc

    async def close(self) -> None:
        self.resp.close()  # drops the connection if the body was not read to the end


TRANSPORTS = {"aiohttp": AiohttpTransport, "asyncio": AsyncioTransport}
