"""Liveness probes of service allocations (spec: Failure Modes, Service Failure
Detection): one asyncio :class:`ProbeRunner` per allocation with a ``liveness_probe``
that runs on this node as its head node.

A runner waits ``initial_delay_secs``, then every ``period_secs`` probes the service on
this node: ``tcp`` connects to the port, ``http`` sends ``GET path`` and takes a 2xx or
3xx status as alive; a probe not done within ``timeout_secs`` failed. After
``failure_threshold`` consecutive failures it calls ``on_failed(allocation_id)`` once
and ends; the agent then stops the allocation with reason ``liveness_probe_failed``,
which its exit report carries to the quorum (Failed, then requeued per its policy).

:class:`ProbeManager` keeps the runners in step with the node's allocations
(``sync``: the desired state and the runtime's running ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping

from lattice_common.types import Allocation, LivenessProbeSpec
from prometheus_client import Counter

log = logging.getLogger("lattice.agent.probes")

REASON_LIVENESS_PROBE_FAILED = "liveness_probe_failed"

PROBE_FAILURES = Counter(
    "lattice_agent_probe_failures",
    "Failed liveness probes of service allocations",
    ["allocation"],
)

_MAX_STATUS_LINE = 4096


async def probe_tcp(host: str, port: int, timeout: float) -> bool:
    """True when a TCP connection to host:port opens within ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def probe_http(host: str, port: int, path: str, timeout: float) -> bool:
    """True when ``GET path`` answers with a 2xx or 3xx status within ``timeout``."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            host_header = f"[{host}]" if ":" in host else host
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\n"
                "User-Agent: lattice-agent-probe\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            line = await reader.readline()
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    parts = line[:_MAX_STATUS_LINE].split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return False
    return 200 <= int(parts[1]) < 400


class ProbeRunner:
    """Probes one allocation until it fails ``failure_threshold`` times in a row.

    ``period``/``timeout``/``initial_delay`` override the spec's whole seconds (tests).
    """

    def __init__(
        self,
        allocation_id: str,
        probe: LivenessProbeSpec,
        *,
        on_failed: Callable[[str], object],
        host: str = "127.0.0.1",
        period: float | None = None,
        timeout: float | None = None,
        initial_delay: float | None = None,
    ) -> None:
        self.allocation_id = allocation_id
        self.probe = probe
        self.on_failed = on_failed
        self.host = host
        self.period = float(probe.period_secs if period is None else period)
        self.timeout = float(probe.timeout_secs if timeout is None else timeout)
        self.initial_delay = float(
            probe.initial_delay_secs if initial_delay is None else initial_delay
        )
        self.threshold = max(1, probe.failure_threshold)
        self.failures = 0  # consecutive
        self.probes = 0  # probes run
        self.failed = False  # the threshold was reached

    async def check(self) -> bool:
        p = self.probe
        if p.probe_type == "http":
            return await probe_http(self.host, p.port, p.path or "/", self.timeout)
        return await probe_tcp(self.host, p.port, self.timeout)

    async def run(self) -> None:
        await asyncio.sleep(self.initial_delay)
        while True:
            ok = await self.check()
            self.probes += 1
            if ok:
                self.failures = 0
            else:
                self.failures += 1
                PROBE_FAILURES.labels(self.allocation_id).inc()
                log.warning(
                    "allocation %s: liveness probe %s :%d failed (%d/%d)",
                    self.allocation_id,
                    self.probe.probe_type,
                    self.probe.port,
                    self.failures,
                    self.threshold,
                )
                if self.failures >= self.threshold:
                    self.failed = True
                    log.error(
                        "allocation %s: %d consecutive liveness probe failures: stopping it",
                        self.allocation_id,
                        self.failures,
                    )
                    self.on_failed(self.allocation_id)
                    return
            await asyncio.sleep(self.period)


class ProbeManager:
    """The runners of this node: one per running service allocation it heads."""

    def __init__(
        self, node_id: str, *, on_failed: Callable[[str], object], host: str = "127.0.0.1"
    ) -> None:
        self.node_id = node_id
        self.on_failed = on_failed
        self.host = host
        self.runners: dict[str, tuple[ProbeRunner, asyncio.Task[None]]] = {}

    def wanted(
        self, assigned: Mapping[str, Allocation], running: Collection[str]
    ) -> dict[str, LivenessProbeSpec]:
        """Allocations to probe: running here, with a probe, and headed by this node."""
        out: dict[str, LivenessProbeSpec] = {}
        for aid, a in assigned.items():
            probe = a.spec.liveness_probe
            if (
                probe is not None
                and probe.port
                and aid in running
                and a.assigned_nodes
                and a.assigned_nodes[0] == self.node_id
            ):
                out[aid] = probe
        return out

    def sync(self, assigned: Mapping[str, Allocation], running: Collection[str]) -> None:
        """Start runners for newly running services, stop those of the others. A runner
        whose threshold was reached is kept (not restarted) while its allocation stops."""
        wanted = self.wanted(assigned, running)
        for aid in list(self.runners):
            runner, _ = self.runners[aid]
            if aid not in wanted or runner.probe != wanted[aid]:
                self._cancel(aid)
        for aid, probe in wanted.items():
            if aid not in self.runners:
                runner = ProbeRunner(aid, probe, on_failed=self.on_failed, host=self.host)
                task = asyncio.get_running_loop().create_task(runner.run(), name=f"probe-{aid}")
                self.runners[aid] = (runner, task)

    def _cancel(self, aid: str) -> None:
        entry = self.runners.pop(aid, None)
        if entry is not None:
            entry[1].cancel()

    async def close(self) -> None:
        tasks = [t for _, t in self.runners.values()]
        for aid in list(self.runners):
            self._cancel(aid)
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = [
    "PROBE_FAILURES",
    "REASON_LIVENESS_PROBE_FAILED",
    "ProbeManager",
    "ProbeRunner",
    "probe_http",
    "probe_tcp",
]
