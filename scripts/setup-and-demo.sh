#!/usr/bin/env bash
# Quick start, part 1: install and build everything, build the busybox base
# image, start a single-node cluster, run the demo workload through the SDK,
# then stop the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
DSEC_EXTRA_PACKAGES="${DSEC_EXTRA_PACKAGES:-podman}" bash scripts/install-deps.sh

state_dir="${DSEC_STATE_DIR:-/var/lib/dsec}"
port="${DSEC_PORT:-7420}"
export DSEC_STATE_DIR="$state_dir"

echo "==> building the busybox base image"
bin/dsec image build busybox --from-busybox --kind base

echo "==> starting a single-node cluster (state in $state_dir)"
log="$(mktemp)"
bin/dsec up --state-dir "$state_dir" --port "$port" >"$log" 2>&1 &
up_pid=$!
trap 'kill -TERM $up_pid 2>/dev/null; wait $up_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  grep -q '^ready ' "$log" && break
  kill -0 $up_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
grep '^ready ' "$log"

echo "==> running the demo"
DSEC_URL="http://127.0.0.1:$port" DSEC_API_KEY="$(cat "$state_dir/admin.key")" \
  node --conditions=dsec-source --import tsx examples/demo.ts

echo "==> stopping the cluster"
