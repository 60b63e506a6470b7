"""Node health signals for the cost model's failure probability (spec: Checkpoint
Broker, "node health signals"), read from the TSDB the node agents push to.

The agents report, per GPU, the volatile ECC error counts (``gpu_ecc_errors_corrected``
and ``gpu_ecc_errors_uncorrected``, since the driver loaded) and ``gpu_temperature``
(lattice_agent.telemetry.nvml). Over the last :data:`DEFAULT_WINDOW_SECONDS` a node's

* ECC errors are the highest count each of its GPUs reported, summed over its GPUs, an
  uncorrected error counting as :data:`UNCORRECTED_ECC_WEIGHT` corrected ones (one
  usually ends the job that met it);
* thermal warnings are its GPUs that reached :data:`DEFAULT_THERMAL_LIMIT_C`.

Without a TSDB (``telemetry.tsdb_endpoint`` empty) or while it does not answer, no
node has signals beyond what the quorum knows (Degraded): the broker goes on, as the
autoscaler does, and says so in its log.

:func:`health_queries` and :func:`node_health` are pure; :class:`TsdbHealth` is the
shell that asks the TSDB.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from lattice_common import promql

from lattice_checkpoint.cost import NodeHealth

log = logging.getLogger("lattice.checkpoint")

ECC_CORRECTED = "gpu_ecc_errors_corrected"
ECC_UNCORRECTED = "gpu_ecc_errors_uncorrected"
TEMPERATURE = "gpu_temperature"
#: prod mode pushes windowed aggregates (the ``max`` one is the worst reading), debug
#: mode ``raw`` samples; ``mean``/``count`` etc. are not readings of the device
READING_AGGS = ("max", "raw")

DEFAULT_WINDOW_SECONDS = 3600.0  # "recently": the last hour
DEFAULT_THERMAL_LIMIT_C = 85.0  # GPUs start to throttle about here
UNCORRECTED_ECC_WEIGHT = 10  # in corrected errors
QUERY_TIMEOUT = 10.0

Query = Callable[[str, str, float], list[Any]]
"""(TSDB base URL, PromQL, timeout) -> an instant query's result vector."""


class HealthUnavailable(Exception):
    """The TSDB could not answer (down, refused, unreadable)."""


def health_queries(window_seconds: float = DEFAULT_WINDOW_SECONDS) -> dict[str, str]:
    """The two instant queries: ``ecc`` (per node, GPU and series: the highest count
    in the window) and ``temperature`` (per node and GPU: the highest reading)."""
    aggs = {"agg": READING_AGGS}
    ecc = promql.rollup(
        "max_over_time",
        promql.selector(names=(ECC_CORRECTED, ECC_UNCORRECTED), regex=aggs),
        window_seconds,
        keep_metric_names=True,
    )
    temp = promql.rollup(
        "max_over_time", promql.selector(names=(TEMPERATURE,), regex=aggs), window_seconds
    )
    return {
        "ecc": promql.aggregate("max", ("node_id", "gpu", "__name__"), ecc),
        "temperature": promql.aggregate("max", ("node_id", "gpu"), temp),
    }


def _rows(result: list[Any]) -> list[tuple[Mapping[str, Any], float]]:
    out: list[tuple[Mapping[str, Any], float]] = []
    for item in result:
        try:
            metric = item["metric"]
            value = float(item["value"][1])
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        if isinstance(metric, Mapping) and metric.get("node_id") and math.isfinite(value):
            out.append((metric, value))
    return out


def node_health(
    ecc: list[Any],
    temperature: list[Any],
    thermal_limit_c: float = DEFAULT_THERMAL_LIMIT_C,
) -> dict[str, NodeHealth]:
    """node id -> its signals, from the two queries' result vectors (junk rows, NaN
    and negative counts dropped). Nodes with no signal are left out."""
    errors: dict[str, float] = {}
    for metric, value in _rows(ecc):
        if value <= 0:
            continue
        weight = UNCORRECTED_ECC_WEIGHT if metric.get("__name__") == ECC_UNCORRECTED else 1
        node = str(metric["node_id"])
        errors[node] = errors.get(node, 0.0) + weight * value
    hot: dict[str, int] = {}
    for metric, value in _rows(temperature):
        if value >= thermal_limit_c:
            node = str(metric["node_id"])
            hot[node] = hot.get(node, 0) + 1
    return {
        node: NodeHealth(ecc_errors=round(errors.get(node, 0.0)), thermal_warnings=hot.get(node, 0))
        for node in sorted(errors.keys() | hot.keys())
    }


def query_tsdb(url: str, expr: str, timeout: float) -> list[Any]:
    """An instant query's result vector (blocking: run it in a thread)."""
    base = url if "://" in url else "http://" + url
    params = urllib.parse.urlencode({"query": expr, "nocache": "1"})
    try:
        with urllib.request.urlopen(
            f"{base.rstrip('/')}/api/v1/query?{params}", timeout=timeout
        ) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise HealthUnavailable(f"the TSDB answered {e.code}") from None
    except (OSError, ValueError) as e:
        raise HealthUnavailable(f"the TSDB cannot be reached ({type(e).__name__})") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise HealthUnavailable("the TSDB sent an answer that is not a query result")
    result = (body.get("data") or {}).get("result")
    return result if isinstance(result, list) else []


class TsdbHealth:
    """The broker's source of node health signals: the TSDB at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        thermal_limit_c: float = DEFAULT_THERMAL_LIMIT_C,
        query: Query = query_tsdb,
    ) -> None:
        self.url = url
        self.queries = health_queries(window_seconds)
        self.thermal_limit_c = thermal_limit_c
        self.query = query
        self.available: bool | None = None  # None: not asked yet

    async def read(self) -> dict[str, NodeHealth]:
        """Every node's signals; {} while the TSDB does not answer."""
        try:
            ecc, temp = await asyncio.gather(
                asyncio.to_thread(self.query, self.url, self.queries["ecc"], QUERY_TIMEOUT),
                asyncio.to_thread(self.query, self.url, self.queries["temperature"], QUERY_TIMEOUT),
            )
        except HealthUnavailable as e:
            if self.available is not False:
                log.warning("node health signals unavailable (%s): ECC and thermal not counted", e)
            self.available = False
            return {}
        if self.available is False:
            log.info("node health signals are back")
        self.available = True
        return node_health(ecc, temp, self.thermal_limit_c)
