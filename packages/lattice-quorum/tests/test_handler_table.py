"""The handler table of ``state.apply``: one handler per command, named after the
command's tag, so a new command goes to an obvious place and cannot be forgotten."""

from __future__ import annotations

import pickle

from lattice_common import commands as c
from lattice_quorum import state
from lattice_quorum.global_state import GlobalState as MovedGlobalState
from lattice_quorum.state import GlobalState


def _command_types() -> set[type[c.Command]]:
    found: set[type[c.Command]] = set()
    todo = [c.Command]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found - {c.Batch}  # apply unpacks a Batch itself


def test_every_command_has_exactly_one_handler() -> None:
    missing = sorted(t.__name__ for t in _command_types() - set(state._HANDLERS))
    assert not missing, f"commands without a handler in state._HANDLERS: {missing}"


def test_each_handler_is_named_after_its_commands_tag() -> None:
    wrong = {
        t.__name__: h.__name__
        for t, h in state._HANDLERS.items()
        if h.__name__ != t.__struct_config__.tag
    }
    assert not wrong


def test_handlers_live_in_the_domain_modules() -> None:
    modules = {h.__module__ for h in state._HANDLERS.values()}
    assert modules == {
        "lattice_quorum.handlers.nodes",
        "lattice_quorum.handlers.allocations",
        "lattice_quorum.handlers.assignment",
        "lattice_quorum.handlers.handoff",
        "lattice_quorum.handlers.checkpoints",
        "lattice_quorum.handlers.tenancy",
        "lattice_quorum.handlers.pki",
        "lattice_quorum.handlers.dags",
        "lattice_quorum.handlers.sessions",
        "lattice_quorum.handlers.staging",
        "lattice_quorum.handlers.audit",
        "lattice_quorum.handlers.backup",
        "lattice_quorum.handlers.retention",
    }


def test_a_dump_naming_the_old_module_still_loads() -> None:
    # pysyncobj pickles the state into its full dump; dumps written before the handlers
    # moved name lattice_quorum.state.GlobalState
    assert GlobalState is MovedGlobalState
    raw = pickle.dumps(GlobalState(revision=7), protocol=0)
    old = raw.replace(b"lattice_quorum.global_state", b"lattice_quorum.state")
    assert old != raw
    loaded = pickle.loads(old)
    assert isinstance(loaded, GlobalState) and loaded.revision == 7
