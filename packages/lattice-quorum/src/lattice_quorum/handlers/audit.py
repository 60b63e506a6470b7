"""The audit log (spec: Security, tamper-evident audit): ``AppendAudit`` and the outbox.

The state machine never signs: apply must be deterministic and no member's private key
belongs on its path. The API signs (lattice_api.audit) and proposes ``AppendAudit``
with entries that continue the log; here they are checked (seq and prev_hash continue
the last entry, each hash matches its contents, each signature verifies with the key
the command names) and appended. A proposal that lost a race with another one is
rejected as stale (StaleRevision, with the log's last seq) and the API signs again.

Some events happen inside the state machine, where no request and no key are at hand
(a sensitive allocation's nodes claimed at assignment, a sensitive allocation ending
however it ends): :func:`note` puts them in ``audit_outbox``, deterministically, and
the leader's API signs them into the log, removing them in the same command
(``outbox_ids``). They survive a crash or a leader change because the outbox is
replicated state.
"""

from __future__ import annotations

from lattice_common import audit
from lattice_common import commands as c
from lattice_common.errors import StaleRevision, ValidationError

from lattice_quorum.global_state import Changes, GlobalState


def note(
    state: GlobalState,
    *,
    now: float,
    actor: str,
    action: str,
    target: str = "",
    tenant: str = "",
    details: dict[str, str] | None = None,
) -> None:
    """Queue an event for the log (the caller's handler has validated and is mutating)."""
    state.audit_outbox_seq += 1
    state.audit_outbox.append(
        audit.AuditEvent(
            time=now,
            actor=actor,
            action=action,
            target=target,
            tenant=tenant,
            details=dict(details or {}),
            id=state.audit_outbox_seq,
        )
    )


def tail(state: GlobalState) -> tuple[int, str]:
    """(seq, hash) of the last entry; (0, GENESIS) for an empty log."""
    if not state.audit_log:
        return 0, audit.GENESIS
    last = state.audit_log[-1]
    return last.seq, last.hash


def append_audit(state: GlobalState, cmd: c.AppendAudit, ch: Changes) -> c.CommandResult:
    if not cmd.entries:
        raise ValidationError("no audit entries to append")
    seq, prev_hash = tail(state)
    first = cmd.entries[0]
    if first.seq != seq + 1 or first.prev_hash != prev_hash:
        raise StaleRevision(
            f"the audit log ends at entry {seq}; these entries start at {first.seq}",
            details={"last_seq": seq},
            hint="Sign the entries again after the log's last entry.",
        )
    waiting = {ev.id for ev in state.audit_outbox}
    gone = [i for i in cmd.outbox_ids if i not in waiting]
    if gone:
        raise StaleRevision(
            f"audit outbox events {gone} are already recorded", details={"last_seq": seq}
        )
    try:
        key = audit.load_public_key(cmd.public_key)
    except ValueError as e:
        raise ValidationError(f"audit entries: {e}") from None
    kid = audit.key_id(key)
    checked = audit.verify_chain(cmd.entries, {kid: key}, first_seq=seq + 1, prev_hash=prev_hash)
    if not checked.ok:
        raise ValidationError(f"audit entries rejected: {checked.message}")
    state.revision += 1  # common.bump; common imports this module
    state.audit_log.extend(cmd.entries)
    state.audit_keys.setdefault(kid, cmd.public_key)
    if cmd.outbox_ids:
        done = set(cmd.outbox_ids)
        state.audit_outbox = [ev for ev in state.audit_outbox if ev.id not in done]
    return c.CommandResult(revision=state.revision)


__all__ = ["append_audit", "note", "tail"]
