"""``lattice admin``: administrative command groups (system-admin role).

Each group is its own module (tenant, vcluster, raft, audit, ca, backup, price,
accounting); a new group is one module here
and one ``add_typer`` line below. ``lattice admin ...`` imports all of them: only the
root word is looked up lazily.
"""

from __future__ import annotations

import typer

from lattice_cli.commands.admin.accounting import accounting_app
from lattice_cli.commands.admin.audit import audit_app
from lattice_cli.commands.admin.backup import backup_app
from lattice_cli.commands.admin.ca import ca_app
from lattice_cli.commands.admin.price import price_app
from lattice_cli.commands.admin.raft import raft_app
from lattice_cli.commands.admin.tenant import tenant_app
from lattice_cli.commands.admin.vcluster import vcluster_app

admin_app = typer.Typer(help="Administrative commands (system-admin role).", no_args_is_help=True)
admin_app.add_typer(tenant_app, name="tenant")
admin_app.add_typer(vcluster_app, name="vcluster")
admin_app.add_typer(raft_app, name="raft")
admin_app.add_typer(audit_app, name="audit")
admin_app.add_typer(ca_app, name="ca")
admin_app.add_typer(backup_app, name="backup")
admin_app.add_typer(price_app, name="price")
admin_app.add_typer(accounting_app, name="accounting")


def register(app: typer.Typer) -> None:
    app.add_typer(admin_app, name="admin")
