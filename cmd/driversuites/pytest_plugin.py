"""Loaded into psycopg's test suite by driversuites (pytest -p fence_suite_plugin): appends a
JSON line to $FENCE_SUITE_LOG for every test: its outcome (passed, failed, error for a
failing setup or teardown, skipped, xfail counted as skipped) and the libpq connections it
opened: to the test DSN's host and port with fence.token in the options ("fenced"), without
("unfenced": the test replaced the options), or somewhere else ("elsewhere": a conninfo not
derived from the test DSN, such as psycopg's "dbname=nosuchdb"). It wraps PGconn.connect and
connect_start (every psycopg connection, sync or async, starts there) and changes nothing
else; it runs in every mode, so it cannot make a difference."""
import json
import os

import pytest

_current = [None]
_conns = {}


def _params(conninfo):
    from psycopg import pq

    if isinstance(conninfo, str):
        conninfo = conninfo.encode()
    return {
        o.keyword.decode(): o.val.decode("utf-8", "replace")
        for o in pq.Conninfo.parse(conninfo)
        if o.val is not None
    }


def _target():
    p = _params(os.environ.get("PSYCOPG_TEST_DSN", ""))
    return p.get("host", ""), p.get("port", "")


def _note(conninfo):
    if _current[0] is None:
        return
    try:
        p = _params(conninfo)
        where = (p.get("host", os.environ.get("PGHOST", "")), p.get("port", os.environ.get("PGPORT", "")))
        options = p.get("options", os.environ.get("PGOPTIONS", ""))
        if where != _target():
            kind = "elsewhere"
        else:
            kind = "fenced" if "fence.token=" in options else "unfenced"
    except Exception:  # a malformed conninfo (tests pass some on purpose): libpq refuses it
        kind = "elsewhere"
    _conns[_current[0]][kind] += 1


def _wrap(cls, name):
    orig = cls.__dict__[name].__func__

    def wrapper(klass, conninfo=b""):
        _note(conninfo)
        return orig(klass, conninfo)

    wrapper.__name__ = orig.__name__
    wrapper.__doc__ = orig.__doc__
    setattr(cls, name, classmethod(wrapper))


class _NoCache:
    """config.cache under -p no:cacheprovider: psycopg's conftest keeps a "segfault" flag
    there (its crash detector across runs), which a throwaway run does not need."""

    def get(self, key, default):
        return default

    def set(self, key, value):
        pass


def pytest_configure(config):
    from psycopg import pq

    if not hasattr(config, "cache"):
        config.cache = _NoCache()
    for name in ("connect", "connect_start"):
        _wrap(pq.PGconn, name)


_outcomes = {}


def pytest_runtest_logreport(report):
    rec = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.skipped:
        if rec["outcome"] == "passed":
            rec["outcome"] = "skipped"
            rec["message"] = str(getattr(report, "wasxfail", "") or report.longrepr)[-300:]
    elif report.failed:
        rec["outcome"] = "failed" if report.when == "call" else "error"
        rec["message"] = str(report.longrepr)[-1000:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    _conns[item.nodeid] = {"fenced": 0, "unfenced": 0, "elsewhere": 0}
    yield
    _current[0] = None
    rec = _outcomes.pop(item.nodeid, {"outcome": "error", "message": "no report"})
    path = os.environ.get("FENCE_SUITE_LOG")
    if path:
        with open(path, "a") as f:
            line = {"test": item.nodeid, "outcome": rec["outcome"], "message": rec["message"], "conns": _conns.pop(item.nodeid)}
            f.write(json.dumps(line) + "\n")
