"""PromQL text, built safely: label values quoted so that no value can close its string
and add to a query, label and metric names checked against PromQL's grammar (never
escaped), durations, selectors, rollups, aggregations, and VictoriaMetrics'
``extra_label`` scoping parameters. Pure; shared by the API's TSDB client
(``lattice_api.tsdb``) and the scheduler's autoscaler.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from lattice_common.errors import ValidationError

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
MATCH_OPS = ("=", "!=", "=~", "!~")


def escape_label_value(value: str) -> str:
    """``value`` as the inside of a double-quoted PromQL string: ``\\`` and ``"``
    escaped, newline, carriage return and tab as ``\\n \\r \\t``, every other control
    character (C0, DEL, C1) and the Unicode line separators as ``\\uXXXX``. Both
    PromQL's and MetricsQL's string syntax (Go's) read it back as ``value``; so does
    JSON's, which the tests use as the reference. A value that cannot be sent as UTF-8
    (a lone surrogate) is a ValidationError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(
            "a label value is not valid text", hint="Use printable characters only."
        ) from None
    out = []
    for ch in value:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or 0x7F <= code < 0xA0 or code in (0x2028, 0x2029):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def quote(value: str) -> str:
    """A PromQL string literal holding exactly ``value``."""
    return '"' + escape_label_value(value) + '"'


_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def regex_literal(value: str) -> str:
    """``value`` as a regular expression (RE2) matching only itself."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in value)


def check_label_name(name: str) -> str:
    if not LABEL_NAME.match(name):
        raise ValueError(f"not a label name: {name!r}")
    return name


def check_metric_name(name: str) -> str:
    if not METRIC_NAME.match(name):
        raise ValueError(f"not a metric name: {name!r}")
    return name


def matcher(name: str, op: str, value: str) -> str:
    """One label matcher, ``name op "value"`` with the value quoted."""
    if op not in MATCH_OPS:
        raise ValueError(f"not a label matcher: {op!r}")
    return f"{check_label_name(name)}{op}{quote(value)}"


def selector(
    labels: Mapping[str, str] | None = None,
    *,
    names: Sequence[str] = (),
    regex: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """A series selector: ``{__name__=~"a|b", l="v", r=~"x|y"}``.

    ``names`` are metric names (one: ``__name__="a"``); ``labels`` equality matchers;
    ``regex`` label -> the values any of which may match (each value matched literally).
    At least one matcher must be given."""
    parts: list[str] = []
    if names:
        for n in names:
            check_metric_name(n)
        if len(names) == 1:
            parts.append(matcher("__name__", "=", names[0]))
        else:
            parts.append(matcher("__name__", "=~", "|".join(regex_literal(n) for n in names)))
    for name, value in (labels or {}).items():
        parts.append(matcher(name, "=", value))
    for name, values in (regex or {}).items():
        if not values:
            raise ValueError(f"no values to match for {name!r}")
        parts.append(matcher(name, "=~", "|".join(regex_literal(v) for v in values)))
    if not parts:
        raise ValueError("a selector needs at least one matcher")
    return "{" + ", ".join(parts) + "}"


def window(seconds: float) -> str:
    """A PromQL duration for ``seconds`` (whole milliseconds, at least 1 ms)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"not a positive duration: {seconds!r}")
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def rollup(func: str, sel: str, seconds: float, *, keep_metric_names: bool = False) -> str:
    """``func(sel[window])``, with MetricsQL's ``keep_metric_names`` when asked (the
    series keep their ``__name__``, so one query can serve several metrics)."""
    check_label_name(func)
    expr = f"{func}({sel}[{window(seconds)}])"
    return expr + " keep_metric_names" if keep_metric_names else expr


def aggregate(op: str, by: Sequence[str], expr: str) -> str:
    """``op by (a, b) (expr)``."""
    check_label_name(op)
    return f"{op} by ({', '.join(check_label_name(b) for b in by)}) ({expr})"


def scope_params(scope: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``extra_label`` URL parameters that confine a query to ``scope``: the TSDB
    adds ``NAME="VALUE"`` to every series selector of the query, the value taken as it is
    (everything after the first ``=``), so nothing in it is syntax."""
    return [("extra_label", f"{check_label_name(k)}={v}") for k, v in scope.items()]


_REF_NAME = re.compile(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*")
_REF_LABEL = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*")


def parse_metric_ref(text: str) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """A metric as users name it: ``name`` or ``name{label="value", other=~'a|b'}`` (the
    specification's custom scaling metrics) -> (name, ((label, op, value), ...)). Values
    are read as quoted strings with ``\\`` escapes, in double or single quotes; anything
    else (functions, ranges, a second selector) is a ``ValueError`` naming what is wrong.
    Rebuild it with :func:`metric_selector`, which quotes every value again."""
    m = _REF_NAME.match(text)
    if not m:
        raise ValueError(f"not a metric name: {text!r}")
    name, pos = m.group(1), m.end()
    matchers: list[tuple[str, str, str]] = []
    if pos < len(text) and text[pos] == "{":
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " ,":
                pos += 1
            if pos < len(text) and text[pos] == "}":
                pos += 1
                break
            lm = _REF_LABEL.match(text, pos)
            if not lm:
                raise ValueError(f'expected label="value" at {text[pos : pos + 20]!r}')
            value, pos = _quoted(text, lm.end())
            matchers.append((lm.group(1), lm.group(2), value))
    if text[pos:].strip():
        raise ValueError(f"unexpected {text[pos:].strip()[:20]!r} after the metric")
    if name in ("__name__",):
        raise ValueError("give the metric name before the braces")
    return name, tuple(matchers)


def _quoted(text: str, pos: int) -> tuple[str, int]:
    if pos >= len(text) or text[pos] not in "\"'":
        raise ValueError(f"expected a quoted value at {text[pos : pos + 20]!r}")
    q = text[pos]
    out: list[str] = []
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append({"n": "\n", "t": "\t", "r": "\r"}.get(nxt, nxt))
            i += 2
            continue
        if ch == q:
            return "".join(out), i + 1
        out.append(ch)
        i += 1
    raise ValueError("a quoted value is not closed")


def metric_selector(
    name: str,
    matchers: Sequence[tuple[str, str, str]] = (),
    labels: Mapping[str, str] | None = None,
    regex: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """``{__name__="name", label op "value", ...}`` with every value quoted: a metric
    from :func:`parse_metric_ref` plus equality ``labels`` and literal-alternative
    ``regex`` matchers (as :func:`selector`)."""
    parts = [matcher("__name__", "=", check_metric_name(name))]
    parts += [matcher(label, op, value) for label, op, value in matchers]
    inner = selector(labels, regex=regex) if labels or regex else ""
    if inner:
        parts.append(inner[1:-1])
    return "{" + ", ".join(parts) + "}"
