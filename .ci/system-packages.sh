#!/usr/bin/env bash
# Installs the Debian packages the tests use, only when missing: prometheus (prometheus, promtool),
# prometheus-alertmanager (alertmanager, amtool), and the daemonless container tools that build and
# run the iterserve image (podman with runc and buildah, mmdebstrap for the base rootfs, skopeo to
# copy images to a registry or an archive; see docs/image.md). The tests start their own Prometheus and
# Alertmanager on loopback ports, so the packages' services are kept from starting at install time
# (a policy-rc.d that denies every start while apt-get runs). This script never stops, disables or
# kills anything that already runs. It fails when a command the tests need is still missing.
set -euo pipefail

# command -> the package that ships it
declare -A PACKAGE_OF=(
    [prometheus]=prometheus
    [promtool]=prometheus
    [prometheus-alertmanager]=prometheus-alertmanager
    [amtool]=prometheus-alertmanager
    [podman]=podman
    [runc]=runc
    [buildah]=buildah
    [mmdebstrap]=mmdebstrap
    [skopeo]=skopeo
)

missing_packages() {
    local command
    for command in "${!PACKAGE_OF[@]}"; do
        command -v "$command" >/dev/null || echo "${PACKAGE_OF[$command]}"
    done | sort -u
}

mapfile -t need < <(missing_packages)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "error: the tests need the Debian packages ${need[*]}; install them with" >&2
    echo "  sudo bash .ci/system-packages.sh   (or: sudo apt-get install --no-install-recommends ${need[*]})" >&2
    exit 1
fi

# invoke-rc.d and deb-systemd-invoke ask /usr/sbin/policy-rc.d before starting a service: 101 means
# "not allowed". An existing policy is put back afterwards, whatever happens.
policy=/usr/sbin/policy-rc.d
saved=""
if [ -e "$policy" ] || [ -L "$policy" ]; then
    saved=$(mktemp /usr/sbin/policy-rc.d.iterserve-saved.XXXXXX)
    mv -f "$policy" "$saved"
fi
restore_policy() {
    rm -f "$policy"
    if [ -n "$saved" ]; then mv -f "$saved" "$policy"; fi
}
trap restore_policy EXIT
printf '#!/bin/sh\n# written by iterserve .ci/system-packages.sh while it installs packages\nexit 101\n' >"$policy"
chmod 755 "$policy"

export DEBIAN_FRONTEND=noninteractive
echo "installing ${need[*]} (their services are not started)"
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null

mapfile -t still < <(missing_packages)
if [ ${#still[@]} -gt 0 ]; then
    echo "error: after apt-get install, commands of ${still[*]} are still missing" >&2
    exit 1
fi
