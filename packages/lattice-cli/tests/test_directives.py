"""Directive parsing: examples from the specification, Slurm translation, and fuzzing.

Scripts are user input, so the property tests feed arbitrary text and check that the
parser never fails with anything but DirectiveError (a ValueError).
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_cli.directives import (
    command_entrypoint,
    depends_on_of,
    iter_directives,
    parse_script,
    script_entrypoint,
    shebang_command,
)
from lattice_cli.submit_options import (
    DirectiveError,
    SubmitOptions,
    merge,
    parse_constraint,
    parse_constraints,
    parse_env,
    parse_gres,
    parse_mem_gb,
)

SPEC_SCRIPT = """#!/bin/bash
#LATTICE --nodes=64
#LATTICE --walltime=72h
#LATTICE --uenv=prgenv-gnu/24.11:v1
#LATTICE --vcluster=ml-training
#LATTICE --tenant=physics
#LATTICE --name=large-training-run

torchrun --nproc_per_node=4 train.py --data /scratch/dataset
"""


def test_spec_example_script():
    opts = parse_script(SPEC_SCRIPT)
    assert opts.nodes == 64
    assert opts.walltime == "72h"
    assert opts.uenv == "prgenv-gnu/24.11:v1"
    assert opts.vcluster == "ml-training"
    assert opts.tenant == "physics"
    assert opts.name == "large-training-run"
    assert opts.warnings == []


def test_uenv_and_view_directives():
    """``#LATTICE --view`` like ``--uenv``; ``#SBATCH --uenv/--view`` as the uenv Slurm
    plugin spells them (spec: Script Parsing); #LATTICE wins."""
    opts = parse_script(
        "#!/bin/bash\n"
        "#SBATCH --uenv=prgenv-gnu/24.7:v2\n"
        "#SBATCH --view=modules\n"
        "#LATTICE --view=default\n"
        "make\n"
    )
    assert (opts.uenv, opts.view, opts.warnings) == ("prgenv-gnu/24.7:v2", "default", [])
    flags = merge(opts, SubmitOptions(view="spack"))
    assert (flags.uenv, flags.view) == ("prgenv-gnu/24.7:v2", "spack")  # a flag wins
    with pytest.raises(DirectiveError, match="needs a value"):
        parse_script("#LATTICE --view\nmake\n")


def test_sbatch_directive_mapping():
    script = """#!/bin/bash
#SBATCH --nodes=4
#SBATCH --time=24:00:00
#SBATCH --job-name=train
#SBATCH --account=physics
#SBATCH --partition=gpu
#SBATCH --constraint=ib
#SBATCH --gres=gpu:4
#SBATCH --exclusive
srun hostname
"""
    opts = parse_script(script)
    assert opts.nodes == 4
    assert opts.walltime == "24:00:00"
    assert opts.name == "train"
    assert opts.tenant == "physics"
    assert opts.vcluster == "gpu"
    assert opts.constraints == {"features": ["ib"], "gpu_count": 4}
    assert opts.warnings == []


def test_sbatch_short_options_and_spacing():
    script = "#SBATCH -N 2 -t 30 -J short\n#SBATCH -A acct -p part -C nvme\n#SBATCH -N3\n"
    opts = parse_script(script)
    assert opts.nodes == 3  # later directives win
    assert opts.walltime == "30"
    assert opts.name == "short"
    assert (opts.tenant, opts.vcluster) == ("acct", "part")
    assert opts.constraints == {"features": ["nvme"]}


def test_unknown_sbatch_directive_is_a_warning():
    opts = parse_script("#SBATCH --mail-user=me@example.com\n#SBATCH --nodes=2\n")
    assert opts.nodes == 2
    assert len(opts.warnings) == 1
    assert "line 1" in opts.warnings[0] and "--mail-user" in opts.warnings[0]


def test_unknown_sbatch_option_consumes_its_value():
    opts = parse_script("#SBATCH --mail-type END --nodes 2\n")
    assert opts.nodes == 2
    assert len(opts.warnings) == 1


