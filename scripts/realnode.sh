#!/usr/bin/env bash
# A real node for the tests' real-node tier (tests/realnode/): containerd + runc + a CNI bridge + a kubelet built
# from the k8s.io/kubernetes Go module, joined to a real control plane (scripts/kube-tools.sh's binaries), running
# the project's own images built from its Dockerfiles with buildah (no Docker daemon, no registry).
#   scripts/realnode.sh build     apt packages, kubelet + crictl, the pause and base images, the wheelhouse and
#                                 the project's images (each step cached; `images` alone rebuilds only those)
#   scripts/realnode.sh packages  the apt packages alone, and the free-disk check
#   scripts/realnode.sh images    the project's images, when the sources changed since the last build
#   scripts/realnode.sh load      import into the running node's containerd what it lacks (`up` does this)
#   scripts/realnode.sh up DIR    control plane + containerd + kubelet (node realnode-1); writes DIR/kubeconfig
#   scripts/realnode.sh join DIR  a second node, realnode-2, joined to `up`'s control plane: its own containerd
#                                 (images copied from the first), kubelet, pod range and mount namespace
#   scripts/realnode.sh leave DIR stops realnode-2 and removes its pods and its Node
#   scripts/realnode.sh down DIR  stops what `up` and `join` started, removes pods, mounts, bridge and iptables rules
#   scripts/realnode.sh home      prints the cache folder
# Network: loopback and the bridge rn0 this script creates (198.18.252.1/22, realnode-2 at 198.18.252.2; pods
# 198.18.252.16-198.18.253.254 on realnode-1, 198.18.254.1-198.18.255.254 on realnode-2, no default route;
# services 198.19.128.0/20). Needs root, Go, and for `build` the Debian mirror, PyPI and the Go proxy.
set -euo pipefail
cd "$(dirname "$0")/.."
PROJECT=$PWD
K8S=v1.37.2
CRICTL=v1.34.0
RN=${EMBEDFLEET_REALNODE_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/embedfleet/realnode-$K8S}
BIN=$RN/bin
BRIDGE=rn0; GW=198.18.252.1; POD_CIDR=198.18.252.0/22; SVC_CIDR=198.19.128.0/20; SVC_KUBE=198.19.128.1
NODE=realnode-1; KUBELET_PORT=20250; KUBELET_HEALTH=20248
SOCK=$RN/containerd/containerd.sock
NODE2=realnode-2; NODE2_IP=198.18.252.2; KUBELET2_HEALTH=20258; N2=$RN/node-2; SOCK2=$N2/containerd/containerd.sock
NAT_CHAIN=EMBEDFLEET-RN
APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' charts/embedfleet/Chart.yaml)
RUNTIME_IMAGE=ghcr.io/embedfleet/runtime:$APP_VERSION
OPERATOR_IMAGE=ghcr.io/embedfleet/operator:$APP_VERSION
PAUSE_IMAGE=localhost/pause:3.10
BASE_IMAGE=localhost/python:3.11-bookworm
NEED_GB=${EMBEDFLEET_REALNODE_NEED_GB:-28}   # containerd 12 + build storage 7 + Go and headroom, + realnode-2's 6
export CONTAINERS_STORAGE_CONF=$RN/storage.conf
log() { echo "realnode: $* ($(date +%T))" >&2; }
kbin() { bash "$PROJECT/scripts/kube-tools.sh" | tail -1; }

# ------------------------------------------------------------------------------------------------------- build
apt_packages() {
  local pkgs="containerd runc containernetworking-plugins buildah podman debootstrap iptables conntrack socat gcc"
  local missing="" p; for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  log "apt-get install$missing"
  local sudo=""; [ "$(id -u)" != 0 ] && sudo=sudo
  $sudo apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >&2
}

free_gb() { df -Pk "$RN" | awk 'NR==2 {print int($4/1048576)}'; }

# On a small disk (CI's machines have about 38 GB free), drop what only a rebuild needs as soon as it is no
# longer needed: the wheelhouse once the images are built, Go's build cache once the kubelet is, podman's
# copies of the images once containerd holds them. A later change then rebuilds from the network.
SLIM_BELOW_GB=${EMBEDFLEET_REALNODE_SLIM_BELOW_GB:-30}
slim() {  # slim WHAT: wheels | gocache | podman, when free space is under SLIM_BELOW_GB
  [ "$(free_gb)" -ge "$SLIM_BELOW_GB" ] && return 0
  log "$(free_gb) GB free (under $SLIM_BELOW_GB): removing $1"
  case "$1" in
    wheels) rm -rf "$RN/wheels" "$RN/wheels.pyproject" ;;
    gocache) go clean -cache ;;
    podman) podman rmi "$RUNTIME_IMAGE" "$OPERATOR_IMAGE" >/dev/null 2>&1 || true
            buildah rmi --prune >/dev/null 2>&1 || true ;;
  esac
}

