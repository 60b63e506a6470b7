"""Grafana dashboards and alert rules only name metrics that exist (issue "Observability").

``infra/grafana/*.json`` and ``infra/alerting/*.yml`` are checked against what the
components really export, so that renaming a metric in code (or a typo in a panel) fails
here instead of showing an empty panel or an alert that can never fire.

What exists is found two ways:

* **by importing** every module of every component package under ``packages/*/src``
  (walked with :mod:`pkgutil`; client and test packages are left out, a module that fails
  to import on this machine is skipped with its reason recorded) and reading the default
  :data:`prometheus_client.REGISTRY`, which is what each daemon serves on ``/metrics``.
  Each family is expanded to the series names the exposition format really has
  (``_total``/``_created`` for counters, ``_bucket``/``_count``/``_sum``/``_created`` for
  histograms, ...).
* **by reading the source** with :mod:`ast`: metric constructors with a literal name give
  the label names of every metric (a labelled metric without children has no samples to
  read them from), and the metrics created lazily inside a function, which importing does
  not register.

Next to them are the node agents' telemetry series pushed to the TSDB: the names of
``lattice_agent.telemetry.samples.CATALOG`` with the labels of ``AllocLabels``.

Every PromQL expression of the dashboards (panel targets, variable queries) and of the
rules is read with a small name extractor (tested on its own below), and each selector's
metric name and matcher labels are looked up. Names the specification lists but no
component exports are kept out of the dashboards and listed in ``infra/grafana/README.md``
under "Not exported yet"; that list is checked too, so it cannot go stale silently.
When ``vmalert`` or ``promtool`` is installed the rule files (and every dashboard
expression, as a recording rule) are also syntax-checked by it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "infra" / "grafana"
ALERTING = ROOT / "infra" / "alerting"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
RULE_FILES = sorted([*ALERTING.glob("*.yml"), *ALERTING.glob("*.yaml")])

#: packages under packages/*/src that run no /metrics endpoint (clients, test code)
NOT_COMPONENTS = {
    "lattice_cli": "command-line client",
    "lattice_sdk": "client library",
    "lattice_test_harness": "test code",
    "lattice_acceptance": "test code",
}
#: generated or never-run-by-a-daemon modules not worth importing
SKIPPED_MODULES = ("lattice_common.proto", "lattice_accounting.migrations")

#: labels the scraper (vmagent/Prometheus) adds to every scraped series
SCRAPE_LABELS = frozenset({"instance", "job"})
SEVERITIES = ("critical", "warning", "info")
DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")


# ======================================================================================
# PromQL metric-name extractor
# ======================================================================================

#: PromQL functions (Prometheus 2.x/3.x) and the MetricsQL ones worth allowing
FUNCTIONS = frozenset(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time days_in_month day_of_month
    day_of_week day_of_year deg delta deriv double_exponential_smoothing exp floor
    histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev
    histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets
    round scalar sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt
    stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector year
    start end keep_last_value increase_pure rollup tlast_over_time tfirst_over_time
    range_first range_last label_set label_del label_keep union
    """.split()  # noqa: SIM905 (a word list)
)
#: aggregation operators (case-insensitive, like every PromQL keyword)
AGGREGATORS = frozenset(
    """
    sum avg count min max group stddev stdvar topk bottomk quantile count_values limitk
    limit_ratio
    """.split()  # noqa: SIM905 (a word list)
)
#: keywords followed by a parenthesised list of label names
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
#: binary-operator and modifier keywords (never metric names)
OPERATOR_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "atan2", "offset", "keep_metric_names", "default"}
)
NUMBER_WORDS = frozenset({"inf", "nan"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])            # Grafana template variables
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z0-9]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@:])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str
    text: str


@dataclass(frozen=True)
class Selector:
    """One metric named in an expression, with the label names of its matchers."""

    name: str
    labels: frozenset[str] = frozenset()


def tokenize(expr: str) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected character {expr[pos]!r} at {pos} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, m.group()))
    return tokens


