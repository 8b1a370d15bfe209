"""The alert rules of ``manifests/monitoring/prometheusrule.yaml`` for tests: the rules as
dicts (:func:`alert_rules`), the PrometheusRule's ``.spec`` as a plain Prometheus rule file
(:func:`rule_file_text`, what ``promtool`` reads) and the vector selectors inside a PromQL
expression (:func:`metric_selectors`), so each can be queried on its own.

``python tests/monitoring.py rules`` prints the rule file (for running ``promtool`` by hand).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
RULE_FILE = MONITORING / "prometheusrule.yaml"
UNIT_TESTS = MONITORING / "tests" / "alerts.test.yaml"
RULES_NAME = "crosskd-rules.yaml"
"""The rule file's name that ``UNIT_TESTS`` loads (``rule_files``), next to itself."""

# Words that are never a metric name where they stand: binary and set operators, modifiers,
# the grouping keywords (each followed by a label list) and the float literals.
_KEYWORDS = {"and", "or", "unless", "atan2", "bool", "offset", "inf", "nan"}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NUMBER = re.compile(
    r"0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
    r"(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?"
)


def prometheus_rule() -> dict:
    """The PrometheusRule object of ``manifests/monitoring/prometheusrule.yaml``."""
    return yaml.safe_load(RULE_FILE.read_text(encoding="utf-8"))


def rule_file_text() -> str:
    """The PrometheusRule's ``.spec`` (its ``groups``) as a Prometheus rule file."""
    return yaml.safe_dump(prometheus_rule()["spec"], sort_keys=False)


def alert_rules() -> list[dict]:
    """Every alerting rule, in file order: the rule's own keys (``alert``, ``expr``, ``for``,
    ``labels``, ``annotations``) plus ``name`` (the same as ``alert``)."""
    return [
        {"name": rule["alert"], **rule}
        for group in prometheus_rule()["spec"]["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabeling (actions keep, drop and replace) of one target's labels."""
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace")
        value = config.get("separator", ";").join(
            labels.get(s, "") for s in config.get("sourceLabels", [])
        )
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if (action == "keep" and not match) or (action == "drop" and match):
            return None
        if action == "replace" and match:
            template = re.sub(r"\$\{(\w+)\}|\$(\w+)", r"\\g<\1\2>", config.get("replacement", "$1"))
            labels[config["targetLabel"]] = match.expand(template)
        assert action in ("keep", "drop", "replace"), action
    return labels


def _skip_string(expr: str, i: int) -> int:
    """The index after the string literal that starts at ``expr[i]``."""
    quote = expr[i]
    i += 1
    while i < len(expr) and expr[i] != quote:
        i += 2 if expr[i] == "\\" and quote != "`" else 1
    return i + 1


def _skip_group(expr: str, i: int, close: str) -> int:
    """The index after the bracket that closes the one at ``expr[i]`` (strings skipped)."""
    opening, depth = expr[i], 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
            continue
        depth += (char == opening) - (char == close)
        i += 1
        if depth == 0:
            return i
    raise ValueError(f"unclosed {opening!r} in {expr!r}")


def _skip_space(expr: str, i: int) -> int:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return i


def metric_selectors(expr: str) -> list[str]:
    """Every vector selector in the PromQL ``expr``, once each, in order of appearance: the
    metric name with its label matchers as written (``up{app="x"}``), without a range, a
    subquery, ``offset`` or ``@``. Functions, aggregations, grouping label lists
    (``by (namespace, job)``), strings, numbers and durations are not selectors; a selector of
    matchers only (``{__name__="x"}``) is one.

    Raises:
        ValueError: A bracket or a string is not closed.
    """
    found: list[str] = []
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "#":
            end = expr.find("\n", i)
            i = len(expr) if end < 0 else end
        elif char == "[":
            i = _skip_group(expr, i, "]")
        elif char == "{":
            end = _skip_group(expr, i, "}")
            found.append(expr[i:end])
            i = end
        elif char.isdigit() or (char == "." and expr[i + 1 : i + 2].isdigit()):
            i = _NUMBER.match(expr, i).end()
        elif match := _IDENT.match(expr, i):
            word, i = match.group(), match.end()
            after = _skip_space(expr, i)
            nxt = _IDENT.match(expr, after)
            if word.lower() in _GROUPING and expr[after : after + 1] == "(":
                i = _skip_group(expr, after, ")")
            elif word.lower() == "offset":
                i = _skip_space(expr, after + (expr[after : after + 1] == "-"))
                i = number.end() if (number := _NUMBER.match(expr, i)) else i
            elif (
                word.lower() in _KEYWORDS
                or expr[after : after + 1] == "("
                or (word in _AGGREGATIONS and nxt and nxt.group() in ("by", "without"))
            ):
                continue
            elif expr[after : after + 1] == "{":
                i = _skip_group(expr, after, "}")
                found.append(word + expr[after:i])
            else:
                found.append(word)
        else:
            i += 1
    return list(dict.fromkeys(found))


def selector_name(selector: str) -> str | None:
    """The metric name of a selector from :func:`metric_selectors` (None: matchers only and
    no ``__name__="..."`` among them)."""
    if match := _IDENT.match(selector):
        return match.group()
    named = re.search(r"""__name__\s*=\s*["'`]([^"'`]+)["'`]""", selector)
    return named.group(1) if named else None


if __name__ == "__main__":
    if sys.argv[1:] != ["rules"]:
        sys.exit("usage: python tests/monitoring.py rules   (prints the alert rule file)")
    sys.stdout.write(rule_file_text())
