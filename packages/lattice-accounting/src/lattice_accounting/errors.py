"""The ledger's own error: a debit that would take an account below zero."""

from __future__ import annotations

from decimal import Decimal

from lattice_common.errors import FailedPrecondition

from lattice_accounting.money import fmt


class InsufficientFunds(FailedPrecondition):
    """Refused: nothing was written."""

    def __init__(self, account: str, available: Decimal, requested: Decimal, hint: str = ""):
        super().__init__(
            f"insufficient funds in {account}",
            details={"Account": account, "Available": fmt(available), "Requested": fmt(requested)},
            hint=hint or "Top up the tenant and transfer funds to the project, or ask for less.",
        )
        self.account = account
        self.available = available
        self.requested = requested