def _closing(tokens: list[Token], i: int, expr: str) -> int:
    """Index of the bracket closing the one at ``i``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[tokens[i].text]]
    for j in range(i + 1, len(tokens)):
        t = tokens[j]
        if t.kind != "op":
            continue
        if t.text in pairs:
            stack.append(pairs[t.text])
        elif t.text in (")", "]", "}"):
            if t.text != stack.pop():
                raise ValueError(f"unbalanced {t.text!r} in {expr!r}")
            if not stack:
                return j
    raise ValueError(f"unclosed {tokens[i].text!r} in {expr!r}")


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return bytes(text[1:-1], "utf-8").decode("unicode_escape")


def _matchers(tokens: list[Token], start: int, end: int, expr: str) -> tuple[set[str], str]:
    """Label names of the matchers in ``tokens[start:end]`` (inside ``{}``) and the metric
    name a ``__name__="..."`` matcher gives (else "")."""
    labels: set[str] = set()
    name = ""
    i = start
    while i < end:
        t = tokens[i]
        if t.text == "," or t.text.lower() == "or":  # MetricsQL allows {a="b" or c="d"}
            i += 1
            continue
        if i + 2 >= end or t.kind not in ("ident", "string"):
            raise ValueError(f"bad label matchers in {expr!r}")
        op, value = tokens[i + 1], tokens[i + 2]
        label = t.text if t.kind == "ident" else _unquote(t.text)
        if op.text not in ("=", "!=", "=~", "!~") or value.kind not in ("string", "var"):
            raise ValueError(f"bad label matcher {label!r} in {expr!r}")
        if label == "__name__":
            if op.text != "=" or value.kind != "string":
                raise ValueError(f"cannot check a __name__ {op.text} matcher in {expr!r}")
            name = _unquote(value.text)
        else:
            labels.add(label)
        i += 3
    return labels, name


def selectors(expr: str) -> list[Selector]:
    """Every metric selector of a PromQL (or plain MetricsQL) expression, in order."""
    tokens = tokenize(expr)
    out: list[Selector] = []
    i = depth = 0
    while i < len(tokens):
        t = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if t.kind == "op" and t.text == "[":  # range, subquery: durations only
            i = _closing(tokens, i, expr) + 1
        elif t.kind == "op" and t.text == "{":  # a selector with no name in front
            end = _closing(tokens, i, expr)
            labels, name = _matchers(tokens, i + 1, end, expr)
            if name:
                out.append(Selector(name, frozenset(labels)))
            i = end + 1
        elif t.kind == "ident":
            low = t.text.lower()
            if low in LABEL_LIST_KEYWORDS:
                if nxt is not None and nxt.text == "(":
                    i = _closing(tokens, i + 1, expr) + 1
                else:
                    i += 1
            elif low in OPERATOR_KEYWORDS or low in NUMBER_WORDS:
                i += 1
            elif nxt is not None and nxt.text == "(":
                if t.text not in FUNCTIONS and low not in AGGREGATORS:
                    raise ValueError(f"unknown function {t.text!r} in {expr!r}")
                i += 1
            elif low in AGGREGATORS and nxt is not None and nxt.text.lower() in ("by", "without"):
                i += 1
            else:
                labels: set[str] = set()
                i += 1
                if nxt is not None and nxt.text == "{":
                    end = _closing(tokens, i, expr)
                    labels, name = _matchers(tokens, i + 1, end, expr)
                    if name and name != t.text:
                        raise ValueError(f"two metric names {t.text!r}, {name!r} in {expr!r}")
                    i = end + 1
                out.append(Selector(t.text, frozenset(labels)))
        else:
            if t.kind == "op" and t.text in ("(", ")"):
                depth += 1 if t.text == "(" else -1
            if depth < 0 or t.text in ("]", "}"):
                raise ValueError(f"unbalanced {t.text!r} in {expr!r}")
            i += 1
    if depth:
        raise ValueError(f"unclosed '(' in {expr!r}")
    return out


def metric_names(expr: str) -> set[str]:
    return {s.name for s in selectors(expr)}


_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?P<expr>.*?)\s*(?:,\s*(?P<label>\w+)\s*)?\)\s*$", re.S
)
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.S)
_NO_METRICS = re.compile(r"^\s*(?:label_names\(.*\)|metrics\(.*\))\s*$", re.S)


def variable_query_exprs(query: str) -> list[str]:
    """The PromQL inside a Grafana Prometheus variable query: ``label_values(expr, label)``
    (``label`` is a label, not a metric), ``label_values(label)``, ``query_result(expr)``,
    ``label_names()``, ``metrics(regex)``."""
    if not query.strip() or _NO_METRICS.match(query):
        return []
    m = _LABEL_VALUES.match(query)
    if m:
        if m.group("label") is None:  # label_values(label): every series, no metric
            return []
        return [m.group("expr")]
    m = _QUERY_RESULT.match(query)
    if m:
        return [m.group("expr")]
    return [query]


# ======================================================================================
# What the components export
# ======================================================================================

#: exposition suffixes by family type (prometheus_client, text and OpenMetrics format)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
CLASS_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "Info": "info",
    "Enum": "stateset",
    # collectors that build their families at scrape time (lattice_api.cluster_metrics)
    "GaugeMetricFamily": "gauge",
    "CounterMetricFamily": "counter",
}


def family_name(name: str, kind: str) -> str:
    """The family name prometheus_client gives the name passed to a constructor."""
    if kind == "counter" and name.endswith("_total"):
        return name[: -len("_total")]
    if kind == "info" and name.endswith("_info"):
        return name[: -len("_info")]
    return name


def series_names(family: str, kind: str) -> dict[str, frozenset[str]]:
    """Series name -> the labels that series adds to the family's (``le``, ``quantile``)."""
    extra = {"_bucket": frozenset({"le"})}
    out = {family + s: extra.get(s, frozenset()) for s in SUFFIXES.get(kind, ("",))}
    if kind == "summary":
        out[family] = frozenset({"quantile"})
    if kind == "stateset":
        out[family] = frozenset({family})
    return out


