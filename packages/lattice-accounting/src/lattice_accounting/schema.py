"""The ledger's tables (SQLAlchemy Core), the same shape the Alembic migrations create.

Money columns are exact integers of micro-units (:class:`Money`, see
:mod:`lattice_accounting.money`); times are UTC (:class:`UtcDateTime`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
)
from sqlalchemy.types import TypeDecorator

from lattice_accounting.money import from_micros, to_micros

metadata = MetaData()

# SQLite only auto-increments an INTEGER PRIMARY KEY
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Money(TypeDecorator[Decimal]):
    """``Decimal`` in Python, BIGINT micro-units in SQL (exact on every backend)."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> int | None:
        if value is None:
            return None
        return to_micros(value if isinstance(value, Decimal) else Decimal(str(value)))

    def process_result_value(self, value: Any, dialect: Any) -> Decimal | None:
        return None if value is None else from_micros(value)


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in Python on both backends (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


accounts = Table(
    "accounts",
    metadata,
    Column("name", String(160), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("tenant", String(64)),
    Column("project", String(64)),
    Column("balance", Money(), nullable=False, default=0),
    Column("enabled", Boolean(), nullable=False, default=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Index("ix_accounts_tenant", "tenant"),
)

journal = Table(
    "journal",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("at", UtcDateTime(), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("allocation_id", String(64)),
    Column("tenant", String(64)),
    Column("project", String(64)),
    Column("user", String(128)),
    Column("vcluster", String(64)),
    Column("amount", Money(), nullable=False),
    Column("who", String(128)),
    Column("price_id", Integer()),
    Column("batch", String(36)),
    Column("properties", JSON()),
    Index("ix_journal_allocation", "allocation_id"),
    Index("ix_journal_tenant_at", "tenant", "at"),
    Index("ix_journal_batch", "batch"),
)

# no foreign keys: see the migration; Ledger.verify() reports orphan rows
ledger = Table(
    "ledger",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("journal_id", BigInteger(), nullable=False),
    Column("account", String(160), nullable=False),
    Column("amount", Money(), nullable=False),
    Index("ix_ledger_journal", "journal_id"),
    Index("ix_ledger_account", "account"),
)

reservations = Table(
    "reservations",
    metadata,
    Column("allocation_id", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("project", String(64), nullable=False),
    Column("user", String(128)),
    Column("vcluster", String(64)),
    # reserved at first; held = what is still in the reservation account for it
    Column("amount", Money(), nullable=False),
    Column("held", Money(), nullable=False),
    Column("charged", Money(), nullable=False, default=0),
    Column("state", String(16), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("started_at", UtcDateTime()),
    Column("last_alive_at", UtcDateTime()),
    Column("last_charged_at", UtcDateTime()),
    Column("finished_at", UtcDateTime()),
    Index("ix_reservations_state", "state"),
    Index("ix_reservations_project", "tenant", "project"),
    postgresql_with={"fillfactor": 70},
)

prices = Table(
    "prices",
    metadata,
    Column("id", Integer(), primary_key=True, autoincrement=True),
    Column("vcluster", String(64), nullable=False),
    Column("resource", String(16), nullable=False),
    Column("gpu_type", String(64), nullable=False, default=""),
    Column("tenant", String(64), nullable=False, default=""),
    Column("rate", Money(), nullable=False),
    Column("multiplier", Money(), nullable=False),
    Column("fixed_cost", Money(), nullable=False),
    Column("valid_from", UtcDateTime(), nullable=False),
    Column("valid_until", UtcDateTime()),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("who", String(128)),
    Index("ix_prices_key", "vcluster", "resource", "gpu_type", "tenant"),
)

# the service's durable position in the quorum's history: the charger stores the Raft
# revision it processed in the same transaction as the ledger rows it wrote for it
cursor = Table(
    "cursor",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("revision", BigInteger(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
)
