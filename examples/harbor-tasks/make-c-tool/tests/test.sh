#!/bin/bash
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
check() {
  [ -x /app/bin/rot13 ] || { echo "/app/bin/rot13 is missing"; return 1; }
  [ "$(printf 'Hello, Harbor!' | /app/bin/rot13)" = 'Uryyb, Uneobe!' ] || { echo "wrong output"; return 1; }
}
# The sources must be the task's own.
for f in main.c rotate.c rotate.h; do
  cmp -s "/app/src/$f" "/tests/src/$f" || { echo "src/$f was changed"; exit 0; }
done
check || exit 0
# A clean rebuild must work too: the binary alone is not the fix.
make -C /app clean >/tmp/clean.log 2>&1 && [ ! -e /app/bin/rot13 ] || { echo "make clean failed"; cat /tmp/clean.log; exit 0; }
make -C /app >/tmp/make.log 2>&1 || { echo "make failed:"; cat /tmp/make.log; exit 0; }
check && echo 1 > /logs/verifier/reward.txt
