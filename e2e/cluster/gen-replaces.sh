#!/usr/bin/env bash
# Pins every staging module that k8s.io/kubernetes replaces with ./staging/src/...
# to its published tag (v1.X.Y -> v0.X.Y), because those replaces only apply
# inside the kubernetes repository itself. Re-run after changing the version.
set -euo pipefail
cd "$(dirname "$0")"
K8S_VERSION=${1:-v1.37.2}
STAGING_VERSION=v0.${K8S_VERSION#v1.}
gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
modules=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$gomod")
test -n "$modules" || { echo "error: no staging replaces found in $gomod" >&2; exit 1; }
for m in $modules; do
    go mod edit -replace "$m=$m@$STAGING_VERSION"
done
echo "pinned $(echo "$modules" | wc -w) staging modules to $STAGING_VERSION"
