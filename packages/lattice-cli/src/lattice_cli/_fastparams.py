"""Keep typer from importing pydantic to convert plain ``str``/``int``/``float``/Enum options.

Since typer 0.2x every parameter value is converted through a pydantic ``TypeAdapter``;
building the first one imports pydantic, ~110 ms on a login node, which by itself breaks
the CLI's start-time budget (``lattice status`` < 200 ms). Our commands only use plain
strings, numbers, enums and lists of those, so this module gives typer a small converter
for exactly those annotations and leaves everything else (paths, datetimes, tuples,
custom parsers: e.g. in ``lattice dev``) to typer's own pydantic-based conversion.

It touches typer internals (``typer.core._TyperParameter.get_runtime_param`` and
``typer._coercion.RuntimeParam``). If those ever change shape, :func:`install` does
nothing and typer behaves as shipped: slower, never wrong. ``LATTICE_CLI_TYPER_PYDANTIC=1``
turns the shortcut off. ``tests/test_main.py`` checks conversions and their errors.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

_installed = False
# What pydantic's bool validation (typer's own path) accepts; "" is False as in typer.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"", "0", "off", "f", "false", "n", "no"})


def install() -> bool:
    """Patch typer once; returns whether the fast path is active."""
    global _installed
    if _installed:
        return True
    if os.environ.get("LATTICE_CLI_TYPER_PYDANTIC"):
        return False
    try:
        from typer import core as typer_core
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam
        from typer._param_types import coerce_cli_choice
        from typer._typing import get_args, get_origin
    except ImportError:  # a typer without these internals: leave it alone
        return False
    parameter_class = getattr(typer_core, "_TyperParameter", None)
    original = getattr(parameter_class, "get_runtime_param", None)
    if parameter_class is None or original is None:
        return False

    @dataclass(frozen=True)
    class _PlainRuntimeParam(RuntimeParam):  # type: ignore[misc, valid-type]
        """Conversion of one plain annotation (or list of it) without pydantic."""

        kind: str = "str"
        leaf: Any = str
        many: bool = False

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if self.many:
                items = value if isinstance(value, list | tuple) else [value]
                return [self._one(v, param, ctx) for v in items]
            return self._one(value, param, ctx)

        def _one(self, value: Any, param: Any, ctx: Any) -> Any:
            info = self.parameter_info
            if self.kind == "str":
                if isinstance(value, bytes):
                    return value.decode("utf-8", "replace")
                return str(value)
            if self.kind == "bool":
                if isinstance(value, bool):
                    return value
                text = str(value).strip().lower()
                if text in _TRUE:
                    return True
                if text in _FALSE:
                    return False
                raise BadParameter(f"{value!r} is not a valid boolean.", ctx=ctx, param=param)
            if self.kind == "enum":
                try:
                    return coerce_cli_choice(
                        value,
                        choices=list(self.leaf),
                        case_sensitive=info.case_sensitive,
                        ctx=ctx,
                    )
                except ValueError as exc:
                    raise BadParameter(str(exc), ctx=ctx, param=param) from None
            # int / float
            if isinstance(value, bool):
                raise BadParameter(f"{value!r} is not a valid number.", ctx=ctx, param=param)
            try:
                number = self.leaf(value)
            except (TypeError, ValueError):
                label = "integer" if self.leaf is int else "number"
                raise BadParameter(
                    f"{value!r} is not a valid {label}.", ctx=ctx, param=param
                ) from None
            low, high = info.min, info.max
            if info.clamp:
                if low is not None and number < low:
                    return self.leaf(low)
                if high is not None and number > high:
                    return self.leaf(high)
                return number
            if low is not None and number < low:
                raise BadParameter(
                    f"Input should be greater than or equal to {low}", ctx=ctx, param=param
                )
            if high is not None and number > high:
                raise BadParameter(
                    f"Input should be less than or equal to {high}", ctx=ctx, param=param
                )
            return number

    def plain(descriptor: Any) -> Any:
        info = descriptor.parameter_info
        if getattr(info, "parser", None) is not None or descriptor.file_annotation is not None:
            return None
        annotation = descriptor.annotation
        many = False
        if get_origin(annotation) is list:
            args = get_args(annotation)
            if len(args) != 1:
                return None
            annotation, many = args[0], True
        if annotation is str:
            kind = "str"
        elif annotation is bool:
            kind = "bool"
        elif annotation in (int, float):
            kind = "number"
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            kind = "enum"
        else:
            return None
        return _PlainRuntimeParam(
            parameter_info=info,
            annotation=descriptor.annotation,
            kind=kind,
            leaf=annotation,
            many=many,
        )

    def get_runtime_param(self: Any) -> Any:
        if getattr(self, "_runtime_param", None) is None:
            try:
                fast = plain(self.type_descriptor)
            except Exception:  # unexpected typer internals: use typer's own path
                fast = None
            if fast is not None:
                self._runtime_param = fast
                return fast
        return original(self)

    parameter_class.get_runtime_param = get_runtime_param
    _installed = True
    return True
