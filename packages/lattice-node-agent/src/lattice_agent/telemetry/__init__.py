"""Node telemetry (spec: Telemetry Architecture): per-allocation collection, prod/debug
aggregation and the push to VictoriaMetrics.

* ``samples`` — plain data: catalog names, labels, targets, readings, samples, ``Source``;
* ``proc`` — the /proc + cgroup collector (``ProcCollector``, source ``proc``);
* ``aggregate`` — pure windows and summaries (p50/p95/p99/mean/max/count);
* ``push`` — ``VictoriaPusher``: text exposition, batched, bounded, never blocking;
* ``loop`` — ``TelemetryLoop``, the agent's task, and per-allocation modes.
"""

from lattice_agent.telemetry.loop import ModeTable, TelemetryLoop, running_targets, telemetry_loop
from lattice_agent.telemetry.proc import ProcCollector
from lattice_agent.telemetry.push import VictoriaPusher
from lattice_agent.telemetry.samples import AllocLabels, Reading, Sample, Source, Target

__all__ = [
    "AllocLabels",
    "ModeTable",
    "ProcCollector",
    "Reading",
    "Sample",
    "Source",
    "Target",
    "TelemetryLoop",
    "VictoriaPusher",
    "running_targets",
    "telemetry_loop",
]
