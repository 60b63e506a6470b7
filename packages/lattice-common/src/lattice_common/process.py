"""What every Lattice daemon does the same way: JSON logs, a metrics endpoint, run
until SIGINT/SIGTERM, short garbage-collector pauses (``lattice_common.heap``), and print
typed errors (not tracebacks) on a failed start."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from lattice_common.errors import LatticeError
from lattice_common.heap import keeper
from lattice_common.logging import setup_logging


def start_metrics(listen: str) -> None:
    """Serve Prometheus /metrics on ``host:port``; an empty value disables it."""
    if not listen:
        return
    from prometheus_client import start_http_server

    from lattice_common.net import split_host_port

    host, port = split_host_port(listen, default_host="0.0.0.0")
    start_http_server(port, addr=host)


async def run_until_signal(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` until it ends or the process gets SIGINT/SIGTERM (then cancel it)."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def run_event_loop(coro: Coroutine[Any, Any, None]) -> None:
    """uvloop when installed (every hop of a job's life crosses several event loops,
    and uvloop cuts their overhead), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def daemon_main(
    component: str, log_level: str, run: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    setup_logging(component, log_level)
    try:
        keeper()  # from now on, full collections stay short (lattice_common.heap)
        run_event_loop(run())
    except LatticeError as e:
        print(e.render(), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
