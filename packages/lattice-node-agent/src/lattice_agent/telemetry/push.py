"""Pushing samples to VictoriaMetrics (spec: Telemetry, Layer 3), out of the agent's way.

Samples go as Prometheus text exposition lines with millisecond timestamps,
``name{label="value",...} value ts_ms``, in batches, to ``POST <endpoint>/api/v1/import/prometheus``
(aiohttp). Telemetry degrades, it never blocks the node: :meth:`VictoriaPusher.offer` only
appends to a bounded queue (the oldest samples are dropped when it is full), a background
task sends what is at least ``min_age`` seconds old (VictoriaMetrics serves instant queries
``-search.latencyOffset`` behind now) every ``interval`` seconds, and a failed push is
counted (``lattice_agent_telemetry_push_failures_total``), kept for the next attempt and
retried with backoff (1 s doubling to 30 s); a batch the TSDB refuses as malformed (4xx) is
dropped rather than retried. Nothing here raises into the agent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable

import aiohttp
from prometheus_client import Counter, Histogram

from lattice_agent.telemetry.samples import Sample

log = logging.getLogger("lattice.agent.telemetry")

__all__ = [
    "PUSH_FAILURES",
    "PUSH_LATENCY",
    "SAMPLES",
    "SAMPLES_DROPPED",
    "VictoriaPusher",
    "escape_label",
    "format_lines",
    "format_sample",
    "import_url",
]

SAMPLES = Counter(
    "lattice_agent_telemetry_samples",
    "Telemetry samples accepted by the TSDB",
)
SAMPLES_DROPPED = Counter(
    "lattice_agent_telemetry_samples_dropped",
    "Telemetry samples discarded: push queue full, or a batch the TSDB refused (4xx)",
)
PUSH_FAILURES = Counter(
    "lattice_agent_telemetry_push_failures",
    "Failed pushes to the TSDB (connection error, timeout, non-2xx answer)",
)
PUSH_LATENCY = Histogram(
    "lattice_agent_telemetry_push_latency_seconds",
    "Duration of one push to the TSDB (failed ones included)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

_BACKOFF_MIN = 1.0
_BACKOFF_MAX = 30.0


def escape_label(value: str) -> str:
    """A label value for the text exposition format: ``\\``, ``"`` and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def format_sample(s: Sample) -> str:
    """One exposition line (no newline): ``name{k="v",...} value timestamp_ms``."""
    labels = ",".join(f'{k}="{escape_label(v)}"' for k, v in s.labels)
    return f"{s.name}{{{labels}}} {_value(s.value)} {s.timestamp_ms}"


def format_lines(samples: Iterable[Sample]) -> str:
    return "".join(format_sample(s) + "\n" for s in samples)


def import_url(endpoint: str) -> str:
    """``telemetry.tsdb_endpoint`` (a VictoriaMetrics base URL) -> its import URL."""
    base = endpoint.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    if base.endswith("/api/v1/import/prometheus"):
        return base
    return base + "/api/v1/import/prometheus"


