"""Every measured figure in the docs comes from a recorded run.

A measured figure is a number with a unit of time, rate or size, a ratio (times sign or x, %), or a bold
headline number, in a section of the docs that reports measurements (MEASURED). Each must equal, at the doc's own
rounding, a value of a row in bench/results/ that its section cites: a results file named in the section
(`bench/results/gateway-cpu.json`, `gateway-cpu.jsonl`, the stem alone, or the bench script `bench/gateway.py`),
or, where a section names none, in its nearest ancestor that does. A figure in a section that cites no results
at all matches nothing. Every figure that matches no row is printed with its doc and line.

A row is one JSON object of a results file (a file of one object or of JSON lines, `.json` or `.jsonl`).
Its values are every number in it, nested ones included, and every number with a unit inside its strings
("462 MB", a note's "4.49 s"). A figure written with d decimals matches a value v when v rounds to it (half
up or half even); "57k" is rounded to thousands. Units convert: time (µs, ms, s), sizes (bytes, KB, MB, GB,
KiB, MiB, GiB) and percentages (a row's 0.242 is "24.2%"). A ratio the bench does not print itself may be
quoted only when DERIVED names it."""

from __future__ import annotations

import bisect
import fnmatch
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

from tests.docs.docfiles import FENCE, ROOT

RESULTS = ROOT / "bench" / "results"

# The docs and their sections that report measurements (a heading's text as written; the section runs to
# the next heading of the same or a higher level, its subsections included; None: the whole file). The rest
# of docs/ describes behaviour, settings and test set-ups, where "5 s" is a time-out, not a result.
MEASURED: dict[str, tuple[str, ...] | None] = {
    "docs/performance.md": None,
    "docs/gpu.md": ("The FP8 gate's promise, measured", "Measured on an H200"),
    "docs/gateway.md": ("Measured",),
    "docs/client.md": ("Measured",),
    "docs/images.md": ("Sizes", "Cold starts and memory on the real node"),
    "docs/spot.md": ("Limits", "Measured on two real nodes"),
    "docs/cache.md": ("Peers measured on two real nodes",),
    "docs/async.md": ("Measured (bench/async_backfill.py)",),
    "docs/http.md": ("Why uvicorn and not a server of our own",),
    "docs/hub.md": (
        "Benchmark (`python3 bench/scheduler.py`)",
        "Fleet simulation on real API servers (`cd bench && python hub_fleet.py --spokes 16 --deployments 2000`)",
    ),
    "docs/tracing.md": ("Cost",),
    "docs/limitations.md": ("Not verified",),
    "docs/quantized.md": ("Calibration ranges: where they come from, how to get them",),
}

# The skip list, beyond the rules (each a kind of number that is not a result although it sits in a
# measured section):
# - fenced blocks and `code spans`: commands, flags and their values, log lines;
# - after a comparison (<, >, <=, their signs, "more than", "at least") or "goal", or in a table's "goal"
#   column: a target or a bound, not a result;
# - followed by "by default", or inside parentheses that say "default": a setting;
# these, each an input of a bench or a figure about something other than this software:
NOT_RESULTS: dict[tuple[str, str, str], str] = {
    # (doc, the figure as written, text around it on its line): why it is not a result
    ("docs/performance.md", "30 s", "30 s once all 300 are Available"): "the steady-state window: an input",
    ("docs/performance.md", "3 s", "3 s before the taint"): "the window requests are counted in: an input",
    ("docs/performance.md", "5 s", "5 s after the stand-in"): "the window requests are counted in: an input",
    ("docs/performance.md", "5%", "a 5% load change"): "the change the scheduler bench applies: an input",
    ("docs/hub.md", "5%", "5% load increase"): "the change the scheduler bench applies: an input",
    ("docs/gpu.md", "3%", "a 3% scale error"): "an error the tests inject: an input",
    ("docs/gpu.md", "2%", "a 2%"): "an error the tests inject: an input",
    ("docs/performance.md", "30 s", "30 s on GCP"): "the clouds' notice windows, not measured here",
    ("docs/limitations.md", "30 s", "30 s on GCP"): "the clouds' notice windows, not measured here",
}

# Ratios quoted from two values of one row where the bench does not print the ratio: (results file stem,
# what the doc calls it, the value from the row's flattened keys).
DERIVED: list[tuple[str, str, Callable[[dict[str, float]], float]]] = [
    ("NVIDIA-H200", "the server over the faster sentence-transformers (fp32), gpu.md",
     lambda r: r["ours_embeddings_per_s"] / r["st_fp32_embeddings_per_s"]),
    ("NVIDIA-H200", "a profiled batch's inputs per second, gpu.md",
     lambda r: r["batch_inputs"] / r["wall_ms"] * 1000),
    ("fp8-gate-cpu", "the held-out worst 1 - cosine over the calibration's worst, gpu.md",
     lambda r: (1 - r["held_out.fp8_vs_bf16.min"]) / (1 - r["gate.calibration_min"])),
    ("kube-clients-cpu", "the sync client's calls/s with a pool of 32 over its default pool, performance.md",
     lambda r: r["sync_pool32"] / r["sync"]),
]

