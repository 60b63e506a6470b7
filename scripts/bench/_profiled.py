"""Run a module under cProfile switched by signals (py-spy is not always at hand).

    python -m _profiled lattice_api.main --config ...

SIGUSR1 starts profiling the main thread (where the asyncio loop runs: gRPC handlers,
the node monitor, the fan-out); SIGUSR2 stops it and writes the stats to
``$LATTICE_BENCH_PROFILE_DIR/profile-<pid>.pstats`` (overwritten each time).
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys

_prof = cProfile.Profile()
_on = False


def _start(*_: object) -> None:
    global _on
    if not _on:
        _prof.enable()
        _on = True


def _stop(*_: object) -> None:
    global _on
    if _on:
        _prof.disable()
        _on = False
        out = os.environ.get("LATTICE_BENCH_PROFILE_DIR", ".")
        _prof.dump_stats(os.path.join(out, f"profile-{os.getpid()}.pstats"))


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
