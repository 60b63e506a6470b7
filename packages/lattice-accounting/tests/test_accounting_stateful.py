"""The ledger invariant, as a hypothesis state machine against the real ledger.

Any sequence of top-ups, transfers, reservations (and repeated ones), charges, charge
passes, releases, cancellations and finalizations (with refunds) keeps every journal
balanced, no account but ``system`` below zero, every balance equal to the sum of its
ledger rows, the ledger equal to a plain-Python model of the same operations, and, per
tenant, available + in projects + reserved + spent equal to what was topped up.
Refused operations write nothing. Runs on SQLite, and a shorter version on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Coroutine
from decimal import Decimal as D
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from lattice_accounting import accounts as acc
from lattice_accounting.errors import InsufficientFunds
from lattice_accounting.ledger import ChargeItem, Ledger
from lattice_accounting.settle import settle
from lattice_common.errors import ValidationError
from ledger_backends import Clock, fresh_url

amounts = st.decimals(min_value=D("0.01"), max_value=D(60), places=2)
# reservations smaller than transfers, so projects hold several at once
small = st.decimals(min_value=D("0.01"), max_value=D(15), places=2)
PROJECTS = ("default", "ml")


def make_machine(loop: asyncio.AbstractEventLoop, led: Ledger) -> type[RuleBasedStateMachine]:
    def run(coro: Coroutine[Any, Any, Any]) -> Any:
        return loop.run_until_complete(coro)

    clock: Clock = led.clock  # type: ignore[assignment]

    class LedgerMachine(RuleBasedStateMachine):
        @initialize()
        def setup(self) -> None:
            tag = uuid.uuid4().hex[:8]
            self.tenants = [f"t{tag}a", f"t{tag}b"]
            self.bal: dict[str, D] = {}
            self.topped = {t: D(0) for t in self.tenants}
            self.spent = {(t, p): D(0) for t in self.tenants for p in PROJECTS}
            self.allocs: dict[str, dict[str, Any]] = {}
            self.ids = itertools.count()
            for t in self.tenants:
                run(led.open_project(t, "ml"))
                run(led.open_tenant(t))
                self.bal[acc.tenant_account(t)] = D(0)
                for p in PROJECTS:
                    self.bal[acc.project_account(t, p)] = D(0)
                    self.bal[acc.reservation_account(t, p)] = D(0)
                # funded from the start, so reservations (and their races) happen early
                run(led.topup(t, D(200)))
                self.topped[t] = D(200)
                self.bal[acc.tenant_account(t)] = D(100)
                for p in PROJECTS:
                    run(led.transfer(t, p, D(50)))
                    self.bal[acc.project_account(t, p)] = D(50)

        # --- helpers ---------------------------------------------------------------
        def open_ids(self) -> list[str]:
            return sorted(a for a, v in self.allocs.items() if v["state"] == "reserved")

        def apply(self, aid: str, s: Any, up_to: Any, finished: bool) -> None:
            a = self.allocs[aid]
            proj = acc.project_account(a["t"], a["p"])
            rsv = acc.reservation_account(a["t"], a["p"])
            self.bal[rsv] -= s.from_reservation + s.release
            self.bal[proj] += s.release + s.refund - s.from_project
            a["held"] -= s.from_reservation + s.release
            a["charged"] += s.charged - s.refund
            self.spent[(a["t"], a["p"])] += s.charged - s.refund
            a["up_to"] = up_to
            if finished:
                a["state"] = "finalized"

        # --- rules -----------------------------------------------------------------
        @rule(t=st.integers(0, 1), amount=amounts)
        def topup(self, t: int, amount: D) -> None:
            tenant = self.tenants[t]
            run(led.topup(tenant, amount))
            self.bal[acc.tenant_account(tenant)] += amount
            self.topped[tenant] += amount

        @rule(t=st.integers(0, 1), p=st.sampled_from(PROJECTS), amount=amounts)
        def transfer(self, t: int, p: str, amount: D) -> None:
            tenant = self.tenants[t]
            src, dst = acc.tenant_account(tenant), acc.project_account(tenant, p)
            if self.bal[src] >= amount:
                run(led.transfer(tenant, p, amount))
                self.bal[src] -= amount
                self.bal[dst] += amount
            else:
                with pytest.raises(InsufficientFunds):
                    run(led.transfer(tenant, p, amount))

        @rule(t=st.integers(0, 1), p=st.sampled_from(PROJECTS), amount=small)
        def reserve(self, t: int, p: str, amount: D) -> None:
            tenant = self.tenants[t]
            aid = f"{tenant}-{next(self.ids)}"
            proj = acc.project_account(tenant, p)
            if self.bal[proj] >= amount:
                r = run(led.reserve(aid, f"{tenant}/{p}", amount, user=f"u{t}", vcluster=p))
                assert not r.existing
                self.bal[proj] -= amount
                self.bal[acc.reservation_account(tenant, p)] += amount
                self.allocs[aid] = {
                    "t": tenant, "p": p, "held": amount, "charged": D(0), "state": "reserved",
                    "up_to": None,
                }  # fmt: skip
            else:
                with pytest.raises(InsufficientFunds):
                    run(led.reserve(aid, f"{tenant}/{p}", amount))

        @precondition(lambda self: self.allocs)
        @rule(data=st.data())
        def reserve_again(self, data: st.DataObject) -> None:
            aid = data.draw(st.sampled_from(sorted(self.allocs)))
            a = self.allocs[aid]
            r = run(led.reserve(aid, f"{a['t']}/{a['p']}", D("1")))
            assert r.existing and r.held == a["held"] and r.state == a["state"]

        @precondition(lambda self: self.open_ids())
        @rule(data=st.data(), amount=st.decimals(min_value=0, max_value=D(40), places=2))
        def charge(self, data: st.DataObject, amount: D) -> None:
            aid = data.draw(st.sampled_from(self.open_ids()))
            a = self.allocs[aid]
            up_to = clock.advance(minutes=1)
            res = run(led.charge(aid, amount, up_to))
            proj = acc.project_account(a["t"], a["p"])
            s = settle(
                held=a["held"], available=self.bal[proj], charged=a["charged"],
                total=a["charged"] + amount, finished=False,
            )  # fmt: skip
            assert (res.charged, res.exhausted) == (s.charged, s.exhausted)
            self.apply(aid, s, up_to, False)

        @precondition(lambda self: self.open_ids())
        @rule(data=st.data())
        def charge_pass(self, data: st.DataObject) -> None:
            ids = data.draw(st.lists(st.sampled_from(self.open_ids()), unique=True, min_size=1))
            costs = data.draw(
                st.lists(
                    st.decimals(min_value=0, max_value=D(60), places=2),
                    min_size=len(ids),
                    max_size=len(ids),
                )
            )
            up_to = clock.advance(minutes=1)
            items = [ChargeItem(a, c, up_to) for a, c in zip(ids, costs, strict=True)]
            got = {r.allocation_id: r for r in run(led.charge_many(items))}
            for it in sorted(items, key=lambda i: i.allocation_id):
                a = self.allocs[it.allocation_id]
                proj = acc.project_account(a["t"], a["p"])
                s = settle(
                    held=a["held"], available=self.bal[proj], charged=a["charged"],
                    total=a["charged"] + it.amount, finished=False,
                )  # fmt: skip
                r = got[it.allocation_id]
                assert (r.charged, r.exhausted, r.from_project) == (
                    s.charged, s.exhausted, s.from_project,
                )  # fmt: skip
                self.apply(it.allocation_id, s, up_to, False)

        def crowded(self) -> list[tuple[str, str]]:
            """Projects with several open allocations (they compete in a charge pass)."""
            count: dict[tuple[str, str], int] = {}
            for a in self.open_ids():
                key = (self.allocs[a]["t"], self.allocs[a]["p"])
                count[key] = count.get(key, 0) + 1
            return sorted(k for k, n in count.items() if n >= 2)

        @precondition(lambda self: self.crowded())
        @rule(data=st.data())
        def pass_overdrawing_a_project(self, data: st.DataObject) -> None:
            # every allocation of one project wants all of the project's funds at once
            t, p = data.draw(st.sampled_from(self.crowded()))
            ids = [
                a for a in self.open_ids() if (self.allocs[a]["t"], self.allocs[a]["p"]) == (t, p)
            ]
            up_to = clock.advance(minutes=1)
            avail = self.bal[acc.project_account(t, p)]
            items = [ChargeItem(a, self.allocs[a]["held"] + avail + 1, up_to) for a in ids]
            got = {r.allocation_id: r for r in run(led.charge_many(items))}
            for it in items:
                a = self.allocs[it.allocation_id]
                s = settle(
                    held=a["held"], available=self.bal[acc.project_account(t, p)],
                    charged=a["charged"], total=a["charged"] + it.amount, finished=False,
                )  # fmt: skip
                assert got[it.allocation_id].charged == s.charged
                assert got[it.allocation_id].exhausted
                self.apply(it.allocation_id, s, up_to, False)

        @precondition(lambda self: self.open_ids())
        @rule(data=st.data(), cancelled=st.booleans())
        def release(self, data: st.DataObject, cancelled: bool) -> None:
            aid = data.draw(st.sampled_from(self.open_ids()))
            a = self.allocs[aid]
            assert run(led.release(aid, cancelled=cancelled)) == a["held"]
            self.bal[acc.reservation_account(a["t"], a["p"])] -= a["held"]
            self.bal[acc.project_account(a["t"], a["p"])] += a["held"]
            a["held"] = D(0)
            a["state"] = "cancelled" if cancelled else "released"

        @precondition(lambda self: self.open_ids())
        @rule(
            data=st.data(),
            total=st.decimals(min_value=0, max_value=D(80), places=2),
            finished=st.booleans(),
        )
        def finalize(self, data: st.DataObject, total: D, finished: bool) -> None:
            aid = data.draw(st.sampled_from(self.open_ids()))
            a = self.allocs[aid]
            at = clock.advance(minutes=1)
            res = run(led.finalize(aid, total, finished=finished, at=at))
            proj = acc.project_account(a["t"], a["p"])
            s = settle(
                held=a["held"], available=self.bal[proj], charged=a["charged"],
                total=total, finished=finished,
            )  # fmt: skip
            assert (res.case, res.charged, res.refund, res.released) == (
                s.case, s.charged, s.refund, s.release,
            )  # fmt: skip
            self.apply(aid, s, at, finished)

        @rule(t=st.integers(0, 1), bad=st.sampled_from(["-1", "0", "abc", "1e400", "0.0000001"]))
        def bad_topup(self, t: int, bad: str) -> None:
            with pytest.raises(ValidationError):
                run(led.topup(self.tenants[t], bad))

        # --- invariants ------------------------------------------------------------
        @invariant()
        def books_balance(self) -> None:
            if not hasattr(self, "tenants"):
                return
            assert run(led.verify()) == []
            for t in self.tenants:
                b = run(led.balance(t))
                assert b.available == self.bal[acc.tenant_account(t)]
                assert b.available >= 0 and b.allocated >= 0 and b.reserved >= 0
                assert b.available + b.allocated + b.reserved + b.spent == self.topped[t]
                for p in PROJECTS:
                    pb = run(led.balance(f"{t}/{p}"))
                    assert pb.available == self.bal[acc.project_account(t, p)]
                    assert pb.reserved == self.bal[acc.reservation_account(t, p)]
                    assert pb.spent == self.spent[(t, p)]

    return LedgerMachine


def _run(url: str, examples: int, steps: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        led = loop.run_until_complete(Ledger.open(url))
        led.clock = Clock()
        try:
            run_state_machine_as_test(
                make_machine(loop, led),
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=steps,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                ),
            )
        finally:
            loop.run_until_complete(led.close())
    finally:
        loop.close()


def test_ledger_invariant_sqlite(tmp_path, request: pytest.FixtureRequest) -> None:
    _run(fresh_url("sqlite", tmp_path, request), examples=15, steps=25)


def test_ledger_invariant_postgres(tmp_path, request: pytest.FixtureRequest) -> None:
    _run(fresh_url("postgres", tmp_path, request), examples=5, steps=15)
