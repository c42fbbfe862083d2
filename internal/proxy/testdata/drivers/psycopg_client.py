"""psycopg 3 through fenceproxy (run by the Go test TestDrivers).

A token in libpq's `options`, prepared statements, transactions, COPY,
LISTEN/NOTIFY, cancel and, with FENCE_TOKEN set, a stale token surfacing as a
psycopg.Error with sqlstate ZF001. libpq reads PGHOST, PGPORT, PGUSER and
PGDATABASE; FENCE_RESOURCE and FENCE_TOKEN name the token (none: an
unfenced session). Prints "ok <check>" per check, then "ALL OK".
"""

import os
import threading
import time

import psycopg

RESOURCE = os.environ.get("FENCE_RESOURCE", "")
TOKEN = os.environ.get("FENCE_TOKEN", "")
DEADLINE = 30  # seconds for anything that waits on the server


def connect(token, **kw):
    if token:
        kw["options"] = f"-c fence.resource={RESOURCE} -c fence.token={token}"
    return psycopg.connect(connect_timeout=60, **kw)


def ok(name):
    print("ok", name, flush=True)


def main():
    conn = connect(TOKEN, autocommit=True)
    assert conn.execute("SELECT 1").fetchone() == (1,)
    ok("connect")

    with conn.cursor() as cur:
        for i in (1, 2, 3, 4, 5, 6):
            cur.execute("SELECT %s::int * 2", (i,), prepare=True)
            assert cur.fetchone() == (2 * i,)
    ok("prepared statement")

    conn.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL)")
    with conn.transaction():
        conn.execute("INSERT INTO t VALUES (1, 'rolled back')")
        raise psycopg.Rollback()
    with conn.transaction():
        conn.execute("INSERT INTO t VALUES (%s, %s)", (1, "kept"))
    try:
        with conn.transaction():
            conn.execute("SELECT 1/0")
    except psycopg.errors.DivisionByZero as e:
        assert e.sqlstate == "22012"
    else:
        raise AssertionError("no division by zero error")
    assert conn.execute("SELECT tag FROM t").fetchall() == [("kept",)]
    ok("transaction")

    with conn.cursor() as cur:
        with cur.copy("COPY t FROM STDIN") as copy:
            for i in range(2, 1001):
                copy.write_row((i, f"row {i}"))
        out = bytearray()
        with cur.copy("COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT") as copy:
            for data in copy:
                out += data
    lines = bytes(out).decode().splitlines()
    assert len(lines) == 1000 and lines[:2] == ["1\tkept", "2\trow 2"], lines[:3]
    ok("copy")

    other = connect(TOKEN, autocommit=True)
    got = []
    conn.add_notify_handler(got.append)
    conn.execute("LISTEN py_chan")
    other.execute("NOTIFY py_chan, 'hello from psycopg'")
    deadline = time.monotonic() + DEADLINE
    while not got and time.monotonic() < deadline:
        conn.execute("SELECT 1")  # reads what the server sent meanwhile
        time.sleep(0.02)
    assert got and got[0].channel == "py_chan" and got[0].payload == "hello from psycopg", got
    ok("listen/notify")

    pid = conn.info.backend_pid

    def cancel_when_running():
        # A CancelRequest for an idle backend cancels nothing.
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            row = other.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND state = 'active' AND query LIKE %s",
                (pid, "%pg_sleep%"),
            ).fetchone()
            if row[0] == 1:
                conn.cancel()
                return
            time.sleep(0.02)

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    try:
        conn.execute("SELECT pg_sleep(60)")
    except psycopg.errors.QueryCanceled as e:
        assert e.sqlstate == "57014"
    else:
        raise AssertionError("pg_sleep was not cancelled")
    canceller.join()
    ok("cancel")

    if TOKEN:
        # A higher token admitted through another session makes this one
        # stale: its next statement fails with ZF001.
        with connect(str(int(TOKEN) + 1)) as higher:
            higher.execute("SELECT 1")
        try:
            conn.execute("SELECT 1")
        except psycopg.Error as e:
            assert e.sqlstate == "ZF001", (type(e), e.sqlstate, str(e))
            print("stale:", type(e).__name__, e.sqlstate, str(e).strip(), flush=True)
        else:
            raise AssertionError("the stale session ran a statement")
        ok("stale token")
    conn.close()
    other.close()
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
