"""What the chart's render tests share: the render cases (defaults, each ci/ file, each role, the opt-ins)
and the release's .Values as helm merges them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.chart.helm import CI_VALUES, DEFAULTS, ROLES

#: (id, values files, --set): the defaults, each ci/ file, and each role on defaults.
CASES = [("defaults", [], {})]
CASES += [(f"ci/{role}", [path], {}) for role, path in CI_VALUES.items()]
CASES += [(f"role={role}", [], {"role": role}) for role in ROLES]
#: The opt-ins that add objects or rights: the hub may copy Secrets; a spoke's and a hub's timing flags.
CASES += [("spoke+propagateSecrets", [CI_VALUES["spoke"]], {"hubAccess.propagateSecrets": "true"}),
          ("spoke+timing", [CI_VALUES["spoke"]], {"spoke.heartbeatInterval": "2", "spoke.leaseDuration": "7"}),
          ("hub+timing", [CI_VALUES["hub"]], {"hub.interval": "3", "hub.rampSeconds": "0",
                                              "hub.spokeWriteTimeout": "4"})]
IDS = [case[0] for case in CASES]


def _nested(sets: Mapping[str, str]) -> dict[str, Any]:
    """`--set a.b=1` as helm reads it: nested maps, the value typed (ints and booleans; helm keeps "2.5" a
    string, which no case here sets)."""
    out: dict[str, Any] = {}
    for dotted, text in sets.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(text)
    return out


def merged_values(files: list[Path], sets: Mapping[str, str]) -> dict[str, Any]:
    """The release's .Values the way helm merges them: maps key by key, anything else (lists too) replaced."""
    out: dict[str, Any] = json.loads(json.dumps(DEFAULTS))
    for override in [yaml.safe_load(p.read_text()) or {} for p in files] + [_nested(sets)]:
        stack: list[tuple[dict[str, Any], dict[str, Any]]] = [(out, override)]
        while stack:
            base, over = stack.pop()
            for key, value in over.items():
                if isinstance(value, dict) and isinstance(base.get(key), dict):
                    stack.append((base[key], value))
                else:
                    base[key] = value
    return out
