#!/usr/bin/env bash
# The Gateway API's standard-channel CRDs (GatewayClass, Gateway, HTTPRoute, ...) at a pinned version, for
# the tests that apply the chart's HTTPRoute to the test control plane. They come with the
# sigs.k8s.io/gateway-api Go module (config/crd/standard/, Apache-2.0), fetched through the Go module proxy
# like the control plane itself (scripts/kube-tools.sh), and are copied once per machine into a versioned
# cache folder: $DEST/standard/*.yaml, with the module's LICENSE beside them.
# Prints the folder on its last line. Re-running with everything present does nothing (no Go needed then).
# Not vendored into the repository: the HTTPRoute CRD alone is 430 kB.
# v1.6.3: the newest release whose go.mod asks for no newer Go than 1.26 (v1.7.0 wants Go 1.27).
set -euo pipefail

GATEWAY_API_VERSION=v1.6.3
ROOT=${EMBEDFLEET_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/embedfleet}
DEST="$ROOT/gateway-api-$GATEWAY_API_VERSION"

if [ -f "$DEST/.complete" ]; then
  echo "$DEST"
  exit 0
fi
command -v go >/dev/null 2>&1 || { echo "gateway-api-crds: Go is not installed (https://go.dev/doc/install); the Gateway API tests will skip" >&2; exit 3; }

# Outside any module (a go.mod or go.work around the caller must not matter).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
modjson=$(cd "$scratch" && GOFLAGS= GO111MODULE=on go mod download -json "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" || true)
dir=$(printf '%s' "$modjson" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
if [ -z "$dir" ] || [ ! -d "$dir/config/crd/standard" ]; then
  echo "gateway-api-crds: could not download sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION:" >&2
  printf '%s\n' "$modjson" >&2
  exit 1
fi

rm -rf "$DEST"
mkdir -p "$DEST/standard"
cp "$dir"/config/crd/standard/*.yaml "$DEST/standard/"
cp "$dir/LICENSE" "$DEST/LICENSE"
chmod -R u+w "$DEST"  # the module cache is read-only; a copy should not be
touch "$DEST/.complete"
echo "$DEST"
