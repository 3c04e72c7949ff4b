#!/usr/bin/env bash
# Quick start, part 1: install and build everything, start a single-node
# cluster, run the main job (the shipped SWE-style tasks, each in its own
# sandbox, graded by their tests) with the reference patches (`--agent gold`,
# every reward 1) and with no agent (`--agent none`, every reward 0), run the
# busybox SDK demo, then stop the cluster.
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

export DSEC_URL="http://127.0.0.1:$port" DSEC_API_KEY="$(cat "$state_dir/admin.key")"
tasks=examples/swe-tasks/tasks.jsonl
results="$state_dir/demo-results"
mkdir -p "$results"
echo "==> building the task set's images: debian-base (debootstrap), python and node toolkits"
echo "    (from Debian's packages), one workspace layer per repository; cached after the first run"
bin/dsec eval prepare "$tasks"

echo "==> agent gold: each task's reference patch, applied through the sandbox's tool calls"
bin/dsec eval run "$tasks" --agent gold --concurrency 4 --out "$results/gold.jsonl"
echo "==> agent none: changes nothing, so every task with a failing test scores 0"
bin/dsec eval run "$tasks" --agent none --concurrency 4 --out "$results/none.jsonl"

echo "==> the SDK demo (busybox sandboxes, a few stateful commands each)"
node --conditions=dsec-source --import tsx examples/demo.ts

echo "==> stopping the cluster"
