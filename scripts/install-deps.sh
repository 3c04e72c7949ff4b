#!/usr/bin/env bash
# Installs what DSec needs on a fresh Debian 12 machine (as root) and builds
# it. Idempotent: what is already there is skipped, so it is cheap to re-run.
#   DSEC_EXTRA_PACKAGES="podman"  additionally installs peers for benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "error: DSec manages mounts, cgroups and namespaces and must run as root (try: sudo $0)" >&2
  exit 1
fi

packages=(runc crun erofs-utils busybox-static nftables iproute2 attr libseccomp-dev libcap-dev debootstrap postgresql python3-httpx python3-pytest python3-pytest-asyncio make gcc libc6-dev libasan8 libubsan1 skopeo buildah docker-registry qemu-system-x86 qemu-utils e2fsprogs cpio chromium zsh ${DSEC_EXTRA_PACKAGES:-})
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -d node_modules ] || [ package-lock.json -nt node_modules ]; then
  echo "==> installing npm dependencies"
  # --prefer-offline: what the local npm cache holds is not asked for again (CI clones afresh).
  npm ci --prefer-offline --no-audit --no-fund --loglevel=error
fi

echo "==> building"
npm run -s build >/dev/null

# What a microVM boots: Debian's cloud kernel (downloaded, never installed) and
# an initramfs with the guest agent. Idempotent; rebuilt when the agent changes.
echo "==> microVM kernel and initramfs"
sh packages/edge/src/backends/microvm/build-assets.sh /var/cache/dsec/microvm packages/native/src
