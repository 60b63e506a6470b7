"""Where the CLI's settings come from: config file < environment < command-line flags.

The file is ``~/.config/lattice/config.yaml`` (or ``$XDG_CONFIG_HOME/lattice/config.yaml``;
``--config PATH`` or ``LATTICE_CONFIG`` pick another one). Both the names of the Getting
Started page (``endpoint``, ``tenant``, ``vcluster``) and of the CLI Design chapter
(``api_url``, ``default_tenant``, ``default_vcluster``) are accepted.

Everything here is pure except :func:`read_config_file`; the environment and the flags
are passed in as mappings so the precedence is testable without touching the process.
The config is almost always a flat ``key: value`` file, so a small reader handles that
and PyYAML (50 ms to import) is loaded only for anything fancier.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ENDPOINT = "http://127.0.0.1:8080"
DEFAULT_PORT = 8080
OUTPUT_FORMATS = ("table", "wide", "json", "yaml")

# file key -> setting; the first key found wins within the file.
_FILE_KEYS: dict[str, tuple[str, ...]] = {
    "endpoint": ("endpoint", "api_url"),
    "tenant": ("tenant", "default_tenant"),
    "vcluster": ("vcluster", "default_vcluster"),
    "token": ("token",),
    "output_format": ("output_format", "output"),
    "color": ("color",),
    "uenv": ("uenv", "default_uenv"),
    "ca_cert": ("ca_cert",),
}
# setting -> environment variables, the first set one wins.
_ENV_KEYS: dict[str, tuple[str, ...]] = {
    "endpoint": ("LATTICE_ENDPOINT", "LATTICE_API_URL"),
    "tenant": ("LATTICE_TENANT",),
    "vcluster": ("LATTICE_VCLUSTER",),
    "token": ("LATTICE_TOKEN",),
    "output_format": ("LATTICE_OUTPUT",),
    "ca_cert": ("LATTICE_CA_CERT",),
}


class ConfigError(ValueError):
    """The config file or a setting cannot be used; ``hint`` says how to fix it."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass
class Endpoint:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@dataclass
class CliConfig:
    """The resolved settings. ``sources`` says where each came from (for ``-v``)."""

    endpoint: str = DEFAULT_ENDPOINT
    tenant: str = ""
    vcluster: str = ""
    token: str = ""
    output_format: str = "table"
    color: bool = True
    uenv: str = ""
    # CA bundle (PEM) that an https endpoint's certificate chains to; "" = the system's
    ca_cert: str = ""
    partition_map: dict[str, str] = field(default_factory=dict)
    qos_map: dict[str, int] = field(default_factory=dict)
    path: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def parsed_endpoint(self) -> Endpoint:
        return parse_endpoint(self.endpoint)

    def ssl_context(self) -> Any:
        """The TLS context for the endpoint: trusting ``ca_cert`` when set (a cluster's
        own CA, e.g. `lattice dev up --secure`), else None (the system's CAs)."""
        if not self.ca_cert:
            return None
        import ssl

        try:
            return ssl.create_default_context(cafile=os.path.expanduser(self.ca_cert))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"cannot read ca_cert {self.ca_cert!r} (from {self.sources.get('ca_cert')}): {e}",
                "Point ca_cert / LATTICE_CA_CERT at the cluster's CA certificate (PEM).",
            ) from None


def parse_endpoint(text: str, default_port: int = DEFAULT_PORT) -> Endpoint:
    """``http://h:8080``, ``https://h``, ``h:8080``, ``h``, ``[::1]:8080`` -> Endpoint.

    A path after the authority is ignored. Raises ConfigError for anything else.
    """
    raw = str(text).strip()
    hint = "Use a URL like http://127.0.0.1:8080 or host:port."
    if not raw:
        raise ConfigError("the API endpoint is empty", hint)
    scheme = "http"
    rest = raw
    if "://" in raw:
        scheme, _, rest = raw.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(
                f"unsupported scheme {scheme!r} in endpoint {raw!r}",
                "The CLI talks to the REST API over http or https, e.g. http://127.0.0.1:8080.",
            )
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    port_text = ""
    if authority.startswith("["):
        host, sep, after = authority[1:].partition("]")
        if not sep:
            raise ConfigError(f"invalid endpoint {raw!r}", hint)
        if after.startswith(":"):
            port_text = after[1:]
        elif after:
            raise ConfigError(f"invalid endpoint {raw!r}", hint)
    elif authority.count(":") == 1:
        host, _, port_text = authority.partition(":")
    elif ":" in authority:  # bare IPv6 literal without a port
        host = authority
    else:
        host = authority
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"invalid endpoint {raw!r}: no host", hint)
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"invalid port {port_text!r} in endpoint {raw!r}", hint)
        port = int(port_text)
    else:
        port = 443 if scheme == "https" and "://" in raw else default_port
    return Endpoint(scheme, host, port)


def default_config_path(env: Mapping[str, str]) -> str:
    if env.get("LATTICE_CONFIG"):
        return env["LATTICE_CONFIG"]
    base = env.get("XDG_CONFIG_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".config"
    )
    return os.path.join(base, "lattice", "config.yaml")