@dataclass(frozen=True)
class Constructor:
    """A metric constructor found in the source."""

    module: str
    line: int
    family: str
    kind: str
    labels: frozenset[str]
    lazy: bool  # inside a function: registered on first use, not on import
    default_registry: bool


@dataclass(frozen=True)
class Series:
    name: str
    labels: frozenset[str] | None  # None: unknown, not checked
    origin: str


@dataclass
class Catalog:
    """Every series name a dashboard or rule may use."""

    series: dict[str, Series] = field(default_factory=dict)
    skipped_modules: dict[str, str] = field(default_factory=dict)
    constructors: list[Constructor] = field(default_factory=list)
    registry_families: dict[str, str] = field(default_factory=dict)  # name -> type

    def add_family(self, family: str, kind: str, labels: frozenset[str] | None, origin: str):
        for name, extra in series_names(family, kind).items():
            known = None if labels is None else labels | extra | SCRAPE_LABELS
            old = self.series.get(name)
            if old is not None and old.labels is not None:  # merge what each source knows
                known = old.labels if known is None else known | old.labels
            self.series[name] = Series(name, known, old.origin if old else origin)


def component_packages() -> Iterator[tuple[str, Path]]:
    for init in sorted(ROOT.glob("packages/*/src/*/__init__.py")):
        if init.parent.name not in NOT_COMPONENTS:
            yield init.parent.name, init.parent


def import_components() -> dict[str, str]:
    """Import every module of every component package; module -> why it was skipped."""
    skipped: dict[str, str] = {}

    def onerror(name: str) -> None:  # a subpackage that failed while walking
        e = sys.exc_info()[1]
        skipped[name] = f"{type(e).__name__}: {e}"

    for pkg, path in component_packages():
        try:
            importlib.import_module(pkg)
        except Exception as e:
            skipped[pkg] = f"{type(e).__name__}: {e}"
            continue
        for info in pkgutil.walk_packages([str(path)], pkg + ".", onerror=onerror):
            name = info.name
            if name.rsplit(".", 1)[-1] == "__main__" or any(
                name == x or name.startswith(x + ".") for x in SKIPPED_MODULES
            ):
                continue
            try:
                importlib.import_module(name)
            except Exception as e:  # an optional dependency missing on this machine
                skipped[name] = f"{type(e).__name__}: {e}"
    return skipped


