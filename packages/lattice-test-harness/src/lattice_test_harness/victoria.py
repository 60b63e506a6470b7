"""A real VictoriaMetrics (Debian's ``victoria-metrics``) on loopback, for tests and
``lattice dev up``.

Started with flags that make what was pushed queryable at once and deterministically:
``-search.latencyOffset=1s`` (instant queries near now do not lag 30 s),
``-search.maxStepForPointsAdjustment=0s``, ``-search.disableCache`` and
``-dedup.minScrapeInterval=1ms`` (a (series, timestamp) pushed twice is stored once).
Pushers write samples at least a second in the past; :meth:`VictoriaMetrics.flush`
(``/internal/force_flush``) makes them visible to the next query.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from lattice_cli.devcluster import TSDB_BINARY as BINARY
from lattice_cli.devcluster import free_port as _free_port
from lattice_cli.devcluster import tsdb_argv

__all__ = ["AGENT_WINDOWS_NEVER_CLOSE", "BINARY", "VictoriaMetrics", "available"]

#: Environment for a cluster whose tests push a metric themselves: the agents' prod
#: windows are aligned to multiples of their length on the wall clock, and a window
#: that closes during a test pushes the job's real (idle) measurement as a second
#: series of the same node, which ``avg by (node_id)`` averages with the pushed one
#: for the whole look-back (60 s). A window of 10^9 s next closes in 2033.
AGENT_WINDOWS_NEVER_CLOSE = {"LATTICE_TELEMETRY__AGGREGATION_WINDOW_SECONDS": "1000000000"}


def available() -> bool:
    return shutil.which(BINARY) is not None


class VictoriaMetrics:
    """``with VictoriaMetrics() as vm:`` -- ``vm.url`` is its base URL."""

    def __init__(
        self, data_dir: str | Path | None = None, port: int = 0, log_path: Path | None = None
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="lattice-vm-"))
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return tsdb_argv(self.data_dir, self.port)  # one set of flags for both

    def start(self, timeout: float = 15.0) -> VictoriaMetrics:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"victoria-metrics exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"victoria-metrics did not answer on {self.url} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> VictoriaMetrics:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- helpers for tests -------------------------------------------------------------

    def flush(self) -> None:
        """Make everything pushed so far visible to queries."""
        with urllib.request.urlopen(self.url + "/internal/force_flush", timeout=10):
            pass

    def push(self, lines: str) -> None:
        """Prometheus text exposition lines (with millisecond timestamps)."""
        req = urllib.request.Request(
            self.url + "/api/v1/import/prometheus", data=lines.encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=10):
            pass

    def query(self, promql: str, **params: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``nocache=1``)."""
        q = urllib.parse.urlencode({"query": promql, "nocache": "1", **params})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.loads(r.read())
        return list(body["data"]["result"])
