"""bench/results is a log the docs quote from: one JSON object per line, every row saying which tree, machine,
date and command produced it, and rows only ever appended (bench/_common.py's record()), never a snapshot a
later run overwrites. Every bench a user runs appends its row so (into --results-dir's folder, bench/results
unless a trial run goes elsewhere); NOT_RECORDING lists the exceptions, each with its reason. Nothing here
runs a benchmark.

Two marks excuse a row from carrying commit, date and command, and both are for rows that were in the
repository before record() existed; they precede every row record() appends:
  "legacy": true              a row of a former snapshot file that lacked one of the three; where it had no
                              commit or date it carries those of the git commit that first added the row (a
                              missing command stays missing)
  "recovered_from_git": true  a row an earlier run's snapshot held and a later one overwrote, taken back from
                              git with the commit and date of the version that added it
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.docs.docfiles import ROOT, doc_files

RESULTS = ROOT / "bench" / "results"
# Files in bench/results that are not JSON lines (a profile table, say); none today. Name each one here.
ARTEFACTS: frozenset[str] = frozenset()
PROVENANCE = ("commit", "date", "command")
MARKS = ("legacy", "recovered_from_git")


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logs() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.name not in ARTEFACTS)


def test_every_results_file_is_a_log() -> None:
    others = [p.name for p in RESULTS.iterdir() if p.suffix != ".jsonl" and p.name not in ARTEFACTS]
    assert not others, f"bench/results holds files that are not .jsonl logs (or listed artefacts): {others}"
    missing = [name for name in ARTEFACTS if not (RESULTS / name).is_file()]
    assert not missing, f"listed artefacts that are gone: {missing}"


@pytest.mark.parametrize("path", _logs(), ids=lambda p: p.name)
def test_every_line_is_a_json_object(path: Path) -> None:
    text = path.read_text()
    assert text.endswith("\n"), f"{path.name}: the last row has no newline, the next one would join it"
    for number, line in enumerate(text.splitlines(), 1):
        row = json.loads(line)  # a blank or partial line fails here too
        assert isinstance(row, dict), f"{path.name}:{number}: not a JSON object"


@pytest.mark.parametrize("path", _logs(), ids=lambda p: p.name)
def test_every_row_says_where_it_came_from(path: Path) -> None:
    bad, appended_seen = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        marked = [m for m in MARKS if row.get(m) is True]
        if marked:
            if appended_seen:
                bad.append(f"{number}: marked {marked} after a row with full provenance: marks are for rows "
                           "that predate record(), which only appends")
            if not (row.get("commit") and row.get("date")):
                bad.append(f"{number}: marked {marked} but without the commit and date git gives")
        else:
            lacking = [k for k in PROVENANCE if not row.get(k)]
            if lacking:
                bad.append(f"{number}: no {', '.join(lacking)} and not marked legacy")
            appended_seen = True
    assert not bad, f"{path.name}:\n" + "\n".join(bad)


def test_record_appends_one_line_and_never_rewrites(tmp_path: Path) -> None:
    common = _common()
    first = common.record("demo", {"figure": "demo", "value": 1, "cpu": "the bench's own label"},
                          results_dir=tmp_path)
    assert first == tmp_path / "demo-cpu.jsonl"
    before = first.read_bytes()
    second = common.record("demo", {"figure": "demo", "value": 2}, results_dir=tmp_path)
    assert second == first
    after = first.read_bytes()
    assert after.startswith(before), "the first line changed"
    lines = after.decode().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    assert [r["value"] for r in rows] == [1, 2]
    for row in rows:
        assert all(row[k] for k in PROVENANCE)
    assert rows[0]["bench_cpu"] == "the bench's own label" and rows[0]["cpu"] == rows[1]["cpu"]
    assert common.read_rows(first) == rows

    named = common.record("NVIDIA-Test", {"figure": "x"}, device="", results_dir=tmp_path,
                          meta={"commit": "c", "cpu": "m", "cores": 1, "date": "d", "command": "gpu.py"})
    assert named == tmp_path / "NVIDIA-Test.jsonl"
    assert json.loads(named.read_text()) == {"figure": "x", "commit": "c", "cpu": "m", "cores": 1, "date": "d",
                                             "command": "gpu.py"}


def test_results_dir_and_device_name(tmp_path: Path) -> None:
    import argparse

    common = _common()
    parser = argparse.ArgumentParser()
    common.add_results_dir(parser, "demo-cpu.jsonl")
    assert parser.parse_args([]).results_dir == common.RESULTS == RESULTS
    assert parser.parse_args(["--results-dir", str(tmp_path)]).results_dir == tmp_path
    assert common.device_name("cpu") == "cpu"
    assert common.gpu_log_name("NVIDIA H200") == "NVIDIA-H200"
    assert common.gpu_log_name("NVIDIA GeForce RTX 4090 (laptop)") == "NVIDIA-GeForce-RTX-4090-laptop"


def test_read_rows_reads_a_log_and_a_one_object_file(tmp_path: Path) -> None:
    common = _common()
    log = tmp_path / "a.jsonl"
    log.write_text('{"a": 1}\n{"a": 2}\n')
    snapshot = tmp_path / "b.json"
    snapshot.write_text(json.dumps({"b": {"c": 1}}, indent=2))
    assert common.read_rows(log) == [{"a": 1}, {"a": 2}]
    assert common.read_rows(snapshot) == [{"b": {"c": 1}}]


WRITE_METHODS = {"write_text", "write_bytes"}


def _writes(tree: ast.AST) -> list[ast.Call]:
    """write_text/write_bytes calls, and open()/Path.open() with a mode that writes."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in WRITE_METHODS:
            out.append(node)
        elif (isinstance(func, ast.Name) and func.id == "open") or (isinstance(func, ast.Attribute)
                                                                      and func.attr == "open"):
            modes = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            modes += [k.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if any(set(str(m.value)) & set("wax") for m in modes):
                out.append(node)
    return out


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_no_bench_script_writes_into_bench_results_but_record() -> None:
    """Only bench/_common.py names the folder in code (RESULTS) and opens a file there (record(), to append);
    a script that wrote a results file itself would be a snapshot again."""
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name == "_common.py":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for call in _writes(tree):
            segment = ast.get_source_segment(source, call) or ""
            if re.search(r"results|RESULTS", segment):
                found.append(f"{path.name}:{call.lineno}: {segment[:100]}")
        for const in _code_strings(tree):
            if const.value == "results" or "bench/results" in const.value:
                found.append(f"{path.name}:{const.lineno}: builds a bench/results path itself: {const.value[:60]!r}")
    for path in sorted((ROOT / "bench").glob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r">\s*\S*bench/results", line):
                found.append(f"{path.name}:{number}: redirects into bench/results: {line.strip()[:100]}")
    assert not found, "write through bench/_common.record() instead:\n" + "\n".join(found)


# Runnable files in bench/ that append no row themselves, each with the reason. Everything else there that a
# user runs appends its row through record().
NOT_RECORDING = {
    "gpu_session.sh": "shell: runs bench/gpu.py on a GPU machine in phases; gpu.py's record() appends the rows",
    "prose.py": "a retrieval set other benches import (int8_server.py); run alone it prints a look at the set, "
                "no figure",
}


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def _runnable() -> list[Path]:
    """bench/'s scripts a user runs: every shell script, and every .py with an `if __name__ == "__main__"`
    (not _common.py, which only the others import)."""
    bench = ROOT / "bench"
    scripts = [p for p in bench.glob("*.py") if p.name != "_common.py"
               and any(_is_main_guard(node) for node in ast.parse(p.read_text()).body)]
    return sorted([*scripts, *bench.glob("*.sh")])


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """Calls of the bare name `name` (as imported from _common), not of methods that share it."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == name]


@pytest.mark.parametrize("path", [p for p in _runnable() if p.name not in NOT_RECORDING], ids=lambda p: p.name)
def test_every_bench_appends_its_row(path: Path) -> None:
    """A run is a row: the script appends what it prints through record(), into the folder --results-dir
    names (add_results_dir(): bench/results unless a trial run goes elsewhere), and the file its help names
    is the one record() writes."""
    tree = ast.parse(path.read_text())
    records = _calls(tree, "record")
    assert records, (f"{path.name} prints a row but appends none: call _common.record(), or list it in "
                     "NOT_RECORDING with the reason")
    bad = [f"line {c.lineno}: record() without results_dir=" for c in records
           if not any(k.arg == "results_dir" for k in c.keywords)]
    options = _calls(tree, "add_results_dir")
    if not options:
        bad.append("no --results-dir: call _common.add_results_dir(parser, <the log's file name>)")
    named = [c.args[1].value for c in options
             if len(c.args) > 1 and isinstance(c.args[1], ast.Constant) and isinstance(c.args[1].value, str)]
    for call in records:
        stem = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
        if stem is not None and not any(log.startswith(f"{stem}-") for log in named):
            bad.append(f"line {call.lineno}: record({stem!r}, ...) writes {stem}-<device>.jsonl; "
                       f"--results-dir's help names {named}")
    assert not bad, f"{path.name}:\n" + "\n".join(bad)


def test_the_exemptions_are_current() -> None:
    runnable = {p.name: p for p in _runnable()}
    stale = [name for name in NOT_RECORDING if name not in runnable]
    assert not stale, f"NOT_RECORDING names files that are not runnable benches (any more): {stale}"
    recording = [name for name in NOT_RECORDING if name.endswith(".py")
                 and _calls(ast.parse(runnable[name].read_text()), "record")]
    assert not recording, f"NOT_RECORDING lists scripts that call record() now: {recording}"
    assert all(reason.strip() for reason in NOT_RECORDING.values())


REDIRECT = re.compile(r"(?<!-)>>?\s*\S*bench/results")  # not an arrow: "figures -> bench/results/..."


def test_no_doc_tells_to_redirect_into_bench_results() -> None:
    """The docs and the scripts' own usage say to run a bench, not to redirect its output into bench/results:
    the bench appends its row itself, and a `>` would overwrite the log."""
    texts = [*doc_files(), *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "scripts").glob("*.sh"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for path in texts for number, line in enumerate(path.read_text().splitlines(), 1)
             if REDIRECT.search(line)]
    assert not found, "redirects into bench/results (the bench appends its row itself):\n" + "\n".join(found)
