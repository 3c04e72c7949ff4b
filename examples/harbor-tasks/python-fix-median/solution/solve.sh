#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import re
path = "/app/stats.py"
src = open(path).read()
fixed = '''def median(values):
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
'''
src = re.sub(r"def median\(values\):\n(?:    .*\n)+", fixed, src)
open(path, "w").write(src)
PY
