"""Async iteration with a watchdog: an async iterator's items, with a check run whenever
no item has arrived for a while. Long streams use it to notice what a quiet stream
cannot tell them: the node behind it is gone (its connection may hang rather than
break), or the client reading it has left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["watched"]


async def watched(
    items: AsyncIterator[T], interval: float, check: Callable[[], bool]
) -> AsyncIterator[T]:
    """``items``, calling ``check()`` after every ``interval`` seconds without one:
    ``check`` raises to give up with an error, returns True to end quietly, False to go
    on waiting. The source is closed however the iteration ends."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                if check():
                    return
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(Exception):
            await items.aclose()  # type: ignore[attr-defined]
