"""What every application protocol offers the coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import msgspec


class Poll(msgspec.Struct, kw_only=True):
    """What the application said since the last poll."""

    done: bool = False  # the checkpoint is complete
    error: str = ""  # the application could not checkpoint
    sign_of_life: bool = False  # an estimate or progress
    defer_seconds: float = 0.0  # it asks to be asked again after this long


class CheckpointProtocol(Protocol):
    async def request(
        self,
        checkpoint_id: str,
        directory: Path,
        *,
        timeout: float,
        force: bool,
        deferral_left: float,
    ) -> None:
        """Ask the application to write the checkpoint into ``directory`` (exists)."""
        ...

    def poll(self) -> Poll: ...

    async def close(self) -> None: ...
