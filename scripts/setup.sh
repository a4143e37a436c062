#!/usr/bin/env bash
# One set-up for a fresh machine, into a virtual environment of its own (./.venv, or $EMBEDFLEET_VENV),
# so nothing already installed on the machine can hide a missing dependency.
#   scripts/setup.sh          the runtime and the operator:       .venv/bin/embedfleet serve
#   scripts/setup.sh --test   also what the tests need: apt packages (redis-server, prometheus, iproute2,
#                             openssl), the `test` extra, and the test control plane built from its Go
#                             modules by scripts/kube-tools.sh (once per machine, cached; ~15 min cold),
#                             and the Gateway API CRDs by scripts/gateway-api-crds.sh (seconds, cached);
#                             as root, the real-node tier by scripts/realnode.sh (containerd, runc, buildah from
#                             apt, a kubelet, the project's images; ~28 GB of disk, ~10 min beside the above).
#
# torch: PyPI's torch 2.13.0 wheel for Linux x86-64 is the CUDA build (about 2.7 GB of NVIDIA libraries
# come with it; a 5.6 GB venv). It runs on CPU without a GPU. PyTorch's CPU-only wheels live only on
# PyTorch's own index, which this project's machines cannot reach, so there is no lighter choice here;
# where you can reach it, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EMBEDFLEET_VENV:-.venv}
want_tests=0
[ "${1:-}" = "--test" ] && want_tests=1

if [ "$want_tests" = 1 ]; then
  need=()
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The packages go in with uv (astral-sh/uv, from PyPI into the venv): it resolves like pip, installs torch's
# 2.7 GB in seconds where pip spends a minute of CPU unpacking it, and keeps a cache of unpacked wheels
# (~/.cache/uv) that a second set-up on the same machine links from. Set EMBEDFLEET_PIP=1 to use pip alone.
if [ "${EMBEDFLEET_PIP:-0}" = 1 ]; then
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" --upgrade pip
else
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.9"
  PIP=("$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python")
fi
"${PIP[@]}" "torch==2.13.0"
if [ "$want_tests" = 1 ]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e ".[all]"  # every part: runtime, operator, gateway, node agent, client (pyproject's extras)
fi
# The sources are installed editable, so no installer byte-compiles them, and where PYTHONDONTWRITEBYTECODE is
# set (containers, CI machines) Python would compile every module `embedfleet serve` imports on each start
# (about 0.1 s of its start here): compile them once. A file edited later is compiled in memory until this
# runs again; an installed package (the images) is compiled by pip.
"$VENV/bin/python" -m compileall -q runtime/embedfleet operator/embedfleet client/embedfleet gateway/embedfleet

if [ "$want_tests" = 1 ]; then
  if command -v go >/dev/null 2>&1; then
    realnode=0
    if [ "$(id -u)" = 0 ]; then
      # The real-node tier (tests/realnode): containerd, buildah, ... from apt, then the project's images, built
      # in the background (downloads and disk) while the control plane compiles (CPU).
      bash scripts/realnode.sh packages
      mkdir -p "$(bash scripts/realnode.sh home)"
      images_log="$(bash scripts/realnode.sh home)/images.log"
      bash scripts/realnode.sh images > "$images_log" 2>&1 &
      images_pid=$!
      realnode=1
    else
      echo "setup: not root: the real-node tier (tests/realnode) will skip; run this as root to build it" >&2
    fi
    bash scripts/kube-tools.sh
    bash scripts/gateway-api-crds.sh  # the Gateway API CRDs the chart's HTTPRoute is checked against
    if [ "$realnode" = 1 ]; then
      wait "$images_pid" || { tail -40 "$images_log" >&2; echo "setup: building the images failed ($images_log)" >&2; exit 1; }
      bash scripts/realnode.sh build  # the kubelet (from the control plane's modules) and crictl; images cached
    fi
  else
    echo "setup: Go is not installed (https://go.dev/doc/install): the control-plane tests will skip" >&2
  fi
fi
echo "setup: done; the environment is $VENV (e.g. $VENV/bin/embedfleet serve)"
