"""PMI-1 and PMI-2 wire formats: parse and format, no sockets.

Why a separate, pure module: the PMI server reads bytes written by
arbitrary (possibly buggy or hostile) user processes.  Every decoding
failure must surface as one typed error, :class:`PmiProtocolError`, so
the socket shell can turn it into "abort this launch" instead of
crashing the node agent.  Nothing here raises any other exception for
any input, and every buffer is bounded so a rank cannot make the agent
allocate without limit.

PMI-1 ("simple" PMI, MPICH ``simple_pmi``/``pmi_v1``): one command per
line, ``cmd=NAME key=value key=value\\n``; tokens are separated by
spaces and split on the first ``=`` (values such as ``segments=2``
contain ``=``).  MPICH's line buffer is 1024 bytes (``PMIU_MAXLINE``).
Newer MPICH escapes spaces in values with a backslash; backslash pairs
are kept verbatim so values round-trip unchanged.  ``mcmd=spawn`` is a
multi-line command terminated by an ``endcmd`` line.

PMI-2: each frame is a 6-character ASCII decimal length followed by
that many bytes ``cmd=NAME;key=value;...;``.  Classic clients
(MPICH < 4 ``simple2pmi``, Slurm ``libpmi2``) left-align the length
("46    cmd=..."); MPICH 4 right-aligns it ("    46cmd=..."), so both
are accepted.  A ``;`` inside a value is escaped as ``;;``.  Note that
every PMI-2 client *starts* with a PMI-1 line (``cmd=init
pmi_version=2 pmi_subversion=0``) before switching to frames, which is
why :class:`PmiDecoder` detects the framing per message rather than
once per connection.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "PMI1_MAX_LINE",
    "PMI1_MAX_MCMD",
    "PMI2_LEN_FIELD",
    "PMI2_MAX_FRAME",
    "Message",
    "PmiDecoder",
    "PmiProtocolError",
    "format_pmi1",
    "format_pmi2",
    "parse_pmi1_line",
    "parse_pmi2_body",
    "parse_pmi2_frame",
]

#: MPICH's PMIU_MAXLINE: the client cannot read a longer reply line, and
#: never writes a longer request line.
PMI1_MAX_LINE = 1024
#: Bound on a whole multi-line ``mcmd=`` command (spawn), in bytes.
PMI1_MAX_MCMD = 64 * 1024
#: Width of the PMI-2 length prefix.
PMI2_LEN_FIELD = 6
#: PMII_MAX_COMMAND_LEN in MPICH/Slurm: the largest PMI-2 body accepted.
PMI2_MAX_FRAME = 64 * 1024

Version = Literal[1, 2]


class PmiProtocolError(ValueError):
    """Malformed, truncated, oversized or non-UTF-8 PMI input.

    The only exception the parsers raise; the shell treats it as a
    fatal error for the offending rank (and therefore the launch).
    """


@dataclass(frozen=True)
class Message:
    """One decoded PMI command.

    ``args`` keeps wire order and duplicates (PMI-2 spawn repeats keys
    per sub-command); :meth:`get` returns the first occurrence, which is
    what both MPICH and Slurm servers do.
    """

    version: Version
    cmd: str
    args: tuple[tuple[str, str], ...] = field(default=())

    def get(self, key: str, default: str | None = None) -> str | None:
        """First value for ``key`` or ``default``."""
        for k, v in self.args:
            if k == key:
                return v
        return default


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PmiProtocolError(f"{what} is not valid UTF-8: {exc.reason}") from None


def _check_key(key: str, what: str) -> None:
    if not key:
        raise PmiProtocolError(f"empty key in {what}")
    for ch in key:
        if ch in "= ;\\" or not ch.isprintable():
            raise PmiProtocolError(f"invalid character {ch!r} in key {key!r} of {what}")


def _check_value_chars(value: str, what: str) -> None:
    for ch in value:
        if ch in "\n\r\x00":
            raise PmiProtocolError(f"control character {ch!r} in value of {what}")


# --------------------------------------------------------------------------- PMI-1


def _split_pmi1_tokens(text: str) -> list[str]:
    """Split on unescaped spaces; ``\\x`` pairs stay verbatim in tokens."""
    tokens: list[str] = []
    cur: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n:
            cur.append(text[i : i + 2])
            i += 2
            continue
        if ch == " ":
            if cur:
                tokens.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        tokens.append("".join(cur))
    return tokens


def parse_pmi1_line(line: bytes) -> Message:
    """Parse one PMI-1 line (with or without its trailing newline).

    Tokens without ``=`` (``endcmd`` in ``mcmd``) get the value ``""``.
    """
    if len(line) > PMI1_MAX_LINE:
        raise PmiProtocolError(f"PMI-1 line of {len(line)} bytes exceeds {PMI1_MAX_LINE}")
    if line.endswith(b"\n"):
        line = line[:-1]
    if b"\n" in line or b"\x00" in line:
        raise PmiProtocolError("PMI-1 line contains an embedded newline or NUL")
    text = _decode(line, "PMI-1 line").rstrip("\r")
    if not text.startswith("cmd="):
        raise PmiProtocolError(f"PMI-1 line does not start with 'cmd=': {text[:40]!r}")
    tokens = _split_pmi1_tokens(text)
    cmd = tokens[0][4:]
    if not cmd:
        raise PmiProtocolError("PMI-1 line has an empty command name")
    _check_key(cmd, "PMI-1 command name")
    args: list[tuple[str, str]] = []
    for tok in tokens[1:]:
        key, sep, value = tok.partition("=")
        _check_key(key, f"PMI-1 cmd={cmd}")
        if sep and not value:
            raise PmiProtocolError(f"PMI-1 key {key!r} has '=' but no value")
        _check_value_chars(value, f"PMI-1 cmd={cmd}")
        args.append((key, value))
    return Message(1, cmd, tuple(args))


def _parse_mcmd(lines: list[bytes]) -> Message:
    """Parse a PMI-1 ``mcmd=`` block: one ``key=value`` per line, values may hold spaces."""
    first = _decode(lines[0], "PMI-1 mcmd line").rstrip("\r")
    if not first.startswith("mcmd="):
        raise PmiProtocolError("mcmd block does not start with 'mcmd='")
    cmd = first[5:]
    _check_key(cmd, "PMI-1 mcmd name")
    args: list[tuple[str, str]] = []
    for raw in lines[1:]:
        text = _decode(raw, "PMI-1 mcmd line").rstrip("\r")
        if not text:
            continue
        key, _, value = text.partition("=")
        _check_key(key, f"PMI-1 mcmd={cmd}")
        _check_value_chars(value, f"PMI-1 mcmd={cmd}")
        args.append((key, value))
    return Message(1, cmd, tuple(args))


def format_pmi1(cmd: str, *pairs: tuple[str, str | int]) -> bytes:
    """Format a PMI-1 reply line, ``\\n``-terminated.

    Raises :class:`PmiProtocolError` if a value would break framing
    (unescaped space, newline) or the line would not fit MPICH's
    1024-byte read buffer, so a too-long KVS value becomes an error
    reply instead of a silently truncated one.
    """
    _check_key(cmd, "PMI-1 reply")
    parts = [f"cmd={cmd}"]
    for key, value in pairs:
        _check_key(key, f"PMI-1 reply cmd={cmd}")
        sval = str(value)
        if "\n" in sval or "\x00" in sval or " " in sval.replace("\\ ", ""):
            raise PmiProtocolError(f"value for {key!r} cannot be sent on a PMI-1 line")
        parts.append(f"{key}={sval}")
    data = (" ".join(parts) + "\n").encode("utf-8")
    if len(data) > PMI1_MAX_LINE:
        raise PmiProtocolError(f"PMI-1 reply of {len(data)} bytes exceeds {PMI1_MAX_LINE}")
    return data


# --------------------------------------------------------------------------- PMI-2


def _parse_len_field(field_bytes: bytes) -> int:
    """Decode the 6-char length: digits padded with spaces on either side."""
    if len(field_bytes) != PMI2_LEN_FIELD:
        raise PmiProtocolError("truncated PMI-2 length field")
    try:
        text = field_bytes.decode("ascii")
    except UnicodeDecodeError:
        raise PmiProtocolError("PMI-2 length field is not ASCII") from None
    digits = text.strip(" ")
    if not digits or not digits.isdigit() or not digits.isascii():
        raise PmiProtocolError(f"bad PMI-2 length field {text!r}")
    length = int(digits)
    if length <= 0:
        raise PmiProtocolError("PMI-2 frame has zero length")
    if length > PMI2_MAX_FRAME:
        raise PmiProtocolError(f"PMI-2 frame of {length} bytes exceeds {PMI2_MAX_FRAME}")
    return length


def parse_pmi2_body(body: bytes) -> Message:
    """Parse a PMI-2 body (``cmd=NAME;k=v;...;``, without the length prefix).

    ``;;`` inside a value is an escaped ``;`` (greedy, as in MPICH's
    ``parse_keyval``); the final ``;`` may be missing (MPICH 4 accepts that).
    """
    if len(body) > PMI2_MAX_FRAME:
        raise PmiProtocolError(f"PMI-2 frame of {len(body)} bytes exceeds {PMI2_MAX_FRAME}")
    if b"\x00" in body:
        raise PmiProtocolError("PMI-2 frame contains NUL")
    text = _decode(body, "PMI-2 frame")
    pairs: list[tuple[str, str]] = []
    i = 0
    n = len(text)
    while i < n:
        eq = text.find("=", i)
        semi = text.find(";", i)
        if eq < 0 or (0 <= semi < eq):
            # key without '=' (MPICH 4 permits): up to ';' or end
            end = n if semi < 0 else semi
            key = text[i:end]
            _check_key(key, "PMI-2 frame")
            pairs.append((key, ""))
            i = end + 1
            continue
        key = text[i:eq]
        _check_key(key, "PMI-2 frame")
        j = eq + 1
        val: list[str] = []
        while j < n:
            ch = text[j]
            if ch == ";":
                if j + 1 < n and text[j + 1] == ";":
                    val.append(";")
                    j += 2
                    continue
                break
            val.append(ch)
            j += 1
        pairs.append((key, "".join(val)))
        i = j + 1
    if not pairs or pairs[0][0] != "cmd":
        raise PmiProtocolError("PMI-2 frame does not start with 'cmd='")
    cmd = pairs[0][1]
    if not cmd:
        raise PmiProtocolError("PMI-2 frame has an empty command name")
    _check_key(cmd, "PMI-2 command name")
    return Message(2, cmd, tuple(pairs[1:]))


def parse_pmi2_frame(frame: bytes) -> Message:
    """Parse one complete PMI-2 frame including its 6-char length prefix."""
    length = _parse_len_field(frame[:PMI2_LEN_FIELD])
    body = frame[PMI2_LEN_FIELD:]
    if len(body) != length:
        raise PmiProtocolError(f"PMI-2 frame announces {length} bytes but carries {len(body)}")
    return parse_pmi2_body(body)


def format_pmi2(cmd: str, *pairs: tuple[str, str | int]) -> bytes:
    """Format a PMI-2 frame; ``;`` in values is escaped as ``;;``.

    The length is right-aligned like MPICH 4's writer; every reader
    (``atoi`` in classic clients) accepts either alignment.
    """
    _check_key(cmd, "PMI-2 reply")
    parts = [f"cmd={cmd};"]
    for key, value in pairs:
        _check_key(key, f"PMI-2 reply cmd={cmd}")
        sval = str(value)
        if "\x00" in sval:
            raise PmiProtocolError(f"value for {key!r} contains NUL")
        parts.append(f"{key}={sval.replace(';', ';;')};")
    body = "".join(parts).encode("utf-8")
    if len(body) > PMI2_MAX_FRAME:
        raise PmiProtocolError(f"PMI-2 reply of {len(body)} bytes exceeds {PMI2_MAX_FRAME}")
    return f"{len(body):6d}".encode("ascii") + body


# --------------------------------------------------------------------------- stream


_PMI1_PREFIXES = (b"cmd=", b"mcmd=")


class PmiDecoder:
    """Incremental decoder for one rank's connection.

    Framing is detected per message from its first bytes: ``cmd=`` /
    ``mcmd=`` is PMI-1, a digit or space starts a PMI-2 length field.
    That handles pure PMI-1 clients, PMI-2 clients (which open with a
    PMI-1 ``init`` line) and clients that start directly with a frame.
    Buffering is bounded; after the first error the decoder stays
    failed, because the byte stream can no longer be resynchronised.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._mcmd: list[bytes] | None = None
        self._mcmd_size = 0
        self._error: PmiProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes buffered but not yet forming a whole message."""
        return len(self._buf) + self._mcmd_size

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return every complete message, in order."""
        if self._error is not None:
            raise self._error
        self._buf += data
        out: list[Message] = []
        try:
            while True:
                msg = self._next()
                if msg is None:
                    break
                out.append(msg)
        except PmiProtocolError as exc:
            self._error = exc
            raise
        return out

    def eof(self) -> None:
        """Signal end of stream; raise if it cut a message short."""
        if self._error is None and self.pending:
            self._error = PmiProtocolError(f"connection closed mid-message ({self.pending} bytes)")
        if self._error is not None and self.pending:
            raise self._error

    def _next(self) -> Message | None:
        buf = self._buf
        if self._mcmd is not None:
            return self._next_mcmd_line()
        if not buf:
            return None
        first = buf[0]
        if first in b"0123456789 ":
            if len(buf) < PMI2_LEN_FIELD:
                return None
            length = _parse_len_field(bytes(buf[:PMI2_LEN_FIELD]))
            end = PMI2_LEN_FIELD + length
            if len(buf) < end:
                return None
            body = bytes(buf[PMI2_LEN_FIELD:end])
            del buf[:end]
            return parse_pmi2_body(body)
        head = bytes(buf[:5])
        if not any(p.startswith(head) or head.startswith(p) for p in _PMI1_PREFIXES):
            raise PmiProtocolError(f"unrecognised PMI framing, starts with {head!r}")
        nl = buf.find(b"\n", 0, PMI1_MAX_LINE)
        if nl < 0:
            if len(buf) >= PMI1_MAX_LINE:
                raise PmiProtocolError(f"PMI-1 line longer than {PMI1_MAX_LINE} bytes")
            return None
        line = bytes(buf[: nl + 1])
        del buf[: nl + 1]
        if line.startswith(b"mcmd="):
            self._mcmd = [line[:-1]]
            self._mcmd_size = len(line)
            return self._next_mcmd_line()
        return parse_pmi1_line(line)

    def _next_mcmd_line(self) -> Message | None:
        assert self._mcmd is not None
        buf = self._buf
        while True:
            nl = buf.find(b"\n", 0, PMI1_MAX_LINE)
            if nl < 0:
                if len(buf) >= PMI1_MAX_LINE:
                    raise PmiProtocolError(f"PMI-1 mcmd line longer than {PMI1_MAX_LINE} bytes")
                return None
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            self._mcmd_size += nl + 1
            if self._mcmd_size > PMI1_MAX_MCMD:
                raise PmiProtocolError(f"PMI-1 mcmd larger than {PMI1_MAX_MCMD} bytes")
            if line.rstrip(b"\r") == b"endcmd":
                lines = self._mcmd
                self._mcmd = None
                self._mcmd_size = 0
                return _parse_mcmd(lines)
            self._mcmd.append(line)


def encode_kvs(kvs: Mapping[str, str]) -> bytes:
    """A fence's key-value pairs on the wire between agents (PmiFence ``kvs_json``)."""
    return json.dumps(kvs, separators=(",", ":"), ensure_ascii=False).encode()


def decode_kvs(raw: bytes) -> dict[str, str]:
    """``encode_kvs``' inverse; PmiProtocolError unless it is one JSON object of strings."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise PmiProtocolError(f"fence keys are not JSON: {e}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise PmiProtocolError("fence keys must be one JSON object of strings")
    return data
