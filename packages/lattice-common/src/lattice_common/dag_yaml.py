"""DAG definitions as people write them, turned into :class:`~lattice_common.dag.DagDefinition`.

Two spellings exist in the documentation and both are accepted, so a file copied from
either works with ``lattice dag submit``:

* the user guide's: top-level ``name`` and ``allocations``, each member named by
  ``name`` and depending through ``depends_on: [{preprocess: success}]``;
* the Intent API's: ``dag: {allocations: [...]}``, members named by ``id``, edges as
  ``{ref, condition}``, with ``resources: {nodes, constraints}`` and
  ``lifecycle: {type, walltime}`` flattened to the flat body the API validates.

Anything wrong becomes a :class:`ValidationError` naming the member and field with a
hint -- never a YAML traceback -- because this text comes straight from users.
:func:`dag_from_mapping` does the same for an already-decoded JSON request body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from lattice_common.dag import DagDefinition, DagMemberSpec, DependencyCondition
from lattice_common.errors import ValidationError
from lattice_common.types import Dependency

MAX_DAG_TEXT_BYTES = 4 * 1024 * 1024
_EXAMPLE = (
    "e.g.\nname: pipeline\nallocations:\n  - name: prep\n    entrypoint: python prep.py\n"
    "    nodes: 1\n    walltime: 1h"
)


def parse_dag_yaml(text: str | bytes) -> DagDefinition:
    """Parse a DAG file (either spelling). Graph checks are :func:`~lattice_common.dag.validate_dag`'s."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValidationError(
                f"the DAG file is not valid UTF-8 (byte {e.start})",
                hint="Save the file as UTF-8.",
            ) from None
    if not isinstance(text, str):
        raise ValidationError("the DAG definition must be text", hint=_EXAMPLE)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValidationError(
            "the DAG file is not valid UTF-8", hint="Save the file as UTF-8."
        ) from None
    if size > MAX_DAG_TEXT_BYTES:
        raise ValidationError(
            f"the DAG file is too large ({size} bytes, limit: {MAX_DAG_TEXT_BYTES})",
            hint="Split the workflow into smaller DAGs.",
        )
    try:
        doc = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValidationError(
            f"the DAG file is not valid YAML{where}: {e.problem or e.context}",
            hint="Check the indentation and quoting around that place.",
        ) from None
    except Exception as e:  # the YAML library's other failures (nesting depth, dates)
        raise ValidationError(
            f"the DAG file is not valid YAML: {type(e).__name__}: {e}"[:300],
            hint="Check the file's syntax.",
        ) from None
    return dag_from_mapping(doc)


def dag_from_mapping(doc: Any) -> DagDefinition:
    """Either documented form, already decoded (YAML or a JSON request body)."""
    if not isinstance(doc, Mapping):
        raise ValidationError(
            f"a DAG definition must be a mapping, not {_kind(doc)}", hint=_EXAMPLE
        )
    name = doc.get("name")
    body: Any = doc
    if "dag" in doc:
        body = doc["dag"]
        if not isinstance(body, Mapping):
            raise ValidationError(
                f"`dag` must be a mapping with `allocations`, not {_kind(body)}",
                hint="e.g. dag: {allocations: [{id: a, entrypoint: ./a.sh}]}",
            )
        name = body.get("name", name)
    if name is not None and not isinstance(name, str | int):
        raise ValidationError(f"the DAG name must be text, not {_kind(name)}", hint=_EXAMPLE)
    allocs = body.get("allocations")
    if not isinstance(allocs, list) or not allocs:
        raise ValidationError(
            "a DAG needs a non-empty `allocations` list"
            + ("" if allocs is None else f", not {_kind(allocs)}"),
            hint=_EXAMPLE,
        )
    members = []
    where: dict[str, int] = {}
    for pos, entry in enumerate(allocs):
        m = _member(pos, entry)
        if m.id in where:
            raise ValidationError(
                f"duplicate allocation id {m.id!r} (allocations {where[m.id] + 1} and {pos + 1})",
                details={"member": m.id},
                hint="Give every allocation its own id (or name).",
            )
        where[m.id] = pos
        members.append(m)
    return DagDefinition(name="" if name is None else str(name), members=tuple(members))


