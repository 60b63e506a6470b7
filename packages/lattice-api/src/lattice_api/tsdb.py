"""The TSDB behind ``lattice top``: an async PromQL client of VictoriaMetrics, and the
pure helpers that build scoped, injection-proof queries.

Scoping is the server's, twice over (spec: "label filters injected from the caller's
identity"):

* every query carries ``extra_label=NAME=VALUE`` URL parameters (:func:`scope_params`):
  VictoriaMetrics adds them as label filters to every series selector of the query,
  whatever the query text says;
* every label value placed in PromQL text goes through :func:`quote`, which escapes
  ``\\``, ``"``, newlines and every other control character, so no value, however
  crafted (``x"} or vector(1) or {a="``), can close its string and add to the query.
  Label names and metric names are checked against PromQL's grammar, never escaped.

Errors: a TSDB that is not configured, unreachable, too slow or answering 5xx is
:class:`~lattice_common.errors.Unavailable` (503) with a hint; a query the TSDB refuses
is an internal error (ours). Neither message contains the TSDB's address (it may hold
credentials); the server log has it.
"""

from __future__ import annotations

import logging
import math
import re
import time as _time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lattice_common.errors import LatticeError, Unavailable, ValidationError
from lattice_common.promql import (
    aggregate,
    check_label_name,
    check_metric_name,
    escape_label_value,
    matcher,
    quote,
    regex_literal,
    rollup,
    scope_params,
    selector,
    window,
)

log = logging.getLogger("lattice.api.tsdb")

#: seconds one TSDB request may take
DEFAULT_TIMEOUT = 10.0


NOT_CONFIGURED_HINT = (
    "The cluster's telemetry.tsdb_endpoint is empty: the operators set it to the "
    "VictoriaMetrics URL the node agents push to (`lattice dev up` starts one when "
    "victoria-metrics is installed)."
)
DOWN_HINT = (
    "The TSDB (VictoriaMetrics, telemetry.tsdb_endpoint) is down or unreachable from the "
    "API server: try again in a moment; if it persists, tell the operators."
)


# --- pure helpers (PromQL text: lattice_common.promql) -----------------------------------

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_seconds(value: str | float | int, *, field: str = "duration") -> float:
    """``"5m"``, ``"1h30m"``, ``"90s"``, ``"2d"``, ``"300"`` (a bare number is seconds) or a
    number -> seconds (> 0). ValidationError otherwise."""
    hint = "Give a duration like 30s, 5m, 1h30m or 2d, or a number of seconds."
    if isinstance(value, bool):
        raise ValidationError(f"invalid {field} {value!r}", details={field: str(value)}, hint=hint)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        try:
            seconds = float(text) if text and len(text) <= 32 else math.nan
        except ValueError:
            pos, seconds = 0, 0.0
            while pos < len(text) and (m := _PART.match(text, pos)):
                seconds += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            if pos == 0 or pos != len(text) or len(text) > 32:
                raise ValidationError(
                    f"invalid {field} {value!r}", details={field: str(value)}, hint=hint
                ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValidationError(
            f"invalid {field} {value!r}: it must be a positive duration",
            details={field: str(value)},
            hint=hint,
        )
    return seconds


def redact(url: str) -> str:
    """``url`` without its user:password (for logs)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, ""))


# --- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One series of an instant query: its labels (``__name__`` included when kept),
    the value and the evaluation time."""

    labels: dict[str, str]
    value: float
    timestamp: float


@dataclass(frozen=True)
class RangeSeries:
    """One series of a range query: its labels and ``(timestamp, value)`` points."""

    labels: dict[str, str]
    points: list[tuple[float, float]] = field(default_factory=list)


def _number(raw: Any) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):
        return math.nan


def parse_instant(body: Any) -> list[Series]:
    """The series of a ``/api/v1/query`` answer (vector or scalar); NaN values dropped."""
    data = _data(body)
    kind = data.get("resultType")
    result = data.get("result")
    if kind == "scalar" and isinstance(result, list) and len(result) == 2:
        value = _number(result[1])
        return [] if math.isnan(value) else [Series({}, value, _number(result[0]))]
    out = []
    for item in result if isinstance(result, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("value"), list):
            continue
        ts, raw = (item["value"] + [None, None])[:2]
        value = _number(raw)
        if not math.isnan(value):
            out.append(Series(_labels(item), value, _number(ts)))
    return out


def parse_range(body: Any) -> list[RangeSeries]:
    """The series of a ``/api/v1/query_range`` answer (a matrix); NaN points dropped."""
    data = _data(body)
    out = []
    for item in data.get("result") or []:
        if not isinstance(item, dict):
            continue
        points = []
        for pair in item.get("values") or []:
            if isinstance(pair, list) and len(pair) == 2:
                value = _number(pair[1])
                if not math.isnan(value):
                    points.append((_number(pair[0]), value))
        out.append(RangeSeries(_labels(item), points))
    return out


def _labels(item: Mapping[str, Any]) -> dict[str, str]:
    metric = item.get("metric")
    return {str(k): str(v) for k, v in metric.items()} if isinstance(metric, dict) else {}


