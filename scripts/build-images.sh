#!/usr/bin/env bash
# Builds embedfleet's images from this checkout, with Docker or with buildah/podman (no daemon needed):
#   ghcr.io/embedfleet/runtime:<appVersion>    runtime/Dockerfile   `embedfleet serve` (CPU torch)
#   ghcr.io/embedfleet/operator:<appVersion>   operator/Dockerfile  the operator, the gateway and the node agent
#   ghcr.io/embedfleet/runtime:<appVersion>-gpu runtime/Dockerfile.gpu (with --gpu)
# <appVersion> is charts/embedfleet/Chart.yaml's, so the chart's defaults name these images as built.
#
#   scripts/build-images.sh                         # both images, PyTorch's CPU index for torch
#   scripts/build-images.sh --builder podman        # docker, podman or buildah (default: the first found)
#   scripts/build-images.sh --base IMAGE            # another Python 3.11 base (default python:3.11-slim)
#   scripts/build-images.sh --torch-index ''        # torch from PyPI (its Linux wheel is the CUDA build, 6 GB)
#   scripts/build-images.sh --wheelhouse DIR        # offline: pip downloads every wheel into DIR on this host,
#                                                   # then builds run with --network none (buildah/podman)
#   scripts/build-images.sh --wheelhouse-ready DIR  # the same from a wheelhouse already downloaded
#   scripts/build-images.sh --only operator         # one image (runtime, operator or gpu)
#   scripts/build-images.sh --gpu --gpu-base IMAGE  # also the GPU image (default base: NVIDIA's TensorRT-LLM)
#   scripts/build-images.sh --tag 0.1.0-dev --label KEY=VALUE
# Prints each image's name and size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' charts/embedfleet/Chart.yaml)
TAG=$APP_VERSION
REGISTRY=${EMBEDFLEET_REGISTRY:-ghcr.io/embedfleet}
BUILDER=""; BASE=""; TORCH_INDEX="https://download.pytorch.org/whl/cpu"; TORCH_INDEX_SET=0
WHEELHOUSE=""; WHEELS_READY=0; ONLY="runtime operator"; GPU=0; GPU_BASE=""; LABELS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --builder) BUILDER=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --torch-index) TORCH_INDEX=$2; TORCH_INDEX_SET=1; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --wheelhouse-ready) WHEELHOUSE=$2; WHEELS_READY=1; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --gpu) GPU=1; shift ;;
    --gpu-base) GPU_BASE=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --label) LABELS+=(--label "$2"); shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build-images: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$GPU" = 1 ] && ONLY="$ONLY gpu"
if [ -z "$BUILDER" ]; then
  for b in docker podman buildah; do command -v "$b" >/dev/null 2>&1 && { BUILDER=$b; break; }; done
fi
[ -n "$BUILDER" ] || { echo "build-images: none of docker, podman or buildah is installed" >&2; exit 3; }
say() { echo "build-images: $* ($(date +%T))" >&2; }

build() {  # build DOCKERFILE IMAGE [build args...]
  local file=$1 image=$2; shift 2
  local args=(-f "$file" -t "$image" "${LABELS[@]}" "$@")
  [ -n "$BASE" ] && args+=(--build-arg "BASE_IMAGE=$BASE")
  if [ -n "$WHEELHOUSE" ]; then
    args+=(--build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels --network none)
    args+=(-v "$(cd "$WHEELHOUSE" && pwd):/wheels:ro")
  fi
  say "$BUILDER build $image from $file"
  local t0; t0=$(date +%s)
  case "$BUILDER" in
    buildah) buildah bud --layers "${args[@]}" . ;;
    *) "$BUILDER" build "${args[@]}" . ;;
  esac
  say "$image built in $(( $(date +%s) - t0 )) s"
}

if [ -n "$WHEELHOUSE" ] && [ "$WHEELS_READY" = 0 ]; then
  [ "$BUILDER" = docker ] && { echo "build-images: --wheelhouse needs buildah or podman (build-time volumes)" >&2; exit 2; }
  # Every wheel the images install, fetched by this host's pip (it may trust a proxy a build container
  # would not); this host's Python must match the base image's (3.11 on Linux x86-64).
  mkdir -p "$WHEELHOUSE"
  say "pip download into $WHEELHOUSE"
  torch_src=(); [ -n "$TORCH_INDEX" ] && torch_src=(--index-url "$TORCH_INDEX")
  python3 -m pip download -q --disable-pip-version-check -d "$WHEELHOUSE" "${torch_src[@]}" "torch==2.13.0"
  # async-timeout: redis needs it on python < 3.11.3 (Debian 12's 3.11.2), whatever this host's python is.
  python3 -m pip download -q --disable-pip-version-check -d "$WHEELHOUSE" hatchling "async-timeout>=4.0.3" \
    ".[runtime,operator,gateway,agent]"
fi
# the wheelhouse holds torch already: the build installs it from there
[ -n "$WHEELHOUSE" ] && [ "$TORCH_INDEX_SET" = 0 ] && TORCH_INDEX=""

for what in $ONLY; do
  case "$what" in
    runtime) build runtime/Dockerfile "$REGISTRY/runtime:$TAG" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX" ;;
    operator) build operator/Dockerfile "$REGISTRY/operator:$TAG" ;;
    gpu) gargs=(); [ -n "$GPU_BASE" ] && gargs=(--build-arg "TRTLLM_IMAGE=$GPU_BASE")
         build runtime/Dockerfile.gpu "$REGISTRY/runtime:$TAG-gpu" "${gargs[@]}" ;;
    *) echo "build-images: unknown image $what (runtime, operator or gpu)" >&2; exit 2 ;;
  esac
done

for what in $ONLY; do
  case "$what" in runtime) i="$REGISTRY/runtime:$TAG" ;; operator) i="$REGISTRY/operator:$TAG" ;; gpu) i="$REGISTRY/runtime:$TAG-gpu" ;; esac
  size=$("$BUILDER" image inspect -f '{{.Size}}' "$i" 2>/dev/null || echo "?")
  [ "$BUILDER" = buildah ] && size=$(podman image inspect -f '{{.Size}}' "$i" 2>/dev/null || echo "?")
  echo "$i $size"
done
