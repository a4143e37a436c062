#!/usr/bin/env bash
# One set-up for a fresh machine. `scripts/setup.sh` installs the runtime and operator;
# `scripts/setup.sh --test` also installs what the test suite needs (redis-server, prometheus,
# test-only Python packages). torch goes first, so pip takes the CPU build and never pulls a
# multi-GB CUDA one as a dependency of something else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_tests=0
[ "${1:-}" = "--test" ] && want_tests=1

if [ "$want_tests" = 1 ]; then
  need=()
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
fi

$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ "$want_tests" = 1 ]; then
  $PY -m pip install -q --disable-pip-version-check -e ".[test]"
else
  $PY -m pip install -q --disable-pip-version-check -e .
fi
