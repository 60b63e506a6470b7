"""Steps for features/audit.feature: the audit log on a real 1-node cluster of its own.

The administrator acts through the `lattice` CLI (the cluster runs without
authentication, so the CLI's $USER is the identity the log records). The cluster's
public key is the public half of the development signing key the member keeps in its
data dir (what `openssl pkey -in KEY -pubout` prints for a configured key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from lattice_acceptance.world import World as ClusterWorld
from lattice_acceptance.world import fresh_world, show
from lattice_common import audit
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("audit.feature")

ADMIN = "ops"


@dataclass
class World(ClusterWorld):
    quota_entry: int = 0  # seq of the quota change's entry (the one the scenario edits)


world = fresh_world(World)  # a cluster of its own per scenario


def _entries(world: World, *args: str) -> list[dict[str, Any]]:
    r = world.cli("admin", "audit", "query", *args, "-o", "json", user=ADMIN)
    return json.loads(r.stdout)


@given(parsers.parse("a Lattice cluster with {count:d} node"))
def lattice_cluster(world: World, count: int) -> None:
    world.start_cluster(count)
    world.node = world.node_ids()[0]


@when(parsers.parse('the administrator "{user}" drains the node for "{reason}"'))
def drain(world: World, user: str, reason: str) -> None:
    r = world.cli("node", "drain", world.node, "--reason", reason, user=user)
    assert world.node in r.stdout, show(r)


@when(parsers.parse('the administrator "{user}" sets the max nodes of tenant "{tenant}" to {n:d}'))
def set_quota(world: World, user: str, tenant: str, n: int) -> None:
    r = world.cli(
        "admin", "tenant", "set-quota", "--name", tenant, "--max-nodes", str(n), user=user
    )
    assert r.stdout.strip() == f"Updated tenant {tenant}", show(r)


@then(
    parsers.parse('lattice admin audit query shows that "{user}" drained the node for "{reason}"')
)
def drain_recorded(world: World, user: str, reason: str) -> None:
    (e,) = _entries(world, "--action", "node.drain")
    assert (e["actor"], e["target"], e["details"]["reason"]) == (user, f"node:{world.node}", reason)
    rows = world.cli("admin", "audit", "query", "--user", user, user=ADMIN).stdout.splitlines()
    assert any(r.split()[2:5] == [user, "node.drain", f"node:{world.node}"] for r in rows), rows


@then(
    parsers.parse(
        'lattice admin audit query shows that "{user}" changed tenant "{tenant}" to max_nodes {n:d}'
    )
)
def quota_recorded(world: World, user: str, tenant: str, n: int) -> None:
    (e,) = _entries(world, "--action", "tenant.update")
    assert (e["actor"], e["target"], e["details"]) == (
        user,
        f"tenant:{tenant}",
        {"max_nodes": str(n)},
    )
    world.quota_entry = e["seq"]


@when("the administrator exports the audit log to a file")
def export(world: World) -> None:
    r = world.cli("admin", "audit", "export", "--to", "audit.jsonl", user=ADMIN)
    assert r.stdout.startswith("Exported "), show(r)
    member = world.cluster.cluster.members[0]
    key = audit.load_private_key((member.dir / "raft" / "audit_signing_key.pem").read_bytes())
    (world.workdir / "audit-public.pem").write_text(audit.public_key_pem(key))


def _verify(world: World, ok: bool) -> Any:
    return world.cli(
        "admin",
        "audit",
        "verify",
        "audit.jsonl",
        "--public-key",
        "audit-public.pem",
        user=ADMIN,
        ok=ok,
    )


@then("lattice admin audit verify accepts the file with the cluster's public key")
def verify_ok(world: World) -> None:
    r = _verify(world, ok=True)
    assert r.stdout.startswith("OK: audit.jsonl: "), show(r)


@when("one byte of the quota change's entry in the file is edited")
def edit_byte(world: World) -> None:
    path = world.workdir / "audit.jsonl"
    data = path.read_bytes()
    edited = data.replace(b'"max_nodes":"4"', b'"max_nodes":"9"')
    assert sum(a != b for a, b in zip(data, edited, strict=True)) == 1
    path.write_bytes(edited)


@then("lattice admin audit verify rejects the file, naming the quota change's entry")
def verify_fails(world: World) -> None:
    r = _verify(world, ok=False)
    assert r.returncode == 1, show(r)
    assert r.stderr.startswith(
        f"Error: entry {world.quota_entry}: hash does not match its contents (edited?)"
    ), show(r)
