#!/usr/bin/env bash
# inspect_ai's own sandbox self-check (src/inspect_ai/util/_sandbox/self_check.py) against the
# dsec provider, at development time (docs/integrations.md, "inspect_ai"). inspect_ai is not
# packaged by Debian and is never taken from PyPI: its source comes from a git checkout, its
# dependencies from Debian 13's packages in a debootstrapped chroot (Debian 12's pydantic is too
# old). A few dependencies Debian does not package get inert stand-ins that the sandbox code path
# never calls (listed in sitecustomize.py below). The provider is found the way inspect finds it:
# through the `inspect_ai` entry point of python/pyproject.toml.
#
#   INSPECT_GIT_DIR=/path/to/inspect_ai.git DSEC_URL=... DSEC_API_KEY=... \
#     scripts/inspect-ai-selfcheck.sh ['{"image":"busybox","user":"1000","workdir":"/tmp/sc"}']
#
# Needs root (debootstrap, chroot) and network access to the Debian mirror the host's apt uses.
# The chroot (CHROOT, default /var/tmp/dsec-trixie) is kept for the next run; remove it with
# rm -rf. The chroot shares the host's network namespace, so DSEC_URL may be on loopback.
set -euo pipefail

: "${INSPECT_GIT_DIR:?a git dir of UKGovernmentBEIS/inspect_ai}"
: "${DSEC_URL:?}" "${DSEC_API_KEY:?}"
COMMIT="${INSPECT_COMMIT:-499e6152e7b8fc8cbd8ac5283536572aa6e4ab17}"
CHROOT="${CHROOT:-/var/tmp/dsec-trixie}"
CONFIG="${1:-{\"image\":\"busybox\",\"user\":\"1000\",\"workdir\":\"/tmp/selfcheck\"}}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"

if [ ! -x "$CHROOT/usr/bin/python3" ]; then
  # The mirror the host's apt already uses (deb822 or one-line sources).
  MIRROR="${DEBIAN_MIRROR:-$(grep -rhoE '^(URIs: *|deb +)https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
    sed -E 's/^(URIs: *|deb +)//' | grep -v security | head -n 1)}"
  [ -n "$MIRROR" ] || { echo "no Debian mirror in the host's apt sources; set DEBIAN_MIRROR" >&2; exit 1; }
  debootstrap --variant=minbase --include=python3,python3-pydantic,python3-anyio,python3-httpx,python3-pytest,python3-yaml,procps \
    trixie "$CHROOT" "$MIRROR"
fi
chroot "$CHROOT" apt-get install -y --no-install-recommends \
  python3-rich python3-tenacity python3-shortuuid python3-platformdirs python3-psutil python3-semver \
  python3-jsonschema python3-click python3-dotenv python3-ijson python3-jsonlines python3-jsonpatch \
  python3-jsonpath-ng python3-fsspec python3-docstring-parser python3-zstandard python3-textual python3-bs4 \
  python3-numpy python3-nest-asyncio python3-frozendict python3-tiktoken python3-boto3 python3-uvicorn \
  python3-fastapi python3-sniffio python3-typing-extensions python3-zipp >/dev/null

# inspect_ai's Python sources at the pinned commit (its web viewer's assets are not needed).
rm -rf "$CHROOT/opt/inspect" "$CHROOT/opt/dsec" "$CHROOT/opt/stubs"
mkdir -p "$CHROOT/opt/inspect" "$CHROOT/opt/dsec" "$CHROOT/opt/stubs"
git --git-dir="$INSPECT_GIT_DIR" ls-tree -r --name-only "$COMMIT" src/inspect_ai |
  grep -E '\.(py|txt|json|yaml|yml)$' | grep -vE '/_view/(dist|www)/' | while read -r f; do
  mkdir -p "$CHROOT/opt/inspect/$(dirname "${f#src/}")"
  git --git-dir="$INSPECT_GIT_DIR" show "$COMMIT:$f" >"$CHROOT/opt/inspect/${f#src/}"
done
echo "__version__ = '0.0.0+${COMMIT:0:7}'" >"$CHROOT/opt/inspect/inspect_ai/_version.py"
mkdir -p "$CHROOT/opt/inspect/inspect_ai-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: inspect_ai\nVersion: 0.0.0\n' >"$CHROOT/opt/inspect/inspect_ai-0.0.0.dist-info/METADATA"

# The dsec package as installed: its sources and its entry points.
cp -r "$REPO/python/dsec" "$CHROOT/opt/dsec/"
mkdir -p "$CHROOT/opt/dsec/dsec-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: dsec\nVersion: 0.0.0\n' >"$CHROOT/opt/dsec/dsec-0.0.0.dist-info/METADATA"
python3 - "$REPO/python/pyproject.toml" "$CHROOT/opt/dsec/dsec-0.0.0.dist-info/entry_points.txt" <<'PY'
import sys, tomllib
groups = tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"]
with open(sys.argv[2], "w") as out:
    for group, entries in groups.items():
        out.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
PY

cat >"$CHROOT/opt/stubs/sitecustomize.py" <<'PY'
"""Inert stand-ins for inspect_ai dependencies Debian does not package; the sandbox self-check
never calls into them (agent protocol, hashing, S3, JSON references, zstd zip members)."""
import collections
import importlib.abc
import importlib.machinery
import sys
import types
import zipfile

MISSING = {"acp", "mmh3", "jsonref", "upath", "s3fs", "aioboto3", "zipfile_zstd"}


def _stub_class(name):
    from pydantic import BaseModel

    cls = type(name, (BaseModel,), {"model_config": {"extra": "allow", "arbitrary_types_allowed": True}})
    cls.__class_getitem__ = classmethod(lambda c, item: c)
    return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.isupper():
            value = collections.defaultdict(str)
        elif name[:1].isupper():
            value = _stub_class(name)
        else:
            value = lambda *a, **k: None  # noqa: E731
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in MISSING:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
if not hasattr(zipfile, "ZIP_ZSTANDARD"):  # what zipfile-zstd adds
    zipfile.ZIP_ZSTANDARD = 93
PY
echo "from nest_asyncio import *  # Debian's nest_asyncio for its fork" >"$CHROOT/opt/stubs/nest_asyncio2.py"

cat >"$CHROOT/opt/run_selfcheck.py" <<'PY'
import asyncio, json, sys

from inspect_ai.util._sandbox.registry import registry_find_sandboxenv
from inspect_ai.util._sandbox.self_check import self_check


async def main() -> int:
    cls = registry_find_sandboxenv("dsec")  # through the entry point
    print("provider:", f"{cls.__module__}.{cls.__name__}", "base:", cls.__mro__[1].__module__)
    config = cls.config_deserialize(json.loads(sys.argv[1]))
    await cls.task_init("selfcheck", config)
    envs = await cls.sample_init("selfcheck", config, {})
    try:
        results = await self_check(envs["default"])
    finally:
        await cls.sample_cleanup("selfcheck", config, envs, False)
        await cls.task_cleanup("selfcheck", config, True)
    failed = {k: v for k, v in results.items() if v is not True}
    for name, why in failed.items():
        print(name, str(why)[:300])
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


sys.exit(asyncio.run(main()))
PY

exec chroot "$CHROOT" env PYTHONPATH=/opt/stubs:/opt/inspect:/opt/dsec DSEC_URL="$DSEC_URL" DSEC_API_KEY="$DSEC_API_KEY" \
  python3 /opt/run_selfcheck.py "$CONFIG"