def _member(pos: int, entry: Any) -> DagMemberSpec:
    label = f"allocation {pos + 1}"
    if not isinstance(entry, Mapping):
        raise ValidationError(
            f"{label} must be a mapping, not {_kind(entry)}",
            hint="Each list item needs at least an id (or name) and an entrypoint.",
        )
    raw_id = entry.get("id", entry.get("name"))
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or str(raw_id) == "":
        raise ValidationError(
            f"{label} has no id",
            details={"field": "id"},
            hint="Give it `id:` (API form) or `name:` (user-guide form).",
        )
    mid = str(raw_id)
    spec: dict[str, Any] = {}
    for key, val in entry.items():
        if not isinstance(key, str):
            raise ValidationError(
                f"member {mid!r}: field names must be text, not {_kind(key)}",
                details={"member": mid},
                hint="Quote the key.",
            )
        if key in ("id", "depends_on"):
            continue
        if key == "resources" and isinstance(val, Mapping):
            _flatten(mid, spec, "resources", val, {})
        elif key == "lifecycle" and isinstance(val, Mapping):
            _flatten(mid, spec, "lifecycle", val, {"type": "lifecycle"})
        elif key == "resources":
            raise ValidationError(
                f"member {mid!r}: resources must be a mapping, not {_kind(val)}",
                details={"member": mid, "field": "resources"},
                hint="e.g. resources: {nodes: 4}",
            )
        else:
            _put(mid, spec, key, val, key)
    entrypoint = spec.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        raise ValidationError(
            f"member {mid!r}: missing entrypoint",
            details={"member": mid, "field": "entrypoint"},
            hint='Give the command to run, e.g. entrypoint: "python train.py".',
        )
    return DagMemberSpec(id=mid, spec=spec, depends_on=_edges(mid, entry.get("depends_on")))


def _flatten(
    mid: str, spec: dict[str, Any], parent: str, val: Mapping[Any, Any], rename: dict[str, str]
) -> None:
    for k, v in val.items():
        if not isinstance(k, str):
            raise ValidationError(
                f"member {mid!r}: field names in {parent} must be text",
                details={"member": mid, "field": parent},
                hint="Quote the key.",
            )
        _put(mid, spec, rename.get(k, k), v, f"{parent}.{k}")


def _put(mid: str, spec: dict[str, Any], key: str, val: Any, path: str) -> None:
    if key in spec and spec[key] != val:
        raise ValidationError(
            f"member {mid!r}: {key} is given twice with different values ({path})",
            details={"member": mid, "field": path},
            hint=f"Give {key} once, either flat or nested.",
        )
    spec[key] = val


def _edges(mid: str, raw: Any) -> tuple[Dependency, ...]:
    if raw is None:
        return ()
    hint = "Write depends_on: [{train: success}] or [{ref: train, condition: success}]."
    if not isinstance(raw, list):
        raise ValidationError(
            f"member {mid!r}: depends_on must be a list, not {_kind(raw)}",
            details={"member": mid, "field": "depends_on"},
            hint=hint,
        )
    edges = []
    for item in raw:
        if isinstance(item, Mapping) and ("ref" in item or "ref_id" in item):
            ref, cond = item.get("ref", item.get("ref_id")), item.get("condition")
            if cond is None:
                raise ValidationError(
                    f"member {mid!r}: dependency on {ref!r} has no condition",
                    details={"member": mid, "field": "depends_on.condition"},
                    hint=hint,
                )
        elif isinstance(item, Mapping) and len(item) == 1:
            ((ref, cond),) = item.items()
        else:
            raise ValidationError(
                f"member {mid!r}: cannot read dependency {item!r}"[:300],
                details={"member": mid, "field": "depends_on"},
                hint=hint,
            )
        if isinstance(ref, bool) or not isinstance(ref, str | int) or str(ref) == "":
            raise ValidationError(
                f"member {mid!r}: a dependency has no ref",
                details={"member": mid, "field": "depends_on.ref"},
                hint=hint,
            )
        if not isinstance(cond, str):
            cond = repr(cond)
        try:
            c = DependencyCondition.parse(cond)
        except ValidationError as e:
            raise ValidationError(
                f"member {mid!r}: {e.message} on dependency {str(ref)!r}",
                details={"member": mid, "field": "depends_on.condition", **e.details},
                hint=e.hint,
            ) from None
        edges.append(Dependency(ref=str(ref), condition=c.value))
    return tuple(edges)


def _kind(x: Any) -> str:
    if x is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "text", bool: "true/false"}.get(
        type(x), f"a {type(x).__name__}"
    )
