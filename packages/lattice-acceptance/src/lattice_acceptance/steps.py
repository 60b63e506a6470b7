"""Step definitions that more than one feature uses, written once. A step module takes
them with ``from lattice_acceptance.steps import *``: pytest-bdd registers each step as a
module-level fixture with a generated name, which a star import carries over (so this
module has no ``__all__``)."""

from __future__ import annotations

from pytest_bdd import given, parsers

from lattice_acceptance.world import World, show


@given(parsers.parse('the administrator creates the tenant "{name}" with at most {count:d} node'))
def tenant_with_max_nodes(world: World, name: str, count: int) -> None:
    r = world.cli(
        "admin", "tenant", "create", "--name", name, "--max-nodes", str(count), user="admin"
    )
    assert r.stdout.strip() == f"Created tenant {name}", show(r)


@given(parsers.parse('a job "{name}" of tenant "{tenant}" that runs until released'))
def tenant_job_until_released(world: World, name: str, tenant: str) -> None:
    job = world.submit(
        name, directives=("--walltime=5m", f"--tenant={tenant}"), until_released=True
    )
    world.wait_running(job)
