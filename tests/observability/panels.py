"""The dashboards as Grafana reads them: every panel's queries, and its template variables substituted.

Pure functions over the JSON files, so the live test (test_dashboards_live.py) and the chart tests read the
dashboards the same way. Grafana writes a variable as `$name`, `${name}`, `${name:format}` or `[[name]]`;
an unknown name is an error here (Grafana would send the text as it is and Prometheus would refuse it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.procs import ROOT

DASHBOARDS = ROOT / "charts" / "embedfleet" / "dashboards"
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\s*\)$")


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def where(self) -> str:
        return f"dashboard {self.dashboard!r}, panel {self.panel!r}, query {self.ref_id}"


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves are not panels with queries."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(dashboard: Mapping[str, Any]) -> Iterator[Query]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield Query(dashboard["title"], panel["title"], target.get("refId", "?"), target["expr"])


def variables(dashboard: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return dashboard.get("templating", {}).get("list", [])


def substitute(text: str, values: Mapping[str, str]) -> str:
    """`text` with every Grafana variable replaced by its value; KeyError names an unknown one."""
    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"unknown variable ${name} in {text!r}")
        return values[name]

    return VARIABLE.sub(value, text)


def label_values_query(var: Mapping[str, Any]) -> tuple[str, str]:
    """A query variable's `label_values(series selector, label)` as (selector, label)."""
    query = var["query"]["query"] if isinstance(var["query"], Mapping) else var["query"]
    found = LABEL_VALUES.match(query.strip())
    if found is None:
        raise ValueError(f"variable ${var['name']}: only label_values(selector, label) is supported, not {query!r}")
    return found["match"], found["label"]


def alternation(values: list[str]) -> str:
    """Several chosen values as Grafana sends a multi-value variable to Prometheus: a regex alternation,
    each value's regex characters escaped for a PromQL string (Grafana's prometheusSpecialRegexEscape)."""
    def escape(value: str) -> str:
        value = value.replace("\\", "\\" * 4)  # a backslash: escaped for the regex, then for the string
        return re.sub(r"([$^*+?.()|\[\]{}'])", r"\\\\\1", value)

    return "|".join(escape(v) for v in sorted(values))


def variable_values(prometheus: Any, board: Mapping[str, Any], window: str) -> dict[str, str]:
    """Each template variable's value as Grafana would send it with every option chosen, from a live
    Prometheus (`prometheus.api("series", ...)`); `$__rate_interval` and `$__range` are `window`."""
    values = {"__rate_interval": window, "__range": window, "__interval": "1s", "datasource": "prometheus"}
    for var in variables(board):
        if var["type"] == "query":
            selector, label = label_values_query(var)
            series = prometheus.api("series", **{"match[]": substitute(selector, values)})
            found = sorted({s[label] for s in series if label in s})
            assert found, f"dashboard {board['title']!r}: variable ${var['name']} ({var['definition']}) found no values"
            values[var["name"]] = alternation(found)
        elif var["type"] in ("textbox", "constant", "custom"):
            values[var["name"]] = var["current"]["value"]
    return values


def failures(prometheus: Any, queries_: Iterable[Query], values: Mapping[str, str], need_data: bool = True
             ) -> list[str]:
    """What is wrong with each query once ``values`` are substituted: refused by Prometheus, or (with
    ``need_data``) answered with nothing."""
    out = []
    for q in queries_:
        expr = substitute(q.expr, values)
        try:
            result = prometheus.query(expr)
        except AssertionError as exc:
            out.append(f"{q.where()}: Prometheus refused it ({exc}):\n    {expr}")
            continue
        if need_data and not result:
            out.append(f"{q.where()}: no data:\n    {expr}")
    return out
