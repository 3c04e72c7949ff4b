#!/usr/bin/env bash
# Quick start, part 1: install and build everything, start a single-node
# cluster, run the main job (the shipped SWE-style tasks, each in its own
# sandbox, graded by their tests) with the reference patches (`--agent gold`,
# every reward 1) and with no agent (`--agent none`, every reward 0), then the
# shipped Harbor-format tasks (examples/harbor-tasks, environments built from
# their Dockerfiles `FROM` a Debian image mirrored into a registry on
# loopback) with `--agent oracle` (every reward 1) and `none` (every reward 0),
# run the busybox SDK demo, then stop the cluster and the registry.
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
registry_pid=
trap 'kill -TERM $up_pid ${registry_pid:+$registry_pid} 2>/dev/null; wait $up_pid ${registry_pid:+$registry_pid} 2>/dev/null || true' EXIT
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

echo "==> a Debian bookworm image in a registry on loopback (debootstrap minbase, cached in /var/cache/dsec)"
registry_dir="$(mktemp -d)"
registry_log="$registry_dir/log"
node --conditions=dsec-source --import tsx scripts/debian-registry.ts "$registry_dir/registry" "$registry_dir/env" \
  >"$registry_log" 2>&1 &
registry_pid=$!
until grep -q '^ready ' "$registry_log"; do
  kill -0 $registry_pid 2>/dev/null || { cat "$registry_log"; exit 1; }
  sleep 0.2
done
grep '^ready ' "$registry_log"
# DEBIAN_IMAGE, DSEC_INSECURE_REGISTRIES (plain HTTP on loopback) and DSEC_REGISTRY_MIRRORS (docker.io).
set -a
# shellcheck disable=SC1091
. "$registry_dir/env"
set +a
harbor=examples/harbor-tasks
# The Dockerfiles' RUN steps reach Debian's mirror through DSec's egress policy, whose resolver
# drops answers in special-use ranges. A lab whose mirror sits in one (a documentation or
# benchmarking range) declares it public for the builds, as an operator would in the node's config.
harbor_config="$registry_dir/config.json"
/usr/bin/python3 - "$harbor_config" <<'PY'
import ipaddress, json, socket, sys
lab = ["192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15", "100.64.0.0/10"]
found = set()
try:
    for info in socket.getaddrinfo("deb.debian.org", 80, socket.AF_INET):
        addr = ipaddress.ip_address(info[4][0])
        found.update(c for c in lab if addr in ipaddress.ip_network(c))
except OSError:
    pass
network = {"publicRanges": sorted(found)} if found else {}
json.dump({"up": {"network": network}}, open(sys.argv[1], "w"))
PY
echo "==> Harbor tasks, agent oracle: each task's solution/solve.sh; environments built from their Dockerfiles (cached)"
bin/dsec eval run "$harbor" --format harbor --agent oracle --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
  --config "$harbor_config" --concurrency 4 --out "$results/harbor-oracle.jsonl"
echo "==> Harbor tasks, agent none: nothing done, so every verifier scores 0"
bin/dsec eval run "$harbor" --format harbor --agent none --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
  --config "$harbor_config" --concurrency 4 --out "$results/harbor-none.jsonl"
kill -TERM $registry_pid && wait $registry_pid || true
registry_pid=
rm -rf "$registry_dir"

echo "==> the SDK demo (busybox sandboxes, a few stateful commands each)"
node --conditions=dsec-source --import tsx examples/demo.ts

echo "==> stopping the cluster"
