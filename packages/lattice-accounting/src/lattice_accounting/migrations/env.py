"""Alembic environment: runs on the connection :func:`lattice_accounting.db.migrate`
hands over (async engines run Alembic's synchronous code through ``run_sync``)."""

from __future__ import annotations

from alembic import context

from lattice_accounting.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run the accounting migrations with lattice_accounting.db.migrate(url)")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
