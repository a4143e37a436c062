"""What a plain `embedfleet serve` start imports: the modules a default start runs (settings, tracing's on/off
rule, the application, the models, the HTTP server) load no library that only an option uses: each would cost
every replica's start its import time (`python -X importtime` shows it)."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT, child_env

# what loads them: a keys file (--api-keys), tracing (--otel / OTEL_TRACES_EXPORTER)
ONLY_FOR_AN_OPTION = ("yaml", "opentelemetry.sdk", "psutil")


def test_a_default_start_imports_nothing_only_an_option_uses() -> None:
    code = (
        "import os, sys\n"
        "from embedfleet.runtime.settings import RuntimeSettings\n"
        "from embedfleet.otel import exporters\n"
        "from embedfleet.runtime.api.app import create_app\n"
        "from embedfleet.runtime.api.gate import GateState\n"
        "from embedfleet.runtime.metrics import RuntimeMetrics\n"
        "from embedfleet.runtime.service import Models\n"
        "from embedfleet.runtime.serve import Server\n"
        "import embedfleet.httpserver\n"
        "settings = RuntimeSettings()\n"
        "assert exporters(settings.otel, os.environ) == ()\n"
        "metrics = RuntimeMetrics()\n"
        "create_app(Models(settings, metrics), GateState())\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({ONLY_FOR_AN_OPTION!r}))\n"
        "assert not bad, bad\n"
    )
    env = child_env({name: None for name in ("OTEL_TRACES_EXPORTER", "EMBEDFLEET_OTEL", "EMBEDFLEET_API_KEYS")})
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
