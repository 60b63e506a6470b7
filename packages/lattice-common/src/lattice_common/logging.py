"""Structured JSON logs for every Lattice process (one object per line on stderr).

Secret values the process knows (lattice_common.secrets.remember: the config's secrets,
the AppRole secret id, the Vault token) are masked in every line, and the HTTP/2 header
codecs (hpack, h2), which dump request headers such as ``authorization`` at debug
level, log warnings only.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from lattice_common.secrets import redact


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, default=str)


def setup_logging(component: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # pysyncobj and aiohttp are chatty at info level
    logging.getLogger("pysyncobj").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # header tables (bearer tokens included) at debug level
    for name in ("hpack", "h2"):
        logging.getLogger(name).setLevel(logging.WARNING)
