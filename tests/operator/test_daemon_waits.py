"""No async kopf daemon waits with `await stopped.wait(n)`.

kopf runs each such time-limited wait as a task of its own. One that timed out just as the operator's
SIGTERM cancelled the daemon kept its TimeoutError, and kopf re-raised it on exit: exit code 1, the
operator's teardown failed (seen twice in CI: the autoscaler's tick, then the rollout gate's poll). Async
daemons sleep instead and end by kopf's cancellation (kopf's own advice for async daemons).
"""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "embedfleet" / "operator"


def _awaited_stopper_waits(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Await) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "wait"
            and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "stopped"]


def test_no_awaited_stopper_wait_in_the_operator() -> None:
    found = {str(path.relative_to(OPERATOR)): lines for path in sorted(OPERATOR.rglob("*.py"))
             if (lines := _awaited_stopper_waits(ast.parse(path.read_text())))}
    assert found == {}


def test_the_check_finds_one() -> None:
    sample = "async def d(stopped):\n    while not stopped:\n        await stopped.wait(5)\n"
    assert _awaited_stopper_waits(ast.parse(sample)) == [3]
