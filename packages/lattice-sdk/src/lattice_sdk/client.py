"""``LatticeClient``: the async client of the Lattice REST API.

One method per endpoint of the REST contract (``/api/v1/...``); every method returns the
records of :mod:`lattice_sdk.models` and raises the typed errors of
:mod:`lattice_sdk.errors`. Streaming endpoints (``watch``, ``stream_logs``) are
newline-delimited JSON read as async iterators.

No HTTP library is imported until the client opens (see :mod:`lattice_sdk._transport`).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from lattice_sdk._version import __version__
from lattice_sdk.errors import LatticeError, error_from_response
from lattice_sdk.models import (
    Allocation,
    AllocationEvent,
    AllocationSpec,
    LogLine,
    LogLines,
    Node,
    QueueEntry,
    StartEstimate,
    Tenant,
    VCluster,
)

if TYPE_CHECKING:
    from datetime import datetime

API = "/api/v1"

#: what ``token`` may be: a bearer token, or a provider called before every request
#: (plain or async) returning the token to send (None/"" sends none)
TokenProvider = Callable[[], "str | Awaitable[str | None] | None"]


def _current_user() -> str:
    user = os.environ.get("USER") or os.environ.get("LOGNAME")
    if user:
        return user
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # no passwd entry in a container
        return ""


def _seg(value: str) -> str:
    """One URL path segment (ids may contain anything a user typed)."""
    return quote(str(value), safe="")


def _log_params(
    tail: int | None, stream: str, node: str | None, since: Any, until: Any
) -> dict[str, Any]:
    """The query of a log read or stream (``stream`` "both" is the server's default)."""
    if stream not in ("stdout", "stderr", "both"):
        raise ValueError(f"stream must be stdout, stderr or both, not {stream!r}")
    return {
        "tail": tail,
        "stream": None if stream == "both" else stream,
        "node": node or None,
        "since": _log_time(since, "since"),
        "until": _log_time(until, "until"),
    }


def _log_time(value: Any, name: str) -> str | None:
    """A log window's bound (epoch seconds, a datetime (naive = UTC) or an RFC 3339
    string) as the server reads it."""
    from datetime import UTC, datetime

    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a time, not {value!r}")
    if isinstance(value, datetime):
        value = (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    if isinstance(value, int | float):
        return repr(float(value))
    return str(value)


def _query(params: dict[str, Any] | None) -> str:
    if not params:
        return ""
    clean = {}
    for key, value in params.items():
        if value is None or value == "" or value is False:
            continue
        clean[key] = "true" if value is True else value
    return "?" + urlencode(clean) if clean else ""


class LatticeClient:
    """Async client of the Lattice REST API.

    ::

        async with LatticeClient("127.0.0.1", 8080, token=...) as client:
            alloc = await client.submit(AllocationSpec(entrypoint="python train.py", nodes=4))

    ``token`` is a bearer token, or a token provider: a callable (plain or async)
    returning the token, called before every request, so a long-lived client can hand
    out a refreshed token (``lattice`` passes one that refreshes its cached OIDC token).
    ``headers`` are sent with every request (for example ``{"x-lattice-tenant": "physics"}``).
    ``x-lattice-user`` is always sent (``user`` or ``$USER``); the server honours it only in
    dev mode without authentication. ``transport`` is ``"aiohttp"`` (pooled, default) or
    ``"asyncio"`` (standard library only, one connection per request; what the CLI uses).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | TokenProvider | None = None,
        headers: dict[str, str] | None = None,
        scheme: str = "http",
        timeout: float | None = 30,
        *,
        user: str | None = None,
        transport: str = "aiohttp",
        ssl_context: Any = None,
    ) -> None:
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, not {scheme!r}")
        if transport not in ("aiohttp", "asyncio"):
            raise ValueError(f"transport must be 'aiohttp' or 'asyncio', not {transport!r}")
        self.host = host.strip("[]")
        self.port = int(port)
        self.scheme = scheme
        self.timeout = timeout
        self.token_provider: TokenProvider | None = token if callable(token) else None
        self.token = None if callable(token) else token or None
        self.transport_name = transport
        self.ssl_context = ssl_context
        self.headers: dict[str, str] = {
            "Accept": "application/json",
            "User-Agent": f"lattice-sdk/{__version__}",
            "x-lattice-user": user if user is not None else _current_user(),
        }
        if self.token:
            self.headers["Authorization"] = f"Bearer {self.token}"
        for key, value in (headers or {}).items():
            if value is not None:
                self.headers[key] = str(value)
        self._transport: Any = None
        self._streams: set[Any] = set()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> LatticeClient:
        """``LatticeClient.from_url("http://127.0.0.1:8080", token=...)``."""
        from urllib.parse import urlsplit

        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        port = parts.port or (443 if scheme == "https" else 8080)
        return cls(parts.hostname or "127.0.0.1", port, scheme=scheme, **kwargs)

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> LatticeClient:
        self._ensure_transport()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_transport(self) -> Any:
        if self._transport is None:
            from lattice_sdk._transport import TRANSPORTS

            cls = TRANSPORTS[self.transport_name]
            self._transport = cls(
                self.scheme, self.host, self.port, self.headers, self.timeout, self.ssl_context
            )
        return self._transport

    async def close(self) -> None:
        """Close open streams and the connection pool. Safe to call twice."""
        for stream in list(self._streams):
            await stream.close()
        self._streams.clear()
        if self._transport is not None:
            transport, self._transport = self._transport, None
            await transport.close()

    # ------------------------------------------------------------------ plumbing

    async def _auth_headers(self) -> dict[str, str] | None:
        """The provider's current token as an Authorization header (None: no provider,
        or it has no token; a static token is in ``self.headers`` already)."""
        if self.token_provider is None:
            return None
        token = self.token_provider()
        if inspect.isawaitable(token):
            token = await token
        return {"Authorization": f"Bearer {token}"} if token else None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        prefix: str = API,
    ) -> Any:
        transport = self._ensure_transport()
        target = prefix + path + _query(params)
        data = json.dumps(body).encode() if body is not None else None
        resp = await transport.request(method, target, data, await self._auth_headers())
        if not 200 <= resp.status < 300:
            raise error_from_response(
                resp.status, resp.reason, resp.body, method=method, url=self.endpoint + target
            )
        if not resp.body.strip():
            return {}
        try:
            return json.loads(resp.body)
        except ValueError as exc:
            raise LatticeError(
                f"the server sent a response that is not JSON ({method} {target})",
                status_code=resp.status,
                code="bad_response",
            ) from exc

    async def _ndjson(self, path: str, params: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        transport = self._ensure_transport()
        target = API + path + _query(params)
        stream = await transport.open_stream("GET", target, await self._auth_headers())
        self._streams.add(stream)
        try:
            if not 200 <= stream.status < 300:
                body = await stream.read()
                raise error_from_response(
                    stream.status, stream.reason, body, method="GET", url=self.endpoint + target
                )
            buffer = b""
            async for chunk in stream.chunks():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    item = _decode_line(line)
                    if item is not None:
                        yield item
            item = _decode_line(buffer)
            if item is not None:
                yield item
        finally:
            self._streams.discard(stream)
            await stream.close()

    # ------------------------------------------------------------------ allocations

    async def submit(self, spec: AllocationSpec) -> Allocation:
        """Submit an allocation; returns it as stored (normally Pending).

        Fills ``spec.request_id`` with a uuid4 hex when empty, so a retry of the same
        spec object is recognised by the server as the same submission.
        """
        if not spec.request_id:
            import uuid

            spec.request_id = uuid.uuid4().hex
        data = await self._call("POST", "/allocations", body=spec.to_dict())
        return Allocation.from_dict(data)

    async def test_submit(self, spec: AllocationSpec) -> StartEstimate:
        """``sbatch --test-only``: the refusal a submission would get, or when and on
        how many nodes it would start; nothing is stored."""
        body = {**spec.to_dict(), "test_only": True}
        data = await self._call("POST", "/allocations", body=body)
        return StartEstimate.from_dict(data.get("estimate") if isinstance(data, dict) else None)

    async def submit_task_group(self, spec: AllocationSpec, task_group: str) -> dict[str, Any]:
        """Submit a task group (job array), e.g. ``task_group="0-99%20"``: one allocation
        per index, each with LATTICE_TASK_INDEX set. Returns ``{"task_group_id",
        "allocation_ids", "tasks", "concurrency"}``."""
        if not spec.request_id:
            import uuid

            spec.request_id = uuid.uuid4().hex
        body = {**spec.to_dict(), "task_group": task_group}
        return await self._call("POST", "/allocations", body=body)

    async def status(self, alloc_id: str) -> Allocation:
        """The allocation with this id (LatticeNotFoundError if there is none)."""
        return Allocation.from_dict(await self._call("GET", f"/allocations/{_seg(alloc_id)}"))

    async def list_allocations(
        self,
        state: str | None = None,
        tenant: str | None = None,
        vcluster: str | None = None,
        user: str | None = None,
        all: bool = False,
        limit: int | None = None,
        task_group: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> list[Allocation]:
        """Allocations visible to the caller; by default the caller's own.

        ``all=True`` asks for every allocation of the tenant (needs permission);
        ``task_group`` lists the tasks of one task group. ``since`` / ``until`` (epoch
        seconds): only allocations that ended in ``[since, until)``, and ``limit`` keeps
        the latest to end (``lattice history``).
        """
        params = {
            "state": state,
            "tenant": tenant,
            "vcluster": vcluster,
            "user": user,
            "all": bool(all),
            "limit": limit,
            "task_group": task_group,
            "since": since,
            "until": until,
        }
        data = await self._call("GET", "/allocations", params=params)
        return [Allocation.from_dict(a) for a in _items(data, "allocations")]

    async def cancel(self, alloc_id: str) -> Allocation:
        """Cancel an allocation; returns it in its new (Cancelled) state."""
        return Allocation.from_dict(await self._call("DELETE", f"/allocations/{_seg(alloc_id)}"))

    async def suspend(self, alloc_id: str) -> Allocation:
        """Checkpoint a Running allocation and hold it Suspended (its owner, where the
        vCluster allows; it must have been submitted with a checkpoint protocol).
        Returns it Checkpointing; it becomes Suspended once its checkpoint is written."""
        return Allocation.from_dict(
            await self._call("POST", f"/allocations/{_seg(alloc_id)}/suspend", body={})
        )

    async def checkpoint(self, alloc_id: str) -> Allocation:
        """Checkpoint a Running allocation now and let it run on (it must have been
        submitted with a checkpoint protocol). Returns it with the checkpoint hint just
        recorded (``checkpoint_hint``); its ``last_checkpoint`` is set once written."""
        return Allocation.from_dict(
            await self._call("POST", f"/allocations/{_seg(alloc_id)}/checkpoint", body={})
        )

    async def resume(self, alloc_id: str) -> Allocation:
        """Put a Suspended allocation back in the queue at once; it resumes from its
        checkpoint (LATTICE_RESUME=1, LATTICE_CHECKPOINT_PATH). Returns it Pending."""
        return Allocation.from_dict(
            await self._call("POST", f"/allocations/{_seg(alloc_id)}/resume", body={})
        )

    async def watch(self, alloc_id: str) -> AsyncIterator[AllocationEvent]:
        """Yield one event per change, starting with the current state; ends when the
        allocation reaches a terminal state (the server closes the stream)."""
        async for item in self._ndjson(f"/allocations/{_seg(alloc_id)}/watch"):
            _raise_inline_error(item)
            yield AllocationEvent.from_dict(item)

    async def logs(
        self,
        alloc_id: str,
        tail: int | None = None,
        stream: str = "both",
        *,
        node: str | None = None,
        since: float | str | datetime | None = None,
        until: float | str | datetime | None = None,
        offset: int | None = None,
        limit: int | None = None,
    ) -> LogLines:
        """Stored output of an allocation, filtered by the server: ``stream`` stdout,
        stderr or both; ``node`` one node's lines; ``since``/``until`` the lines captured
        in that window (epoch seconds, a ``datetime`` (naive = UTC) or an RFC 3339
        string); ``tail`` the last N of what is left; then ``offset``/``limit`` page
        through it. Returns a list of :class:`LogLine` whose ``truncated`` is true when
        ``limit`` cut lines off (ask again with ``offset`` advanced)."""
        params = {
            **_log_params(tail, stream, node, since, until),
            "stream": stream,
            "offset": offset or None,
            "limit": limit,
        }
        data = await self._call("GET", f"/allocations/{_seg(alloc_id)}/logs", params=params)
        lines = LogLines(LogLine.from_dict(line) for line in _items(data, "lines"))
        lines.truncated = bool(isinstance(data, dict) and data.get("truncated"))
        return lines

    async def stream_logs(
        self,
        alloc_id: str,
        tail: int | None = None,
        stream: str = "both",
        *,
        node: str | None = None,
        since: float | str | datetime | None = None,
        until: float | str | datetime | None = None,
    ) -> AsyncIterator[LogLine]:
        """Live output: the last ``tail`` lines, then new lines as they arrive; ends when the
        allocation has ended and its output is drained. ``node``, ``since`` and
        ``until`` filter on the server, as in :meth:`logs` (with ``until`` in the past
        the stream ends once the window is read)."""
        params = _log_params(tail, stream, node, since, until)
        async for item in self._ndjson(f"/allocations/{_seg(alloc_id)}/logs/stream", params):
            _raise_inline_error(item)
            yield LogLine.from_dict(item)

    # ------------------------------------------------------------------ metrics

    async def query_metrics(
        self,
        alloc_id: str,
        mode: str = "summary",
        duration: str | float | None = None,
        metrics: list[str] | str | None = None,
        node: str | None = None,
    ) -> dict[str, Any]:
        """The allocation's latest metrics from the TSDB (``lattice top``).

        ``mode``: ``summary`` (one value per metric across the allocation), ``per-node``
        or ``per-gpu``; ``duration``: how far back values are looked for (``"5m"``,
        ``"1h"``, or seconds; default 5 minutes); ``metrics``: catalog names (default:
        all); ``node``: one node only. Returns ``{allocation_id, state, mode,
        duration_seconds, timestamp (None: no data yet), resolution_seconds,
        telemetry_mode, node_ids, samples: [{name, node_id, value, unit, timestamp,
        labels}], alerts}``; no TSDB (or a TSDB that is down) is a
        ``LatticeUnavailableError``."""
        if isinstance(metrics, str):
            metrics = [metrics]
        params = {
            "mode": mode if mode and mode != "summary" else None,
            "duration": None if duration is None else str(duration),
            "metrics": ",".join(metrics) if metrics else None,
            "node": node,
        }
        return await self._call("GET", f"/allocations/{_seg(alloc_id)}/metrics", params=params)

    async def stream_metrics(
        self,
        alloc_id: str,
        metrics: list[str] | str | None = None,
        node: str | None = None,
        alerts_only: bool = False,
        interval: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The allocation's live metrics pushed by its node agents (``lattice watch``):
        one record per node and event, until the allocation ends.

        Records are ``{allocation_id, event, node_id, timestamp, telemetry_mode,
        mode_until, resolution_seconds, state, samples: [{name, node_id, value, unit,
        timestamp, labels}], alerts, alert_events: [{rule, metric, node_id, state,
        value, comparison, threshold, for_seconds, since, timestamp, severity,
        message}]}`` with ``event``: ``metrics`` (first the latest collection, then one
        per aggregation window in prod mode, one per second in debug mode), ``mode``
        (the node's telemetry mode changed), ``alert`` (threshold alerts fired or
        resolved), ``node_lost`` / ``node_back`` (a node's stream broke / came back;
        the stream goes on), ``end`` (last). ``metrics``: catalog names (default all);
        ``node``: one node; ``alerts_only``: alerts and lost nodes only; ``interval``:
        seconds between metric records at most. The server allows 5 open streams per
        user; a Pending or ended allocation is a ``LatticeError`` with code
        ``invalid_transition``."""
        if isinstance(metrics, str):
            metrics = [metrics]
        params = {
            "metrics": ",".join(metrics) if metrics else None,
            "node": node,
            "alerts_only": True if alerts_only else None,
            "interval": interval or None,
        }
        path = f"/allocations/{_seg(alloc_id)}/metrics/stream"
        async for item in self._ndjson(path, params):
            _raise_inline_error(item)
            yield item

    async def set_telemetry_mode(
        self, alloc_id: str, mode: str, duration: str | float | None = None
    ) -> dict[str, Any]:
        """Switch the allocation's telemetry mode on all its nodes (``lattice
        telemetry``): ``prod``, ``debug`` (reverts to the default after ``duration``,
        by default 30 minutes) or ``audit``; ``duration``: ``"30m"``, ``"1h"`` or
        seconds. Returns ``{allocation_id, telemetry_mode, duration_seconds, until,
        nodes: [{node, ok, mode, until | error}]}``. Only the owner, a tenant admin of
        its tenant or a system admin may switch it; sensitive allocations stay in audit
        mode."""
        body: dict[str, Any] = {"telemetry_mode": mode}
        if duration not in (None, ""):
            body["duration"] = duration
        return await self._call("PATCH", f"/allocations/{_seg(alloc_id)}", body=body)

    async def compare_metrics(
        self,
        alloc_ids: list[str],
        metrics: list[str] | str | None = None,
        duration: str | float | None = None,
        step: str | float | None = None,
    ) -> dict[str, Any]:
        """The same metrics of two or more allocations, each aligned at its own start
        (``lattice compare``; the first allocation is the baseline).

        ``metrics``: catalog names (default gpu_utilization, cpu_utilization,
        memory_used); ``duration``: the offsets to show (``"1h"`` or seconds; default the
        longest run); ``step``: the spacing of the points (at least the agents' 30 s
        window; default automatic). Returns ``{align, duration_seconds, step_seconds,
        resolution_seconds, allocations: [{allocation_id, state, started_at,
        finished_at}], comparisons: [{metric, unit, combine, values, series:
        [{allocation_id, points: [[t_offset_seconds, value]], mean, max, final, delta,
        ratio}]}]}`` (``delta``/``ratio``: the mean against the first allocation's).
        Another user's allocation is a ``LatticeNotFoundError``; one that has not
        started a ``LatticeError`` with code ``failed_precondition``; no TSDB a
        ``LatticeUnavailableError``. The server allows 10 comparisons a minute per user."""
        if isinstance(alloc_ids, str):
            alloc_ids = [alloc_ids]
        if isinstance(metrics, str):
            metrics = [metrics]
        params = {
            "ids": ",".join(alloc_ids),
            "metrics": ",".join(metrics) if metrics else None,
            "duration": None if duration is None else str(duration),
            "step": None if step is None else str(step),
        }
        return await self._call("GET", "/compare", params=params)

    async def get_diagnostics(self, alloc_id: str, section: str | None = None) -> dict[str, Any]:
        """Network, storage and GPU health of a running allocation, each line with a mark
        (``lattice diag``). ``section``: ``network`` or ``storage`` only (default all).

        Returns ``{allocation_id, state, scope, sections, timestamp, status (the worst
        mark), summary, tsdb, nodes: [{node_id, group, ok, error}], checks: [{section,
        name, node_id, status (ok | warning | critical | unknown: no data), message,
        details, values, histogram: [{low_us, high_us, count}]}]}``. Another user's
        allocation is a ``LatticeNotFoundError``; a Pending or ended one a
        ``LatticeError`` with code ``invalid_transition``. The server allows 30 a minute
        per user (over it: a ``LatticeError`` with status 429)."""
        params = {"section": section or None}
        return await self._call("GET", f"/allocations/{_seg(alloc_id)}/diagnostics", params=params)

    # ------------------------------------------------------------------ task launches

    async def launch_tasks(
        self,
        alloc_id: str,
        argv: list[str],
        *,
        num_tasks: int = 0,
        tasks_per_node: int = 0,
        env: dict[str, str] | None = None,
        pmi: str = "",
        nodes: list[str] | None = None,
        working_dir: str = "",
    ) -> dict[str, Any]:
        """``srun``: start ``argv`` as ranks in a Running allocation of yours.

        Returns ``{"task_id", "nodes", "world_size", "ranks_per_node"}``; follow the
        launch with :meth:`watch_launch`. ``pmi``: "" / pmi1 / pmi2 (the agent's PMI
        server), none, or pmix."""
        body = {
            "argv": list(argv),
            "num_tasks": num_tasks,
            "tasks_per_node": tasks_per_node,
            "env": dict(env or {}),
            "mpi": pmi,
            "nodes": list(nodes or []),
            "working_dir": working_dir,
        }
        return await self._call("POST", f"/allocations/{_seg(alloc_id)}/tasks", body=body)

    async def watch_launch(self, alloc_id: str, task_id: str) -> AsyncIterator[dict[str, Any]]:
        """A launch's events from its start: ``{"type": "start"}`` (nodes, ranks_per_node,
        world_size), ``output`` (rank, stream, line), ``rank_exit`` (rank, exit_code),
        ``node_done`` per node, then ``done`` (exit_status, aborted, reason, failed_rank,
        failed_node, rank_exit_codes), after which the stream ends."""
        path = f"/allocations/{_seg(alloc_id)}/tasks/{_seg(task_id)}/events"
        async for item in self._ndjson(path):
            _raise_inline_error(item)
            yield item

    async def attach(
        self,
        alloc_id: str,
        node: str | None = None,
        command: list[str] | str | None = None,
        tty: bool = True,
        *,
        rows: int = 0,
        cols: int = 0,
    ) -> Any:
        """A terminal in a Running allocation of yours (``srun --pty``): an open
        :class:`lattice_sdk.attach.AttachSession` (``send``, ``resize``, ``signal``,
        ``close_stdin``, ``async for`` output chunks, ``exit_code``, ``close``).

        ``node``: one of its nodes (default the first); ``command``: argv (a string is
        run by ``/bin/sh -c``), default the user's login shell; ``tty``: a PTY (else
        pipes, stderr chunks as ``Stderr``). Refusals raise the typed errors (403 not
        yours, 409 not Running, 429 ``maximum concurrent sessions reached (5/5)``)."""
        from lattice_sdk.attach import AttachSession

        if isinstance(command, str):
            command = ["/bin/sh", "-c", command]
        params: list[tuple[str, Any]] = [("tty", "true" if tty else "false")]
        if node:
            params.append(("node", node))
        params += [("command", c) for c in command or []]
        if rows and cols:
            params += [("rows", int(rows)), ("cols", int(cols))]
        target = f"{API}/allocations/{_seg(alloc_id)}/attach?{urlencode(params)}"
        headers = {k: v for k, v in self.headers.items() if k != "Accept"}
        headers.update(await self._auth_headers() or {})
        return await AttachSession.open(
            self.endpoint, target, headers, ssl=self.ssl_context, timeout=self.timeout
        )

    # ------------------------------------------------------------------ DAG workflows

    async def submit_dag(
        self,
        dag: str | dict[str, Any],
        *,
        tenant: str | None = None,
        vcluster: str | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """Submit a DAG workflow: YAML text (a DAG file, either documented form) or the
        decoded mapping. ``tenant``/``vcluster`` are defaults for members that name
        none. Refused as a whole, nothing stored, when any part is wrong.

        Returns ``{"dag_id", "allocation_ids", "dag", "allocations"}``; ``dag`` as
        :meth:`get_dag` returns it. A ``request_id`` (a uuid4 hex when not given) makes
        a retry of the same call the same DAG.
        """
        if isinstance(dag, str):
            body: dict[str, Any] = {"yaml": dag}
        elif isinstance(dag, dict):
            body = dict(dag)
        else:
            raise TypeError(f"dag must be YAML text or a dict, not {type(dag).__name__}")
        for key, value in (("tenant", tenant), ("vcluster", vcluster)):
            if value:
                body[key] = value
        if request_id is None and not body.get("request_id"):
            import uuid

            request_id = uuid.uuid4().hex
        if request_id:
            body["request_id"] = request_id
        return await self._call("POST", "/dags", body=body)

    async def get_dag(self, dag_id: str) -> dict[str, Any]:
        """``{"id", "name", "tenant", "user", "state", "members": [{"ref",
        "allocation_id", "state"}], "edges": [{"upstream", "downstream", "condition"}],
        "submitted_at", "finished_at", "revision"}``; a member waiting for its
        dependencies is ``"Blocked"``."""
        return await self._call("GET", f"/dags/{_seg(dag_id)}")

    async def list_dags(
        self,
        state: str | None = None,
        tenant: str | None = None,
        user: str | None = None,
        all: bool = False,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """DAGs newest first; the caller's own unless ``user`` is named or ``all=True``
        (needs permission). ``state``: Running, Completed, Failed, Cancelled (or several,
        comma-separated)."""
        params = {"state": state, "tenant": tenant, "user": user, "all": bool(all), "limit": limit}
        data = await self._call("GET", "/dags", params=params)
        return list(_items(data, "dags"))

    async def cancel_dag(self, dag_id: str, reason: str = "") -> dict[str, Any]:
        """Cancel every member of a DAG that has not ended. Returns ``{"dag",
        "cancelled_allocation_ids"}``."""
        return await self._call("DELETE", f"/dags/{_seg(dag_id)}", params={"reason": reason})

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self, spec: AllocationSpec | None = None, **fields: Any
    ) -> dict[str, Any]:
        """An interactive session: an allocation (``spec``, or fields such as nodes,
        walltime, vcluster, constraints; entrypoint and walltime have server defaults)
        that you work in with :meth:`attach`. Returns the session (id, allocation_id,
        state, nodes)."""
        body = spec.to_dict() if spec is not None else {}
        if spec is not None and not spec.entrypoint:
            body.pop("entrypoint", None)
        body.update({k: v for k, v in fields.items() if v is not None})
        return await self._call("POST", "/sessions", body=body)

    async def get_session(self, session_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/sessions/{_seg(session_id)}")

    async def list_sessions(
        self, *, user: str | None = None, all: bool = False
    ) -> list[dict[str, Any]]:
        params = {"user": user, "all": "true" if all else None}
        return list((await self._call("GET", "/sessions", params=params)).get("sessions", []))

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        """End a session: its allocation is cancelled."""
        return await self._call("DELETE", f"/sessions/{_seg(session_id)}")

    # ------------------------------------------------------------------ services

    async def list_services(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Registered services ``[{name, endpoints: [{allocation_id, node_id, address,
        port, tenant}]}]`` visible to the caller (its tenant's; an admin's: every
        tenant's, or ``tenant``'s)."""
        data = await self._call("GET", "/services", params={"tenant": tenant})
        return list(data.get("services", []))

    async def lookup_service(self, name: str, tenant: str | None = None) -> dict[str, Any]:
        """``{name, endpoints}`` of one service; NotFound when none is registered."""
        return await self._call("GET", f"/services/{_seg(name)}", params={"tenant": tenant})

    # ------------------------------------------------------------------ nodes

    async def list_nodes(self, state: str | None = None) -> list[Node]:
        data = await self._call("GET", "/nodes", params={"state": state})
        return [Node.from_dict(n) for n in _items(data, "nodes")]

    async def get_node(self, node_id: str) -> Node:
        return Node.from_dict(await self._call("GET", f"/nodes/{_seg(node_id)}"))

    async def _node_action(self, node_id: str, action: str, reason: str = "") -> Node:
        data = await self._call(
            "POST", f"/nodes/{_seg(node_id)}/{action}", body={"reason": reason or ""}
        )
        return Node.from_dict(data)

    async def drain_node(self, node_id: str, reason: str = "") -> Node:
        """Stop placing new work on the node; running allocations finish."""
        return await self._node_action(node_id, "drain", reason)

    async def undrain_node(self, node_id: str, reason: str = "") -> Node:
        return await self._node_action(node_id, "undrain", reason)

    async def disable_node(self, node_id: str, reason: str = "") -> Node:
        """Take the node out of service entirely."""
        return await self._node_action(node_id, "disable", reason)

    async def enable_node(self, node_id: str, reason: str = "") -> Node:
        return await self._node_action(node_id, "enable", reason)

    async def release_node_claim(self, node_id: str) -> Node:
        """End your sensitive claim on an idle node (administrators: anyone's)."""
        return await self._node_action(node_id, "release")

    # ------------------------------------------------------------------ uenv caches

    async def cache_status(self, node: str | None = None) -> list[dict[str, Any]]:
        """The uenv image cache of ``node`` or of every node, one dict per node:
        ``{node, ok, enabled, cache_dir, max_bytes, used_bytes, images: [{ref, sha256,
        size, last_access, in_use}]}``; a node whose agent did not answer is ``{node,
        ok: False, error: {code, message, details, hint}}``."""
        data = await self._call("GET", "/cache", params={"node": node})
        return list(data.get("nodes", []))

    async def warm_cache(
        self,
        image: str,
        *,
        nodes: list[str] | None = None,
        group: int | None = None,
        all: bool = False,
    ) -> dict[str, Any]:
        """Fetch the uenv ``image`` (``name/version[:tag]``) into the caches of ``nodes``,
        of every node of dragonfly ``group``, or of ``all`` nodes (exactly one; system
        admins): ``{image, results: [{node, ok, image | error}]}``, one result per node
        (a node that failed does not fail the call). The server waits for every copy,
        so a large image needs a client ``timeout`` to match."""
        body: dict[str, Any] = {"image": image}
        if nodes is not None:
            body["nodes"] = list(nodes)
        if group is not None:
            body["group"] = group
        if all:
            body["all"] = True
        return await self._call("POST", "/cache/warm", body=body)

    async def evict_cache(self, image: str, node: str) -> dict[str, Any]:
        """Remove ``image`` (a uenv ref, or an image's sha256) from ``node``'s cache (system
        admins): ``{image, results: [{node, ok, image}]}``. Refused while an allocation
        on the node uses it (409) and when it is not cached there (404)."""
        return await self._call("POST", "/cache/evict", body={"image": image, "node": node})

    # ------------------------------------------------------------------ tenants

    async def list_tenants(self) -> list[Tenant]:
        data = await self._call("GET", "/tenants")
        return [Tenant.from_dict(t) for t in _items(data, "tenants")]

    async def get_tenant(self, name: str) -> Tenant:
        return Tenant.from_dict(await self._call("GET", f"/tenants/{_seg(name)}"))

    async def create_tenant(
        self,
        name: str,
        max_nodes: int | None = None,
        max_concurrent_allocations: int | None = None,
        fair_share_target: float | None = None,
        burst_allowance: float | None = None,
        gpu_hours_budget: float | None = None,
        node_hours_budget: float | None = None,
        isolation: str | None = None,
        **extra: Any,
    ) -> Tenant:
        """Create a tenant; unset limits are left to the server's defaults (no limit)."""
        body = {
            "name": name,
            "max_nodes": max_nodes,
            "max_concurrent_allocations": max_concurrent_allocations,
            "fair_share_target": fair_share_target,
            "burst_allowance": burst_allowance,
            "gpu_hours_budget": gpu_hours_budget,
            "node_hours_budget": node_hours_budget,
            "isolation": isolation,
            **extra,
        }
        body = {k: v for k, v in body.items() if v is not None}
        return Tenant.from_dict(await self._call("POST", "/tenants", body=body))

    async def update_tenant(self, name: str, **fields: Any) -> Tenant:
        """PATCH the given fields (an explicit ``None`` clears a limit)."""
        data = await self._call("PATCH", f"/tenants/{_seg(name)}", body=fields)
        return Tenant.from_dict(data)

    # ------------------------------------------------------------------ usage

    async def tenant_usage(self, tenant: str, days: float | None = 90) -> dict[str, Any]:
        """Node-hours and GPU-hours a tenant used over the last ``days`` (None: the
        server's budget period), with its budgets (``budget_fraction_used``,
        ``*_hours_remaining``), quotas and a per-user breakdown (``users``)."""
        return await self._call("GET", f"/tenants/{_seg(tenant)}/usage", params={"days": days})

    async def user_usage(
        self, user: str | None = None, days: float | None = 90, tenant: str | None = None
    ) -> dict[str, Any]:
        """A user's node-hours and GPU-hours over the last ``days`` (default: the caller;
        ``tenant`` restricts to one tenant), with a per-tenant breakdown (``tenants``)."""
        params = {"user": user, "days": days, "tenant": tenant}
        return await self._call("GET", "/usage", params=params)

    # ------------------------------------------------------------------ vclusters

    async def list_vclusters(self) -> list[VCluster]:
        data = await self._call("GET", "/vclusters")
        return [VCluster.from_dict(v) for v in _items(data, "vclusters")]

    async def get_vcluster(self, name: str) -> VCluster:
        return VCluster.from_dict(await self._call("GET", f"/vclusters/{_seg(name)}"))

    async def create_vcluster(
        self,
        name: str,
        scheduler_type: str = "hpc-backfill",
        tenant: str = "",
        weights: dict[str, float] | None = None,
        cycle_interval_seconds: float | None = None,
        backfill_depth: int | None = None,
        allow_borrowing: bool | None = None,
        **extra: Any,
    ) -> VCluster:
        """Create a vCluster. ``tenant=""`` makes it shared by all tenants."""
        body = {
            "name": name,
            "scheduler_type": scheduler_type,
            "tenant": tenant,
            "weights": weights,
            "cycle_interval_seconds": cycle_interval_seconds,
            "backfill_depth": backfill_depth,
            "allow_borrowing": allow_borrowing,
            **extra,
        }
        body = {k: v for k, v in body.items() if v is not None}
        return VCluster.from_dict(await self._call("POST", "/vclusters", body=body))

    async def update_vcluster(self, name: str, **fields: Any) -> VCluster:
        """PATCH the given fields; ``weights`` may name only the weights to change."""
        data = await self._call("PATCH", f"/vclusters/{_seg(name)}", body=fields)
        return VCluster.from_dict(data)

    # ------------------------------------------------------------------ cluster

    async def vcluster_queue(self, name: str, all: bool = False) -> dict[str, Any]:
        """A vCluster's pending queue in scheduling order: ``{"vcluster", "total",
        "computed_at", "entries": [QueueEntry, ...]}``; the caller's own entries unless
        ``all=True`` (needs permission); positions count everyone's."""
        data = await self._call("GET", f"/vclusters/{_seg(name)}/queue", params={"all": bool(all)})
        return {**data, "entries": [QueueEntry.from_dict(e) for e in _items(data, "entries")]}

    async def raft_status(self) -> dict[str, Any]:
        """Quorum view of the member that answered: leader, term, commit index, members."""
        return await self._call("GET", "/raft/status")

    # ------------------------------------------------------------------ audit log

    async def query_audit(
        self,
        *,
        since: float | str | None = None,
        until: float | str | None = None,
        user: str | None = None,
        action: str | None = None,
        tenant: str | None = None,
        target: str | None = None,
        allocation_id: str | None = None,
        limit: int | None = None,
        page_token: str | None = None,
    ) -> dict[str, Any]:
        """One page of the audit log, oldest first: ``{"entries": [...],
        "next_page_token"}`` ("" = no more). ``since``/``until``: epoch seconds or ISO
        8601; ``action`` exact or a prefix ending in "." (``"node."``); ``target`` like
        ``"node:n1"`` or just ``"n1"``. System admins see every entry, tenant admins
        their tenant's."""
        params = {
            "since": since,
            "until": until,
            "user": user,
            "action": action,
            "tenant": tenant,
            "target": target,
            "allocation_id": allocation_id,
            "limit": limit,
            "page_token": page_token,
        }
        return await self._call("GET", "/admin/audit", params=params)

    async def audit_entries(self, **filters: Any) -> AsyncIterator[dict[str, Any]]:
        """Every entry matching ``filters`` (as :meth:`query_audit`), page after page."""
        token: str | None = None
        while True:
            page = await self.query_audit(**filters, page_token=token)
            for entry in _items(page, "entries"):
                yield entry
            token = page.get("next_page_token") if isinstance(page, dict) else None
            if not token:
                return

    async def export_audit(self) -> bytes:
        """The whole audit log as an export file, byte for byte as the server wrote it
        (JSON lines: a signed header naming the public keys, then one entry per line);
        check it offline with ``lattice admin audit verify FILE --public-key PEM``."""
        transport = self._ensure_transport()
        target = API + "/admin/audit/export"
        stream = await transport.open_stream("GET", target)
        self._streams.add(stream)
        try:
            if not 200 <= stream.status < 300:
                body = await stream.read()
                raise error_from_response(
                    stream.status, stream.reason, body, method="GET", url=self.endpoint + target
                )
            return b"".join([chunk async for chunk in stream.chunks()])
        finally:
            self._streams.discard(stream)
            await stream.close()

    async def verify_audit(self) -> dict[str, Any]:
        """The server checks the committed chain: ``{valid, count, first_bad_sequence,
        message, last_hash, public_keys: {key_id: PEM}, signing_key_id}``."""
        return await self._call("POST", "/admin/audit/verify", body={})

    # ------------------------------------------------------------------ backups

    async def create_backup(self, path: str = "") -> dict[str, Any]:
        """Write a backup of the quorum state where the server can: ``path`` on the
        serving member (a file, or a directory for ``backup-<UTC>.lattice``), an
        ``s3://bucket/key`` URL, or "" (the server's ``quorum.backup_dir``). Returns the
        BackupInfo: ``{path, checksum, revision, size_bytes, created_at, raft_term,
        raft_index, allocations, nodes, tenants, vclusters, audit_entries, ...}``."""
        return await self._call("POST", "/admin/backup", body={"path": path})

    async def download_backup(self) -> bytes:
        """A backup of the quorum state sent back whole (nothing is written on the
        server); check it with ``lattice_common.backup.verify``."""
        transport = self._ensure_transport()
        target = API + "/admin/backup"
        body = json.dumps({"download": True}).encode()
        resp = await transport.request("POST", target, body, await self._auth_headers())
        if not 200 <= resp.status < 300:
            raise error_from_response(
                resp.status, resp.reason, resp.body, method="POST", url=self.endpoint + target
            )
        return resp.body

    async def verify_backup(self, path: str = "") -> dict[str, Any]:
        """The server checks a backup it can read (``path`` or ``s3://``; "" = its latest
        scheduled snapshot): ``{valid: true, checksum, revision, raft_term, ...counts}``
        or ``{valid: false, message, hint}``."""
        return await self._call("GET", "/admin/backup/verify", params={"path": path or None})

    async def restore_backup(self, path: str, *, force: bool = False) -> dict[str, Any]:
        """Verify ``path`` for a restore; ``{info, message}``: the restart steps
        (a restore runs as ``lattice-server --recover-from FILE --bootstrap``)."""
        return await self._call("POST", "/admin/restore", body={"path": path, "force": force})

    # ------------------------------------------------------------------ internal CA

    async def init_ca(self, *, rotate: bool = False) -> dict[str, Any]:
        """Create the cluster's internal CA (``rotate``: replace it; the old one stays
        trusted until what it signed expires): ``{cert_pem, serial, not_after,
        previous_pem, site}``."""
        return await self._call("POST", "/admin/ca", body={"rotate": rotate})

    async def get_ca(self) -> dict[str, Any]:
        """The internal CA's certificate (``cert_pem`` "" when there is none yet)."""
        return await self._call("GET", "/admin/ca")

    async def issue_certificate(
        self,
        kind: str,
        name: str,
        csr_pem: str,
        *,
        lifetime_seconds: float = 0.0,
        hosts: list[str] | None = None,
    ) -> dict[str, Any]:
        """Sign a certificate request (made where the key lives) as ``kind`` (bootstrap,
        agent, api, scheduler, checkpoint, accounting) for ``name``: ``{cert_pem, ca_pem,
        serial, not_after}``."""
        body = {
            "kind": kind,
            "name": name,
            "csr_pem": csr_pem,
            "lifetime_seconds": lifetime_seconds,
            "hosts": list(hosts or []),
        }
        return await self._call("POST", "/admin/ca/issue", body=body)

    # ------------------------------------------------------------------ identity

    async def whoami(self) -> dict[str, Any]:
        """The caller as the server sees it: ``{user, role, tenant, method, expires_at}``
        (``method``: oidc, hmac, agent or none; ``expires_at``: the token's expiry, epoch
        seconds, or None)."""
        return await self._call("GET", "/auth/whoami")

    async def auth_discovery(self) -> dict[str, Any]:
        """Where to log in (public, no token needed): ``{issuer, client_id, mode,
        authorization_endpoint, token_endpoint, device_authorization_endpoint,
        revocation_endpoint, ...}``; ``mode`` is oidc, hmac or none."""
        return await self._call("GET", "/auth/discovery")

    async def health(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok", ...}`` when the server is up."""
        return await self._call("GET", "/healthz", prefix="")

    # --- accounting (the built-in ledger; accounting.enabled) -------------------------
    # Money is decimal text ("12.50"); pass amounts as str or Decimal, not float.

    async def balance(
        self, tenant: str | None = None, project: str | None = None
    ) -> dict[str, Any]:
        """``{available, reserved, spent, allocated}`` of a tenant (default: the caller's)
        or one of its projects."""
        return await self._call(
            "GET", "/accounts/balance", params={"tenant": tenant, "project": project}
        )

    async def topup(self, tenant: str, amount: Any) -> dict[str, Any]:
        """Funds paid in for ``tenant`` (system admins)."""
        return await self._call(
            "POST", "/accounts/topup", body={"tenant": tenant, "amount": str(amount)}
        )

    async def transfer(
        self, project: str, amount: Any, tenant: str | None = None
    ) -> dict[str, Any]:
        """Tenant -> one of its projects; returns the project's balance."""
        body = {"tenant": tenant or "", "project": project, "amount": str(amount)}
        return await self._call("POST", "/accounts/transfer", body=body)

    async def transactions(self, **filters: Any) -> dict[str, Any]:
        """Journal rows, newest first: filters tenant, project, allocation, kind, user,
        since, until (ISO 8601), limit, before_id; ``next_before_id`` pages on."""
        return await self._call("GET", "/accounts/transactions", params=filters)

    async def costs(
        self,
        by: str = "project",
        *,
        tenant: str | None = None,
        project: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        """Charges less refunds grouped ``by`` project, user, vcluster, day or tenant."""
        params = {"by": by, "tenant": tenant, "project": project, "since": since, "until": until}
        return await self._call("GET", "/accounts/costs", params=params)

    async def allocation_costs(self, ids: list[str]) -> dict[str, Any]:
        """``{"enabled": bool, "costs": {id: {cost, held, state}}}`` for the allocations
        the caller may see (``lattice history``'s cost column)."""
        return await self._call("GET", "/accounts/allocations", params={"ids": ",".join(ids)})

    async def set_price(self, vcluster: str, rate: Any, **fields: Any) -> dict[str, Any]:
        """A new price (system admins): ``resource`` node_hour (default), gpu_hour (with
        ``gpu_type``) or allocation; ``multiplier``, ``fixed_cost``, ``tenant``,
        ``valid_from``/``valid_until`` (ISO 8601)."""
        body = {"vcluster": vcluster, "rate": str(rate), **{k: str(v) for k, v in fields.items()}}
        return await self._call("POST", "/admin/prices", body=body)

    async def list_prices(self, vcluster: str | None = None) -> list[dict[str, Any]]:
        r = await self._call("GET", "/admin/prices", params={"vcluster": vcluster})
        return list(r.get("prices", []))

    async def accounting_status(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/accounting/status")

    async def accounting_reconcile(self, since: str, until: str) -> dict[str, Any]:
        body = {"since": since, "until": until}
        return await self._call("POST", "/admin/accounting/reconcile", body=body)


def _decode_line(line: bytes) -> Any:
    text = line.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        snippet = text[:120].decode("utf-8", "replace")
        raise LatticeError(
            f"malformed line in a streamed response: {snippet!r}", code="bad_response"
        ) from exc


def _raise_inline_error(item: Any) -> None:
    """A stream may end with ``{"error": {...}}`` instead of a record."""
    if isinstance(item, dict) and isinstance(item.get("error"), dict) and len(item) == 1:
        from lattice_sdk.errors import error_class_for_code

        err = item["error"]
        raise error_class_for_code(str(err.get("code") or ""))(
            str(err.get("message") or "stream failed"),
            code=str(err.get("code") or ""),
            details=err.get("details") if isinstance(err.get("details"), dict) else {},
            hint=str(err.get("hint") or ""),
        )


def _items(data: Any, key: str) -> list[Any]:
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        value = data.get(key)
        if isinstance(value, list):
            return value
    return []
