"""``lattice account``, ``lattice admin price`` and the history's cost column: the pure
renderers (the commands themselves run against a real cluster in the repository's
tests/test_accounting_cluster.py and the acceptance suite's accounting.feature)."""

from __future__ import annotations

from lattice_cli.commands.account import balance_text, costs_text, transactions_text
from lattice_cli.commands.admin.price import prices_text
from lattice_cli.commands.history import with_costs


def test_a_project_balance_lists_available_reserved_and_spent() -> None:
    text = balance_text(
        {"account": "project:physics/ml", "tenant": "physics", "project": "ml",
         "available": "12.50", "reserved": "40.00", "spent": "7.25", "allocated": "0.00"}
    )  # fmt: skip
    assert text.splitlines() == [
        "Account:   project:physics/ml",
        "Available: 12.50",
        "Reserved:  40.00",
        "Spent:     7.25",
    ]
    tenant = balance_text({"tenant": "physics", "available": "1.00", "allocated": "9.00"})
    assert "In projects: 9.00" in tenant


def test_transactions_and_costs_are_tables_with_amounts_to_the_cent() -> None:
    text = transactions_text(
        {"transactions": [
            {"id": 7, "at": "2026-03-01T10:00:00.123+00:00", "kind": "charge",
             "amount": "0.021384", "tenant": "physics", "project": "ml",
             "allocation_id": "a1b2", "user": "alice"},
        ], "next_before_id": 6}
    )  # fmt: skip
    lines = text.splitlines()
    assert lines[0].split() == ["ID", "TIME", "KIND", "AMOUNT", "PROJECT", "ALLOCATION", "USER"]
    assert lines[1].split() == ["7", "2026-03-01", "10:00:00", "charge", "0.02", "physics/ml",
                                "a1b2", "alice"]  # fmt: skip
    assert "more" in lines[-1]
    assert transactions_text({"transactions": []}) == "no transactions"
    costs = costs_text({"by": "user", "costs": [{"key": "alice", "amount": "10.00"}]})
    assert costs.splitlines() == ["USER    COST", "alice  10.00"]


def test_prices_list_shows_the_gpu_type_and_the_window() -> None:
    text = prices_text(
        [{"id": 1, "vcluster": "gpu", "resource": "gpu_hour", "gpu_type": "a100", "rate": "2.5",
          "multiplier": "1", "fixed_cost": "0", "tenant": "", "valid_from":
          "2026-03-01T00:00:00+00:00", "valid_until": None}]
    )  # fmt: skip
    assert "gpu_hour (a100)" in text and "2026-03-01T00:00:00" in text


def test_history_gets_a_cost_column_only_with_accounting() -> None:
    table = "JobID Elapsed\n------ -------\na1 00:00:02\nb2 00:00:05"
    allocs = [{"id": "a1", "cost": "0.021384"}, {"id": "b2", "cost": None}]
    out = with_costs(table, allocs, {"a1": {}}).splitlines()
    assert out[0].endswith("Cost") and out[2].endswith("0.02") and out[3].endswith("-")
    assert with_costs(table, allocs, None) == table