def _literal_strings(node: ast.AST | None) -> frozenset[str] | None:
    if node is None:
        return frozenset()
    if isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return frozenset(e.value for e in node.elts)  # type: ignore[union-attr]
    return None


def source_constructors(source: str, module: str) -> list[Constructor]:
    """The prometheus_client metric constructors of one module with a literal name."""
    tree = ast.parse(source)
    classes: dict[str, str] = {}  # local name -> metric kind
    modules: set[str] = set()  # local names of the prometheus_client module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client"):
            for a in node.names:
                if a.name in CLASS_TYPES:
                    classes[a.asname or a.name] = CLASS_TYPES[a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "prometheus_client":
                    modules.add(a.asname or a.name)
    out: list[Constructor] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Call):
                kind = _constructor_kind(child.func, classes, modules)
                if kind is not None:
                    c = _constructor(child, kind, module, in_function)
                    if c is not None:
                        out.append(c)
            visit(child, inner)

    visit(tree, False)
    return out


def _constructor_kind(func: ast.AST, classes: dict[str, str], modules: set[str]) -> str | None:
    if isinstance(func, ast.Name):
        return classes.get(func.id)
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in modules
    ):
        return CLASS_TYPES.get(func.attr)
    return None


def _constructor(call: ast.Call, kind: str, module: str, lazy: bool) -> Constructor | None:
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    args = list(call.args)
    name_node = args[0] if args else kw.get("name")
    if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)):
        return None  # a computed name: only the registry knows it
    parts = []
    for key in ("namespace", "subsystem"):
        v = kw.get(key)
        if isinstance(v, ast.Constant) and v.value:
            parts.append(str(v.value))
    name = "_".join([*parts, name_node.value])
    labels = _literal_strings(args[2] if len(args) > 2 else kw.get("labelnames", kw.get("labels")))
    registry = kw.get("registry")
    default = registry is None or (isinstance(registry, ast.Name) and registry.id == "REGISTRY")
    if kind == "stateset" and labels is not None:
        labels = labels | {name}
    return Constructor(
        module,
        call.lineno,
        family_name(name, kind),
        kind,
        labels if labels is not None else frozenset(),
        lazy,
        default,
    )


def telemetry_series() -> dict[str, frozenset[str]]:
    """The series the node agents push to the TSDB, with their labels."""
    from lattice_agent.telemetry.samples import AGGS, CATALOG, AllocLabels

    labels = frozenset(k for k, _ in AllocLabels("a", "n").pairs(AGGS[0]))
    return {name: labels for name in CATALOG}


