"""Domain records (msgspec Structs) <-> wire messages (betterproto2 Messages).

Every process thinks in ``lattice_common.types`` records and talks in the messages
generated from ``proto/lattice/v1`` (``lattice_common.proto.lattice.v1``). The two are
kept one vocabulary by a naming rule: a message field has exactly the name of the
Struct field it carries. The conversion therefore goes through a plain dict, one field
name to one value, with no per-type mapping code:

* a dict is the one shape both libraries build from and read into natively
  (``msgspec.convert`` / ``Message.from_dict``, ``Message.to_dict``), so nested
  records, lists, maps, enums (as their string values) and ``None`` are handled once,
  here, instead of in a hand-written converter per message that drifts with the types;
* adding a field to a record and to its message needs no change here, and
  ``tests/test_proto_contract.py`` fails when the two stop matching.

What the dicts must get right, and why this module exists instead of calling the two
libraries inline:

* ``Message.to_dict()`` defaults to proto-JSON (camelCase keys, 64-bit ints as
  strings, bytes as base64); we ask for ``OutputFormat.PYTHON`` and ``Casing.SNAKE``.
* proto3 cannot tell "unset" from zero for plain scalars. Fields that are zero on the
  wire are left out of the dict so the record's own default applies (``lifecycle=""``
  becomes ``bounded``). Numbers whose domain default is not zero, or that may be
  absent, are proto3 ``optional`` (``nodes``, ``preemption_class``, ``exit_code``...):
  they are kept whenever set, so an explicit 0 survives, and ``None`` means "default".
* A Struct field without a default (``entrypoint``, ``tenant``) that is empty on the
  wire is filled with the empty value rather than rejected, so validation, not
  decoding, reports it.
* ``msgspec.to_builtins`` honours ``omit_defaults`` and would leave defaults off the
  wire; :func:`to_message` writes every field so that any reader (not only this
  module) sees the real values.

Speed: the dict path through betterproto2 cost ~0.5 ms per allocation each way, most
of the API's CPU per request. :func:`to_message` and :func:`message_to_dict` follow the
same rules through a plan made once per class from the message's field metadata (the
dict path, :func:`to_message_via_dict` and ``Message.to_dict``, stays the reference the
property tests compare with), and betterproto2's per-call type-hint and field-default
lookups are memoised.
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from typing import Any, TypeVar

import betterproto2
import msgspec
from betterproto2 import Casing

from lattice_common.errors import ValidationError

StructT = TypeVar("StructT", bound=msgspec.Struct)
MessageT = TypeVar("MessageT", bound=betterproto2.Message)

__all__ = ["from_message", "message_to_dict", "to_message", "to_message_via_dict"]


def _cache_type_hints() -> None:
    """betterproto2 recomputes ``typing.get_type_hints`` for a message class on every
    to_dict/from_dict (a quarter of the API's CPU per request when profiled). A class's
    hints never change once its module is loaded, so memoise them per class."""
    original = betterproto2.Message._type_hints.__func__  # type: ignore[attr-defined]
    if getattr(original, "_lattice_cached", False):
        return
    cache: dict[type, dict[str, type]] = {}

    def _type_hints(cls: type) -> dict[str, type]:
        hints = cache.get(cls)
        if hints is None:
            hints = cache[cls] = original(cls)
        return hints

    _type_hints._lattice_cached = True  # type: ignore[attr-defined]
    betterproto2.Message._type_hints = classmethod(_type_hints)  # type: ignore[method-assign,assignment]


_cache_type_hints()


def _cache_field_defaults() -> None:
    """betterproto2 builds a field's default under ``warnings.catch_warnings()`` each
    time it compares a value with it: for every field of every message it serializes
    (most of ``bytes(message)``'s time). Every caller only compares with the default,
    so one built default per class and field serves them all."""
    original = betterproto2.Message._get_field_default
    if getattr(original, "_lattice_cached", False):
        return
    cache: dict[tuple[type, str], Any] = {}

    def _get_field_default(self: betterproto2.Message, field_name: str) -> Any:
        key = (type(self), field_name)
        try:
            return cache[key]
        except KeyError:
            value = cache[key] = original(self, field_name)
            return value

    _get_field_default._lattice_cached = True  # type: ignore[attr-defined]
    betterproto2.Message._get_field_default = _get_field_default  # type: ignore[method-assign]


_cache_field_defaults()


def to_message(
    struct: msgspec.Struct, message_cls: type[MessageT], *, ignore_unknown_fields: bool = False
) -> MessageT:
    """Build a ``message_cls`` from a domain record.

    Every field of ``struct`` (defaults included) is written; enums become their string
    values, ``None`` leaves an optional field unset. A Struct field the message lacks is
    a contract error and raises ``TypeError`` unless ``ignore_unknown_fields``.

    The message is built directly, by a plan derived once per (record type, message
    class) from the message's field metadata with the same one-name rule. Through
    ``from_dict`` an allocation took ~0.5 ms, half of the API's CPU per submission;
    :func:`to_message_via_dict` stays the reference (``tests/test_wire_plan.py`` checks
    that both build the same message).
    """
    plan = _plan(type(struct), message_cls, ignore_unknown_fields)
    if plan is None:
        return to_message_via_dict(struct, message_cls, ignore_unknown_fields=ignore_unknown_fields)
    return plan(struct)  # type: ignore[no-any-return]


def to_message_via_dict(
    struct: msgspec.Struct, message_cls: type[MessageT], *, ignore_unknown_fields: bool = False
) -> MessageT:
    """:func:`to_message` through a plain dict and ``Message.from_dict``."""
    data = _struct_to_builtins(struct)
    try:
        return message_cls.from_dict(data, ignore_unknown_fields=ignore_unknown_fields)
    except KeyError as e:
        raise TypeError(
            f"{type(struct).__name__} does not fit {message_cls.__name__}: {e.args[0]}"
        ) from None


_INT_TYPES = frozenset(betterproto2.ALL_INT_TYPES)


def _scalar(proto_type: str) -> Any:
    """The conversion ``Message.from_dict`` applies to one scalar of the record."""
    from betterproto2 import TYPE_BOOL, TYPE_BYTES, TYPE_DOUBLE, TYPE_FLOAT, TYPE_STRING

    if proto_type == TYPE_STRING:
        return lambda v: v.value if isinstance(v, enum.Enum) else v
    if proto_type == TYPE_BOOL:
        return lambda v: v
    if proto_type in (TYPE_FLOAT, TYPE_DOUBLE):
        return lambda v: float(v) if isinstance(v, int) else v
    if proto_type == TYPE_BYTES:
        return lambda v: bytes(v)
    if proto_type in _INT_TYPES:
        return lambda v: int(v)
    return None


@functools.cache
def _plan(struct_cls: type, message_cls: type, ignore_unknown_fields: bool) -> Any:
    """A function building ``message_cls`` from a ``struct_cls`` record, or None where
    a field needs more than this knows (enums, wrapper types): the dict path then."""
    from betterproto2 import TYPE_MAP, TYPE_MESSAGE

    meta = message_cls._betterproto  # type: ignore[attr-defined]
    steps: list[tuple[str, Any, str]] = []  # (name, convert, kind)
    for name in struct_cls.__struct_fields__:  # type: ignore[attr-defined]
        fmeta = meta.meta_by_field_name.get(name)
        if fmeta is None:
            if ignore_unknown_fields:
                continue
            raise TypeError(
                f"{struct_cls.__name__} does not fit {message_cls.__name__}: Unknown field "
                f"'{name}' in message {message_cls.__name__}."
            )
        if getattr(fmeta, "unwrap", None):
            return None
        field_cls = meta.cls_by_field.get(name)
        if fmeta.proto_type == TYPE_MESSAGE:
            convert = _nested(field_cls, ignore_unknown_fields)
            steps.append((name, convert, "list" if fmeta.repeated else "one"))
        elif fmeta.proto_type == TYPE_MAP:
            key_conv = _scalar(fmeta.map_meta[0].proto_type)
            vmeta = fmeta.map_meta[1]
            if key_conv is None or getattr(vmeta, "unwrap", None):
                return None
            if vmeta.proto_type == TYPE_MESSAGE:
                val_conv = _nested(meta.cls_by_field[f"{name}.value"], ignore_unknown_fields)
            else:
                val_conv = _scalar(vmeta.proto_type)
            if val_conv is None:
                return None
            steps.append((name, (key_conv, val_conv), "map"))
        else:
            convert = _scalar(fmeta.proto_type)
            if convert is None:
                return None
            steps.append((name, convert, "list" if fmeta.repeated else "one"))

    def build(struct: Any) -> Any:
        kwargs: dict[str, Any] = {}
        for name, convert, kind in steps:
            value = getattr(struct, name)
            if value is None:
                continue  # unset, as from_dict leaves it
            if kind == "one":
                kwargs[name] = convert(value)
            elif kind == "list":
                kwargs[name] = [convert(v) for v in value]
            else:
                kc, vc = convert
                kwargs[name] = {kc(k): vc(v) for k, v in value.items()}
        return message_cls(**kwargs)

    return build


def _nested(field_cls: type, ignore_unknown_fields: bool) -> Any:
    def convert(value: Any) -> Any:
        if isinstance(value, msgspec.Struct):
            return to_message(value, field_cls, ignore_unknown_fields=ignore_unknown_fields)
        return field_cls.from_dict(  # type: ignore[attr-defined]
            _struct_to_builtins(value), ignore_unknown_fields=ignore_unknown_fields
        )

    return convert


def from_message(message: betterproto2.Message, struct_cls: type[StructT]) -> StructT:
    """Build a domain record of type ``struct_cls`` from a wire message.

    Unset and zero plain fields take the record's default; set ``optional`` fields are
    kept (0 included); message fields the record does not have are ignored. Raises
    :class:`~lattice_common.errors.ValidationError` when a value does not fit the record
    (unknown state name, missing nested record, ...).
    """
    data = _message_to_builtins(message, struct_cls)
    try:
        return msgspec.convert(data, struct_cls)
    except msgspec.ValidationError as e:
        raise ValidationError(
            f"invalid {type(message).__name__}: {e}",
            details={"message": type(message).__name__, "error": str(e)},
            hint="Check the request fields against proto/lattice/v1.",
        ) from None


# ---------------------------------------------------------------- struct -> dict


def _struct_to_builtins(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return {name: _struct_to_builtins(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {_struct_to_builtins(k): _struct_to_builtins(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_struct_to_builtins(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    # bytes -> base64 text (what Message.from_dict expects), datetimes -> ISO text, ...
    return msgspec.to_builtins(value)


# ---------------------------------------------------------------- message -> dict


def message_to_dict(message: betterproto2.Message) -> dict[str, Any]:
    """``message.to_dict(output_format=PYTHON, casing=SNAKE)`` (set fields only, snake
    keys, nested messages as dicts), by a plan per message class: betterproto2's own
    walk looks up type hints and casing for every field of every call."""
    return _dict_plan(type(message))(message)  # type: ignore[no-any-return]


@functools.cache
def _dict_plan(message_cls: type) -> Any:
    from betterproto2 import TYPE_MAP, TYPE_MESSAGE

    steps: list[tuple[str, str, str]] = []  # (attribute, key, kind)
    for name, meta in message_cls._betterproto.meta_by_field_name.items():  # type: ignore[attr-defined]
        key = Casing.SNAKE(name).rstrip("_")  # type: ignore[operator]
        nested = meta.proto_type == TYPE_MESSAGE and not meta.unwrap
        if meta.repeated:
            kind = "messages" if nested else "list"
        elif meta.proto_type == TYPE_MAP:
            kind = "map_messages" if meta.map_meta[1].proto_type == TYPE_MESSAGE else "map"
            if meta.map_meta[1].unwrap:
                kind = "map"
        elif nested:
            kind = "message"
        elif meta.optional or meta.proto_type == TYPE_MESSAGE:
            kind = "set"  # kept whenever not None (optional scalars, unwrapped values)
        else:
            kind = "scalar"
        steps.append((name, key, kind))

    def build(message: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, key, kind in steps:
            value = getattr(message, name)
            if kind == "scalar":
                if value:
                    out[key] = value
            elif value is None:
                continue
            elif kind == "message":
                out[key] = message_to_dict(value)
            elif kind == "set":
                out[key] = value
            elif kind == "list":
                if value:
                    out[key] = list(value)
            elif kind == "messages":
                if value:
                    out[key] = [message_to_dict(v) for v in value]
            elif kind == "map":
                if value:
                    out[key] = dict(value)
            elif value:  # map of messages
                out[key] = {k: message_to_dict(v) for k, v in value.items()}
        return out

    return build


def _message_to_builtins(message: betterproto2.Message, struct_cls: type) -> dict[str, Any]:
    data = message_to_dict(message)
    _complete(data, message, struct_cls)
    return data


def _complete(data: dict[str, Any], message: betterproto2.Message, struct_cls: type) -> None:
    """Fill required Struct fields that were empty on the wire, recursing into records."""
    for field in _fields(struct_cls):
        name = field.name
        wire_value = getattr(message, name, None)
        if name not in data:
            # A set nested message is always in `data` (as {} at least); what is missing
            # here is a zero scalar, an empty list/map, or an unset message (left out,
            # so msgspec reports the missing record).
            if field.required and wire_value is not None:
                data[name] = wire_value  # "", 0, False, [] or {}
            continue
        nested = _struct_of(field.type)
        if nested is None or wire_value is None:
            continue
        value = data[name]
        if isinstance(value, dict) and isinstance(wire_value, betterproto2.Message):
            _complete(value, wire_value, nested)
        elif isinstance(value, list) and isinstance(wire_value, list):
            for item, wire_item in zip(value, wire_value, strict=False):
                if isinstance(item, dict) and isinstance(wire_item, betterproto2.Message):
                    _complete(item, wire_item, nested)
        elif isinstance(value, dict) and isinstance(wire_value, dict):
            for key, item in value.items():
                wire_item = wire_value.get(key)
                if isinstance(item, dict) and isinstance(wire_item, betterproto2.Message):
                    _complete(item, wire_item, nested)


@functools.cache
def _fields(struct_cls: type) -> tuple[msgspec.structs.FieldInfo, ...]:
    # msgspec.structs.fields re-evaluates the class's annotations on every call
    return msgspec.structs.fields(struct_cls)


@functools.cache
def _struct_of(annotation: Any) -> type | None:
    """The Struct type inside ``T``, ``T | None``, ``list[T]`` or ``dict[str, T]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _struct_of(arg)
            if found is not None:
                return found
        return None
    if origin in (list, tuple, set, frozenset) and args:
        return _struct_of(args[0])
    if origin is dict and len(args) == 2:
        return _struct_of(args[1])
    return None
