"""README's local quick start, as a newcomer pastes it: the serve command of its first block (the set-up before
`&&` is what CI itself ran to get here), then its curl, verbatim, answered with two embeddings."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time

import pytest

from tests.docs.docfiles import ROOT
from tests.procs import child_env, stop_process

pytestmark = pytest.mark.timeout(600)


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_quick_start_answers_its_curl() -> None:
    blocks = bash_blocks()
    serve = next(b for b in blocks if "embedfleet serve" in b).strip()
    curl = next(b for b in blocks if b.lstrip().startswith("curl")).strip().replace("\\\n", " ")
    assert serve.startswith("bash scripts/setup.sh && "), serve
    command = serve.split("&&", 1)[1].strip()
    port = int(re.search(r"localhost:(\d+)", curl).group(1))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.fail(f"port {port}, the README's, is taken on this machine: the quick start cannot run here")
    venv = ROOT / ".venv" / "bin" / "embedfleet"
    if not venv.exists():
        pytest.skip("no .venv here: run `bash scripts/setup.sh --test` (CI does), as the README's test command says")
    proc = subprocess.Popen(shlex.split(command), cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        answer = None
        while time.monotonic() < deadline and proc.poll() is None:
            done = subprocess.run(["bash", "-c", curl], cwd=ROOT, capture_output=True, text=True, timeout=60)
            if done.returncode == 0 and done.stdout.startswith("{") and '"data"' in done.stdout:
                answer = json.loads(done.stdout)
                break
            time.sleep(1)
        assert answer is not None, f"the README's curl got no embeddings (server exit {proc.poll()})"
        assert [row["index"] for row in answer["data"]] == [0, 1]
        assert all(len(row["embedding"]) == 384 for row in answer["data"])
        assert answer["model"] == "all-MiniLM-L6-v2"
    finally:
        stop_process(proc)