@functools.cache
def catalog() -> Catalog:
    from prometheus_client import REGISTRY

    cat = Catalog()
    cat.skipped_modules = import_components()
    for _pkg, path in component_packages():
        for file in sorted(path.rglob("*.py")):
            parts = list(file.relative_to(path.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join(parts)
            if any(module == x or module.startswith(x + ".") for x in SKIPPED_MODULES):
                continue
            cat.constructors += source_constructors(file.read_text(encoding="utf-8"), module)
    declared: dict[str, frozenset[str]] = {}
    for c in cat.constructors:
        if c.default_registry:
            declared[c.family] = declared.get(c.family, frozenset()) | c.labels
    for fam in REGISTRY.collect():
        cat.registry_families[fam.name] = fam.type
        if fam.samples:
            labels: frozenset[str] | None = frozenset(
                k for s in fam.samples for k in s.labels if k not in ("le", "quantile")
            )
        else:
            labels = declared.get(fam.name)
        cat.add_family(fam.name, fam.type, labels, "registry")
        for s in fam.samples:  # custom collectors may expose anything
            if s.name not in cat.series:
                cat.series[s.name] = Series(s.name, None, "registry")
    for c in cat.constructors:  # lazy metrics, and those of modules that failed to import
        if c.default_registry and c.family not in cat.registry_families:
            cat.add_family(c.family, c.kind, c.labels, f"source {c.module}:{c.line}")
    for name, labels in telemetry_series().items():
        cat.series[name] = Series(name, labels, "telemetry push")
    return cat


# ======================================================================================
# What the dashboards and rules use
# ======================================================================================


@dataclass(frozen=True)
class Use:
    where: str  # file and panel/rule
    expr: str


def dashboard_uses(doc: dict[str, Any], fname: str) -> Iterator[Use]:
    for v in doc.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            text = q.get("query", "") if isinstance(q, dict) else (q or "")
            for expr in variable_query_exprs(text):
                yield Use(f"{fname} variable ${v.get('name')}", expr)
    for panel in all_panels(doc):
        for t in panel.get("targets", []):
            if t.get("expr"):
                yield Use(f"{fname} panel {panel.get('title')!r} {t.get('refId')}", t["expr"])
    for a in doc.get("annotations", {}).get("list", []):
        if a.get("expr"):
            yield Use(f"{fname} annotation {a.get('name')!r}", a["expr"])


def rule_uses(doc: dict[str, Any], fname: str) -> Iterator[Use]:
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            yield Use(f"{fname} {rule.get('alert') or rule.get('record')}", str(rule["expr"]))


def all_panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in doc.get("panels", []):
        yield p
        yield from p.get("panels", [])  # a collapsed row keeps its panels inside


def check_uses(uses: Iterable[Use], known: dict[str, Series]) -> list[str]:
    """Problems: a metric nobody exports, a label that metric does not have, an expression
    the extractor cannot read."""
    problems = []
    for use in uses:
        try:
            found = selectors(use.expr)
        except ValueError as e:
            problems.append(f"{use.where}: {e}")
            continue
        if not found:
            problems.append(f"{use.where}: no metric in {use.expr!r}")
        for sel in found:
            series = known.get(sel.name)
            if series is None:
                problems.append(f"{use.where}: {sel.name} is not exported by any component")
            elif series.labels is not None and not sel.labels <= series.labels:
                extra = ", ".join(sorted(sel.labels - series.labels))
                problems.append(
                    f"{use.where}: {sel.name} has no label {extra} "
                    f"(it has {', '.join(sorted(series.labels))})"
                )
    return problems


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in DASHBOARDS}


def load_rules() -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in RULE_FILES}


def every_use() -> list[Use]:
    uses: list[Use] = []
    for fname, doc in load_dashboards().items():
        uses += dashboard_uses(doc, fname)
    for fname, doc in load_rules().items():
        uses += rule_uses(doc, fname)
    return uses


