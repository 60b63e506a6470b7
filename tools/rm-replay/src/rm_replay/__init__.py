"""RM-Replay: replay workload traces through the real Lattice scheduler in simulated time.

The simulator imports ``lattice_scheduler`` (cost function, solver, topology model,
preemption) and calls it the way the live vCluster loop does; nothing of the
scheduler is re-implemented here. See the package README for the trace, inventory and
weight-profile formats.
"""

from __future__ import annotations

__version__ = "0.1.0"
