#!/usr/bin/env bash
# Builds the local Kubernetes control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kwok) plus kubectl and helm from the
# Go modules pinned in this folder into e2e/cluster/bin/, and for the live alerting and HPA tests
# prometheus-adapter (adapter/: the external metrics API) and Prometheus (prometheus/: the Debian
# package's is built without kubernetes_sd_configs; this one has only file, http and kubernetes SD).
# The first build takes ~11 minutes on 2 cores (+ the adapter, see below); later ones reuse ~/.cache/go-build.
set -euo pipefail
cd "$(dirname "$0")"
BIN=$PWD/bin
K8S_VERSION=v1.37.2
HELM_VERSION=v4.3.2

KUBE_PACKAGES=(
    k8s.io/kubernetes/cmd/kube-apiserver
    k8s.io/kubernetes/cmd/kube-controller-manager
    k8s.io/kubernetes/cmd/kube-scheduler
    k8s.io/kubernetes/cmd/kubectl
    go.etcd.io/etcd/server/v3
    sigs.k8s.io/kwok/cmd/kwok
)
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm prometheus-adapter prometheus)

up_to_date() {
    local name
    for name in "${BINARIES[@]}"; do
        [[ -x $BIN/$name && $BIN/$name -nt go.sum && $BIN/$name -nt helm/go.sum && $BIN/$name -nt adapter/go.sum && $BIN/$name -nt prometheus/go.sum ]] || return 1
    done
}

if up_to_date; then
    echo "cluster tools in $BIN are newer than go.sum: nothing to build"
    exit 0
fi
command -v go >/dev/null || { echo "error: Go 1.24+ is needed to build the cluster tools (https://go.dev/dl/)" >&2; exit 1; }
mkdir -p "$BIN"

# Without these the binaries report v0.0.0-master, which kubectl, helm and
# charts with a kubeVersion constraint treat as a very old cluster.
kube_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kube_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION")"
    kube_ldflags+=" -X $pkg.gitTreeState=clean"
done

start=$SECONDS
echo "building ${KUBE_PACKAGES[*]} into $BIN (first build: ~11 min on 2 cores)"
go build -ldflags "-s -w $kube_ldflags" -o "$BIN/" "${KUBE_PACKAGES[@]}"
mv -f "$BIN/server" "$BIN/etcd"  # go names etcd's binary after its package folder
echo "building helm $HELM_VERSION into $BIN"
(cd helm && go build -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" -o "$BIN/" helm.sh/helm/v4/cmd/helm)
adapter_start=$SECONDS
echo "building prometheus-adapter ($(awk '$1 == "require" {print $3}' adapter/go.mod)) into $BIN"
(cd adapter && go build -ldflags "-s -w" -o "$BIN/prometheus-adapter" sigs.k8s.io/prometheus-adapter/cmd/adapter)
echo "built prometheus-adapter in $((SECONDS - adapter_start)) s"
prometheus_start=$SECONDS
echo "building prometheus ($(awk '$1 == "require" {print $3}' prometheus/go.mod)) into $BIN"
(cd prometheus && go build -tags remove_all_sd,enable_kubernetes_sd -ldflags "-s -w" -o "$BIN/prometheus" \
    github.com/prometheus/prometheus/cmd/prometheus)
echo "built prometheus in $((SECONDS - prometheus_start)) s"
touch "${BINARIES[@]/#/$BIN/}"
echo "built ${BINARIES[*]} in $((SECONDS - start)) s"