def not_exported_list() -> list[str]:
    """The names in README.md's "Not exported yet" section."""
    text = (GRAFANA / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Not exported yet\n(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "infra/grafana/README.md has no '## Not exported yet' section"
    return re.findall(r"^\|\s*`([a-z_:][a-z0-9_:]*)`", m.group("body"), re.M)


# ======================================================================================
# Tests: the extractor
# ======================================================================================


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up_foo", {"up_foo"}),
        (
            'histogram_quantile(0.99, sum by (le, vcluster) (rate(x_bucket{vcluster=~"$vcluster"}'
            "[$__rate_interval])))",
            {"x_bucket"},
        ),
        (
            "sum(rate(a_total[5m])) by (job) / on(job) group_left(team) b_info",
            {"a_total", "b_info"},
        ),
        ("a * on (instance) group_left c", {"a", "c"}),
        ("sum without (instance, job) (x) and ignoring(le) y unless z or w", {"x", "y", "z", "w"}),
        ("sum BY (le) (x) > BOOL 1", {"x"}),
        ("sum by(vcluster)(x)", {"x"}),
        ('{__name__="foo", job="x"}', {"foo"}),
        ('label_replace(m, "dst", "$1 sum(x) by", "src", "(.*)")', {"m"}),
        ('x{a="b\\"c", d!~`e"f`}', {"x"}),
        ("max_over_time(rate(m[5m])[1h:1m] offset 1d)", {"m"}),
        ("rate(m[5m] @ end()) + n @ 1609746000 - o offset -5m", {"m", "n", "o"}),
        ('count_values("version", build_version)', {"build_version"}),
        ("topk(5, x) > 0.5 and quantile(0.9, y) < 1e3", {"x", "y"}),
        ("1e3 * Inf + NaN - 0x1F / .5", set()),
        ("vector(1) or absent(bar) or time() - baz", {"bar", "baz"}),
        ("job:rate5m:sum / scalar(s)", {"job:rate5m:sum", "s"}),
        ("# a comment naming not_a_metric\nfoo", {"foo"}),
        ('sum by (le) (rate(m{agg="$agg", node_id=~"${node}"}[$__interval]))', {"m"}),
        ("(max(l) < 1) or absent(l)", {"l"}),
        ("count by (s) (g == 1)", {"g"}),
        ("sum(increase(c[$__range])) or vector(0)", {"c"}),
    ],
)
def test_extractor_finds_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_extractor_reports_matcher_labels() -> None:
    (sel,) = selectors('rate(x_total{vcluster=~"$vcluster", result="rejected"}[5m])')
    assert sel == Selector("x_total", frozenset({"vcluster", "result"}))
    # labels of by()/on() lists are not matchers
    assert selectors("sum by (node) (y) / on (node) z") == [Selector("y"), Selector("z")]


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(x[5m])",  # unclosed
        "x)",  # unbalanced
        "rat(x[5m])",  # typo in a function: would otherwise hide a wrong query
        '{__name__=~"lattice_.*"}',  # a regex name cannot be checked
        "x{a=b}",  # a matcher value must be a string
    ],
)
def test_extractor_refuses_what_it_cannot_check(expr: str) -> None:
    with pytest.raises(ValueError):
        selectors(expr)


@pytest.mark.parametrize(
    ("query", "exprs"),
    [
        ('label_values(lattice_x{a="b"}, vcluster)', ['lattice_x{a="b"}']),
        ("label_values(node_id)", []),
        ("query_result(topk(3, y))", ["topk(3, y)"]),
        ("label_names()", []),
        ("metrics(lattice_.*)", []),
    ],
)
def test_variable_queries(query: str, exprs: list[str]) -> None:
    assert variable_query_exprs(query) == exprs


# ======================================================================================
# Tests: the exported-name discovery and the checker
# ======================================================================================


