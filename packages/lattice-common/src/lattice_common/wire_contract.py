"""The wire contract's compatibility rule: between one committed contract and the next,
changes are additive only (spec: Upgrades and Rollouts — mixed versions talk to each
other during a rolling upgrade).

A contract is plain data read from a compiled ``FileDescriptorSet`` of ``proto/``
(:func:`contract_of`): every message with its fields (name -> number, type, label,
message/enum type), every enum with its values, every service with its RPCs (request,
response, streaming). :func:`breaking_changes` lists what the new contract takes away or
changes from the old one — a message, field, enum value, service or RPC removed; a field
renumbered, retyped or relabelled; a number reused under another name; an RPC's types or
streaming changed. New messages, fields, values and RPCs are allowed.

``scripts/check-wire-contract`` compares ``proto/`` with the committed
``proto/contract.json`` (CI fails on any breaking change) and ``--update`` records the
current contract after an additive change.
"""

from __future__ import annotations

from typing import Any

__all__ = ["breaking_changes", "contract_of"]

Contract = dict[str, dict[str, Any]]


def contract_of(descriptor_set: bytes) -> Contract:
    """The contract of a serialized ``google.protobuf.FileDescriptorSet``."""
    from google.protobuf import descriptor_pb2

    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set)
    messages: dict[str, Any] = {}
    enums: dict[str, Any] = {}
    services: dict[str, Any] = {}

    def walk_enum(prefix: str, e: Any) -> None:
        enums[f"{prefix}.{e.name}"] = {v.name: v.number for v in e.value}

    def walk_message(prefix: str, m: Any) -> None:
        name = f"{prefix}.{m.name}"
        messages[name] = {
            f.name: [f.number, f.type, f.label, f.type_name.lstrip(".")] for f in m.field
        }
        for nested in m.nested_type:  # map<k, v> entries too: their types are the map's
            walk_message(name, nested)
        for e in m.enum_type:
            walk_enum(name, e)

    for f in fds.file:
        pkg = f.package
        for m in f.message_type:
            walk_message(pkg, m)
        for e in f.enum_type:
            walk_enum(pkg, e)
        for s in f.service:
            services[f"{pkg}.{s.name}"] = {
                r.name: [
                    r.input_type.lstrip("."),
                    r.output_type.lstrip("."),
                    r.client_streaming,
                    r.server_streaming,
                ]
                for r in s.method
            }
    return {"messages": messages, "enums": enums, "services": services}


def breaking_changes(old: Contract, new: Contract) -> list[str]:
    """What ``new`` breaks of ``old``, one sentence each, sorted (empty: compatible)."""
    out: list[str] = []
    old_m, new_m = old.get("messages", {}), new.get("messages", {})
    for msg, fields in old_m.items():
        if msg not in new_m:
            out.append(f"message {msg} was removed")
            continue
        now = new_m[msg]
        by_number = {spec[0]: name for name, spec in now.items()}
        for field, spec in fields.items():
            number = spec[0]
            if field not in now:
                taker = by_number.get(number)
                if taker is not None:
                    out.append(f"{msg}.{field} (= {number}) was renamed or replaced by {taker}")
                else:
                    out.append(f"{msg}.{field} (= {number}) was removed")
                continue
            cur = now[field]
            if cur[0] != number:
                out.append(f"{msg}.{field} was renumbered from {number} to {cur[0]}")
            elif list(cur[1:]) != list(spec[1:]):
                out.append(f"{msg}.{field} (= {number}) changed its type or label")
    old_e, new_e = old.get("enums", {}), new.get("enums", {})
    for enum, values in old_e.items():
        if enum not in new_e:
            out.append(f"enum {enum} was removed")
            continue
        for value, number in values.items():
            cur = new_e[enum].get(value)
            if cur is None:
                out.append(f"{enum}.{value} (= {number}) was removed")
            elif cur != number:
                out.append(f"{enum}.{value} was renumbered from {number} to {cur}")
    old_s, new_s = old.get("services", {}), new.get("services", {})
    for svc, rpcs in old_s.items():
        if svc not in new_s:
            out.append(f"service {svc} was removed")
            continue
        for rpc, sig in rpcs.items():
            cur = new_s[svc].get(rpc)
            if cur is None:
                out.append(f"rpc {svc}.{rpc} was removed")
            elif list(cur) != list(sig):
                out.append(f"rpc {svc}.{rpc} changed its request, response or streaming")
    return sorted(out)