def _data(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or body.get("status") != "success":
        raise _unavailable("the TSDB sent an answer that is not a query result")
    data = body.get("data")
    if not isinstance(data, dict):
        raise _unavailable("the TSDB sent an answer that is not a query result")
    return data


def _unavailable(reason: str) -> Unavailable:
    return Unavailable(f"metrics are not available: {reason}", hint=DOWN_HINT)


def not_configured() -> Unavailable:
    return Unavailable(
        "metrics are not available: no TSDB configured",
        details={"setting": "telemetry.tsdb_endpoint"},
        hint=NOT_CONFIGURED_HINT,
    )


# --- the client -------------------------------------------------------------------------


class TsdbClient:
    """``async with TsdbClient(url) as tsdb: await tsdb.query(expr, scope={...})``.

    One HTTP session per ``async with`` (concurrent queries of one request share it).
    ``url`` is VictoriaMetrics' base URL (``http://vm:8428``; a path prefix such as a
    cluster's ``/select/0/prometheus`` is kept); "" raises the "no TSDB configured"
    Unavailable. Every query is sent with ``nocache=1`` (fresh pushes are seen at once
    and the evaluation time is not shifted back by the TSDB's latency offset)."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        url = (url or "").strip()
        if not url:
            raise not_configured()
        if "://" not in url:
            url = "http://" + url
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session: Any = None

    async def __aenter__(self) -> TsdbClient:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Accept": "application/json"},
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def query(
        self,
        expr: str,
        *,
        scope: Mapping[str, str],
        at: float | None = None,
    ) -> list[Series]:
        """An instant query at ``at`` (epoch seconds; None = now), confined to
        ``scope`` (label -> value, at least one)."""
        params = [("query", expr)]
        if at is not None:
            params.append(("time", _fmt_time(at)))
        return parse_instant(await self._get("/api/v1/query", params, scope))

    async def query_range(
        self,
        expr: str,
        *,
        scope: Mapping[str, str],
        start: float,
        end: float,
        step: float,
    ) -> list[RangeSeries]:
        """A range query over ``[start, end]`` every ``step`` seconds, confined to
        ``scope``."""
        if not (end >= start and step > 0):
            raise ValueError("a range query needs start <= end and step > 0")
        params = [
            ("query", expr),
            ("start", _fmt_time(start)),
            ("end", _fmt_time(end)),
            ("step", window(step)),
        ]
        return parse_range(await self._get("/api/v1/query_range", params, scope))

    async def _get(self, path: str, params: list[tuple[str, str]], scope: Mapping[str, str]) -> Any:
        import aiohttp

        if not scope:
            raise ValueError("every TSDB query is scoped: give at least one label")
        if self._session is None:
            raise RuntimeError("use `async with TsdbClient(...)`")
        params = [*params, *scope_params(scope), ("nocache", "1")]
        url = self.url + path
        t0 = _time.monotonic()
        try:
            async with self._session.get(url, params=params) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            log.warning("TSDB %s: no answer within %.1f s", redact(url), self.timeout)
            raise _unavailable(f"the TSDB did not answer within {self.timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            log.warning("TSDB %s unreachable: %s", redact(url), e)
            raise _unavailable(f"the TSDB cannot be reached ({_reason(e)})") from None
        log.debug("TSDB %s %s in %.3f s", path, status, _time.monotonic() - t0)
        body = _json(raw)
        if status >= 500 or status == 429:
            log.warning("TSDB %s answered %s: %s", redact(url), status, raw[:500])
            raise _unavailable(f"the TSDB answered {status}")
        if status != 200:
            error = body.get("error") if isinstance(body, dict) else None
            log.error("TSDB refused %r (%s): %s", params, status, raw[:500])
            raise LatticeError(
                f"the TSDB refused the metrics query ({status})",
                details={"error": str(error or raw[:200].decode("utf-8", "replace"))},
                hint="This is a bug in lattice-server or a TSDB limit; see the server log.",
            )
        if body is None:
            raise _unavailable("the TSDB sent an answer that is not JSON")
        return body


def _json(raw: bytes) -> Any:
    import json

    try:
        return json.loads(raw)
    except ValueError:
        return None


def _fmt_time(t: float) -> str:
    return f"{t:.3f}"


def _reason(e: BaseException) -> str:
    """A short, address-free reason for a connection failure."""
    import socket

    cause = getattr(e, "os_error", None) or e
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, socket.gaierror):
        return "unknown host"
    if isinstance(cause, ConnectionResetError):
        return "connection reset"
    if isinstance(cause, TimeoutError):
        return "timed out"
    if type(e).__name__ == "ServerDisconnectedError":
        return "the connection was closed"
    return type(cause).__name__


__all__ = [
    "DEFAULT_TIMEOUT",
    "RangeSeries",
    "Series",
    "TsdbClient",
    "aggregate",
    "check_label_name",
    "check_metric_name",
    "escape_label_value",
    "matcher",
    "not_configured",
    "parse_instant",
    "parse_range",
    "parse_seconds",
    "quote",
    "redact",
    "regex_literal",
    "rollup",
    "scope_params",
    "selector",
    "window",
]
