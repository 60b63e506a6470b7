"""The prologue and epilogue of allocations on this node (spec: allocation flow 8a-8f,
Prologue Failure, Allocation Data Lifecycle).

An allocation with something to fetch (a uenv, an OCI image) is assigned into
Staging. Every node it was given runs the prologue here: the uenv image fetched into
the node cache and verified, the OCI image pulled, then the site's
``node_agent.prologue_script`` (node health checks, data staging hooks). The result
goes to the quorum with the next heartbeat (sent at once) as an ``AllocationReport``
with phase ``staged`` or ``prologue_failed``; the quorum makes the allocation Running
when every node is staged, or excludes this node and retries it elsewhere. The head
node's runtime then starts the processes from the warm cache.

A result belongs to one attempt (requeues, preemptions and prologue failures make new
ones), so a late result never counts for a later placement. Images stay pinned in the
caches while the attempt is on this node. When any allocation leaves the node the
site's ``node_agent.epilogue_script`` runs (GPU reset and site cleanups; the cgroup
scope, the uenv namespace and the scratch directory are already gone with the
processes: the head node removes them before it reports the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lattice_common.types import (
    PHASE_PROLOGUE_FAILED,
    PHASE_STAGED,
    Allocation,
    AllocationReport,
    AllocationState,
)
from prometheus_client import Counter, Histogram

log = logging.getLogger("lattice.agent.prologue")

PROLOGUE_SECONDS = Histogram(
    "lattice_agent_prologue_seconds",
    "Time the prologue of a Staging allocation took on this node",
    ["result"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
EPILOGUE_FAILURES = Counter(
    "lattice_agent_epilogue_failures_total", "Epilogue scripts that failed or timed out"
)

_SCRIPT_OUTPUT_LIMIT = 400  # characters of a failed hook's output kept in the reason


class ImageCache(Protocol):
    """What the prologue needs of the uenv cache (``lattice_agent.uenv.UenvCache``)."""

    def acquire(self, ref: str, alloc_id: str, *, sha256: str = "") -> Any: ...
    def release(self, alloc_id: str) -> None: ...


class OciImages(Protocol):
    """What the prologue needs of the OCI image store (``lattice_agent.oci.OciStore``)."""

    def pull(self, ref: str, *, pin_for: str | None = None) -> Any: ...  # has ``digest``
    def unpin(self, alloc_id: str) -> None: ...


def attempt_key(a: Allocation) -> tuple[str, int, int, int]:
    """One placement of an allocation: a new one after a requeue, a preemption or a
    prologue failure."""
    return (a.id, a.requeue_count, a.preempted_count, a.prologue_failures)


@dataclass
class _Result:
    ok: bool
    reason: str = ""
    image_digest: str = ""


@dataclass
class _Entry:
    key: tuple[str, int, int, int]
    allocation: Allocation
    task: asyncio.Task[None] | None = None
    result: _Result | None = None
    pinned: set[str] = field(default_factory=set)  # "uenv", "oci"


class PrologueManager:
    """Runs prologues for the Staging allocations of this node and reports them."""

    def __init__(
        self,
        node_id: str,
        *,
        uenv: ImageCache | None = None,
        oci: OciImages | None = None,
        script: str = "",
        epilogue_script: str = "",
        timeout: float = 300.0,
        on_result: Callable[[], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self._uenv = uenv
        self._oci = oci
        self._script = script
        self._epilogue = epilogue_script
        self._timeout = timeout
        self._on_result = on_result
        self._entries: dict[str, _Entry] = {}
        self._seen: dict[str, Allocation] = {}  # every allocation on this node (epilogue)
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ desired state

    def sync(self, assigned: Mapping[str, Allocation]) -> None:
        """Start the prologue of each new Staging attempt on this node; release what
        left the node (and run the epilogue there)."""
        for aid in list(self._entries):
            a = assigned.get(aid)
            entry = self._entries[aid]
            if a is not None and attempt_key(a) == entry.key:
                entry.allocation = a
                continue
            self._drop(entry)
        if self._epilogue:
            for aid in self._seen.keys() - assigned.keys():
                self._start_epilogue(self._seen[aid])
        self._seen = dict(assigned)
        for aid, a in assigned.items():
            if aid in self._entries or a.state != AllocationState.STAGING:
                continue
            if self.node_id not in a.assigned_nodes:
                continue
            entry = _Entry(key=attempt_key(a), allocation=a)
            self._entries[aid] = entry
            entry.task = asyncio.get_running_loop().create_task(
                self._run(entry), name=f"prologue-{aid}"
            )

    def reports(self) -> list[AllocationReport]:
        """The finished prologues of allocations still Staging (heartbeats repeat them
        until the quorum has moved on)."""
        out = []
        for e in self._entries.values():
            a, r = e.allocation, e.result
            if r is None or a.state != AllocationState.STAGING:
                continue
            out.append(
                AllocationReport(
                    allocation_id=a.id,
                    phase=PHASE_STAGED if r.ok else PHASE_PROLOGUE_FAILED,
                    reason=r.reason,
                    attempt=a.prologue_failures,
                    image_digest=r.image_digest,
                )
            )
        return out

    def result(self, alloc_id: str) -> tuple[bool, str] | None:
        """(ok, reason) of the current attempt's prologue here, None while it runs."""
        e = self._entries.get(alloc_id)
        if e is None or e.result is None:
            return None
        return e.result.ok, e.result.reason

    async def idle(self) -> None:
        """Wait for every running prologue and epilogue (tests, shutdown)."""
        tasks = [e.task for e in self._entries.values() if e.task is not None] + list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for e in self._entries.values():
            if e.task is not None:
                e.task.cancel()
        await self.idle()

    # ------------------------------------------------------------------ the prologue

    async def _run(self, e: _Entry) -> None:
        a = e.allocation
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            e.result = await asyncio.wait_for(self._steps(e), self._timeout)
        except TimeoutError:
            e.result = _Result(False, f"prologue timed out after {self._timeout:.0f}s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must fail this prologue, not the agent
            log.exception("prologue of %s failed unexpectedly", a.id)
            e.result = _Result(False, f"prologue error: {exc}")
        took = loop.time() - t0
        PROLOGUE_SECONDS.labels("ok" if e.result.ok else "failed").observe(took)
        if e.result.ok:
            log.info("allocation %s: prologue done in %.3fs", a.id, took)
        else:
            log.warning("allocation %s: prologue failed: %s", a.id, e.result.reason)
        if self._on_result is not None:
            self._on_result()

    async def _steps(self, e: _Entry) -> _Result:
        a = e.allocation
        spec = a.spec
        digest = ""
        if spec.uenv:
            if self._uenv is None:
                return _Result(False, f"uenv {spec.uenv}: uenv is not enabled on this node")
            try:
                # exactly the image the API resolved at submit, when it did
                await asyncio.to_thread(
                    functools.partial(self._uenv.acquire, spec.uenv, a.id, sha256=a.uenv_sha256)
                )
            except Exception as exc:  # UenvError and I/O errors: the cause is the message
                return _Result(False, str(exc))
            e.pinned.add("uenv")
        if spec.image:
            if self._oci is None:
                return _Result(
                    False, f"image {spec.image}: containers are not enabled on this node"
                )
            try:
                image = await asyncio.to_thread(
                    functools.partial(self._oci.pull, spec.image, pin_for=a.id)
                )
            except Exception as exc:  # OciError and I/O errors
                return _Result(False, str(exc))
            digest = str(image.digest)
            e.pinned.add("oci")
        if self._script:
            failure = await self._hook(self._script, a, "prologue")
            if failure:
                return _Result(False, failure)
        return _Result(True, image_digest=digest)

    async def _hook(self, script: str, a: Allocation, what: str) -> str:
        """Run a site hook; "" when it succeeded, else why it did not."""
        env = {
            **os.environ,
            "LATTICE_ALLOCATION_ID": a.id,
            "LATTICE_NODE_ID": self.node_id,
            "LATTICE_USER": a.spec.user,
            "LATTICE_TENANT": a.spec.tenant,
            "LATTICE_NODELIST": ",".join(a.assigned_nodes),
            "LATTICE_UENV": a.spec.uenv,
            "LATTICE_IMAGE": a.spec.image,
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                script,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            return f"{what} script {script} could not start: {exc.strerror or exc}"
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self._timeout)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()
            raise
        if proc.returncode == 0:
            return ""
        text = out.decode(errors="replace").strip().splitlines()
        last = text[-1][:_SCRIPT_OUTPUT_LIMIT] if text else ""
        return f"{what} script exited with {proc.returncode}" + (f": {last}" if last else "")

    # ------------------------------------------------------------------ leaving

    def _drop(self, e: _Entry) -> None:
        """The attempt is over here: stop its prologue and release its pins."""
        del self._entries[e.key[0]]
        if e.task is not None and not e.task.done():
            e.task.cancel()
        aid = e.key[0]
        if "uenv" in e.pinned and self._uenv is not None:
            self._uenv.release(aid)
        if "oci" in e.pinned and self._oci is not None:
            self._oci.unpin(aid)

    def _start_epilogue(self, a: Allocation) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run_epilogue(a), name=f"epilogue-{a.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_epilogue(self, a: Allocation) -> None:
        try:
            failure = await self._hook(self._epilogue, a, "epilogue")
        except TimeoutError:
            failure = f"epilogue script timed out after {self._timeout:.0f}s"
        if failure:
            EPILOGUE_FAILURES.inc()
            log.warning("allocation %s: %s", a.id, failure)