def test_sbatch_output_array_and_dependency_are_kept():
    opts = parse_script("#SBATCH --output=out.txt\n#SBATCH --array=0-9\n#SBATCH -d afterok:1\n")
    assert opts.warnings == []
    assert opts.tags["slurm_output"] == "out.txt"
    assert opts.task_group == "0-9" and opts.dependency == "afterok:1"
    opts = parse_script(
        "#SBATCH --array=0-15:4%2\n#SBATCH --dependency=afterok:a1:b2,afterany:c3\n"
    )
    assert opts.task_group == "0-12:4%2"
    assert depends_on_of(opts.dependency or "", "job") == [
        {"ref": "a1", "condition": "success"},
        {"ref": "b2", "condition": "success"},
        {"ref": "c3", "condition": "any"},
    ]


@pytest.mark.parametrize(
    ("line", "text"),
    [
        ("#SBATCH --array=1,2,7", "--array=1,2,7"),
        ("#SBATCH --dependency=afterok:1?afterok:2", "--dependency=afterok:1?afterok:2"),
        ("#SBATCH -d after:5", "-d=after:5"),
    ],
)
def test_array_and_dependency_forms_lattice_cannot_keep_are_errors(line: str, text: str) -> None:
    with pytest.raises(DirectiveError) as e:
        parse_script(line + "\n")
    assert text in e.value.message and e.value.hint


def test_lattice_dependency_directive_as_the_submit_flag():
    opts = parse_script("#LATTICE --dependency=afterok:a1:b2\n")
    assert depends_on_of(opts.dependency or "", "job") == [
        {"ref": "a1", "condition": "success"},
        {"ref": "b2", "condition": "success"},
    ]
    assert parse_script("#LATTICE --dependency afterany:c3\n").dependency == "afterany:c3"
    with pytest.raises(DirectiveError) as e:
        parse_script("#!/bin/sh\n#LATTICE --dependency=after:5\n")
    assert e.value.line == 2 and "#LATTICE --dependency=after:5" in e.value.message


def test_unknown_lattice_directive_is_an_error():
    with pytest.raises(DirectiveError) as info:
        parse_script("#!/bin/sh\n#LATTICE --frobnicate=1\n")
    assert info.value.line == 2
    assert "line 2" in str(info.value)
    assert "lattice submit" in info.value.hint


def test_lattice_directive_needs_value():
    with pytest.raises(DirectiveError, match="needs a value"):
        parse_script("#LATTICE --nodes\n")


@pytest.mark.parametrize(
    "line",
    ["#LATTICE --nodes=0", "#LATTICE --nodes=many", "#LATTICE --preemption-class=11"],
)
def test_bad_values_are_errors(line):
    with pytest.raises(DirectiveError):
        parse_script(line + "\n")


def test_directives_stop_at_first_command():
    script = "#!/bin/bash\n#SBATCH -N 2\n\n# comment\necho hi\n#SBATCH -N 8\n#LATTICE --bogus\n"
    opts = parse_script(script)
    assert opts.nodes == 2


def test_lattice_wins_over_sbatch_regardless_of_order():
    opts = parse_script("#LATTICE --nodes=8\n#SBATCH --nodes=2\n#SBATCH --job-name=x\n")
    assert opts.nodes == 8
    assert opts.name == "x"


def test_inline_comments_and_quotes():
    opts = parse_script('#LATTICE --name "my run" # a comment\n#SBATCH -J=ignored # x\n')
    assert opts.name == "my run"


def test_unbalanced_quote_is_directive_error():
    with pytest.raises(DirectiveError, match="line 1"):
        parse_script('#LATTICE --name "oops\n')


def test_ntasks_mapping():
    opts = parse_script("#SBATCH --ntasks=10\n#SBATCH --ntasks-per-node=4\n")
    assert opts.nodes == 3
    assert opts.tags == {"ntasks": "10", "ntasks_per_node": "4"}
    alone = parse_script("#SBATCH --ntasks=10\n")
    assert alone.nodes is None
    assert any("--ntasks=10" in w for w in alone.warnings)
    explicit = parse_script("#SBATCH --ntasks=10\n#SBATCH -N 5\n")
    assert explicit.nodes == 5


