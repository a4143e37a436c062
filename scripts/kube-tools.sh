#!/usr/bin/env bash
# Builds the test control plane from Go modules, once per machine, into a versioned cache folder:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes), etcd,
#   helm and kwok, plus the kwok stage file the harness passes with `-c`.
# Prints the folder on its last line. Re-running with everything present does nothing.
# Why from source: no Docker engine or release downloads here; the Go module proxy is reachable, and
# a real API server is the only honest judge of our CRDs, chart and RBAC (see shared/DESIGN.md).
set -euo pipefail

KUBE_VERSION=v1.37.2
KUBE_MINOR=37
HELM_VERSION=v4.3.1
KWOK_VERSION=v0.8.0
ROOT=${EMBEDFLEET_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/embedfleet}
DEST="$ROOT/kube-$KUBE_VERSION-helm-$HELM_VERSION-kwok-$KWOK_VERSION"
BIN="$DEST/bin"

if [ -f "$DEST/.complete" ]; then
  echo "$DEST"
  exit 0
fi
command -v go >/dev/null 2>&1 || { echo "kube-tools: Go is not installed (https://go.dev/doc/install); the control-plane tests will skip" >&2; exit 3; }
mkdir -p "$BIN"
export GOFLAGS=-buildvcs=false CGO_ENABLED=0

step() { echo "kube-tools: $* ($(date +%T))" >&2; }

# -- kubernetes + etcd: one scratch module ---------------------------------------------------
if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/etcd" ] || [ ! -x "$BIN/kubectl" ] \
   || [ ! -x "$BIN/kube-controller-manager" ] || [ ! -x "$BIN/kube-scheduler" ]; then
  WORK="$DEST/src/kube"
  mkdir -p "$WORK/tools" "$WORK/cmd/etcd"
  cd "$WORK"
  modjson=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION")
  gomod=$(printf '%s' "$modjson" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  {
    echo "module embedfleet.dev/kubetools"
    echo
    grep -E '^go ' "$gomod"
    echo
    echo "require k8s.io/kubernetes $KUBE_VERSION"
    echo
    # k8s.io/kubernetes replaces its staging modules with local paths; those lines are ignored in a
    # dependency, so point each at its published version instead.
    echo "replace ("
    grep -E '=> \./staging/' "$gomod" | awk '{print $1}' | grep -v '/sample-' \
      | while read -r m; do echo "	$m => $m v0.$KUBE_MINOR.${KUBE_VERSION##*.}"; done
    echo ")"
  } > go.mod
  cat > tools/tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
  cat > cmd/etcd/main.go <<'EOF'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
  step "resolving k8s.io/kubernetes $KUBE_VERSION modules"
  # tidy keeps every version k8s.io/kubernetes pins (etcd included): no `go get`, which would upgrade.
  go mod tidy
  LD="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LD="$LD -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$KUBE_MINOR"
    LD="$LD -X $pkg.gitTreeState=clean"
  done
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    if [ ! -x "$BIN/$cmd" ]; then
      step "building $cmd"
      go build -ldflags "$LD" -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
      mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    fi
  done
  if [ ! -x "$BIN/etcd" ]; then
    step "building etcd"
    go build -ldflags "-s -w" -o "$BIN/etcd.tmp" ./cmd/etcd
    mv "$BIN/etcd.tmp" "$BIN/etcd"
  fi
fi

# -- helm -------------------------------------------------------------------------------------
if [ ! -x "$BIN/helm" ]; then
  step "building helm $HELM_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
fi

# -- kwok and its stages ----------------------------------------------------------------------
if [ ! -x "$BIN/kwok" ]; then
  step "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
fi
KWOK_SRC=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION
mkdir -p "$DEST/kwok"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/*.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  for src in "$KWOK_SRC"/kustomize/stage/$f; do
    case "$src" in *kustomization.yaml) continue ;; esac
    cp "$src" "$DEST/kwok/$(echo "${src#"$KWOK_SRC"/kustomize/stage/}" | tr / _)"
  done
done
chmod -R u+w "$DEST/kwok"

touch "$DEST/.complete"
step "done"
echo "$DEST"
