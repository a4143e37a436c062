"""Each part of the product installs from its own pyproject extra, and that extra holds everything it imports.

Two checks. The static one walks every command's modules (``embedfleet.runtime.selfcheck.closure``: imports at
module level and inside functions, and module names the operator loads by string) and requires each third-party
package found there to be installed by the command's extra, directly or through its requirements. The live one
installs a light extra alone into a fresh virtual environment and runs the command line an image runs with
``--check``, which imports all of it: a package missing from the extra fails here, not in a cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from uv import find_uv_bin

from embedfleet.runtime.cli import COMMANDS
from embedfleet.runtime.selfcheck import closure

ROOT = Path(__file__).resolve().parents[2]
# imported only where installed, with a message naming what to install (the trtllm engine)
OPTIONAL = {"tensorrt_llm"}


def _requirement_name(text: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", text, maxsplit=1)[0].lower().replace("_", "-")


def _extras_of(text: str) -> set[str]:
    match = re.search(r"\[([^\]]*)\]", text.split(";")[0])
    return {e.strip() for e in match.group(1).split(",")} if match else set()


def _marker_holds(text: str, extra: str | None) -> bool:
    if ";" not in text:
        return True
    from packaging.markers import Marker

    return Marker(text.split(";", 1)[1]).evaluate({"extra": extra or ""})


def distributions_of(extra: str) -> set[str]:
    """The distributions `pip install embedfleet[extra]` installs: the requirements' transitive closure."""
    todo: list[tuple[str, set[str]]] = [("embedfleet", {extra})]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while todo:
        name, extras = todo.pop()
        for ex in extras | {""}:
            if (name, ex) in seen:
                continue
            seen.add((name, ex))
            names.add(name)
            try:
                requires = metadata.distribution(name).requires or []
            except metadata.PackageNotFoundError:
                continue
            for req in requires:
                if _marker_holds(req, ex or None) and (ex or "extra ==" not in req):
                    todo.append((_requirement_name(req), _extras_of(req)))
    return names


def providers() -> dict[str, set[str]]:
    """Top-level import name -> the distributions that install it (in this environment)."""
    return {top: {d.lower().replace("_", "-") for d in dists}
            for top, dists in metadata.packages_distributions().items()}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_commands_extra_installs_everything_it_imports(command: str) -> None:
    module, extra, _ = COMMANDS[command]
    found = closure([module])
    assert len(found.modules) > 3, f"the walk from {module} found almost nothing: {found.modules}"
    installed = distributions_of(extra)
    provided_by = providers()
    missing = {
        top: sorted(users)[:3]
        for top, users in found.third_party.items()
        if top not in OPTIONAL and not (provided_by.get(top, set()) & installed)
    }
    assert not missing, (f"`embedfleet {command}` imports packages that embedfleet[{extra}] does not install "
                         f"(package: importing modules): {missing}")


def test_the_walk_follows_imports_inside_functions_and_role_tables() -> None:
    """What an import-only smoke test misses: handlers loaded by name at run time, imports inside functions."""
    found = closure(["embedfleet.operator.cli"])
    assert "embedfleet.operator.handlers.embedding" in found.modules  # main.ROLE_HANDLERS, a string
    assert "embedfleet.operator.hub.handlers" in found.modules
    assert "embedfleet.operator.leader" in found.modules  # imported inside run_operator()
    assert "numpy" in found.third_party  # reached through handlers -> render -> rollout -> compat.gate


def test_the_operator_extra_brings_no_torch() -> None:
    assert "torch" not in distributions_of("operator")
    assert "torch" not in distributions_of("gateway")
    assert "torch" not in distributions_of("agent")


# The command lines the images run (operator/Dockerfile's checks), per light extra.
LIVE = {
    "operator": [["operator", "run", "--all-namespaces"]],
    "gateway": [["gateway", "--kubernetes"]],
    "agent": [["cache", "agent", "--cache-root", "/tmp/embedfleet-check"],
              ["cache", "pull", "--source", "file:///dev/null", "--digest", "sha256:0", "--cache-dir", "/tmp/c"]],
    "client": [["embed", "--help"]],
}


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, subprocess.Popen]]]:
    """One fresh venv per light extra, installed as scripts/setup.sh installs (uv, resolving like pip: the
    extra's own requirements, nothing from this environment), the installs started together."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    started: dict[str, tuple[Path, subprocess.Popen]] = {}
    for extra in sorted(LIVE):
        env_dir = tmp_path_factory.mktemp(f"venv-{extra}")
        venv.EnvBuilder(with_pip=False).create(env_dir)
        with open(env_dir / "pip.log", "w") as log:  # the child keeps its own descriptor
            started[extra] = (env_dir, subprocess.Popen(
                [find_uv_bin(), "pip", "install", "-q", "--python", str(env_dir / "bin" / "python"),
                 f"{ROOT}[{extra}]"], stdout=log, stderr=subprocess.STDOUT, env=env))
    yield started
    for _, proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", sorted(LIVE))
def test_a_venv_with_only_the_extra_runs_its_commands(
        extra: str, venvs: dict[str, tuple[Path, subprocess.Popen]], tmp_path: Path) -> None:
    env_dir, install = venvs[extra]
    returncode = install.wait(timeout=840)
    output = (env_dir / "pip.log").read_text()
    if returncode != 0 and "not found in the package registry" in output:  # uv's words
        pytest.skip(f"PyPI is not reachable here: {output[-300:]}")
    assert returncode == 0, output[-2000:]
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for argv in LIVE[extra]:
        check = [*argv, "--check"] if argv[-1] != "--help" else argv
        run = subprocess.run([str(env_dir / "bin" / "embedfleet"), *check], capture_output=True, text=True,
                             env=env, timeout=120, cwd=tmp_path)
        assert run.returncode == 0, f"embedfleet {' '.join(check)} in a venv with only [{extra}]:\n{run.stderr[-2000:]}"
    no_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True, env=env, cwd=tmp_path)
    assert no_torch.returncode != 0, f"embedfleet[{extra}] pulled in torch"


def test_a_missing_dependency_fails_the_check(tmp_path: Path) -> None:
    """The check reports a module that cannot import (here: one whose dependency is blocked) with exit 1."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['numpy'] = None  # as if numpy were not installed\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "operator", "run", "--check"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode != 0
    assert "numpy" in run.stderr