def test_suffixes_match_prometheus_client() -> None:
    """Our suffix table gives the names prometheus_client really exposes."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
    from prometheus_client.exposition import generate_latest

    reg = CollectorRegistry()
    made = [
        (Counter("t_a_total", "", registry=reg), "t_a_total", "counter"),
        (Counter("t_b", "", registry=reg), "t_b", "counter"),
        (Gauge("t_c_total", "", registry=reg), "t_c_total", "gauge"),
        (Histogram("t_d_seconds", "", registry=reg), "t_d_seconds", "histogram"),
        (Summary("t_e_seconds", "", registry=reg), "t_e_seconds", "summary"),
    ]
    exposed = {
        line.split("{")[0].split(" ")[0]
        for line in generate_latest(reg).decode().splitlines()
        if line and not line.startswith("#")
    }
    expected = set()
    for _metric, name, kind in made:
        expected |= set(series_names(family_name(name, kind), kind))
    expected.discard("t_e_seconds")  # the Python client exports no summary quantiles
    assert exposed == expected


def test_source_constructors() -> None:
    src = (
        "import prometheus_client as pc\n"
        "from prometheus_client import Counter as C, Histogram\n"
        "A = C('x_total', 'doc', ['vcluster'])\n"
        "B = Histogram(name='y_seconds', documentation='', labelnames=('a', 'b'))\n"
        "P = pc.Gauge('z', '', namespace='ns', registry=None)\n"
        "def lazy():\n"
        "    from prometheus_client import Gauge\n"
        "    return Gauge('w', '')\n"
        "D = C(NAME, 'computed')\n"
    )
    got = {c.family: c for c in source_constructors(src, "m")}
    assert set(got) == {"x", "y_seconds", "ns_z", "w"}
    assert got["x"].labels == {"vcluster"} and got["x"].kind == "counter"
    assert got["y_seconds"].labels == {"a", "b"}
    assert not got["ns_z"].default_registry
    assert got["w"].lazy and not got["x"].lazy


def test_components_are_imported() -> None:
    cat = catalog()
    for pkg, _ in component_packages():
        assert pkg not in cat.skipped_modules, cat.skipped_modules[pkg]
    if cat.skipped_modules:  # recorded, not hidden: their metrics still come from the source
        lines = "\n".join(f"  {m}: {why}" for m, why in sorted(cat.skipped_modules.items()))
        warnings.warn(f"modules not importable here, read from source only:\n{lines}", stacklevel=1)


def test_import_discovery_agrees_with_the_source() -> None:
    """Every module-level metric of an imported module is in the registry (so discovery by
    import really sees the components' metrics), with the type the source says."""
    cat = catalog()
    missing = [
        f"{c.module}:{c.line} {c.family}"
        for c in cat.constructors
        if not c.lazy
        and c.default_registry
        and c.module not in cat.skipped_modules
        and cat.registry_families.get(c.family) != c.kind
    ]
    assert not missing, missing


def test_catalog_has_the_components_and_telemetry() -> None:
    known = catalog().series
    for name in (
        "lattice_scheduling_cycle_duration_seconds_bucket",
        "lattice_raft_leader",
        "lattice_api_requests_total",
        "lattice_agent_telemetry_push_failures_total",  # Counter named without _total
        "lattice_nodes_total",  # a Gauge: no suffix added, none removed
        "lattice_agent_cgroups_available",  # created lazily
        "process_resident_memory_bytes",
        "cpu_utilization",
    ):
        assert name in known, name
    assert "lattice_agent_telemetry_push_failures" not in known
    assert known["cpu_utilization"].labels == {
        "alloc_id",
        "node_id",
        "tenant",
        "user",
        "vcluster",
        "agg",
    }
    assert known["lattice_scheduling_cycle_duration_seconds_bucket"].labels == {
        "vcluster",
        "le",
        "instance",
        "job",
    }


def test_checker_fails_on_a_renamed_metric() -> None:
    """The exporter side: if code renames a metric, dashboards using the old name fail."""
    doc = {
        "panels": [
            {
                "id": 1,
                "title": "Cycle",
                "targets": [
                    {
                        "refId": "A",
                        "expr": "histogram_quantile(0.99, sum by (le) "
                        "(rate(lattice_scheduling_cycle_duration_seconds_bucket[5m])))",
                    },
                    {"refId": "B", "expr": 'lattice_scheduling_queue_depth{vcluster="hpc"}'},
                ],
            }
        ]
    }
    before = Catalog()
    before.add_family("lattice_scheduling_cycle_duration_seconds", "histogram", frozenset(), "x")
    before.add_family("lattice_scheduling_queue_depth", "gauge", frozenset({"vcluster"}), "x")
    assert check_uses(dashboard_uses(doc, "d.json"), before.series) == []

    renamed = Catalog()
    renamed.add_family("lattice_scheduling_cycle_seconds", "histogram", frozenset(), "x")
    renamed.add_family("lattice_scheduling_queue_depth", "gauge", frozenset({"vcluster_id"}), "x")
    problems = check_uses(dashboard_uses(doc, "d.json"), renamed.series)
    assert len(problems) == 2
    assert "lattice_scheduling_cycle_duration_seconds_bucket is not exported" in problems[0]
    assert "'Cycle' A" in problems[0]
    assert "has no label vcluster" in problems[1]


# ======================================================================================
# Tests: the dashboards and rules themselves
# ======================================================================================


def test_every_metric_used_is_exported() -> None:
    uses = every_use()
    assert uses, "no dashboards or rules found"
    problems = check_uses(uses, catalog().series)
    assert not problems, "\n".join(problems)


def test_dashboards_are_present() -> None:
    names = {p.name for p in DASHBOARDS}
    assert {
        "lattice-overview.json",
        "lattice-scheduler.json",
        "lattice-agents.json",
        "lattice-allocation.json",
    } <= names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["uid"] and len(doc["uid"]) <= 40 and doc["title"]
    assert 36 <= doc["schemaVersion"] <= 41
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["DS"]["type"] == "datasource" and variables["DS"]["query"] == "prometheus"
    panels = list(all_panels(doc))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), f"duplicate panel titles in {path.name}"
    for p in panels:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS}" and t["expr"].strip(), p["title"]
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var.startswith("__") or var in variables, (p["title"], var)
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${DS}", v["name"]


