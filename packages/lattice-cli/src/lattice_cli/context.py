"""What every ``lattice`` command shares: the invocation's :class:`State`, the API runner
and the ways to print (``emit``, ``warn``, ``fail``).

Command modules under :mod:`lattice_cli.commands` import this module and never
:mod:`lattice_cli.main` (which imports them), so there is no import cycle. Start time
matters (``lattice status`` is typed all day): only typer and the standard library are
imported here; the SDK, asyncio and the renderers are imported inside the functions that
need them.

Errors the user can fix print as ``Error: ...`` / ``  Key: value`` / ``Hint: ...`` on
stderr (:func:`lattice_common.error_text.render_error`, shared with the SDK and the core)
and exit 1 (2 for usage errors), never as a traceback.
"""

from __future__ import annotations

import enum
import os
import sys
from typing import Annotated, Any, NoReturn

import typer


class OutputFormat(enum.StrEnum):
    """``-o``: how commands print (CLI-only; the API has no such enum)."""

    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


OutputOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="Output format: table (default), wide, json or yaml.",
        case_sensitive=False,
    ),
]


class State:
    """Global flags of one invocation, and the config resolved from them on first use."""

    def __init__(
        self,
        *,
        output: str | None = None,
        quiet: bool = False,
        verbose: bool = False,
        tenant: str | None = None,
        vcluster: str | None = None,
        config_path: str | None = None,
        no_color: bool = False,
        endpoint: str | None = None,
    ) -> None:
        self.output_flag = output
        self.quiet = quiet
        self.verbose = verbose
        self.tenant = tenant
        self.vcluster = vcluster
        self.config_path = config_path
        self.no_color = no_color
        self.endpoint = endpoint
        self._config: Any = None

    @property
    def config(self) -> Any:
        if self._config is None:
            from lattice_cli.config import ConfigError, load_config

            flags = {
                "endpoint": self.endpoint,
                "tenant": self.tenant,
                "vcluster": self.vcluster,
                "output_format": self.output_flag,
            }
            try:
                self._config = load_config(self.config_path, os.environ, flags)
            except ConfigError as exc:
                fail(exc.message, hint=exc.hint)
            if self.no_color:
                self._config.color = False
            if self.verbose:
                cfg = self._config
                debug(f"config file: {cfg.path}")
                for key in ("endpoint", "tenant", "vcluster", "output_format"):
                    source = cfg.sources.get(key, "default")
                    debug(f"{key} = {getattr(cfg, key)!r} (from {source})")
        return self._config

    def output(self, override: OutputFormat | None = None) -> str:
        if override is not None:
            return override.value
        return self.config.output_format

    def color(self, stream: Any = None) -> bool:
        stream = stream or sys.stdout
        if self.no_color or os.environ.get("NO_COLOR"):
            return False
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return tty and bool(self.config.color)


def state_of(ctx: typer.Context) -> State:
    """The invocation's :class:`State` (set by the root callback; a default one when a
    command is invoked without it, e.g. from a test)."""
    obj = ctx.find_root().obj
    if not isinstance(obj, State):
        obj = State()
        ctx.find_root().obj = obj
    return obj


def debug(message: str) -> None:
    print(f"debug: {message}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def fail(message: str, *, hint: str = "", details: dict | None = None, code: int = 1) -> NoReturn:
    """Print ``Error: ...`` (with details and hint) to stderr and exit."""
    from lattice_common.error_text import render_error

    print(render_error(message, details, hint), file=sys.stderr)
    raise typer.Exit(code)


def print_api_error(state: State, exc: Any) -> None:
    """Print an SDK error; a connection failure also says where the endpoint came from."""
    from lattice_sdk import LatticeUnavailableError

    if isinstance(exc, LatticeUnavailableError) and exc.status_code is None:
        source = state.config.sources.get("endpoint", "default")
        exc.details.setdefault("endpoint_from", source)
    print(exc.render(), file=sys.stderr)
    if state.verbose:
        debug(f"{type(exc).__name__} status={exc.status_code} code={exc.code!r}")


def make_client(state: State, *, min_timeout: float = 0.0) -> Any:
    """A :class:`lattice_sdk.LatticeClient` for the configured endpoint, tenant and token
    (the configured ``token``, else this endpoint's cached login); its timeout is
    ``LATTICE_TIMEOUT`` (30 s), at least ``min_timeout``."""
    from lattice_sdk import LatticeClient

    cfg = state.config
    endpoint = cfg.parsed_endpoint
    headers = {"x-lattice-tenant": cfg.tenant} if cfg.tenant else {}
    timeout = max(float(os.environ.get("LATTICE_TIMEOUT") or 30), min_timeout)
    ssl_context = ssl_context_of(state)
    return LatticeClient(
        endpoint.host,
        endpoint.port,
        token=cfg.token or cached_token(state),
        headers=headers,
        scheme=endpoint.scheme,
        timeout=timeout,
        transport=os.environ.get("LATTICE_HTTP_TRANSPORT") or "asyncio",
        ssl_context=ssl_context,
    )


def ssl_context_of(state: State) -> Any:
    """The TLS context for the configured endpoint (``ca_cert``), or None; a ca_cert
    that cannot be read exits 2 with the hint."""
    from lattice_cli.config import ConfigError

    try:
        return state.config.ssl_context()
    except ConfigError as exc:
        fail(exc.message, hint=exc.hint, code=2)


def cached_token(state: State) -> Any:
    """The token provider for the configured endpoint's cached login
    (:class:`lattice_cli.auth.CachedToken`: refreshed silently when it expires), or None
    when ``lattice login`` was not run for it. A ``token`` in the config or
    ``LATTICE_TOKEN`` takes precedence (see :func:`make_client`)."""
    from lattice_cli.auth import CachedToken, TokenStore, tokens_path

    store = TokenStore(tokens_path(os.environ), warn=warn)
    server = state.config.parsed_endpoint.url
    entry = store.get(server)
    return CachedToken(server, store, entry) if entry else None


def run_api(state: State, fn: Any, *, min_timeout: float = 0.0) -> Any:
    """Run ``await fn(client)`` with a client for the configured endpoint (requests time
    out after ``LATTICE_TIMEOUT``, at least ``min_timeout`` seconds).

    SDK errors are printed (exit 1); Ctrl-C exits 130 without a traceback.
    """
    import asyncio

    from lattice_sdk import LatticeError

    async def go() -> Any:
        async with make_client(state, min_timeout=min_timeout) as client:
            return await fn(client)

    try:
        return asyncio.run(go())
    except LatticeError as exc:
        print_api_error(state, exc)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def emit(state: State, fmt: str, data: Any, text: Any = None) -> None:
    """Print ``data`` as JSON/YAML, or ``text()`` for table/wide."""
    from lattice_cli import output

    if fmt == "json":
        print(output.to_json(data))
    elif fmt == "yaml":
        print(output.to_yaml(data), end="")
    elif text is not None:
        rendered = text() if callable(text) else text
        if rendered:
            print(rendered)


def show_one(state: State, output: OutputFormat | None, record: Any, message: str) -> None:
    """After a create/update: the record as JSON/YAML, else ``message`` (unless quiet)."""
    fmt = state.output(output)
    if fmt in ("json", "yaml"):
        emit(state, fmt, record.raw)
    elif not state.quiet:
        print(message)
