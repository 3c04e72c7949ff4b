#!/bin/bash
# Recomputes the answer from the verifier's own copy of the log (the agent may have edited /app's).
mkdir -p /logs/verifier
expected="$(cut -d' ' -f1 /tests/access.log | LC_ALL=C sort | uniq -c \
  | awk '{print $1, $2}' | LC_ALL=C sort -k1,1nr -k2,2 | head -n 3)"
if [ -f /app/top_ips.txt ] && [ "$(cat /app/top_ips.txt)" = "$expected" ]; then
  echo "top_ips.txt is right"
  echo 1 > /logs/verifier/reward.txt
else
  echo "expected:"; echo "$expected"; echo "got:"; cat /app/top_ips.txt 2>&1 || true
  echo 0 > /logs/verifier/reward.txt
fi
