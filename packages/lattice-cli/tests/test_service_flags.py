"""`lattice submit --expose` and `--liveness*`: parsed into the submission and stored
(the real REST API over a LocalQuorum, the ``api`` fixture), bad values refused with a
hint and nothing stored."""

from __future__ import annotations

import pytest
from lattice_cli.main import app, load_commands
from lattice_cli.submit_options import DirectiveError, parse_expose, parse_liveness
from typer.testing import CliRunner

load_commands()


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_flags_reach_the_stored_allocation(api, monkeypatch) -> None:
    monkeypatch.setenv("LATTICE_TENANT", "physics")
    monkeypatch.setenv("LATTICE_VCLUSTER", "gpu-batch")
    api.names()
    api.nodes("nid001")
    r = run(
        "-q", "submit", "-t", "1h", "--expose", "api:8080", "--expose", "9100",
        "--liveness", "http:8080/healthz", "--liveness-period", "5",
        "--liveness-threshold", "2", "--liveness-delay", "0", "--", "python", "serve.py",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (alloc_id,) = api.allocation_ids()
    spec = api.quorum.state.allocations[alloc_id].spec
    assert [(e.name, e.port) for e in spec.expose] == [("api", 8080), ("port-9100", 9100)]
    p = spec.liveness_probe
    assert p is not None
    assert (p.probe_type, p.port, p.path) == ("http", 8080, "/healthz")
    assert (p.period_secs, p.failure_threshold, p.initial_delay_secs, p.timeout_secs) == (
        5,
        2,
        0,
        5,  # the specification's default
    )


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--liveness", "ftp:21"], "invalid liveness probe 'ftp:21'"),
        (["--liveness", "tcp:22/x"], "a tcp probe has no path"),
        (["--liveness-period", "5"], "need --liveness"),
        (["--expose", "api:99999"], "not a port"),
    ],
)
def test_bad_flags_are_refused_and_nothing_is_stored(api, monkeypatch, args, text) -> None:
    monkeypatch.setenv("LATTICE_TENANT", "physics")
    monkeypatch.setenv("LATTICE_VCLUSTER", "gpu-batch")
    api.names()
    r = run("submit", "-t", "1h", *args, "--", "true")
    assert r.exit_code == 2 and text in r.output, r.output
    assert api.allocation_ids() == []


def test_parsers() -> None:
    assert parse_expose("metrics:9100") == {"name": "metrics", "port": 9100}
    assert parse_liveness("tcp:5432") == {"probe_type": "tcp", "port": 5432}
    assert parse_liveness("HTTP:80") == {"probe_type": "http", "port": 80, "path": "/"}
    with pytest.raises(DirectiveError):
        parse_expose("api:")
