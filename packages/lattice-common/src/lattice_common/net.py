"""``host:port`` addresses: one parser for config validation, listeners and clients.

IPv6 hosts are written in brackets (``[::1]:9000``); the brackets are stripped from the
host this returns, since socket APIs and grpclib want the bare address.
"""

from __future__ import annotations


def split_host_port(
    value: str, *, default_host: str = "", allow_port_zero: bool = True
) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``. An empty host becomes ``default_host``
    (e.g. ``":50051"`` listens on every interface with ``default_host="0.0.0.0"``).
    Port 0 means "pick a free port" for listeners; clients pass ``allow_port_zero=False``.
    Raises ValueError naming the bad value."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise ValueError(f"expected host:port, got {value!r}")
    low = 0 if allow_port_zero else 1
    if not low <= int(port) <= 65535:
        raise ValueError(f"port must be between {low} and 65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or default_host), int(port)


def http_url_or_empty(v: str) -> str:
    """A config value that must be an http(s) URL with a host, or empty (the feature is
    off); ValueError otherwise (pydantic reports it with the key)."""
    v = v.strip()
    if not v:
        return v
    scheme, sep, rest = v.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest.split("/", 1)[0]:
        raise ValueError(f"expected an http(s) URL or empty, got {v!r}")
    return v


__all__ = ["http_url_or_empty", "split_host_port"]