TIMES, MINUS, EN_DASH = "\u00d7", "\u2212", "\u2013"
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?k?"
SIGNED = rf"[{MINUS}+-]?{NUMBER}"
# What joins figures that share the unit written after the last one: a range "0.85-1.09" (a hyphen or an
# en dash), "6.37 vs 4.38 ms", "1.80 and 1.84", "24.2 / 26.3%".
JOIN = rf"(?:\s*[{EN_DASH}-]\s*|\s+vs\.?\s+|\s*/\s*|,\s+|\s+and\s+|\s+or\s+|\s+to\s+)"
RATES = r"(?:embeddings|emb|tokens|tok|requests|req|pairs|inputs|texts|passages|calls|k)/s"
UNIT = rf"(?P<unit>\s?(?:µs|ms|s|TFLOP/s|[KMG]B/s|[KMGT]B|[KMG]iB|{RATES})|/s|{TIMES}|x|%)(?![\w/])"
# Not where a figure starts: inside a word or another number ("sm90", "v1.37", "x86_64", "2^-13").
START = rf"(?<![\w.^/:#={MINUS}+-])"
FIGURE = re.compile(rf"{START}(?P<chain>{SIGNED}(?:{JOIN}{SIGNED})*){UNIT}")
BOLD = re.compile(rf"\*\*(?:[A-Za-z][^*\d]*\s)?(?P<chain>{SIGNED}(?:{JOIN}{SIGNED})*)\*\*")  # "**ratio 1.84**"
TIMES_FIRST = re.compile(rf"(?:^|(?<=[\s(])){TIMES}(?P<chain>{NUMBER})(?![\w.])")  # the sign before: "(x1.12"
ONE = re.compile(rf"(?:(?:^|(?<=\s))[{MINUS}+-])?{NUMBER}")  # a sign only where a number starts a word
GOAL = re.compile(r"(?:[≤≥<>]=?|\bgoal:?|\b(?:more|less) than|\bat (?:least|most))\s*$")
CITED = re.compile(r"\b(?:bench/results/)?([\w*<>-]+)\.(?:jsonl?|py)\b|\bbench/results/([\w*-]+)")