class VictoriaPusher:
    """A bounded queue of samples and the task that pushes it (module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_queue: int = 200_000,
        batch_size: int = 10_000,
        interval: float = 1.0,
        timeout: float = 5.0,
        min_age: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = import_url(endpoint)
        self.max_queue = max(1, int(max_queue))
        self.batch_size = max(1, int(batch_size))
        self.interval = float(interval)
        self.timeout = float(timeout)
        self.min_age = float(min_age)
        self._clock = clock
        self._queue: collections.deque[Sample] = collections.deque()
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._backoff = 0.0
        self._retry_at = 0.0  # monotonic time before which no push is tried after a failure
        self.failures = 0  # this pusher's own count (the Counter is process-wide)
        self.pushed = 0
        self.dropped = 0
        self.last_error = ""

    # --- the queue ----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._queue)

    def offer(self, samples: Iterable[Sample]) -> int:
        """Queue ``samples`` (never blocks); returns how many old ones were dropped."""
        q = self._queue
        q.extend(samples)
        over = len(q) - self.max_queue
        if over > 0:
            for _ in range(over):
                q.popleft()
            self._drop(over, "push queue full")
            return over
        return 0

    def kick(self) -> None:
        """Push now rather than at the next interval (a window just closed)."""
        self._kick.set()

    def _drop(self, n: int, why: str) -> None:
        self.dropped += n
        SAMPLES_DROPPED.inc(n)
        log.warning("telemetry: dropped %d samples (%s)", n, why)

    def _take(self) -> list[Sample]:
        """Up to ``batch_size`` samples at least ``min_age`` old, in queue order; the
        younger ones stay queued, in order."""
        cutoff = round((self._clock() - self.min_age) * 1000)
        q = self._queue
        batch: list[Sample] = []
        keep: list[Sample] = []
        for _ in range(len(q)):
            s = q.popleft()
            if s.timestamp_ms <= cutoff:
                batch.append(s)
                if len(batch) >= self.batch_size:
                    break
            else:
                keep.append(s)
        q.extendleft(reversed(keep))
        return batch

    def _requeue(self, batch: list[Sample]) -> None:
        self._queue.extendleft(reversed(batch))
        over = len(self._queue) - self.max_queue
        if over > 0:  # the oldest go first
            for _ in range(over):
                self._queue.popleft()
            self._drop(over, "push queue full while the TSDB is unreachable")

    # --- pushing --------------------------------------------------------------------------

    async def flush(self) -> bool:
        """Push what is ready, batch after batch; False at the first failed batch (it
        stays queued). Never raises (except cancellation)."""
        async with self._lock:
            while True:
                batch = self._take()
                if not batch:
                    return True
                if not await self._push(batch):
                    return False

    async def _push(self, batch: list[Sample]) -> bool:
        body = format_lines(batch).encode()
        t0 = time.perf_counter()
        status = 0
        try:
            session = self._client()
            async with session.post(
                self.url, data=body, headers={"Content-Type": "text/plain"}
            ) as resp:
                status = resp.status
                text = "" if status < 300 else (await resp.text())[:300]
        except asyncio.CancelledError:
            self._requeue(batch)
            raise
        except Exception as e:  # telemetry degrades: whatever went wrong, count and retry
            PUSH_LATENCY.observe(time.perf_counter() - t0)
            self._failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            self._requeue(batch)
            return False
        PUSH_LATENCY.observe(time.perf_counter() - t0)
        if status < 300:
            self.pushed += len(batch)
            SAMPLES.inc(len(batch))
            self._backoff = 0.0
            self._retry_at = 0.0
            return True
        self._failed(f"HTTP {status}: {text.strip()}")
        if 400 <= status < 500 and status not in (408, 429):
            self._drop(len(batch), f"refused by the TSDB: HTTP {status}")
            return True  # the rest of the queue may be fine
        self._requeue(batch)
        return False

    def _failed(self, why: str) -> None:
        self.failures += 1
        PUSH_FAILURES.inc()
        first = not self.last_error
        self.last_error = why
        self._backoff = min(max(self._backoff * 2, _BACKOFF_MIN), _BACKOFF_MAX)
        self._retry_at = time.monotonic() + self._backoff
        (log.warning if first or self._backoff >= _BACKOFF_MAX else log.debug)(
            "telemetry push to %s failed (%s); %d samples queued, next try in %.0f s",
            self.url,
            why,
            len(self._queue),
            self._backoff,
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(self.timeout, 2.0))
            )
        return self._session

    async def run(self) -> None:
        """Push every ``interval`` (or at once when kicked) until cancelled, backing off
        after failures."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval)
            self._kick.clear()
            if time.monotonic() < self._retry_at:
                continue
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end telemetry, let alone the agent
                log.exception("telemetry push loop failed; continuing")

    async def close(self, final_flush_timeout: float = 2.0) -> None:
        """A last best-effort push of what is ready, then close the HTTP session."""
        if self._queue and final_flush_timeout > 0 and time.monotonic() >= self._retry_at:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.flush(), final_flush_timeout)
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
