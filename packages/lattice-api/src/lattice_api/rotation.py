"""Secret rotation in a running lattice-server (lattice_common.secrets).

``api.oidc_hmac_secret`` and ``api.agent_token`` written as references (``env://``,
``file://``, ``vault://``) were resolved when the configuration was loaded;
:func:`watch_api_secrets` watches those references (every
``secrets.refresh_interval_seconds``) and hands a changed value to the Authenticator:
the HMAC secret is swapped (tokens signed with the old one are refused from then on),
a new agent token is accepted next to the previous one until the next rotation (agents
and schedulers read theirs at start and are restarted one by one). No restart of the
API is needed. Values are never logged; the resolver logs the reference only.
"""

from __future__ import annotations

import logging

from lattice_common.config import LatticeConfig
from lattice_common.secrets import SecretResolver
from pydantic import SecretStr

from lattice_api.auth import Authenticator

log = logging.getLogger("lattice.api.secrets")

WATCHED = ("api.oidc_hmac_secret", "api.agent_token")


def watch_api_secrets(
    cfg: LatticeConfig, auth: Authenticator, resolver: SecretResolver | None = None
) -> SecretResolver | None:
    """Watch the API's secret references and apply new values to ``auth``; returns the
    started resolver (``await resolver.stop()`` at shutdown), None when nothing is a
    reference. Call on the event loop."""
    refs = {field: ref for field, ref in cfg.secret_refs.items() if field in WATCHED}
    if not refs:
        return None
    resolver = resolver or SecretResolver(cfg.secrets)

    def hmac_changed(value: SecretStr) -> None:
        auth.set_hmac_secret(value.get_secret_value())
        log.info("api.oidc_hmac_secret rotated (from %s)", refs["api.oidc_hmac_secret"])

    def agent_token_changed(value: SecretStr) -> None:
        auth.set_agent_token(value.get_secret_value())
        log.info("api.agent_token rotated (from %s)", refs["api.agent_token"])

    if "api.oidc_hmac_secret" in refs:
        resolver.watch(refs["api.oidc_hmac_secret"], hmac_changed, cfg.api.oidc_hmac_secret)
    if "api.agent_token" in refs:
        resolver.watch(refs["api.agent_token"], agent_token_changed, cfg.api.agent_token)
    resolver.start()
    return resolver


__all__ = ["WATCHED", "watch_api_secrets"]