def test_dashboard_uids_and_titles_are_unique() -> None:
    docs = load_dashboards().values()
    uids = [d["uid"] for d in docs]
    titles = [d["title"] for d in docs]
    assert len(uids) == len(set(uids)) and len(titles) == len(set(titles))


def test_rules_have_required_fields() -> None:
    rules = load_rules()
    assert rules, "no rule files in infra/alerting"
    names: list[str] = []
    for fname, doc in rules.items():
        groups = doc["groups"]
        assert len({g["name"] for g in groups}) == len(groups), fname
        for g in groups:
            if "interval" in g:
                assert DURATION.match(str(g["interval"])), (fname, g["name"])
            assert g["rules"], (fname, g["name"])
            for r in g["rules"]:
                if "record" in r:
                    assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", r["record"]), r
                    continue
                where = f"{fname} {r.get('alert')}"
                assert re.fullmatch(r"Lattice[A-Z][A-Za-z0-9]+", r["alert"]), where
                assert isinstance(r["expr"], str) and r["expr"].strip(), where
                assert DURATION.match(str(r.get("for", "0s"))), where
                assert r["labels"]["severity"] in SEVERITIES, where
                assert r["annotations"]["summary"].strip(), where
                assert r["annotations"]["description"].strip(), where
                names.append(r["alert"])
    assert len(names) == len(set(names)), "duplicate alert names"


def test_not_exported_list_is_current() -> None:
    """Names README.md lists as "not exported yet" are indeed not exported: once a
    component exports one, move it to a dashboard and off the list."""
    listed = not_exported_list()
    assert listed, "the 'Not exported yet' list is empty"
    cat = catalog()
    exported = set(cat.series) | set(cat.registry_families)
    now_exported = sorted(n for n in listed if n in exported)
    assert not now_exported, f"exported now, update infra/grafana/README.md: {now_exported}"


# ======================================================================================
# Tests: syntax check by vmalert / promtool when installed
# ======================================================================================

_VARIABLE_VALUES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def _as_plain_promql(expr: str) -> str:
    """A dashboard expression with its Grafana variables replaced by plain values."""

    def sub(m: re.Match[str]) -> str:
        name = (m.group(1) or m.group(2)).split(":")[0]
        return _VARIABLE_VALUES.get(name, "x")

    return re.sub(r"\$\{([^}]*)\}|\$(\w+)", sub, expr)


def _dashboard_rule_file(tmp_path: Path) -> Path:
    rules = [
        {"record": f"lattice:dashboard_check:{i}", "expr": _as_plain_promql(u.expr)}
        for i, u in enumerate(u for u in every_use() if ".json" in u.where)
    ]
    out = tmp_path / "dashboards-as-rules.yml"
    out.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return out


def test_rules_and_queries_parse_with_vmalert_or_promtool(tmp_path: Path) -> None:
    vmalert, promtool = shutil.which("vmalert"), shutil.which("promtool")
    if not (vmalert or promtool):
        pytest.skip("neither vmalert nor promtool is installed")
    files = [*RULE_FILES, _dashboard_rule_file(tmp_path)]
    for f in files:
        if vmalert:
            r = subprocess.run(
                [vmalert, "-dryRun", f"-rule={f}", "-loggerLevel=ERROR"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, f"vmalert rejects {f.name}:\n{r.stdout}{r.stderr}"
        if promtool:
            r = subprocess.run(
                [promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60
            )
            assert r.returncode == 0, f"promtool rejects {f.name}:\n{r.stdout}{r.stderr}"
