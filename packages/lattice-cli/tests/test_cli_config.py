"""CLI configuration: file < environment < flags, endpoint parsing, the flat YAML reader."""

from __future__ import annotations

import string

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_cli.config import (
    ConfigError,
    default_config_path,
    load_config,
    parse_endpoint,
    parse_flat_yaml,
    resolve_config,
)


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file(tmp_path):
    cfg = load_config(None, {"HOME": str(tmp_path)}, {})
    assert cfg.endpoint == "http://127.0.0.1:8080"
    assert cfg.tenant == "" and cfg.vcluster == "" and cfg.token == ""
    assert cfg.output_format == "table"
    assert cfg.path == str(tmp_path / ".config" / "lattice" / "config.yaml")


def test_file_then_env_then_flags(tmp_path):
    path = write(
        tmp_path,
        "endpoint: http://file:1\ntenant: file-tenant\nvcluster: file-vc\ntoken: file-token\n",
    )
    cfg = load_config(path, {}, {})
    assert (cfg.endpoint, cfg.tenant, cfg.vcluster, cfg.token) == (
        "http://file:1",
        "file-tenant",
        "file-vc",
        "file-token",
    )
    assert cfg.sources["tenant"].endswith(":tenant")

    env = {
        "LATTICE_ENDPOINT": "http://env:2",
        "LATTICE_TENANT": "env-tenant",
        "LATTICE_TOKEN": "env-token",
    }
    cfg = load_config(path, env, {})
    assert (cfg.endpoint, cfg.tenant, cfg.vcluster, cfg.token) == (
        "http://env:2",
        "env-tenant",
        "file-vc",
        "env-token",
    )
    assert cfg.sources["endpoint"] == "env:LATTICE_ENDPOINT"

    flags = {"endpoint": "http://flag:3", "tenant": "flag-tenant", "vcluster": None}
    cfg = load_config(path, env, flags)
    assert (cfg.endpoint, cfg.tenant, cfg.vcluster) == ("http://flag:3", "flag-tenant", "file-vc")
    assert cfg.sources["endpoint"] == "flag"


def test_spec_key_names_and_api_url_env(tmp_path):
    path = write(
        tmp_path,
        'api_url: "https://lattice.example.com:50051"\ndefault_tenant: "physics"\n'
        'default_vcluster: "hpc-batch"\noutput_format: "wide"\ncolor: true\n',
    )
    cfg = load_config(path, {}, {})
    assert cfg.endpoint == "https://lattice.example.com:50051"
    assert (cfg.tenant, cfg.vcluster, cfg.output_format) == ("physics", "hpc-batch", "wide")
    cfg = load_config(path, {"LATTICE_API_URL": "other:9"}, {})
    assert cfg.endpoint == "other:9"
    # LATTICE_ENDPOINT wins over LATTICE_API_URL when both are set
    cfg = load_config(path, {"LATTICE_API_URL": "a:1", "LATTICE_ENDPOINT": "b:2"}, {})
    assert cfg.endpoint == "b:2"


def test_config_path_from_env_and_flag(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("tenant: from-a\n")
    b = tmp_path / "b.yaml"
    b.write_text("tenant: from-b\n")
    assert load_config(None, {"LATTICE_CONFIG": str(a)}, {}).tenant == "from-a"
    assert load_config(str(b), {"LATTICE_CONFIG": str(a)}, {}).tenant == "from-b"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"), {}, {})
    with pytest.raises(ConfigError):
        load_config(None, {"LATTICE_CONFIG": str(tmp_path / "missing.yaml")}, {})


def test_xdg_config_home():
    assert default_config_path({"XDG_CONFIG_HOME": "/x"}) == "/x/lattice/config.yaml"
    assert default_config_path({"HOME": "/h"}) == "/h/.config/lattice/config.yaml"


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "endpoint: [unclosed\n"), {}, {})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), {}, {})
    with pytest.raises(ConfigError, match="output format"):
        load_config(write(tmp_path, "output_format: fancy\n"), {}, {})
    with pytest.raises(ConfigError, match="endpoint"):
        load_config(write(tmp_path, "endpoint: 'ftp://x'\n"), {}, {})
    assert load_config(write(tmp_path, ""), {}, {}).tenant == ""