def test_qos_partition_maps_mem_requeue():
    script = "#SBATCH --qos=high\n#SBATCH -p debug\n#SBATCH --mem=512G\n#SBATCH --no-requeue\n"
    opts = parse_script(script, partition_map={"debug": "interactive"})
    assert opts.preemption_class == 7
    assert opts.vcluster == "interactive"
    assert opts.constraints == {"memory_gb": 512}
    assert opts.requeue == "never"
    custom = parse_script("#SBATCH --qos=gold\n", qos_map={"gold": 9})
    assert custom.preemption_class == 9
    unknown = parse_script("#SBATCH --qos=platinum\n")
    assert unknown.preemption_class is None and unknown.warnings


def test_time_unlimited():
    opts = parse_script("#SBATCH --time=UNLIMITED\n")
    assert opts.walltime is None and opts.warnings


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("gpu_type=GH200,gpu_count=4", {"gpu_type": "GH200", "gpu_count": 4}),
        ("memory_gb>=512", {"memory_gb": 512}),
        ("require_unified_memory", {"features": ["require_unified_memory"]}),
        ("prefer_same_numa", {"features": ["prefer_same_numa"]}),
        ("gpu_type:GH200", {"gpu_type": "GH200"}),
        ("ib&nvme, ib", {"features": ["ib", "nvme"]}),
        ("topology=tight", {"topology": "tight"}),
        ("features=a+b", {"features": ["a", "b"]}),
        ("", {}),
    ],
)
def test_parse_constraint(expr, expected):
    assert parse_constraint(expr) == expected


@pytest.mark.parametrize(
    "expr",
    ["a|b", "[a*2]", "colour=red", "gpu_count=four", "gpu_type>=GH200", "memory_gb<4", "x y!"],
)
def test_parse_constraint_errors(expr):
    with pytest.raises(DirectiveError):
        parse_constraint(expr)


def test_parse_constraints_later_wins():
    assert parse_constraints(["gpu_type=A100,ib", "gpu_type=GH200"]) == {
        "gpu_type": "GH200",
        "features": ["ib"],
    }


def test_gres_and_mem():
    assert parse_gres("gpu:4") == ({"gpu_count": 4}, [])
    assert parse_gres("gpu:a100:2") == ({"gpu_type": "a100", "gpu_count": 2}, [])
    assert parse_gres("gpu") == ({"gpu_count": 1}, [])
    constraints, warnings = parse_gres("nvme:1,gpu:8")
    assert constraints == {"gpu_count": 8} and len(warnings) == 1
    assert parse_mem_gb("64000") == 63  # Slurm's default unit is MB
    assert parse_mem_gb("64000M") == 63
    assert parse_mem_gb("1T") == 1024
    assert parse_mem_gb("0") is None
    with pytest.raises(DirectiveError):
        parse_mem_gb("lots")


def test_env_items():
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in ("NOVALUE", "=1", "1A=2", "A B=1"):
        with pytest.raises(DirectiveError):
            parse_env([bad])


# --------------------------------------------------------------------------- precedence


def test_flags_override_directives():
    script = parse_script(
        "#SBATCH -N 4 -t 1:00:00 -J fromscript\n#SBATCH --gres=gpu:4 -C ib\n"
        "#LATTICE --env=A=1 --env=B=2\n"
    )
    flags = SubmitOptions(
        nodes=8,
        name=None,
        constraints=parse_constraints(["gpu_count=2"]),
        env={"B": "flag"},
    )
    merged = merge(script, flags)
    assert merged.nodes == 8  # flag
    assert merged.walltime == "1:00:00"  # directive kept
    assert merged.name == "fromscript"
    assert merged.constraints == {"gpu_count": 2, "features": ["ib"]}
    assert merged.env == {"A": "1", "B": "flag"}