disk_check() {  # fail early, with the numbers, when the disk cannot hold the images twice over
  mkdir -p "$RN"
  local have=0; { [ -d "$RN/containerd/root" ] || [ -f "$RN/images.hash" ]; } && have=1   # space already taken
  if [ "$have" = 0 ] && [ "$(free_gb)" -lt "$NEED_GB" ]; then
    echo "realnode: $(free_gb) GB free under $RN, the real-node tier needs about $NEED_GB GB (at its peak" \
         "containerd holds about 12 GB for the runtime image beside 7 GB of build storage, and realnode-2's" \
         "containerd 6 GB of unpacked layers; the wheelhouse and" \
         "Go's build cache are removed as soon as they are not needed on a disk this small). Free space, or" \
         "set EMBEDFLEET_REALNODE_HOME to a larger disk." >&2
    exit 4
  fi
}

go_bins() {  # kubelet from the control plane's module workspace (shares its build cache), crictl
  local ksrc; ksrc=$(kbin)/src/kube
  mkdir -p "$BIN"
  if [ ! -x "$BIN/kubelet" ]; then
    rm -rf "$RN/src/kubelet"; mkdir -p "$RN/src/kubelet"
    ( cd "$RN/src/kubelet"; cp "$ksrc/go.mod" "$ksrc/go.sum" .
      sed -i 's#^module .*#module embedfleet.dev/kubelet#' go.mod
      printf '//go:build tools\n\npackage kubelet\n\nimport _ "k8s.io/kubernetes/cmd/kubelet"\n' > tools.go
      go mod tidy >&2
      local minor=${K8S#v1.} ldf="-s -w" p; minor=${minor%%.*}
      for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldf="$ldf -X $p.gitVersion=$K8S -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"; done
      log "go build kubelet $K8S (about 2 min after the control plane's build)"
      CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -ldflags "$ldf" -o "$BIN/kubelet.tmp" k8s.io/kubernetes/cmd/kubelet >&2
      mv "$BIN/kubelet.tmp" "$BIN/kubelet" )
  fi
  if [ ! -x "$BIN/crictl" ]; then
    log "go install crictl $CRICTL"
    GOBIN="$BIN" CGO_ENABLED=0 GOFLAGS=-buildvcs=false go install -ldflags "-s -w" "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL" >&2
  fi
  slim gocache   # every binary is cached in its versioned folder
}

storage_conf() {
  mkdir -p "$RN/containers"
  [ -f "$RN/storage.conf" ] || printf '[storage]\ndriver = "overlay"\nrunroot = "%s/containers/run"\ngraphroot = "%s/containers/storage"\n' \
    "$RN" "$RN" > "$RN/storage.conf"
}

pause_image() {  # kubernetes' own pause.c, static, in an image of its own
  podman image exists "$PAUSE_IMAGE" && return 0
  local src; src=$(go mod download -json "k8s.io/kubernetes@$K8S" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$RN/pause"
  gcc -Os -static -DVERSION=v3.10 -o "$RN/pause/pause" "$src/build/pause/linux/pause.c"; strip "$RN/pause/pause"
  local c; c=$(buildah from scratch); buildah copy "$c" "$RN/pause/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  buildah commit -q "$c" "$PAUSE_IMAGE" >/dev/null; buildah rm "$c" >/dev/null
}

base_image() {  # Debian 12 with its python 3.11 in a venv at /usr/local: a stand-in for python:3.11-slim
  podman image exists "$BASE_IMAGE" && return 0
  local R=$RN/rootfs-bookworm mirror
  mirror=$( { grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null || true; } \
           | head -1 | awk '{print $2}')
  if [ ! -x "$R/usr/bin/python3" ]; then
    rm -rf "$R"; log "debootstrap bookworm (about 1-2 min)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$R" \
      "${mirror:-http://deb.debian.org/debian}" >&2
  fi
  rm -rf "$R"/var/lib/apt/lists/* "$R"/var/cache/apt/*.bin "$R"/var/cache/apt/archives/*.deb "$R"/usr/share/doc/* "$R"/usr/share/man/*
  : > "$R/etc/resolv.conf"; echo localhost > "$R/etc/hostname"
  tar --numeric-owner -C "$R" -c . | podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - localhost/debian:bookworm-rootfs >/dev/null
  mkdir -p "$RN/ctx-base"
  printf 'FROM localhost/debian:bookworm-rootfs\nRUN python3 -m venv /usr/local && /usr/local/bin/python --version\nCMD ["python3"]\n' \
    > "$RN/ctx-base/Containerfile"
  buildah bud -q --network none -t "$BASE_IMAGE" "$RN/ctx-base" >/dev/null
  rm -rf "$R"
}

sources_hash() {  # what the images are built from: the files the Dockerfiles copy, as they are on disk now
  ( cd "$PROJECT"
    git ls-files -co --exclude-standard pyproject.toml README.md runtime operator client gateway \
      | grep -v '/Dockerfile.gpu$' | sort | xargs sha256sum | sha256sum | cut -c1-16 )
}

project_images() {  # the Dockerfiles as written; only the base, the wheelhouse and --network none are chosen here
  local hash; hash=$(sources_hash)
  if [ -f "$RN/images.hash" ] && [ "$(cat "$RN/images.hash")" = "$hash" ]; then
    if { podman image exists "$RUNTIME_IMAGE" && podman image exists "$OPERATOR_IMAGE"; } \
       || [ "$(cat "$RN/images/loaded.hash" 2>/dev/null)" = "$hash" ]; then
      return 0
    fi
  fi
  local ctx=$RN/src; rm -rf "$ctx"; mkdir -p "$ctx"
  ( cd "$PROJECT"; git ls-files -co --exclude-standard pyproject.toml README.md runtime operator client gateway scripts charts \
      | tar -c -T - ) | tar -x -C "$ctx"
  # wheels: this host's pip downloads; the builds never reach the network
  if ! ls "$RN/wheels"/torch-2.13.0-*.whl >/dev/null 2>&1 || [ "$(cat "$RN/wheels.pyproject" 2>/dev/null)" != "$(sha256sum < "$PROJECT/pyproject.toml")" ]; then
    rm -f "$RN/wheels.pyproject"
  fi
  local wh=(--wheelhouse "$RN/wheels")
  [ -f "$RN/wheels.pyproject" ] && wh=(--wheelhouse-ready "$RN/wheels")
  ( cd "$ctx"; bash scripts/build-images.sh --builder buildah --base "$BASE_IMAGE" --torch-index '' "${wh[@]}" \
      --label "embedfleet.sources=$hash" >&2 )
  sha256sum < "$PROJECT/pyproject.toml" > "$RN/wheels.pyproject"
  # the GPU image's own layers on a stand-in base (the CPU runtime image: python, CUDA torch from PyPI);
  # NVIDIA's TensorRT-LLM base itself is only pulled by the release workflow
  ( cd "$ctx"; bash scripts/build-images.sh --builder buildah --only gpu --gpu-base "$RUNTIME_IMAGE" \
      --wheelhouse-ready "$RN/wheels" --tag "$APP_VERSION-standin" >&2 )
  podman rmi "ghcr.io/embedfleet/runtime:$APP_VERSION-standin-gpu" >/dev/null 2>&1 || true
  buildah rmi --prune >/dev/null 2>&1 || true   # the previous build's layers (6 GB for the runtime)
  rm -rf "$ctx"
  echo "$hash" > "$RN/images.hash"
  slim wheels
}

build() {
  apt_packages; disk_check; go_bins; images
}

images() {
  storage_conf; pause_image; base_image; project_images
  podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'embedfleet|pause|python' >&2
}

# ---------------------------------------------------------------------------------------------------------- up
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# The control plane runs at a higher CPU priority than the node and the tests (as root; else unchanged): in a
# cluster it has machines of its own, here it shares two cores with image imports and servers, and an API
# server starved for seconds makes the operator miss its Lease's renew deadline.
CP_NICE=()
if [ "$(nice -n -5 nice 2>/dev/null)" = "$(( $(nice) - 5 ))" ]; then CP_NICE=(nice -n -5); fi

bg() {  # bg NAME CMD...: start in the background, log to $D/NAME.log, record the PID
  local name=$1; shift; "$@" > "$D/$name.log" 2>&1 & echo "$! $name" >> "$D/pids"
}

service_nat() {  # service_nat PORT: the `kubernetes` ClusterIP to this run's API server, in a chain of our own
  # Reset at every `up`, so a rule left by a run that never reached `down` (a killed test) cannot point the
  # ClusterIP at a dead API server ahead of ours: every pod would then see "connection refused".
  iptables -t nat -N "$NAT_CHAIN" 2>/dev/null || iptables -t nat -F "$NAT_CHAIN"
  iptables -t nat -C PREROUTING -d "$SVC_KUBE/32" -j "$NAT_CHAIN" 2>/dev/null \
    || iptables -t nat -I PREROUTING -d "$SVC_KUBE/32" -j "$NAT_CHAIN"
  local rule  # rules written straight into PREROUTING by older versions of this script
  # (`|| true`: under pipefail, finding none must not end `up`)
  { iptables -t nat -S PREROUTING | grep -- "-d $SVC_KUBE/32 .*-j DNAT" || true; } | sed 's/^-A //' | while read -r rule; do
    # shellcheck disable=SC2086
    iptables -t nat -D $rule; done
  iptables -t nat -A "$NAT_CHAIN" -p tcp --dport 443 -j DNAT --to-destination "$GW:$1"
  printf -- '-t nat -D PREROUTING -d %s/32 -j %s\n-t nat -F %s\n-t nat -X %s\n' "$SVC_KUBE" "$NAT_CHAIN" \
    "$NAT_CHAIN" "$NAT_CHAIN" >> "$D/iptables"
}

containerd_config() {  # containerd_config DIR RANGE_START RANGE_END: DIR/config.toml, its CNI in DIR/../cni
  local dir=$1 cni; cni=$(dirname "$1")/cni
  mkdir -p "$dir" "$cni/net.d"
  cat > "$dir/config.toml" <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
[grpc]
  address = "$dir/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # a root without CAP_SYS_RESOURCE cannot give the pause container oom_score_adj -998: runc then fails with
  # "can't get final child's PID from pipe: EOF". Clamp to containerd's own score, as for rootless.
  restrict_oom_score_adj = $RESTRICT_OOM
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$cni/net.d"
TOML
  # one bridge for every node, each node its own part of the range; routes to 198.18.0.0/15 only, so nothing
  # in a pod reaches past this machine
  cat > "$cni/net.d/10-realnode.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "realnode",
 "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$GW", "rangeStart": "$2", "rangeEnd": "$3"}]],
            "routes": [{"dst": "198.18.0.0/15"}], "dataDir": "$cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}},
  {"type": "loopback"}
 ]}
JSON
}

kubelet_config() {  # kubelet_config FILE IP HEALTH_PORT CGROUP_ROOT SOCKET
  cat > "$1" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: $4
containerRuntimeEndpoint: unix://$5
address: $2
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $3
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $D/ca.crt}}
authorization: {mode: Webhook}
failSwapOn: false
resolvConf: $D/resolv.conf
clusterDomain: cluster.local
serializeImagePulls: false
evictionHard: {memory.available: "200Mi", nodefs.available: "3%", imagefs.available: "3%"}
imageGCHighThresholdPercent: 98
imageGCLowThresholdPercent: 97
YAML
}

node_ready() {  # node_ready NAME: wait up to 2 minutes for the Node's Ready condition
  local i; for i in $(seq 1 120); do
    [ "$(kc get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] && return 0
    sleep 1
  done
}

load_images() {  # podman storage -> containerd's k8s.io namespace, only what changed; the archive is removed
  local img id idf t0
  mkdir -p "$RN/images"
  if [ "$(cat "$RN/images/loaded.hash" 2>/dev/null)" = "$(cat "$RN/images.hash" 2>/dev/null)" ] \
     && ! podman image exists "$RUNTIME_IMAGE"; then
    return 0   # containerd holds this build; podman's copies were removed to make room
  fi
  for img in "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"; do
    id=$(podman image inspect -f '{{.Id}}' "$img")
    idf="$RN/images/$(echo "$img" | tr '/:' '__').id"
    if [ -f "$idf" ] && [ "$(cat "$idf")" = "$id" ] && \
       [ -n "$(ctr --address "$SOCK" -n k8s.io images ls -q "name==$img" 2>/dev/null)" ]; then continue; fi
    t0=$(date +%s)
    # docker-archive keeps layers uncompressed (an oci-archive would gzip 6 GB first) and ctr keeps its
    # RepoTags; streamed, so no archive of the image is ever written to disk
    podman save --format docker-archive "$img" | ctr --address "$SOCK" -n k8s.io images import - >&2
    if [ -f "$idf" ] && [ "$(cat "$idf")" != "$id" ]; then   # the previous build's content
      ctr --address "$SOCK" -n k8s.io images rm "sha256:$(cat "$idf")" >/dev/null 2>&1 || true
    fi
    echo "$id" > "$idf"
    log "imported $img into containerd in $(( $(date +%s) - t0 )) s"
  done
  cp "$RN/images.hash" "$RN/images/loaded.hash"
  slim podman
}

up() {
  D=$1; mkdir -p "$D/certs" "$D/etcd"; D=$(cd "$D" && pwd)
  [ -x "$BIN/kubelet" ] || { echo "realnode: run 'scripts/realnode.sh build' first" >&2; exit 3; }
  local KB; KB=$(kbin)/bin
  RESTRICT_OOM=false   # CAP_SYS_RESOURCE is capability 24
  if [ $(( 0x$(awk '/CapEff/ {print $2}' /proc/self/status) >> 24 & 1 )) = 0 ]; then RESTRICT_OOM=true; fi
  # the bridge first: the API server and the kubelet listen on its address, so pods reach them
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then ip link add "$BRIDGE" type bridge; fi
  echo "$BRIDGE" > "$D/bridge"
  ip addr show dev "$BRIDGE" | grep -q "inet $GW/" || ip addr add "$GW/22" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  openssl genrsa -out "$D/sa.key" 2048 2>/dev/null; openssl rsa -in "$D/sa.key" -pubout -out "$D/sa.pub" 2>/dev/null
  echo "admin-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n'),admin,admin,system:masters" > "$D/tokens.csv"
  local tok; tok=$(cut -d, -f1 "$D/tokens.csv")
  # the kubelet authenticates the API server's client certificate (logs, exec) against this CA
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$D/ca.key" -out "$D/ca.crt" -days 7 -subj /CN=realnode-ca 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout "$D/kubelet-client.key" -out "$D/kubelet-client.csr" \
    -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
  openssl x509 -req -in "$D/kubelet-client.csr" -CA "$D/ca.crt" -CAkey "$D/ca.key" -CAcreateserial \
    -out "$D/kubelet-client.crt" -days 7 2>/dev/null
  printf 'apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n- level: Metadata\n' > "$D/audit-policy.yaml"
  local ec ep ap; ec=$(port); ep=$(port); ap=$(port); echo "$ap" > "$D/apiserver.port"
  bg etcd "${CP_NICE[@]}" "$KB/etcd" --data-dir "$D/etcd" --listen-client-urls "http://127.0.0.1:$ec" --advertise-client-urls "http://127.0.0.1:$ec" \
    --listen-peer-urls "http://127.0.0.1:$ep" --initial-advertise-peer-urls "http://127.0.0.1:$ep" --initial-cluster "default=http://127.0.0.1:$ep" \
    --unsafe-no-fsync
  bg apiserver "${CP_NICE[@]}" "$KB/kube-apiserver" --etcd-servers="http://127.0.0.1:$ec" --secure-port="$ap" --bind-address="$GW" \
    --advertise-address="$GW" --service-cluster-ip-range="$SVC_CIDR" \
    --authorization-mode=Node,RBAC --token-auth-file="$D/tokens.csv" --cert-dir="$D/certs" \
    --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$D/sa.pub" \
    --service-account-signing-key-file="$D/sa.key" --audit-log-path="$D/audit.log" --audit-policy-file="$D/audit-policy.yaml" \
    --kubelet-client-certificate="$D/kubelet-client.crt" --kubelet-client-key="$D/kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP
  cat > "$D/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: realnode
  cluster: {server: "https://$GW:$ap", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: $tok}
contexts:
- name: realnode
  context: {cluster: realnode, user: admin, namespace: default}
current-context: realnode
KC
  kc() { "$KB/kubectl" --kubeconfig "$D/kubeconfig" "$@"; }
  local i; for i in $(seq 1 120); do kc get --raw /readyz >/dev/null 2>&1 && break; sleep 0.5; done
  kc get --raw /readyz >/dev/null || { echo "realnode: the API server did not become ready ($D/apiserver.log)" >&2; exit 1; }
  bg controller-manager "${CP_NICE[@]}" "$KB/kube-controller-manager" --kubeconfig "$D/kubeconfig" --leader-elect=false --bind-address=127.0.0.1 \
    --secure-port="$(port)" --service-account-private-key-file="$D/sa.key" --root-ca-file="$D/certs/apiserver.crt" \
    --use-service-account-credentials --controllers='*'
  bg scheduler "${CP_NICE[@]}" "$KB/kube-scheduler" --kubeconfig "$D/kubeconfig" --leader-elect=false --bind-address=127.0.0.1 --secure-port="$(port)"
  # No kube-proxy: the one Service pods use is `kubernetes` (in-cluster config); DNAT its ClusterIP as kube-proxy would
  service_nat "$ap"
  containerd_config "$RN/containerd" 198.18.252.16 198.18.253.254
  bg containerd containerd --config "$RN/containerd/config.toml"
  for i in $(seq 1 60); do ctr --address "$SOCK" version >/dev/null 2>&1 && break; sleep 0.5; done
  load_images
  mkdir -p "$RN/kubelet"; printf 'nameserver 127.0.0.1\noptions ndots:1\n' > "$D/resolv.conf"  # no DNS leaves a pod
  rm -rf "$RN/nodecache"   # the chart's platform.cacheRoot in the tests: a fresh node has an empty weight cache
  kubelet_config "$D/kubelet-config.yaml" "$GW" "$KUBELET_HEALTH" / "$SOCK"
  bg kubelet "$BIN/kubelet" --config "$D/kubelet-config.yaml" --kubeconfig "$D/kubeconfig" --root-dir "$RN/kubelet" \
    --cert-dir "$D/kubelet-pki" --node-ip "$GW" --hostname-override "$NODE" --v=1
  node_ready "$NODE"
  for i in $(seq 1 60); do kc get serviceaccount default >/dev/null 2>&1 && break; sleep 0.5; done  # pods need it
  echo "$RN" > "$D/home"
  echo "$D/kubeconfig"
}

# -------------------------------------------------------------------------------------------------- join/leave
# realnode-2 shares the machine, the bridge and the control plane, and nothing else a node owns: its containerd
# (root, state, socket; the first node's image blobs hard-linked in, so only the unpacked layers take space),
# its kubelet (root dir, cgroup root /realnode-2, node IP 198.18.252.2) and its pod range. Both run in a mount
# namespace of their own where the node cache root (the chart's platform.cacheRoot, $RN/nodecache in the tests)
# and /var/log/pods, /var/log/containers and /var/lib/kubelet are the node's own folders: hostPath volumes on
# two machines name the same path and hold different bytes, and so they do here.
image_digest() {  # image_digest SOCKET IMAGE: the digest containerd holds for the tag, empty when none
  ctr --address "$1" -n k8s.io images ls "name==$2" 2>/dev/null | awk 'NR==2 {print $3}'
}

cgroup_root() {  # cgroup_root create|remove: realnode-2's cgroup root, in every hierarchy (cgroup v1 or v2)
  local h
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    if [ "$1" = create ]; then
      mkdir -p /sys/fs/cgroup/realnode-2
      echo "+cpu +cpuset +memory +pids" > /sys/fs/cgroup/realnode-2/cgroup.subtree_control 2>/dev/null || true
    else find /sys/fs/cgroup/realnode-2 -depth -type d -exec rmdir {} \; 2>/dev/null; fi
    return 0
  fi
  for h in /sys/fs/cgroup/*/; do
    mountpoint -q "$h" || continue   # a hierarchy, not a plain folder (a link to one is met twice: harmless)
    if [ "$1" = create ]; then
      mkdir -p "$h/realnode-2"
      if [ -f "$h/cpuset.cpus" ]; then   # a v1 cpuset takes no task until it has CPUs and memory nodes
        cat "$h/cpuset.cpus" > "$h/realnode-2/cpuset.cpus"; cat "$h/cpuset.mems" > "$h/realnode-2/cpuset.mems"
      fi
    else find "$h/realnode-2" -depth -type d -exec rmdir {} \; 2>/dev/null; fi
  done
  return 0
}

join() {
  D=$1; D=$(cd "$D" && pwd); [ -f "$D/kubeconfig" ] || { echo "realnode: run 'up $D' first" >&2; exit 3; }
  local KB i pid t0; KB=$(kbin)/bin
  kc() { "$KB/kubectl" --kubeconfig "$D/kubeconfig" "$@"; }
  if grep -q -- "-2$" "$D/pids" 2>/dev/null; then   # a join before: keep it only if it got as far as Ready
    if [ "$(kc get node "$NODE2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
    then log "realnode-2 is up already"; return 0; fi
    ( leave "$D" )   # in a subshell: its `set +e` stays there
  fi
  t0=$(date +%s)
  RESTRICT_OOM=false
  if [ $(( 0x$(awk '/CapEff/ {print $2}' /proc/self/status) >> 24 & 1 )) = 0 ]; then RESTRICT_OOM=true; fi
  ip addr show dev "$BRIDGE" | grep -q "inet $NODE2_IP/" || ip addr add "$NODE2_IP/22" dev "$BRIDGE"
  mkdir -p "$N2/nodecache" "$N2/podlogs" "$N2/containerlogs" "$N2/varlib" "$N2/containerd/root" "$RN/nodecache" \
    /var/log/pods /var/log/containers /var/lib/kubelet
  # the first node's blobs, immutable and named by their digest: the import below finds them and writes none
  if [ ! -d "$N2/containerd/root/io.containerd.content.v1.content" ]; then
    cp -al "$RN/containerd/root/io.containerd.content.v1.content" "$N2/containerd/root/"
  fi
  containerd_config "$N2/containerd" 198.18.254.1 198.18.255.254
  cgroup_root create
  # /var/lib/kubelet: the paths a kubelet uses whatever its root dir (device plugins, pod resources)
  bg containerd-2 unshare --mount --propagation slave sh -c "mount --bind '$N2/nodecache' '$RN/nodecache' && \
    mount --bind '$N2/podlogs' /var/log/pods && mount --bind '$N2/containerlogs' /var/log/containers && \
    mount --bind '$N2/varlib' /var/lib/kubelet && exec containerd --config '$N2/containerd/config.toml'"
  pid=$(awk '$2=="containerd-2" {print $1}' "$D/pids" | tail -1)
  for i in $(seq 1 60); do ctr --address "$SOCK2" version >/dev/null 2>&1 && break; sleep 0.5; done
  ctr --address "$SOCK2" version >/dev/null 2>&1 || { echo "realnode: containerd-2 did not start ($D/containerd-2.log)" >&2; exit 1; }
  local img missing=()
  for img in "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"; do   # absent, or an older build of the tag
    [ "$(image_digest "$SOCK2" "$img")" = "$(image_digest "$SOCK" "$img")" ] || missing+=("$img")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    ctr --address "$SOCK" -n k8s.io images export - "${missing[@]}" | ctr --address "$SOCK2" -n k8s.io images import - >&2
  fi
  # an older build's image ID references (the CRI's sha256:<config> names) the first node has dropped: without
  # them containerd's collector frees that build's blobs and layers here too (6 GB a runtime build)
  comm -23 <(ctr --address "$SOCK2" -n k8s.io images ls -q | grep '^sha256:' | sort) \
    <(ctr --address "$SOCK" -n k8s.io images ls -q | grep '^sha256:' | sort) \
    | xargs -r ctr --address "$SOCK2" -n k8s.io images rm >/dev/null 2>&1 || true
  log "realnode-2's containerd holds the images ($(( $(date +%s) - t0 )) s)"
  kubelet_config "$D/kubelet-2-config.yaml" "$NODE2_IP" "$KUBELET2_HEALTH" /realnode-2 "$SOCK2"
  bg kubelet-2 nsenter --mount="/proc/$pid/ns/mnt" "$BIN/kubelet" --config "$D/kubelet-2-config.yaml" \
    --kubeconfig "$D/kubeconfig" --root-dir "$N2/kubelet" --cert-dir "$D/kubelet-2-pki" --node-ip "$NODE2_IP" \
    --hostname-override "$NODE2" --v=1
  node_ready "$NODE2"
  [ "$(kc get node "$NODE2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] \
    || { echo "realnode: $NODE2 did not become Ready ($D/kubelet-2.log)" >&2; exit 1; }
  log "$NODE2 Ready in $(( $(date +%s) - t0 )) s"
}

leave() {  # the second node's pods, processes, Node object and node-local folders (its images stay cached)
  set +e
  D=$1; [ -d "$D" ] || return 0; D=$(cd "$D" && pwd); [ -f "$D/pids" ] || return 0
  grep -q -- "-2$" "$D/pids" || return 0
  local KB p i; KB=$(kbin)/bin
  "$KB/kubectl" --kubeconfig "$D/kubeconfig" delete pods -A --field-selector "spec.nodeName=$NODE2" --grace-period=0 \
    --force --wait=false >/dev/null 2>&1
  for i in $(seq 1 30); do [ -z "$("$BIN/crictl" --runtime-endpoint "unix://$SOCK2" pods -q 2>/dev/null)" ] && break; sleep 1; done
  "$BIN/crictl" --runtime-endpoint "unix://$SOCK2" pods -q 2>/dev/null | while read -r p; do
    "$BIN/crictl" --runtime-endpoint "unix://$SOCK2" stopp "$p" >/dev/null 2>&1
    "$BIN/crictl" --runtime-endpoint "unix://$SOCK2" rmp -f "$p" >/dev/null 2>&1; done
  for name in kubelet-2 containerd-2; do   # every one recorded (a join retried after a failure records two)
    for p in $(awk -v n=$name '$2==n {print $1}' "$D/pids"); do
      kill "$p" 2>/dev/null; for i in $(seq 1 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
      kill -9 "$p" 2>/dev/null
    done
    sed -i "/ $name\$/d" "$D/pids"
  done
  "$KB/kubectl" --kubeconfig "$D/kubeconfig" delete node "$NODE2" --wait=false >/dev/null 2>&1
  # shims outlive containerd only when a pod was not removed; their mounts are in the node's namespace, gone with it
  cgroup_root remove
  ip addr del "$NODE2_IP/22" dev "$BRIDGE" 2>/dev/null
  rm -rf "$N2/nodecache" "$N2/podlogs" "$N2/containerlogs" "$N2/varlib" "$N2/kubelet" "$N2/cni/ipam" \
    "$D/kubelet-2-pki"
  return 0
}

# -------------------------------------------------------------------------------------------------------- down
down() {
  set +e
  leave "$1"
  D=$1; [ -d "$D" ] || return 0; D=$(cd "$D" && pwd); [ -f "$D/pids" ] || return 0
  local KB p name alive i; KB=$(kbin)/bin
  # stop new pods first, then let the kubelet remove every pod, so no shim, netns or mount is left
  for name in scheduler controller-manager; do
    p=$(awk -v n=$name '$2==n {print $1}' "$D/pids"); [ -n "$p" ] && kill "$p" 2>/dev/null; done
  if "$KB/kubectl" --kubeconfig "$D/kubeconfig" get --raw /readyz >/dev/null 2>&1; then
    "$KB/kubectl" --kubeconfig "$D/kubeconfig" delete pods --all -A --grace-period=0 --force --wait=false >/dev/null 2>&1
    for i in $(seq 1 30); do [ -z "$("$BIN/crictl" --runtime-endpoint "unix://$SOCK" pods -q 2>/dev/null)" ] && break; sleep 1; done
  fi
  "$BIN/crictl" --runtime-endpoint "unix://$SOCK" pods -q 2>/dev/null | while read -r p; do
    "$BIN/crictl" --runtime-endpoint "unix://$SOCK" stopp "$p" >/dev/null 2>&1
    "$BIN/crictl" --runtime-endpoint "unix://$SOCK" rmp -f "$p" >/dev/null 2>&1; done
  tac "$D/pids" | while read -r p name; do kill "$p" 2>/dev/null; done
  for i in $(seq 1 20); do
    alive=0; while read -r p name; do kill -0 "$p" 2>/dev/null && alive=1; done < "$D/pids"; [ $alive = 0 ] && break; sleep 0.5
  done
  while read -r p name; do kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null; done < "$D/pids"; rm -f "$D/pids"
  grep -o " $RN/kubelet[^ ]*" /proc/mounts | sort -r | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  # containerd's shims outlive it only when a pod was not removed; their mounts too
  grep -o " $RN/containerd/state[^ ]*" /proc/mounts | sort -r | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  [ -f "$D/iptables" ] && { while read -r r; do iptables $r 2>/dev/null; done < "$D/iptables"; rm -f "$D/iptables"; }
  [ -f "$D/bridge" ] && { ip link del "$(cat "$D/bridge")" 2>/dev/null; rm -f "$D/bridge"; }
  rm -rf "$RN/cni/ipam" "$RN/nodecache"
  return 0
}

{ # one compound command, read whole before it runs: editing this file during a run cannot derail it
case "${1:-}" in
  build) build ;;
  packages) apt_packages; disk_check ;;
  images) storage_conf; images ;;
  load) load_images ;;
  up) up "${2:?usage: realnode.sh up DIR}" ;;
  join) join "${2:?usage: realnode.sh join DIR}" ;;
  leave) leave "${2:?usage: realnode.sh leave DIR}" ;;
  down) down "${2:?usage: realnode.sh down DIR}" ;;
  home) echo "$RN" ;;
  *) echo "usage: $0 build | packages | images | load | up DIR | join DIR | leave DIR | down DIR | home" >&2; exit 2 ;;
esac
exit
}
