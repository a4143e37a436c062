"""The release workflow publishes what the chart and the operator will pull, under the chart's version.

The workflow itself cannot run here (no Docker engine, no registry): actionlint checks every workflow
file, and the tests below read release.yml and hold it to charts/embedfleet and the operator's defaults.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from embedfleet.operator import platform

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
CHART = ROOT / "charts" / "embedfleet"
RUNTIME_REPOSITORY = "ghcr.io/embedfleet/runtime"
BUILD_PUSH = "docker/build-push-action@"
MATRIX_EXPR = re.compile(r"\$\{\{\s*matrix\.([\w-]+)\s*\}\}")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _chart() -> dict:
    return _load(CHART / "Chart.yaml")


def _release() -> dict:
    return _load(RELEASE)


def _pushes(workflow: dict) -> list[tuple[str, dict, dict]]:
    """Every docker/build-push-action step, once per matrix entry: (job id, its `with:` with the matrix
    expressions resolved, the matrix entry)."""
    out = []
    for job_id, job in workflow["jobs"].items():
        entries = (job.get("strategy") or {}).get("matrix", {}).get("include") or [{}]
        for step in job.get("steps", []):
            if not str(step.get("uses", "")).startswith(BUILD_PUSH):
                continue
            for entry in entries:
                resolved = {
                    key: MATRIX_EXPR.sub(lambda m, e=entry: str(e[m.group(1)]), str(value))
                    for key, value in step.get("with", {}).items()
                }
                out.append((job_id, resolved, entry))
    return out


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def _version_source(workflow: dict) -> tuple[str, dict]:
    """The job whose `version` output the image tags use, and the step that output comes from."""
    refs = {m for _, w, _ in _pushes(workflow) for m in re.findall(r"needs\.([\w-]+)\.outputs\.version", w["tags"])}
    assert len(refs) == 1, f"image tags must take the version from one job's output, found {refs}"
    job_id = refs.pop()
    job = workflow["jobs"][job_id]
    m = re.fullmatch(r"\$\{\{\s*steps\.([\w-]+)\.outputs\.version\s*\}\}", job["outputs"]["version"])
    assert m, f"job {job_id}'s version output must come from one of its steps: {job['outputs']['version']}"
    step = next(s for s in job["steps"] if s.get("id") == m.group(1))
    return job_id, step


# -- (a) actionlint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workflow", sorted(p.name for p in WORKFLOWS.glob("*.y*ml")))
def test_actionlint_passes(workflow: str) -> None:
    if shutil.which("go") is None and not _cached_actionlint():
        pytest.skip("go is not installed: actionlint is built from its Go module (scripts/actionlint.sh)")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "actionlint.sh"), f".github/workflows/{workflow}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode == 3:
        pytest.skip(f"go is not installed: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"actionlint on {workflow}:\n{proc.stderr}{proc.stdout}"


def _cached_actionlint() -> bool:
    version = re.search(r"^ACTIONLINT_VERSION=(\S+)$", (ROOT / "scripts" / "actionlint.sh").read_text(), re.M)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedfleet"
    return bool(version) and (cache / f"actionlint-{version.group(1)}" / "bin" / "actionlint").is_file()


# -- (b) what release.yml publishes ----------------------------------------------------------------


def test_release_runs_on_version_tags_and_by_hand() -> None:
    workflow = _release()
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["push"]["tags"] == ["v*"]
    assert "workflow_dispatch" in on
    assert workflow["permissions"] == {"contents": "read", "packages": "write"}


def test_pushed_images_are_the_chart_and_operator_defaults() -> None:
    values = _load(CHART / "values.yaml")
    app_version = str(_chart()["appVersion"])
    operator_default = values["image"]["repository"]
    runtime_defaults = _operator_runtime_defaults()
    assert {ref.rsplit(":", 1)[0] for ref in runtime_defaults} == {RUNTIME_REPOSITORY}

    pushed = {}
    for _, with_, _ in _pushes(_release()):
        assert with_.get("push") == "True", f"{with_['file']} is built but not pushed"
        for tag in _lines(with_["tags"]):
            repository, _, suffix = tag.partition(":")
            pushed.setdefault(repository, set()).add(suffix)
    assert set(pushed) == {operator_default, RUNTIME_REPOSITORY}

    job_id, _ = _version_source(_release())
    version = "${{ needs." + job_id + ".outputs.version }}"
    assert version in pushed[operator_default]
    assert {version, version + "-gpu"} <= pushed[RUNTIME_REPOSITORY]
    # The defaults a user gets without naming a tag are this release's tags.
    assert values["image"]["tag"] == app_version
    assert runtime_defaults == {f"{RUNTIME_REPOSITORY}:{app_version}"}


def _operator_runtime_defaults() -> set[str]:
    """Every runtime image a user gets without naming one: the chart's ``runtimeImage`` (an empty tag is
    appVersion), which the operator runs for a spec with no image, and the operator's built-in default
    when run without the chart (the runtime of its own version: pyproject.toml's ``version``). Neither the
    operator's code nor the CRDs write a tag of their own (a CRD default would pin every object)."""
    values = _load(CHART / "values.yaml")["runtimeImage"]
    chart_default = f"{values['repository']}:{values['tag'] or _chart()['appVersion']}"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert platform.RUNTIME_REPOSITORY == RUNTIME_REPOSITORY
    builtin = f"{platform.RUNTIME_REPOSITORY}:{version}"
    pattern = re.compile(r"ghcr\.io/embedfleet/runtime:[\w.-]+")
    sources = [*(ROOT / "operator").rglob("*.py"), *(ROOT / "crds").glob("*.yaml"), *(CHART / "crds").glob("*.yaml")]
    written = {f"{path.relative_to(ROOT)}: {ref}" for path in sources for ref in pattern.findall(path.read_text())}
    assert written == set(), "a runtime tag written into the operator or the CRDs"
    return {chart_default, builtin}


def test_every_image_tag_derives_from_the_chart_app_version() -> None:
    workflow = _release()
    job_id, step = _version_source(workflow)
    for push_job, with_, _ in _pushes(workflow):
        assert job_id in _as_list(workflow["jobs"][push_job]["needs"])
        assert all(
            "${{ needs." + job_id + ".outputs.version }}" in t or "${{ github.sha }}" in t
            for t in _lines(with_["tags"])
        ), with_["tags"]
    assert "charts/embedfleet/Chart.yaml" in step["run"] and "appVersion" in step["run"]


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


@pytest.mark.parametrize(
    ("ref_type", "ref_name", "passes"),
    [
        ("tag", "v{app}", True),
        ("tag", "v{app}.1", False),
        ("tag", "{app}", False),
        ("branch", "v{app}", False),
    ],
)
def test_tag_check_step_refuses_any_other_ref(tmp_path: Path, ref_type: str, ref_name: str, passes: bool) -> None:
    """The version job's script, run as the runner would run it, against this checkout's Chart.yaml."""
    chart = _chart()
    _, step = _version_source(_release())
    assert "${{" not in step["run"], "expressions reach the script through env, never inline"
    output = tmp_path / "github_output"
    env = {
        **os.environ,
        "GITHUB_OUTPUT": str(output),
        "REF_TYPE": ref_type,
        "REF_NAME": ref_name.format(app=chart["appVersion"]),
    }
    assert set(step["env"]) == {"REF_TYPE", "REF_NAME"}
    proc = subprocess.run(
        ["bash", "-e", "-c", step["run"]], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if passes:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert dict(line.split("=", 1) for line in output.read_text().splitlines()) == {
            "version": str(chart["appVersion"]),
            "chart_version": str(chart["version"]),
        }
    else:
        assert proc.returncode != 0, proc.stdout
        assert not output.exists() or not output.read_text()


def test_platforms_per_image() -> None:
    platforms = {}
    for _, with_, entry in _pushes(_release()):
        platforms[(with_["file"], entry.get("suffix", ""))] = set(with_["platforms"].split(","))
    assert platforms == {
        ("runtime/Dockerfile", ""): {"linux/amd64", "linux/arm64"},
        ("operator/Dockerfile", ""): {"linux/amd64", "linux/arm64"},
        ("runtime/Dockerfile.gpu", "-gpu"): {"linux/amd64"},
    }


def test_build_args_and_dockerfiles() -> None:
    for _, with_, _ in _pushes(_release()):
        assert with_["context"] == "."
        dockerfile = ROOT / with_["file"]
        assert dockerfile.is_file(), f"{with_['file']} is referenced by release.yml and does not exist"
        args = dict(line.split("=", 1) for line in _lines(with_.get("build-args", "")))
        if with_["file"] == "runtime/Dockerfile":
            assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        if with_["file"] == "runtime/Dockerfile.gpu":
            assert args["TRTLLM_IMAGE"].startswith("nvcr.io/nvidia/tensorrt-llm/")


def test_chart_is_pushed_to_ghcr_as_oci() -> None:
    workflow = _release()
    runs = "\n".join(s.get("run", "") for job in workflow["jobs"].values() for s in job.get("steps", []))
    assert "helm package charts/embedfleet" in runs
    assert re.search(r'helm push "dist/embedfleet-\$CHART_VERSION\.tgz" oci://ghcr\.io/embedfleet/charts\b', runs)
    assert "helm registry login ghcr.io" in runs
    chart_job = next(j for j in workflow["jobs"].values() if "helm push" in str(j))
    assert any(str(s.get("uses", "")).startswith("azure/setup-helm@") for s in chart_job["steps"])
    # The pushed file's name is the chart's version, which the tag-check step writes (tested above).
    job_id, step = _version_source(workflow)
    assert (
        workflow["jobs"][job_id]["outputs"]["chart_version"] == "${{ steps." + step["id"] + ".outputs.chart_version }}"
    )
    push = next(s for s in chart_job["steps"] if "helm push" in s.get("run", ""))
    assert push["env"]["CHART_VERSION"] == "${{ needs." + job_id + ".outputs.chart_version }}"
    assert job_id in _as_list(chart_job["needs"])


def test_actions_are_pinned_by_major_version_and_run_scripts_hold_no_expressions() -> None:
    for path in sorted(WORKFLOWS.glob("*.y*ml")):
        for job_id, job in _load(path)["jobs"].items():
            for step in job.get("steps", []):
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w./-]+@v\d+", step["uses"]), f"{path.name} {job_id}: {step['uses']}"
                assert "${{" not in step.get("run", ""), f"{path.name} {job_id}: expression inside run:"