def test_nested_yaml_falls_back_to_pyyaml(tmp_path):
    path = write(
        tmp_path,
        "endpoint: http://h:1\npartition_map:\n  gpu: ml-training\nqos_map:\n  gold: 9\n",
    )
    cfg = load_config(path, {}, {})
    assert cfg.partition_map == {"gpu": "ml-training"}
    assert cfg.qos_map == {"gold": 9}


def test_no_color_env():
    assert resolve_config({"color": True}, {"NO_COLOR": "1"}, {}).color is False
    assert resolve_config({"color": "no"}, {}, {}).color is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://127.0.0.1:8080", ("http", "127.0.0.1", 8080)),
        ("https://lattice.example.com", ("https", "lattice.example.com", 443)),
        ("https://lattice.example.com:50051/", ("https", "lattice.example.com", 50051)),
        ("lattice-api.example.com:50051", ("http", "lattice-api.example.com", 50051)),
        ("localhost", ("http", "localhost", 8080)),
        ("[::1]:9000", ("http", "::1", 9000)),
        ("http://[fe80::1]", ("http", "fe80::1", 8080)),
        ("HTTP://user@h:1/api", ("http", "h", 1)),
    ],
)
def test_parse_endpoint(text, expected):
    ep = parse_endpoint(text)
    assert (ep.scheme, ep.host, ep.port) == expected


@pytest.mark.parametrize("text", ["", "grpc://h:1", "h:notaport", "h:0", "h:70000", "http://:80"])
def test_parse_endpoint_errors(text):
    with pytest.raises(ConfigError):
        parse_endpoint(text)


@settings(deadline=None)
@given(st.text(max_size=40))
def test_parse_endpoint_never_crashes(text):
    try:
        ep = parse_endpoint(text)
    except ConfigError:
        return
    assert 0 < ep.port < 65536 and ep.host


# --------------------------------------------------------------------------- flat YAML


def test_flat_yaml_reads_common_files():
    text = (
        "# written by lattice dev up\n---\nendpoint: http://127.0.0.1:8080\n"
        "tenant: default  # comment\nvcluster: 'hpc-batch'\ntoken: \"abc.def\"\n"
        "color: false\nretries: 3\nempty:\n"
    )
    assert parse_flat_yaml(text) == {
        "endpoint": "http://127.0.0.1:8080",
        "tenant": "default",
        "vcluster": "hpc-batch",
        "token": "abc.def",
        "color": False,
        "retries": 3,
        "empty": None,
    }


@pytest.mark.parametrize(
    "text",
    [
        "a:\n  b: 1\n",
        "a: [1, 2]\n",
        "a: 1.5\n",
        "a: 2026-03-01\n",
        "on: x\n",
        "a: 010\n",
        "a: &x y",
    ],
)
def test_flat_yaml_defers_to_pyyaml(text):
    assert parse_flat_yaml(text) is None


_KEY = st.one_of(
    st.sampled_from(["endpoint", "tenant", "on", "yes", "null", "a", "x_y", "Key1"]),
    st.text(string.ascii_letters + "_", min_size=1, max_size=8),
)
_VALUE = st.one_of(
    st.sampled_from(
        [
            "http://127.0.0.1:8080",
            "127.0.0.1:8080",
            "host:9",
            "1:30",
            "1:2:3",
            "true",
            "TRUE",
            "tRue",
            "Yes",
            "y",
            "n",
            "off",
            "~",
            "null",
            "0",
            "007",
            "0x1F",
            "1_000",
            "1e3",
            "1.5",
            ".inf",
            "2026-03-01",
            "-5",
            "+5",
            "'quoted'",
            '"dq"',
            "'it''s'",
            "a # c",
            "a#b",
            "",
            "@x",
            "*alias",
            "!tag x",
        ]
    ),
    st.text(string.ascii_letters + string.digits + "_./:@+-", max_size=12),
    st.text(max_size=8),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(_KEY, _VALUE), max_size=5))
def test_flat_yaml_agrees_with_pyyaml(pairs):
    text = "".join(f"{k}: {v}\n" for k, v in pairs)
    ours = parse_flat_yaml(text)
    if ours is None:
        return  # deferred to PyYAML: always correct
    assert ours == yaml.safe_load(text) or (ours == {} and yaml.safe_load(text) is None)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_flat_yaml_agrees_on_arbitrary_text(text):
    ours = parse_flat_yaml(text)
    if ours is None:
        return
    try:
        theirs = yaml.safe_load(text)
    except yaml.YAMLError:
        pytest.fail(f"flat reader accepted text PyYAML rejects: {text!r}")
    assert ours == (theirs or {})