@settings(deadline=None)
@given(
    script_nodes=st.integers(1, 10_000),
    flag_nodes=st.one_of(st.none(), st.integers(1, 10_000)),
    script_name=st.text(string.ascii_letters, min_size=1, max_size=10),
    flag_name=st.one_of(st.none(), st.text(string.ascii_letters, min_size=1, max_size=10)),
)
def test_flags_always_override(script_nodes, flag_nodes, script_name, flag_name):
    script = parse_script(f"#SBATCH --nodes={script_nodes}\n#LATTICE --name={script_name}\n")
    merged = merge(script, SubmitOptions(nodes=flag_nodes, name=flag_name))
    assert merged.nodes == (flag_nodes if flag_nodes is not None else script_nodes)
    assert merged.name == (flag_name if flag_name is not None else script_name)


# --------------------------------------------------------------------------- fuzzing

_OPTION_WORDS = [
    "--nodes",
    "-N",
    "--walltime",
    "--time",
    "-t",
    "--name",
    "--job-name",
    "-J",
    "--tenant",
    "--account",
    "--partition",
    "--vcluster",
    "--constraint",
    "-C",
    "--gres",
    "--gpus-per-node",
    "--mem",
    "--qos",
    "--ntasks",
    "--ntasks-per-node",
    "--env",
    "--requeue",
    "--no-requeue",
    "--preemption-class",
    "--uenv",
    "--view",
    "--chdir",
    "--bogus",
    "-x",
    "--",
    "-",
]
_VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(-5, 10**12).map(str),
    st.sampled_from(["gpu:4", "gpu:a:b:c", "1-3", "UNLIMITED", "a|b", "=", '"', "'", "\\", "#"]),
)
_TOKEN = st.one_of(
    st.sampled_from(_OPTION_WORDS),
    st.tuples(st.sampled_from(_OPTION_WORDS), _VALUES).map(lambda t: f"{t[0]}={t[1]}"),
    _VALUES,
)
_DIRECTIVE_LINE = st.tuples(
    st.sampled_from(["#SBATCH", "#LATTICE", "#SBATCH ", "  #LATTICE", "#SBATCHX", "#"]),
    st.lists(_TOKEN, max_size=5),
).map(lambda t: t[0] + " " + " ".join(t[1]))
_LINE = st.one_of(_DIRECTIVE_LINE, st.text(max_size=40), st.just(""), st.just("#!/bin/bash"))


def _parse_or_directive_error(text: str) -> None:
    try:
        opts = parse_script(text, qos_map={"q": 1})
    except DirectiveError as exc:
        assert isinstance(exc, ValueError)
        assert exc.message
        return
    assert isinstance(opts, SubmitOptions)
    assert opts.nodes is None or opts.nodes >= 1
    assert opts.preemption_class is None or 0 <= opts.preemption_class <= 10
    assert all(isinstance(w, str) for w in opts.warnings)


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINE, max_size=12).map("\n".join))
def test_fuzz_structured_scripts_only_raise_directive_error(text):
    _parse_or_directive_error(text)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_arbitrary_text_only_raises_directive_error(text):
    _parse_or_directive_error(text)
    _parse_or_directive_error("#SBATCH " + text)
    _parse_or_directive_error("#LATTICE " + text)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_constraints_only_raise_directive_error(text):
    try:
        result = parse_constraint(text)
    except DirectiveError:
        return
    assert set(result) <= {"gpu_type", "gpu_count", "memory_gb", "topology", "features"}


@settings(deadline=None)
@given(st.text())
def test_fuzz_helpers_total(text):
    for fn in (parse_gres, parse_mem_gb):
        try:
            fn(text)
        except DirectiveError:
            pass
    assert shebang_command(text)
    list(iter_directives(text))


# --------------------------------------------------------------------------- entrypoints


def test_entrypoints():
    assert script_entrypoint("/home/u/train.sh", "echo hi\n") == "/bin/bash /home/u/train.sh"
    assert (
        script_entrypoint("/p/a b.py", "#!/usr/bin/env python3 -u\nprint(1)\n", ["--x", "1 2"])
        == "/usr/bin/env python3 -u '/p/a b.py' --x '1 2'"
    )
    assert command_entrypoint(["torchrun", "train.py"]) == "torchrun train.py"
    with pytest.raises(DirectiveError):
        command_entrypoint([])
