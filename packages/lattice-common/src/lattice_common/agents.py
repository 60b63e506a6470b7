"""Clients of NodeAgentService: one reused channel per agent address.

Used by lattice-server (logs, task launches) and by agents talking to each other
(PMI fences, launch aborts and watches). Every call carries the agent token when
one is configured, since agents refuse calls without it; with ``ssl`` (mTLS) the
caller's certificate is presented instead. Agents' certificates name their node, not
the address they listen on, so the context checks the chain and not the host name.
"""

from __future__ import annotations

import ssl

from grpclib.client import Channel

from lattice_common.net import split_host_port
from lattice_common.proto.lattice import v1
from lattice_common.rpc import auth_metadata

__all__ = ["AgentChannels"]


class AgentChannels:
    """``stub(address)`` for any agent address (``host:port``); ``close()`` ends them all."""

    def __init__(self, token: str | None = None, ssl: ssl.SSLContext | None = None) -> None:
        self.metadata = auth_metadata(token)
        self.ssl = ssl
        self._channels: dict[str, Channel] = {}
        self._retired: list[Channel] = []

    def stub(self, address: str) -> v1.NodeAgentServiceStub:
        """A stub for the agent at ``address``; ValueError when it is not host:port."""
        ch = self._channels.get(address)
        if ch is None:
            host, port = split_host_port(address, default_host="127.0.0.1", allow_port_zero=False)
            ch = Channel(host, port, ssl=self.ssl)
            self._channels[address] = ch
        return v1.NodeAgentServiceStub(ch, metadata=self.metadata)

    def renewed(self) -> None:
        """The client certificate changed: the next calls open new connections that
        present it; calls in flight (an attach, a launch watch) keep theirs until close."""
        self._retired.extend(self._channels.values())
        self._channels.clear()

    def close(self) -> None:
        for ch in [*self._channels.values(), *self._retired]:
            ch.close()
        self._channels.clear()
        self._retired.clear()
