"""QuorumService operations (internal): schedulers and the checkpoint broker propose
encoded commands and watch the state stream (a snapshot, then one delta per entry)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from lattice_common import commands as c
from lattice_common.errors import ValidationError
from lattice_quorum.quorum import Quorum

from lattice_api.auth import Identity


class QuorumOps:
    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum

    async def propose(self, who: Identity, raw: bytes) -> tuple[bytes, int]:
        """An encoded command in; its encoded result and the revision out."""
        try:
            cmd = c.decode_command(raw)
        except msgspec.DecodeError as e:
            raise ValidationError(f"undecodable command: {e}") from None
        res = await self.quorum.propose(cmd)
        return c.encode_result(res), res.revision

    async def watch_state(self, who: Identity) -> AsyncIterator[tuple[bytes, bool, int]]:
        """(payload, snapshot, revision): the first snapshot and the deltas come as the
        quorum encoded them (snapshot False, revision 0: the payload carries both); a
        replaced state restarts with a fresh snapshot."""
        q = self.quorum.subscribe()
        try:
            while True:
                raw = await q.get()
                if raw is None:  # state replaced under us: start over with a snapshot
                    yield self.quorum.snapshot_delta(), True, self.quorum.revision
                    continue
                yield raw, False, 0
        finally:
            self.quorum.unsubscribe(q)


__all__ = ["QuorumOps"]
