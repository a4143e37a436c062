"""Each component imports only what it is: the layers between the parts of the product, checked statically.

The walk is `embedfleet.runtime.selfcheck`'s (imports at module level and inside functions, and module
names the operator loads by string), read from source: nothing here is imported, torch least of all.

- no import circle between modules of embedfleet (a lazy import inside a function counts: it is a
  circle in disguise);
- the node agent (`embedfleet cache`) reaches neither the renderer nor the rollout code, nor numpy or
  torch: it is a small DaemonSet image;
- the gateway reaches nothing of the runtime or the operator, nor torch;
- the common package (the top-level ``embedfleet.*`` modules: otel, calls, httpserver, compat,
  api_group, and the control-plane kit ``embedfleet.kit``) reaches no component package: every component
  may import it;
- the gateway and the hub watch through the same kit informer;
- the operator reaches neither torch nor the runtime.

A failure names the import chain that breaks the rule. A rule that cannot hold yet is an entry in
``ALLOWED`` with its reason, never a weaker rule.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

from embedfleet.runtime.selfcheck import PACKAGE, _named, _roots, _source, closure

COMPONENTS = ("runtime", "operator", "gateway", "client")
AGENT = "embedfleet.operator.cache.cli"
GATEWAY = "embedfleet.gateway.cli"
OPERATOR = "embedfleet.operator.cli"

#: (entry, forbidden module) -> why it is tolerated for now. Empty: every rule below holds in full.
ALLOWED: dict[tuple[str, str], str] = {}


def all_modules() -> list[str]:
    """Every module of the namespace package, from the source folders (nothing imported)."""
    found: set[str] = set()
    for root in _roots():
        for path in root.rglob("*.py"):
            parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            if "__pycache__" not in parts and len(parts) > 1:
                found.add(".".join(parts))
    return sorted(found)


@cache
def _imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(modules of ours that ``module``'s import statements name, those it names only as strings).

    As in selfcheck: every import statement counts, at module level or inside a function, and
    ``from pkg import name`` names ``pkg`` and, when it is a module, ``pkg.name``."""
    located = _source(module, _roots())
    if located is None:
        return frozenset(), frozenset()
    path, is_package = located
    package = module if is_package else module.rpartition(".")[0]
    imported: set[str] = set()
    strings: set[str] = set()
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"), str(path))):
        for name in _named(node, package):
            if name.split(".")[0] != PACKAGE or name == module or _source(name, _roots()) is None:
                continue
            (strings if isinstance(node, ast.Constant) else imported).add(name)
    return frozenset(imported), frozenset(strings - imported)


def _loads(module: str) -> set[str]:
    """What loading ``module`` can load next, as selfcheck's closure follows it: the modules it names
    (strings too), and the packages above each (Python runs a package's __init__ before its module)."""
    imported, strings = _imports(module)
    out: set[str] = set()
    for name in imported | strings:
        parts = name.split(".")
        out.update(p for p in (".".join(parts[:k]) for k in range(2, len(parts) + 1)) if _source(p, _roots()))
    out.discard(module)
    return out


def chain(entry: str, target: str) -> list[str]:
    """One shortest import chain from ``entry`` to ``target`` (a module of ours); [] when none."""
    parent: dict[str, str | None] = {entry: None}
    todo = deque([entry])
    while todo:
        module = todo.popleft()
        if module == target:
            path: list[str] = []
            step: str | None = module
            while step is not None:
                path.append(step)
                step = parent[step]
            return path[::-1]
        for nxt in sorted(_loads(module)):
            if nxt not in parent:
                parent[nxt] = module
                todo.append(nxt)
    return []


def cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module, or of one
    module that imports itself. Tarjan's algorithm, iterative (the graph may be deep)."""
    edges = {node: sorted(set(targets) & graph.keys()) for node, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:  # done with node: hand its low-link to the node that reached it
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    components.append(sorted(component))
    found = []
    for component in components:
        members, first = set(component), component[0]
        parent: dict[str, str | None] = {first: None}  # the shortest way back to `first` inside it
        todo = deque([first])
        while todo:
            node = todo.popleft()
            if first in edges[node]:
                path = [node]
                while (step := parent[path[-1]]) is not None:
                    path.append(step)
                found.append([*reversed(path), first])
                break
            for nxt in edges[node]:
                if nxt in members and nxt not in parent:
                    parent[nxt] = node
                    todo.append(nxt)
    return found


def _under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(entry: str, forbidden_modules: Iterable[str], forbidden_packages: Iterable[str]) -> list[str]:
    """What ``entry`` reaches that it must not, each with the chain that reaches it; ALLOWED entries left out."""
    found = closure([entry])
    assert entry in found.modules, f"{entry} is not a module of ours"
    problems = []
    for module in found.modules:
        if _under(module, forbidden_modules) and (entry, module) not in ALLOWED:
            problems.append(" -> ".join(chain(entry, module)))
    for top in sorted(set(forbidden_packages) & found.third_party.keys()):
        if (entry, top) not in ALLOWED:
            users = sorted(found.third_party[top])
            problems.append(f"{top}, imported by {users[:5]} (reached as {' -> '.join(chain(entry, users[0]))})")
    return problems


def shared_modules() -> list[str]:
    """The common package: every module of ours outside the four component packages."""
    return [m for m in all_modules() if m.split(".")[1] not in COMPONENTS]


# --- the walker itself ---------------------------------------------------------------------------------


def test_the_cycle_finder_reports_a_cycle_and_nothing_else() -> None:
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert cycles({"a": ["a"]}) == [["a", "a"]]
    assert cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []


def test_the_chain_names_each_step() -> None:
    path = chain(OPERATOR, "embedfleet.operator.render")
    assert path[0] == OPERATOR and path[-1] == "embedfleet.operator.render" and len(path) > 2


# --- the rules -----------------------------------------------------------------------------------------


def test_no_import_circle_between_modules() -> None:
    """Imports name modules (strings the operator loads by name are not imports and may point back)."""
    graph = {m: _imports(m)[0] for m in all_modules()}
    assert len(graph) > 100, f"found almost no modules: {sorted(graph)[:5]}"
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_node_agent_reaches_neither_the_renderer_nor_rollouts_nor_numpy() -> None:
    problems = violations(AGENT, ["embedfleet.operator.render", "embedfleet.operator.rollout"], ["numpy", "torch"])
    assert not problems, "`embedfleet cache` reaches:\n" + "\n".join(problems)
    assert "embedfleet.operator.cache.agent" in closure([AGENT]).modules  # the walk did follow the command


def test_the_gateway_reaches_nothing_of_the_runtime_or_the_operator() -> None:
    problems = violations(GATEWAY, ["embedfleet.runtime", "embedfleet.operator"], ["torch"])
    assert not problems, "`embedfleet gateway` reaches:\n" + "\n".join(problems)
    assert "embedfleet.gateway.proxy" in closure([GATEWAY]).modules


@pytest.mark.parametrize("module", shared_modules())
def test_the_common_package_reaches_no_component(module: str) -> None:
    components = [f"{PACKAGE}.{c}" for c in COMPONENTS]
    problems = violations(module, components, ["torch"])
    assert not problems, f"{module} (shared by components) reaches:\n" + "\n".join(problems)


def test_the_common_package_is_what_the_components_share() -> None:
    shared = set(shared_modules())
    assert {"embedfleet.otel", "embedfleet.calls", "embedfleet.httpserver", "embedfleet.api_group",
            "embedfleet.compat", "embedfleet.compat.names", "embedfleet.compat.gate", "embedfleet.kit.client",
            "embedfleet.kit.informer"} <= shared, shared


def test_the_gateway_and_the_hub_watch_through_the_kit() -> None:
    for entry in (GATEWAY, "embedfleet.operator.hub.controller"):
        assert "embedfleet.kit.informer" in closure([entry]).modules, entry
    # and both queue their work on the kit's work queue
    for entry in (GATEWAY, "embedfleet.operator.hub.controller"):
        assert "embedfleet.kit.workqueue" in closure([entry]).modules, entry
    # one informer, the kit's; the hub's module only binds the operator's restart counter to it
    assert [m for m in all_modules() if m.endswith(".informer")] == ["embedfleet.kit.informer",
                                                                     "embedfleet.operator.hub.informer"]


def test_the_operator_reaches_neither_torch_nor_the_runtime() -> None:
    problems = violations(OPERATOR, ["embedfleet.runtime"], ["torch"])
    assert not problems, "`embedfleet operator` reaches:\n" + "\n".join(problems)
    assert "embedfleet.operator.handlers.embedding" in closure([OPERATOR]).modules  # role table strings
