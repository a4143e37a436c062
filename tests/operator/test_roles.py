"""The role switch lives in main.ROLE_HANDLERS: a hub registers no local reconcile handler, and the hub
and spoke packages depend on nothing of the standalone handlers."""

from __future__ import annotations

import subprocess
import sys

from embedfleet.operator import cli, main


def test_cli_offers_exactly_the_roles_main_runs() -> None:
    assert cli.ROLES == main.ROLES


def _modules_after_registering(role: str) -> set[str]:
    code = ("import importlib, sys; from embedfleet.operator.main import ROLE_HANDLERS; "
            f"[importlib.import_module(m) for m in ROLE_HANDLERS[{role!r}]]; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('embedfleet.operator')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_a_hub_registers_no_local_reconcile_handler() -> None:
    hub = _modules_after_registering("hub")
    assert "embedfleet.operator.hub.handlers" in hub
    assert not {m for m in hub if m.startswith("embedfleet.operator.handlers.")} - {
        "embedfleet.operator.handlers.settings"}, sorted(hub)


def test_a_spoke_adds_its_heartbeat_to_the_local_handlers() -> None:
    spoke = _modules_after_registering("spoke")
    assert {"embedfleet.operator.handlers.embedding", "embedfleet.operator.spoke.handlers"} <= spoke
    assert "embedfleet.operator.hub.handlers" not in spoke
