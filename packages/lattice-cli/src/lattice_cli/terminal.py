"""The local end of a remote terminal (``lattice attach``, ``lattice session``): raw mode
while attached, window-size changes sent as resizes, Ctrl-C forwarded as SIGINT when
stdin is not a terminal, and the terminal restored on every way out (the command's
end, an error, SIGTERM/SIGHUP to this process)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

from lattice_cli.context import State, run_api


class RawTerminal:
    """Raw mode on ``fd`` while entered; the saved settings restored on exit (idempotent)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: list[Any] | None = None

    def __enter__(self) -> RawTerminal:
        import termios
        import tty

        self.saved = termios.tcgetattr(self.fd)
        tty.setraw(self.fd, termios.TCSANOW)
        return self

    def restore(self) -> None:
        if self.saved is None:
            return
        import termios

        with contextlib.suppress(OSError):
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
        self.saved = None

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _size() -> tuple[int, int]:
    for fd in (1, 0, 2):
        with contextlib.suppress(OSError):
            s = os.get_terminal_size(fd)
            return s.lines, s.columns
    return 0, 0


async def session_loop(term: Any, interactive: bool, raw: RawTerminal | None) -> int | None:
    """Relay this terminal and the remote one until the remote command ends."""
    loop = asyncio.get_running_loop()
    stdin_fd = sys.stdin.fileno()
    inputs: asyncio.Queue[bytes | None] = asyncio.Queue()
    main = asyncio.current_task()
    assert main is not None

    def readable() -> None:
        try:
            data = os.read(stdin_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(stdin_fd)
        inputs.put_nowait(data or None)

    async def pump() -> None:
        while True:
            data = await inputs.get()
            if data is None:
                if not interactive:
                    await term.close_stdin()
                return
            await term.send(data)

    pending: set[asyncio.Future[None]] = set()

    def later(coro: Any) -> None:
        fut = asyncio.ensure_future(coro)
        pending.add(fut)
        fut.add_done_callback(pending.discard)

    def resized() -> None:
        rows, cols = _size()
        if rows and cols:
            later(term.resize(rows, cols))

    def interrupted() -> None:  # not a tty: Ctrl-C goes to the remote command
        later(term.signal("INT"))

    def stop(signum: int) -> None:
        main.cancel(f"signal {signum}")

    added: list[int] = []
    loop.add_reader(stdin_fd, readable)
    try:
        if interactive:
            loop.add_signal_handler(signal.SIGWINCH, resized)
            added.append(signal.SIGWINCH)
        else:
            loop.add_signal_handler(signal.SIGINT, interrupted)
            added.append(signal.SIGINT)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop, int(sig))
            added.append(sig)
        sender = asyncio.create_task(pump())
        try:
            async for chunk in term:
                fd = 2 if type(chunk).__name__ == "Stderr" else 1
                view = memoryview(chunk)
                while view:
                    try:
                        n = os.write(fd, view)
                    except BlockingIOError:
                        await asyncio.sleep(0.01)
                        continue
                    view = view[n:]
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(stdin_fd)
        for sig in added:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        if raw is not None:
            raw.restore()
    return term.exit_code  # type: ignore[no-any-return]


def run_terminal(
    st: State, alloc_id: str, *, node: str | None = None, remote: list[str] | None = None
) -> int:
    """Attach to ``alloc_id`` until the remote command ends; its exit status (1 when
    the session ended without one, after saying so)."""
    interactive = sys.stdin.isatty()
    raw = RawTerminal(sys.stdin.fileno()) if interactive else None
    result: dict[str, Any] = {"code": None, "error": None}

    async def go(client: Any) -> None:
        rows, cols = _size() if interactive else (0, 0)
        term = await client.attach(
            alloc_id, node=node, command=remote, tty=interactive, rows=rows, cols=cols
        )
        async with term:
            if raw is not None:
                raw.__enter__()
            try:
                result["code"] = await session_loop(term, interactive, raw)
            except Exception as e:
                result["error"] = e
            finally:
                if raw is not None:
                    raw.restore()

    try:
        run_api(st, go)
    finally:
        if raw is not None:
            raw.restore()
    err = result["error"]
    if err is not None:
        print(f"\nlattice attach: {getattr(err, 'message', None) or err}", file=sys.stderr)
        return 1
    code = result["code"]
    if code is None or code < 0:
        if not st.quiet:
            print("\nlattice attach: the session ended without an exit status", file=sys.stderr)
        return 1
    return int(code)
