"""pytest plugin of scripts/e2b-suites.ts for E2B's Python SDK suite (loaded with -p).

It changes nothing in the suite. It
- answers name lookups itself: localhost and the run's E2B domain (DSEC_E2B_SUITES_DOMAIN) with
  its subdomains are 127.0.0.1, any other name fails; no DNS server is ever asked;
- deselects, at collection, every py entry of exclude.txt (DSEC_E2B_SUITES_EXCLUDE), so an
  excluded test is never set up or run;
- writes each test's outcome, with the first line of its error, as JSON lines to
  DSEC_E2B_SUITES_REPORT (the controller's view under xdist).
"""

import json
import os
import socket

import pytest

_DOMAIN = os.environ.get("DSEC_E2B_SUITES_DOMAIN", "").lower()
if not _DOMAIN:
    raise RuntimeError("pytest_dsec_suites: DSEC_E2B_SUITES_DOMAIN is not set")

_original_getaddrinfo = socket.getaddrinfo


def _is_ip_literal(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


def _loopback_getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
    name = host.decode() if isinstance(host, bytes) else host
    if name is None or _is_ip_literal(name):
        return _original_getaddrinfo(host, port, family, type, proto, flags)
    h = name.lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost") or h == _DOMAIN or h.endswith("." + _DOMAIN):
        return _original_getaddrinfo("127.0.0.1", port, socket.AF_INET, type, proto, flags)
    raise socket.gaierror(socket.EAI_NONAME, f"{name}: scripts/e2b-suites resolves loopback only")


socket.getaddrinfo = _loopback_getaddrinfo


def _excluded() -> list[str]:
    path = os.environ.get("DSEC_E2B_SUITES_EXCLUDE")
    if not path:
        raise RuntimeError("pytest_dsec_suites: DSEC_E2B_SUITES_EXCLUDE is not set")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            suite, _, rest = line.partition(" ")
            if suite != "py":
                continue
            out.append(rest.split(" -- ", 1)[0].strip())
    return out


def _matches(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "[")


def pytest_collection_modifyitems(session, config, items):
    entries = _excluded()
    keep, drop = [], []
    for item in items:
        (drop if any(_matches(item.nodeid, e) for e in entries) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # Under xdist each worker collects and deselects; the harness reads this file to check that
    # every entry matched and none ran (pytest's own summary does not count workers' deselections).
    if _report_path:
        with open(_report_path + ".deselected", "a", encoding="utf-8") as f:
            for item in drop:
                f.write(item.nodeid + "\n")


_report_path = os.environ.get("DSEC_E2B_SUITES_REPORT")


def _first_line(report) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    if hasattr(report.longrepr, "reprcrash") and report.longrepr.reprcrash is not None:
        text = report.longrepr.reprcrash.message
    elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        text = str(report.longrepr[2])
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return ""


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not _report_path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    outcome = None
    if report.when == "call":
        outcome = report.outcome
    elif report.outcome == "failed":  # setup or teardown error
        outcome = "failed"
    elif report.when == "setup" and report.outcome == "skipped":
        outcome = "skipped"
    if outcome is None:
        return
    with open(_report_path, "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "id": report.nodeid,
                    "when": report.when,
                    "outcome": outcome,
                    "error": _first_line(report) if outcome == "failed" else "",
                }
            )
            + "\n"
        )
