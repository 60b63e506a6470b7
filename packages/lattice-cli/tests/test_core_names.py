"""The CLI's spelled-out copies of core names stay equal to the originals.

The CLI keeps its own lists of weight names, enum values and state names because
importing ``lattice_common.types`` (msgspec) costs ~80 ms at every start. These tests
import the originals and fail as soon as a copy drifts, so the copies are never a second
source of truth. Error rendering is not copied at all: every caller uses
``lattice_common.error_text.render_error``; the last tests check that.
"""

from __future__ import annotations

import pytest
from lattice_cli import config, output
from lattice_cli.commands.admin.vcluster import WEIGHTS, SchedulerType
from lattice_cli.commands.submit import RequeuePolicy
from lattice_cli.context import OutputFormat
from lattice_cli.main import app, load_commands
from lattice_common import types
from typer.main import get_command
from typer.testing import CliRunner

load_commands()


def _values(enum_cls: type) -> list[str]:
    return [member.value for member in enum_cls]


def _command(*path: str):
    cmd = get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def test_weight_names_are_cost_weights_fields():
    assert list(WEIGHTS) == list(types.CostWeights.__struct_fields__)


def test_set_weights_has_one_flag_per_weight():
    flags = {
        opt
        for param in _command("admin", "vcluster", "set-weights").params
        if param.param_type_name == "option" and not param.hidden
        for opt in param.opts
    }
    weight_flags = flags - {"--name", "--weight", "--output", "-o", "--help", "-h"}
    assert weight_flags == {"--" + w.replace("_", "-") for w in WEIGHTS}


def test_checkpoint_is_a_hidden_alias_of_checkpoint_efficiency(api):
    runner = CliRunner()

    def set_weights(*flags: str):
        args = ["admin", "vcluster", "set-weights", "--name", "hpc-batch", *flags]
        return runner.invoke(app, args, catch_exceptions=False)

    created = runner.invoke(app, ["admin", "vcluster", "create", "--name", "hpc-batch"])
    assert created.exit_code == 0, created.stderr
    for flag in ("--checkpoint=0.25", "--checkpoint-efficiency=0.25"):
        assert set_weights(flag).exit_code == 0
        assert api.last("PATCH")["json"] == {"weights": {"checkpoint_efficiency": 0.25}}
    both = set_weights("--checkpoint=0.1", "--checkpoint-efficiency=0.2")
    assert both.exit_code == 2 and "two different values" in both.stderr
    hidden = [p.opts for p in _command("admin", "vcluster", "set-weights").params if p.hidden]
    assert hidden == [["--checkpoint"]]  # accepted, not shown in --help


@pytest.mark.parametrize(
    ("copy", "original"),
    [
        (RequeuePolicy, types.RequeuePolicy),
        (SchedulerType, types.SchedulerType),
    ],
)
def test_enum_copies_match_the_core(copy: type, original: type):
    assert _values(copy) == _values(original)


def test_submit_option_names_match_the_core():
    from lattice_cli import submit_options as directives

    assert list(directives.REQUEUE_POLICIES) == _values(types.RequeuePolicy)
    assert set(directives.CONSTRAINT_KEYS) == set(types.Constraints.__struct_fields__)
    assert {k for k in directives.CONSTRAINT_KEYS if k in directives._INT_KEYS} == {
        name
        for name in types.Constraints.__struct_fields__
        if types.Constraints.__annotations__[name] in ("int", int)
    }


def test_state_names_match_the_core():
    assert list(output.ALLOCATION_STATES) == _values(types.AllocationState)
    assert list(output.NODE_STATES) == _values(types.NodeState)
    assert set(output.HOLDING_STATES) == {s.value for s in types.HOLDING_STATES}
    known = set(output.ALLOCATION_STATES) | set(output.NODE_STATES)
    assert set(output._STATE_COLORS) <= known


def test_sdk_terminal_states_match_the_core():
    from lattice_sdk import TERMINAL_STATES

    assert set(TERMINAL_STATES) == {s.value for s in types.TERMINAL_STATES}


def test_output_format_is_one_list_in_the_cli():
    assert tuple(_values(OutputFormat)) == config.OUTPUT_FORMATS


# --------------------------------------------------------------------------- error rendering

DETAILS = {"nodes_requested": 8, "max_nodes": 4, "GPU_type": "GH200"}


def test_cli_sdk_and_core_render_errors_alike(capsys):
    import typer
    from lattice_cli.context import fail
    from lattice_common.error_text import render_error
    from lattice_common.errors import QuotaExceeded
    from lattice_sdk import LatticeError as SdkError

    expected = render_error("over quota", DETAILS, "Ask for fewer nodes.")
    assert expected.splitlines() == [
        "Error: over quota",
        "  Nodes requested: 8",
        "  Max nodes: 4",
        "  GPU type: GH200",
        "Hint: Ask for fewer nodes.",
    ]
    assert SdkError("over quota", details=DETAILS, hint="Ask for fewer nodes.").render() == expected
    assert QuotaExceeded("over quota", details=DETAILS, hint="Ask for fewer nodes.").render() == (
        expected
    )
    with pytest.raises(typer.Exit):
        fail("over quota", details=DETAILS, hint="Ask for fewer nodes.")
    assert capsys.readouterr().err == expected + "\n"
    assert render_error("plain") == "Error: plain"
