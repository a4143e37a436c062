#!/usr/bin/env bash
# End to end on a real (kind) cluster: create the cluster, build and load both images, install the
# chart, apply an EmbeddingDeployment and wait until it reports Available.
#
#   e2e/kind.sh                       # uses e2e/embedding-kind.yaml (model baked into the image)
#   MANIFEST=examples/embedding.yaml e2e/kind.sh
#   KEEP=1 e2e/kind.sh                # leave the cluster running afterwards
#
# Needs docker, kind, helm and kubectl on PATH. Not run in CI (no Docker engine or kind there).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-embedfleet-e2e}
NAMESPACE=${NAMESPACE:-embedfleet-system}
MANIFEST=${MANIFEST:-e2e/embedding-kind.yaml}
TIMEOUT=${TIMEOUT:-600s}
RUNTIME_IMAGE=ghcr.io/embedfleet/runtime:0.1.0
OPERATOR_IMAGE=ghcr.io/embedfleet/operator:0.1.0
CONTEXT="kind-${CLUSTER}"

for tool in docker kind helm kubectl; do
  command -v "$tool" >/dev/null 2>&1 || { echo "e2e/kind.sh: $tool is not installed" >&2; exit 3; }
done

cleanup() {
  if [ "${KEEP:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --wait 180s
fi

docker build -f runtime/Dockerfile -t "$RUNTIME_IMAGE" .
docker build -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
kind load docker-image --name "$CLUSTER" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"

helm upgrade --install embedfleet charts/embedfleet --kube-context "$CONTEXT" \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.pullPolicy=Never --set role=standalone --set region=kind \
  --wait --timeout "$TIMEOUT"
kubectl --context "$CONTEXT" -n "$NAMESPACE" rollout status deployment/embedfleet --timeout "$TIMEOUT"

kubectl --context "$CONTEXT" apply -f "$MANIFEST"
kubectl --context "$CONTEXT" wait --for=condition=Available --timeout "$TIMEOUT" -f "$MANIFEST"
kubectl --context "$CONTEXT" get embeddingdeployments -A -o wide
echo "e2e/kind.sh: Available"
