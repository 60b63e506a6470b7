"""One module per ``lattice`` command or command group.

Each module has ``register(app)``, which adds its command (or its sub-app) to the root
typer app. :mod:`lattice_cli.main` maps each command word to its module and imports only
the module named on the command line, so ``lattice status`` does not pay for ``admin``
or ``dev``. Modules import :mod:`lattice_cli.context` for the shared state and printing,
never :mod:`lattice_cli.main`.
"""
