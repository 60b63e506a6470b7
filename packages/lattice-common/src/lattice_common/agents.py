"""Clients of NodeAgentService: one reused channel per agent address.

Used by lattice-server (logs, task launches) and by agents talking to each other
(PMI fences, launch aborts and watches). Every call carries the agent token when
one is configured, since agents refuse calls without it.
"""

from __future__ import annotations

from grpclib.client import Channel

from lattice_common.net import split_host_port
from lattice_common.proto.lattice import v1
from lattice_common.rpc import auth_metadata

__all__ = ["AgentChannels"]


class AgentChannels:
    """``stub(address)`` for any agent address (``host:port``); ``close()`` ends them all."""

    def __init__(self, token: str | None = None) -> None:
        self.metadata = auth_metadata(token)
        self._channels: dict[str, Channel] = {}

    def stub(self, address: str) -> v1.NodeAgentServiceStub:
        """A stub for the agent at ``address``; ValueError when it is not host:port."""
        ch = self._channels.get(address)
        if ch is None:
            host, port = split_host_port(address, default_host="127.0.0.1", allow_port_zero=False)
            ch = Channel(host, port)
            self._channels[address] = ch
        return v1.NodeAgentServiceStub(ch, metadata=self.metadata)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
