"""How the tests read the dashboards: Grafana's variable syntaxes and its multi-value regex."""

from __future__ import annotations

import re

import pytest

from tests.observability import panels


def test_every_variable_syntax_is_substituted() -> None:
    values = {"region": "eu-1", "__rate_interval": "5m"}
    assert panels.substitute('rate(x{region=~"$region"}[$__rate_interval])', values) == \
        'rate(x{region=~"eu-1"}[5m])'
    assert panels.substitute("${region} ${region:regex} [[region]]", values) == "eu-1 eu-1 eu-1"


def test_an_unknown_variable_is_named() -> None:
    with pytest.raises(KeyError, match=r"\$regoin"):
        panels.substitute('x{region=~"$regoin"}', {"region": "eu-1"})


def test_alternation_matches_exactly_the_values_chosen() -> None:
    regex = panels.alternation(["all-MiniLM-L6-v2", "bge.small", "e5(large)"])
    as_go_reads_it = regex.replace("\\\\", "\\")  # the PromQL string literal's own escapes undone
    for value in ("all-MiniLM-L6-v2", "bge.small", "e5(large)"):
        assert re.fullmatch(as_go_reads_it, value)
    assert not re.fullmatch(as_go_reads_it, "bgeXsmall")


def test_label_values_queries_are_read() -> None:
    var = {"name": "deployment", "query": {"query": 'label_values(up{region=~"$region"}, deployment)'}}
    assert panels.label_values_query(var) == ('up{region=~"$region"}', "deployment")
    with pytest.raises(ValueError, match="label_values"):
        panels.label_values_query({"name": "x", "query": "query_result(up)"})


def test_every_dashboard_query_names_only_known_variables() -> None:
    for path in panels.dashboard_files():
        board = panels.load(path)
        known = {v["name"]: "x" for v in panels.variables(board)} | {"__rate_interval": "1m", "__range": "1m",
                                                                    "__interval": "1s"}
        queries = list(panels.queries(board))
        assert queries, path
        for q in queries:
            panels.substitute(q.expr, known)
