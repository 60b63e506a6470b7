"""The ledger: accounts, journal, ledger rows, reservations, prices, the durable cursor.

Revision ID: 0001_ledger
Revises:
Create Date: 2026-11-26
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Money = sa.BigInteger  # micro-units (lattice_accounting.money)
Time = sa.DateTime(timezone=True)


def upgrade() -> None:
    accounts = op.create_table(
        "accounts",
        sa.Column("name", sa.String(160), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(64)),
        sa.Column("project", sa.String(64)),
        sa.Column("balance", Money(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", Time, nullable=False),
    )
    op.create_index("ix_accounts_tenant", "accounts", ["tenant"])
    # the platform account exists from the start: the counterpart of every top-up
    op.bulk_insert(
        accounts,
        [
            {
                "name": "system",
                "kind": "system",
                "tenant": None,
                "project": None,
                "balance": 0,
                "enabled": True,
                "created_at": datetime.now(UTC).replace(tzinfo=None),
            }
        ],
    )
    op.create_table(
        "journal",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("at", Time, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("allocation_id", sa.String(64)),
        sa.Column("tenant", sa.String(64)),
        sa.Column("project", sa.String(64)),
        sa.Column("user", sa.String(128)),
        sa.Column("vcluster", sa.String(64)),
        sa.Column("amount", Money(), nullable=False),
        sa.Column("who", sa.String(128)),
        sa.Column("price_id", sa.Integer()),
        sa.Column("batch", sa.String(36)),
        sa.Column("properties", sa.JSON()),
    )
    op.create_index("ix_journal_allocation", "journal", ["allocation_id"])
    op.create_index("ix_journal_tenant_at", "journal", ["tenant", "at"])
    op.create_index("ix_journal_batch", "journal", ["batch"])
    # no foreign keys on the ledger rows: they are written only by the ledger, in bulk by
    # the charge pass, where per-row key checks would cost more than the pass itself;
    # Ledger.verify() reports orphans instead
    op.create_table(
        "ledger",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("journal_id", sa.BigInteger(), nullable=False),
        sa.Column("account", sa.String(160), nullable=False),
        sa.Column("amount", Money(), nullable=False),
    )
    op.create_index("ix_ledger_journal", "ledger", ["journal_id"])
    op.create_index("ix_ledger_account", "ledger", ["account"])
    op.create_table(
        "reservations",
        sa.Column("allocation_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("user", sa.String(128)),
        sa.Column("vcluster", sa.String(64)),
        sa.Column("amount", Money(), nullable=False),
        sa.Column("held", Money(), nullable=False),
        sa.Column("charged", Money(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", Time, nullable=False),
        sa.Column("started_at", Time),
        sa.Column("last_alive_at", Time),
        sa.Column("last_charged_at", Time),
        sa.Column("finished_at", Time),
        # room on each page for the charge pass's updates to stay HOT
        postgresql_with={"fillfactor": 70},
    )
    op.create_index("ix_reservations_state", "reservations", ["state"])
    op.create_index("ix_reservations_project", "reservations", ["tenant", "project"])
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("vcluster", sa.String(64), nullable=False),
        sa.Column("resource", sa.String(16), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("rate", Money(), nullable=False),
        sa.Column("multiplier", Money(), nullable=False),
        sa.Column("fixed_cost", Money(), nullable=False),
        sa.Column("valid_from", Time, nullable=False),
        sa.Column("valid_until", Time),
        sa.Column("created_at", Time, nullable=False),
        sa.Column("who", sa.String(128)),
    )
    op.create_index("ix_prices_key", "prices", ["vcluster", "resource", "gpu_type", "tenant"])
    op.create_table(
        "cursor",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", Time, nullable=False),
    )


def downgrade() -> None:
    for table in ("cursor", "prices", "reservations", "ledger", "journal", "accounts"):
        op.drop_table(table)