TIME = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}
SIZE = {"bytes": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    text: str  # as written: "0.85-1.09 ms"
    value: float
    decimals: int
    unit: str
    cited: frozenset[str]  # the results stems its section cites
    at: int = 0  # where in its block of text it starts


def key(stem: str) -> str:
    return stem.lower().replace("_", "-")


@cache
def results() -> dict[str, list[dict]]:
    """The rows of every results file by stem, `.json` and `.jsonl` alike, one object or JSON lines each."""
    out: dict[str, list[dict]] = {}
    for path in sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.jsonl")]):
        text = path.read_text()
        try:
            rows = [json.loads(text)]
        except json.JSONDecodeError:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        out.setdefault(path.stem, []).extend(rows)
    return out


def flatten(node: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, number) for every number in a row; a string's numbers with a unit come as the unit's
    base (seconds, bytes): "462 MB" is 462e6."""
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, int | float):
        yield prefix, float(node)
    elif isinstance(node, str):
        for figure in figures_in(node, "", 0, frozenset()):
            unit = figure.unit.removesuffix("/s")
            yield prefix, figure.value * (TIME.get(unit) or SIZE.get(unit) or 1.0)
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from flatten(value, f"{prefix}.{name}" if prefix else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from flatten(value, f"{prefix}.{i}")


@cache
def values(stems: frozenset[str]) -> list[float]:
    """Every number of every row of these results files, DERIVED included, sorted."""
    out: set[float] = set()
    for stem, rows in results().items():
        if key(stem) not in stems:
            continue
        for row in rows:
            pairs = list(flatten(row))
            out.update(value for _, value in pairs)
            flat = dict(pairs)
            for derived_stem, _, how in DERIVED:
                if derived_stem == stem:
                    try:
                        out.add(how(flat))
                    except (KeyError, ZeroDivisionError):
                        pass
    return sorted(out)


def parse_number(text: str) -> tuple[float, int]:
    """"10,814" -> (10814, 0); "0.950" -> (0.95, 3); "57k" -> (57000, -3); "-0.01" -> (-0.01, 2)."""
    thousands = text.endswith("k")
    text = text.removesuffix("k").replace(",", "").replace(MINUS, "-")
    decimals = len(text.partition(".")[2])
    value = float(text)
    return (value * 1000, decimals - 3) if thousands else (value, decimals)


def figures_in(line: str, doc: str, number: int, cited: frozenset[str]) -> Iterator[Figure]:
    for pattern in (FIGURE, BOLD, TIMES_FIRST):
        for m in pattern.finditer(line):
            if pattern is BOLD and FIGURE.fullmatch(m.group("chain")):
                continue
            unit = TIMES if pattern is TIMES_FIRST else (m.groupdict().get("unit") or "").strip()
            numbers = [one.group(0) for one in ONE.finditer(m.group("chain"))]
            if numbers[-1].endswith("k"):  # "2.0-3.2k": the range's last "k" is every number's
                numbers = [n if n.endswith("k") else f"{n}k" for n in numbers]
            for text in numbers:
                value, decimals = parse_number(text)
                yield Figure(doc, number, m.group(0), value, decimals, unit, cited, m.start())


def targets(figure: Figure) -> Iterator[tuple[float, float]]:
    """(value, tolerance): what a row value may be for the figure to match, in each unit of its kind."""
    half = 0.5 * 10.0**-figure.decimals * (1 + 1e-9)
    unit = figure.unit.removesuffix("/s")
    if unit in TIME or unit in SIZE:
        kind = TIME if unit in TIME else SIZE
        written = [kind[unit]]
        if unit in ("KB", "MB", "GB"):  # a decimal size may be a binary one rounded: a "256 MB" of 2**28 bytes
            written.append(SIZE[unit.replace("B", "iB")])
        for scale in written:
            for other in kind.values():
                yield figure.value * scale / other, half * scale / other
    elif figure.unit == "%":
        yield figure.value, half
        yield figure.value / 100, half / 100
    else:
        yield figure.value, half


def matches(figure: Figure) -> bool:
    pool = values(figure.cited)
    for target, tolerance in targets(figure):
        i = bisect.bisect_left(pool, target - tolerance)
        if i < len(pool) and pool[i] <= target + tolerance:
            return True
    return False


def cited_stems(text: str) -> set[str]:
    """The results files a stretch of doc names, as keys of results()' stems."""
    stems = {key(s) for s in results()}
    out: set[str] = set()
    for m in CITED.finditer(text):
        name = key(m.group(1) or m.group(2))
        out |= {s for s in stems if s in (name, f"{name}-cpu") or ("*" in name and fnmatch.fnmatch(s, name))}
        if name == "<gpu-name>" or name == "gpu":
            out |= {s for s in stems if not s.endswith("-cpu")}
    return out


def sections(doc: str) -> Iterator[tuple[int, str, frozenset[str]]]:
    """(line number, line, cited stems) of a doc's measured sections; a heading or a fenced block's line comes
    as an empty line. A line's cited stems are those its own section names, else its nearest ancestor's."""
    lines = (ROOT / doc).read_text().splitlines()
    nodes: list[tuple[int, str, int]] = [(0, "", 0)]  # (depth, title, first line index) of every heading
    fenced = False
    for i, line in enumerate(lines):
        if FENCE.match(line.strip()):
            fenced = not fenced
        heading = None if fenced else re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if heading:
            nodes.append((len(heading.group(1)), heading.group(2), i))
    own = [  # the stems each heading's own text (up to the next heading) cites
        cited_stems("\n".join(lines[first : nodes[n + 1][2] if n + 1 < len(nodes) else len(lines)]))
        for n, (_, _, first) in enumerate(nodes)
    ]
    wanted = MEASURED[doc]
    stack: list[int] = []  # the headings from the top down to the current one
    inside: int | None = 0 if wanted is None else None  # depth of the measured section we are in
    fenced = False
    node = 0
    for i, line in enumerate(lines):
        if node + 1 < len(nodes) and nodes[node + 1][2] == i:
            node += 1
            depth, title, _ = nodes[node]
            while stack and nodes[stack[-1]][0] >= depth:
                stack.pop()
            stack.append(node)
            if wanted is not None and inside is not None and depth <= inside:
                inside = None
            if wanted is not None and title in wanted:
                inside = depth
            line = ""
        elif FENCE.match(line.strip()) or fenced:
            fenced = fenced != bool(FENCE.match(line.strip()))
            line = ""
        if inside is None:
            continue
        cited = next((own[n] for n in [*reversed(stack), 0] if own[n]), set())
        yield i + 1, line, frozenset(cited)


def blocks(doc: str) -> Iterator[tuple[list[tuple[int, int]], str, frozenset[str]]]:
    """The measured sections as blocks of text: each table row, each paragraph or list item joined into one
    line (a figure and its unit may sit on two lines). With each block, (offset, line number) of its lines."""
    lines: list[tuple[int, str]] = []
    cited: frozenset[str] = frozenset()

    def flush() -> Iterator[tuple[list[tuple[int, int]], str, frozenset[str]]]:
        offsets, text = [], ""
        for number, line in lines:
            offsets.append((len(text), number))
            text += line.strip() + " "
        if text:
            yield offsets, text, cited
        lines.clear()

    for number, line, line_cited in sections(doc):
        starts = not line.strip() or line.startswith("|") or re.match(r"\s*(?:[-*]|\d+\.)\s", line)
        if starts:
            yield from flush()
        if line.strip():
            lines.append((number, line))
            cited = line_cited
        if line.startswith("|"):
            yield from flush()
    yield from flush()


def measured_figures(doc: str) -> Iterator[Figure]:
    goal_columns: set[int] = set()
    for offsets, block, cited in blocks(doc):
        text = block
        if block.startswith("|"):
            cells = block.strip().strip("|").split("|")
            names = [c.strip().lower() for c in cells]
            if "goal" in names:
                goal_columns = {i for i, name in enumerate(names) if name == "goal"}
            text = "|".join("" if i in goal_columns else c for i, c in enumerate(cells))
        else:
            goal_columns = set()
        text = re.sub(r"`[^`]*`", lambda m: "`" + " " * (len(m.group(0)) - 2) + "`", text)
        for figure in figures_in(text, doc, 0, cited):
            before, after = text[: figure.at], text[figure.at + len(figure.text) :]
            if GOAL.search(before) or after.startswith(" by default") or _inside_default(before, after):
                continue
            if any(d == doc and f == figure.text and context in block for d, f, context in NOT_RESULTS):
                continue
            number = max((n for at, n in offsets if at <= figure.at), default=offsets[0][1])
            yield Figure(doc, number, figure.text, figure.value, figure.decimals, figure.unit, cited, figure.at)


def _inside_default(before: str, after: str) -> bool:
    opened = before.rfind("(")
    if opened < 0 or ")" in before[opened:]:
        return False
    closed = after.find(")")
    return "default" in before[opened:] + after[: closed if closed >= 0 else len(after)]


def all_figures() -> list[Figure]:
    return [figure for doc in MEASURED for figure in measured_figures(doc)]


def test_the_measured_sections_exist() -> None:
    missing = []
    for doc, wanted in MEASURED.items():
        headings = set(re.findall(r"(?m)^#{1,6}\s+(.*?)\s*$", (ROOT / doc).read_text()))
        missing += [f"{doc}: {title!r}" for title in wanted or () if title not in headings]
    assert not missing, "MEASURED names sections the docs no longer have:\n" + "\n".join(missing)


def test_every_skip_and_derivation_is_used() -> None:
    texts = {doc: [text for _, text, _ in blocks(doc)] for doc in MEASURED}
    unused = [entry for entry in NOT_RESULTS if not any(entry[2] in text for text in texts[entry[0]])]
    assert not unused, f"NOT_RESULTS entries whose text is gone from the measured sections: {unused}"
    assert {stem for stem, _, _ in DERIVED} <= set(results()), "DERIVED names a results file that is gone"


def test_every_measured_figure_matches_a_row() -> None:
    figures = all_figures()
    assert len(figures) > 300, f"only {len(figures)} figures found: the extraction broke"
    unmatched = [f for f in figures if not matches(f)]
    report = "\n".join(
        f"{f.doc}:{f.line}: {f.value:g} in {f.text!r}, against {', '.join(sorted(f.cited)) or 'no results cited'}"
        for f in unmatched
    )
    assert not unmatched, f"{len(unmatched)} of {len(figures)} measured figures match no row:\n{report}"


def test_the_extraction_and_the_rounding() -> None:
    text = f"p50 0.85{EN_DASH}1.09 ms, **1.42{TIMES}** and 55k vs 30k embeddings/s, c=16 at 2 cores"
    found = [(f.value, f.decimals, f.unit) for f in figures_in(text, "", 0, frozenset())]
    assert found == [(0.85, 2, "ms"), (1.09, 2, "ms"), (1.42, 2, TIMES), (55000, -3, "embeddings/s"),
                     (30000, -3, "embeddings/s")]

    def near(figure: Figure, value: float) -> bool:
        return any(abs(value - target) <= tolerance for target, tolerance in targets(figure))

    ms = Figure("", 0, "1.99 ms", 1.99, 2, "ms", frozenset())
    assert near(ms, 1.989) and near(ms, 0.001989) and not near(ms, 1.98)  # ms as written, or as seconds
    assert near(Figure("", 0, "24.2%", 24.2, 1, "%", frozenset()), 0.242)
    assert near(Figure("", 0, "256 MB", 256, 0, "MB", frozenset()), 2**28)  # bytes, a binary MB
    assert GOAL.search("goal <= ") and GOAL.search("p99 ≤ ") and not GOAL.search("p99 ")
    assert _inside_default("(75 s", " by default here)") and not _inside_default("(75 s", ")")
