"""Account names: the draft's accounts mapped to Lattice.

* ``system``: the platform; the counterpart of top-ups and the revenue of charges. The
  only account allowed below zero (it goes negative by what was topped up).
* ``tenant:<tenant>``: the draft's virtual lab; the target of top-ups.
* ``project:<tenant>/<project>``: a project's main account (allocations carry a project;
  every tenant has a ``default`` project).
* ``reservation:<tenant>/<project>``: the project's reservation account, holding the sum
  of its allocations' open reservations.
"""

from __future__ import annotations

import re

from lattice_common.errors import ValidationError

SYSTEM = "system"
DEFAULT_PROJECT = "default"
KINDS = ("system", "tenant", "project", "reservation")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValidationError(
            f"invalid {what} name",
            details={what.capitalize(): repr(value)},
            hint=f"A {what} name is 1-63 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit.",
        )
    return value


def tenant_account(tenant: str) -> str:
    return f"tenant:{check_name(tenant, 'tenant')}"


def project_account(tenant: str, project: str) -> str:
    return f"project:{check_name(tenant, 'tenant')}/{check_name(project, 'project')}"


def reservation_account(tenant: str, project: str) -> str:
    return f"reservation:{check_name(tenant, 'tenant')}/{check_name(project, 'project')}"


def split_project(ref: str) -> tuple[str, str]:
    """``"<tenant>/<project>"`` or ``"<tenant>"`` (its default project)."""
    tenant, _, project = ref.partition("/")
    return check_name(tenant, "tenant"), check_name(project or DEFAULT_PROJECT, "project")


def kind_of(account: str) -> str:
    return account.split(":", 1)[0]


def may_go_negative(account: str) -> bool:
    return account == SYSTEM
