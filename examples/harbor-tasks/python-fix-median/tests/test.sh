#!/bin/bash
mkdir -p /logs/verifier
# -B: no bytecode left behind; -I: the tests' own sys.path, nothing from the environment.
if python3 -B -I /tests/test_stats.py -v; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
