#!/bin/bash
# SWE-ReX's own tests/test_execution.py, unmodified, against DSec (docs/integrations.md, "SWE-ReX").
#
#   scripts/framework-suites/swerex/run.sh SWEREX_CHECKOUT [WORK_DIR]
#
# SWEREX_CHECKOUT is a SWE-ReX source tree (src/ and tests/) at the commit docs/integrations.md
# names. swerex needs pydantic 2, which Debian 12 lacks, so the suite runs in a Debian 13 chroot
# (debootstrap from the Debian mirror, Debian packages only) that is also the sandboxes' image.
# The suite's conftest.py is replaced by the one beside this script (same fixtures, DSecRuntime
# instead of RemoteRuntime). test_server_dead is deselected: it resolves a public host name.
# Needs root (debootstrap, chroot, dsec up). Every mount and the server are cleaned up on exit.
set -euo pipefail
SRC=$(cd "$1" && pwd)
WORK=${2:-$(mktemp -d /tmp/dsec-swerex-suite.XXXXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
ROOT=$WORK/trixie
STATE=$WORK/state
DSEC=(node --conditions=dsec-source --import tsx "$REPO/packages/cli/src/run.ts" --state-dir "$STATE")
PKGS=python3,python3-pydantic,python3-pexpect,python3-httpx,python3-pytest,python3-pytest-asyncio,python3-typing-extensions,python3-requests,python3-rich,python3-aiohttp,python-is-python3,less

if [ ! -x "$ROOT/usr/bin/python3" ]; then
  debootstrap --variant=minbase --include="$PKGS" trixie "$ROOT" http://deb.debian.org/debian
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb
fi

UP=
cleanup() {
  mountpoint -q "$ROOT/dev" && umount "$ROOT/dev"
  mountpoint -q "$ROOT/proc" && umount "$ROOT/proc"
  if [ -n "$UP" ]; then kill -TERM "$UP" 2>/dev/null || true; wait "$UP" || true; fi
}
trap cleanup EXIT

rm -rf "$STATE" "$ROOT/opt/dsec-python" "$ROOT/opt/swerex"
cd "$REPO"
# The image is built before anything is mounted in the tree.
"${DSEC[@]}" image build debian13 --from-dir "$ROOT" --kind base >"$WORK/build.log" 2>&1
"${DSEC[@]}" up --port 0 --stop-sandboxes --no-cgroup-favordynmods >"$WORK/up.out" 2>"$WORK/up.err" &
UP=$!
for _ in $(seq 1 180); do grep -q '^ready ' "$WORK/up.out" && break; sleep 1; done
URL=$(sed -n 's/^ready //p' "$WORK/up.out" | head -1)
[ -n "$URL" ] || { echo "dsec up did not start: $(cat "$WORK/up.err")" >&2; exit 1; }

mkdir -p "$ROOT/opt/dsec-python" "$ROOT/opt/swerex"
cp -r "$REPO/python/dsec" "$ROOT/opt/dsec-python/"
cp -r "$SRC/src" "$SRC/tests" "$ROOT/opt/swerex/"
cp "$HERE/conftest.py" "$ROOT/opt/swerex/tests/conftest.py"
mount -t proc proc "$ROOT/proc"
mount --bind /dev "$ROOT/dev"
set +e
chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root PYTHONPATH=/opt/dsec-python:/opt/swerex/src \
  DSEC_URL="$URL" DSEC_API_KEY="$(cat "$STATE/admin.key")" SWEREX_DSEC_IMAGE=debian13 \
  sh -c "cd /opt/swerex && python3 -m pytest -p no:cacheprovider -o asyncio_mode=auto -q -rfE \
    tests/test_execution.py --deselect tests/test_execution.py::test_server_dead"
rc=$?
set -e
echo "suite exit status $rc (work dir $WORK)"
exit $rc