def read_config_file(path: str, *, required: bool) -> dict[str, Any]:
    """The file's mapping, ``{}`` when it does not exist and is not required."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        if required:
            raise ConfigError(
                f"config file {path} does not exist",
                "Check the --config path or LATTICE_CONFIG, or create the file.",
            ) from None
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    return parse_config_text(text, path)


def parse_config_text(text: str, path: str = "config") -> dict[str, Any]:
    data = parse_flat_yaml(text)
    if data is None:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file {path} is not valid YAML: {exc}",
                "The file holds `key: value` lines, e.g. `endpoint: http://127.0.0.1:8080`.",
            ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of settings, not {type(data).__name__}",
            "The file holds `key: value` lines, e.g. `endpoint: http://127.0.0.1:8080`.",
        )
    return data


_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN_RE = re.compile(r"[A-Za-z0-9_./:@+-]*\Z")
_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+(:\d+)?(/.*)?\Z")
_INT_RE = re.compile(r"(0|[1-9][0-9]*)\Z")
_BOOLS = {
    **dict.fromkeys(("yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"), True),
    **dict.fromkeys(("no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"), False),
}
_NULLS = ("~", "null", "Null", "NULL")


def _plain(value: str) -> tuple[bool, Any]:
    """(understood, value) for a plain scalar, reading it as PyYAML's safe loader does."""
    if value == "" or value in _NULLS:
        return True, None
    if not _PLAIN_RE.match(value) or value.endswith(":"):
        return False, None
    if value in _BOOLS:
        return True, _BOOLS[value]
    if value[0].isalpha():
        return True, value
    if _INT_RE.match(value):
        return True, int(value)
    if _IPV4_RE.match(value):
        return True, value
    return False, None  # numbers, dates, sexagesimals...: let PyYAML decide


def parse_flat_yaml(text: str) -> dict[str, Any] | None:
    """Read a flat ``key: value`` YAML document, or return None if it is anything else.

    Understands comments, blank lines, plain words, URLs, host:port, integers, booleans,
    null, and quoted strings without escapes. Whenever a line is outside that subset the
    answer is None and the caller uses PyYAML, so this never reads a document differently
    from PyYAML (a property test checks it).
    """
    out: dict[str, Any] = {}
    if not text.isascii():
        return None
    for line in text.split("\n"):
        line = line.removesuffix("\r")
        if not line.isprintable():  # tabs, control characters
            return None
        stripped = line.strip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        if stripped == "---" and line == "---" and not out:
            continue
        key, sep, rest = line.partition(":")
        if not sep or not _KEY_RE.match(key) or key in _BOOLS or key in _NULLS:
            return None
        if rest and rest[0] != " ":
            return None
        value_text = rest.strip()
        if value_text[:1] in ("'", '"'):
            quote = value_text[0]
            close = value_text.find(quote, 1)
            if close < 0:
                return None
            inner, after = value_text[1:close], value_text[close + 1 :]
            if "\\" in inner or "'" in inner or '"' in inner or not inner.isprintable():
                return None
            if after and not (after[0] == " " and after.lstrip().startswith("#")):
                return None
            value: Any = inner
        else:
            if value_text.startswith("#"):
                value_text = ""
            elif " #" in value_text:
                value_text = value_text.split(" #", 1)[0].rstrip()
            ok, value = _plain(value_text)
            if not ok:
                return None
        if key in out:
            return None
        out[key] = value
    return out


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, not {value!r}")


def resolve_config(
    file_data: Mapping[str, Any],
    env: Mapping[str, str],
    flags: Mapping[str, Any],
    *,
    path: str = "",
) -> CliConfig:
    """Merge the three layers: file < env < flags. ``None``/empty flags do not override."""
    cfg = CliConfig(path=path)
    for setting, keys in _FILE_KEYS.items():
        for key in keys:
            if key in file_data and file_data[key] is not None and file_data[key] != "":
                setattr(cfg, setting, file_data[key])
                cfg.sources[setting] = f"{path or 'config'}:{key}"
                break
    for setting, names in _ENV_KEYS.items():
        for name in names:
            if env.get(name):
                setattr(cfg, setting, env[name])
                cfg.sources[setting] = f"env:{name}"
                break
    for setting, value in flags.items():
        if value is None or value == "":
            continue
        if not hasattr(cfg, setting):
            raise KeyError(setting)
        setattr(cfg, setting, value)
        cfg.sources[setting] = "flag"
    if env.get("NO_COLOR"):
        cfg.color = False
    cfg.color = _as_bool(cfg.color, "color")
    for setting in ("endpoint", "tenant", "vcluster", "token", "output_format", "uenv", "ca_cert"):
        setattr(cfg, setting, str(getattr(cfg, setting)).strip())
    cfg.output_format = cfg.output_format.lower()
    if cfg.output_format not in OUTPUT_FORMATS:
        raise ConfigError(
            f"unknown output format {cfg.output_format!r} (from {cfg.sources.get('output_format')})",
            "Use one of: " + ", ".join(OUTPUT_FORMATS) + ".",
        )
    cfg.partition_map = _str_map(file_data.get("partition_map"), "partition_map")
    cfg.qos_map = {k: _int(v, f"qos_map.{k}") for k, v in _str_map_raw(file_data, "qos_map")}
    parse_endpoint(cfg.endpoint)  # validate early, with the config error's hint
    return cfg


def _str_map_raw(data: Mapping[str, Any], key: str) -> list[tuple[str, Any]]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ConfigError(f"{key} in the config file must be a mapping")
    return [(str(k), v) for k, v in value.items()]


def _str_map(value: Any, key: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} in the config file must be a mapping")
    return {str(k): str(v) for k, v in value.items()}


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, not {value!r}") from None


def load_config(
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> CliConfig:
    """Read the file (``config_path`` or the default location) and merge env and flags."""
    env = os.environ if env is None else env
    explicit = bool(config_path or env.get("LATTICE_CONFIG"))
    path = os.path.expanduser(config_path or default_config_path(env))
    data = read_config_file(path, required=explicit)
    return resolve_config(data, env, flags or {}, path=path)
