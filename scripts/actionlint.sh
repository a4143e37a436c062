#!/usr/bin/env bash
# Lints the GitHub Actions workflows (.github/workflows/*.yml, *.yaml) with actionlint, which also runs
# shellcheck on `run:` scripts when shellcheck is on PATH. actionlint is built from its Go module,
# once per machine, into a versioned cache folder (the scripts/kube-tools.sh pattern).
#   scripts/actionlint.sh            build if needed, lint every workflow, print the binary path last
#   scripts/actionlint.sh FILE...    lint only these files
# Exit status: actionlint's (0 clean, 1 problems found), or 3 when Go is not installed.
# Why lint instead of run: the release workflow pushes to ghcr.io and needs a Docker engine; neither
# exists in this project's CI, so a linter is the check we can afford on every change.
set -euo pipefail

ACTIONLINT_VERSION=v1.7.12
ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/embedfleet
DEST="$ROOT/actionlint-$ACTIONLINT_VERSION"
BIN="$DEST/bin/actionlint"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ ! -x "$BIN" ]; then
  command -v go >/dev/null 2>&1 || { echo "actionlint: Go is not installed (https://go.dev/doc/install); workflows are not linted" >&2; exit 3; }
  echo "actionlint: building $ACTIONLINT_VERSION ($(date +%T))" >&2
  mkdir -p "$DEST/bin"
  GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOBIN="$DEST/bin" \
    go install -ldflags "-s -w" "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION"
fi

cd "$REPO"
if [ "$#" -gt 0 ]; then
  files=("$@")
else
  shopt -s nullglob
  files=(.github/workflows/*.yml .github/workflows/*.yaml)
  shopt -u nullglob
  [ "${#files[@]}" -gt 0 ] || { echo "actionlint: no workflow files under .github/workflows" >&2; exit 1; }
fi
rc=0
"$BIN" -no-color "${files[@]}" >&2 || rc=$?
echo "$BIN"
exit "$rc"
