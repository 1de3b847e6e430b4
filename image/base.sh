#!/usr/bin/env bash
# Builds the image's base: a Debian bookworm root filesystem made by mmdebstrap from Debian's
# own packages, imported as a local image. For machines that cannot pull from a container
# registry; elsewhere `--build-arg BASE=python:3.11-slim-bookworm` replaces it.
#
# Python is Debian's python3 (3.11 in bookworm, the version the project requires) with venv.
# apt stays in, so the GPU variant can add a C compiler with apt-get. Docs, man pages and apt
# lists are left out to keep the layer small.
#
#   bash image/base.sh [TAG]          default TAG: localhost/iterserve-base:bookworm
#   DEBIAN_SNAPSHOT=20261201T000000Z bash image/base.sh   pins every package to snapshot.debian.org
#
# The tag is reused when it exists (FORCE=1 rebuilds): the base changes rarely and takes a minute.
set -euo pipefail

TAG=${1:-localhost/iterserve-base:bookworm}
PACKAGES=python3,python3-venv,ca-certificates,libgomp1

if [ "${FORCE:-0}" != 1 ] && podman image exists "$TAG"; then
    echo "base $TAG exists (FORCE=1 rebuilds it)"
    exit 0
fi
for tool in mmdebstrap podman; do
    command -v "$tool" >/dev/null || {
        echo "error: $tool is missing; install it with: sudo bash .ci/system-packages.sh" >&2
        exit 1
    }
done

if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
    MIRROR="http://snapshot.debian.org/archive/debian/${DEBIAN_SNAPSHOT}"
    # snapshot.debian.org serves old Release files: their Valid-Until has passed.
    APT_OPTS=(--aptopt='Acquire::Check-Valid-Until "false"')
else
    MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
    APT_OPTS=()
fi

work=$(mktemp -d /var/tmp/iterserve-base.XXXXXX)
trap 'rm -rf "$work"' EXIT

mmdebstrap --variant=apt --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    "${APT_OPTS[@]}" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/rootfs.tar" "$MIRROR"

podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    "$work/rootfs.tar" "$TAG"
echo "base $TAG: $(podman image inspect --format '{{.Size}}' "$TAG") bytes"
