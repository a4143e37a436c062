"""The docs cannot rot silently: every relative link and anchor resolves, every flag they name exists, and
every chart value they name is in values.yaml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.docfiles import FLAG, ROOT, anchors, command_flags, doc_files, links, values_keys

# Long options of the other tools the docs show commands for (helm, kubectl, curl, pip, git, podman/buildah,
# pytest): not ours to check, named here so that a flag of ours that goes away is never mistaken for one.
OTHER_TOOLS = frozenset({
    "namespace", "create-namespace", "set", "set-file", "set-string", "values", "wait", "timeout", "version",
    "dry-run", "server-side", "force-conflicts", "validate", "strict", "replicas", "from-file", "from-literal",
    "context", "duration", "type", "output", "selector", "all-namespaces", "kubeconfig", "network", "data",
    "data-binary", "header", "request", "upgrade", "install", "no-deps", "index-url", "extra-index-url",
    "find-links", "no-index", "build-arg", "tag", "file", "platform", "format", "address", "target", "follow",
    "tail", "previous", "for", "watch", "image", "rm", "restart", "port", "name", "help",
    "etcd-prefix",  # kube-apiserver
    "durations",  # pytest
    "cluster-name", "login", "server-id",  # the clouds' exec credential plugins (aws, kubelogin)
})
CODE_TOKEN = re.compile(r"`([A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)+)`")
SET_VALUE = re.compile(r"--set(?:-string|-file)?[ =]([A-Za-z][\w.]*)=")
FILE_SUFFIX = re.compile(r"\.(py|md|ya?ml|json|sh|txt|toml|cfg|ini|tpl|go|csv|whl|log)$")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("doc", doc_files(), ids=_ids(doc_files()))
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for number, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... (never fetched here)
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{doc.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{doc.name}:{number}: {target} (no heading with that anchor in {dest.name})")
    assert not broken, "\n".join(broken)


def script_flags() -> set[str]:
    """Flags of the repository's own scripts and benchmarks (their parsers or `case` patterns)."""
    out: set[str] = set()
    for path in [*ROOT.joinpath("scripts").glob("*.sh"), *ROOT.joinpath("bench").glob("*.py")]:
        out.update(re.findall(r"""["'\s(|]--([a-z][a-z0-9-]*)""", path.read_text()))
    return out


def test_every_flag_named_exists() -> None:
    known = set().union(*command_flags().values()) | {"check"} | script_flags() | OTHER_TOOLS
    unknown = []
    for doc in doc_files():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            unknown += [f"{doc.relative_to(ROOT)}:{number}: --{m.group(1)}" for m in FLAG.finditer(line)
                        if m.group(1) not in known]
    assert not unknown, "flags the docs name that no command, script or listed tool has:\n" + "\n".join(unknown)


def test_every_chart_value_named_is_in_values_yaml() -> None:
    keys = values_keys()
    tops = {k for k in keys if "." not in k and any(other.startswith(k + ".") for other in keys)}
    missing = []
    for doc in doc_files():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            named = set(SET_VALUE.findall(line))
            named |= {t for t in CODE_TOKEN.findall(line) if t.split(".")[0] in tops and not FILE_SUFFIX.search(t)}
            missing += [f"{doc.relative_to(ROOT)}:{number}: {name}" for name in sorted(named) if name not in keys]
    assert not missing, "chart values the docs name that values.yaml lacks:\n" + "\n".join(missing)
