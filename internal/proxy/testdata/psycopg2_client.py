"""A client that is not Go: psycopg2 (libpq underneath) through fenceproxy.

Run by TestPsycopg2 as `python3 psycopg2_client.py DSN`, once directly
against PostgreSQL and once through the proxy: each check prints one line,
the two outputs must be identical and the exit status 0. Nothing printed may
depend on the session (no process IDs).
"""

import io
import os
import select
import sys
import threading
import time

import psycopg2
import psycopg2.errors
import psycopg2.extensions


def check(name, cond, detail=""):
    if not cond:
        print("FAIL", name, detail, flush=True)
        sys.exit(1)
    print("ok", name, flush=True)


def main(dsn):
    conn = psycopg2.connect(dsn)
    cur = conn.cursor()

    # Parameters of several types (psycopg2 interpolates them client-side).
    cur.execute(
        "SELECT %s::int + 1, %s::text, %s::bytea, %s::text, %s::int[], %s::numeric",
        (41, "it's a \\ backslash, é and 漢字", psycopg2.Binary(b"\x00\xff'\\"), None, [1, 2, 3], "1.50"),
    )
    row = cur.fetchone()
    check("parameters", (row[0], row[1], bytes(row[2]), row[3], row[4], str(row[5]))
          == (42, "it's a \\ backslash, é and 漢字", b"\x00\xff'\\", None, [1, 2, 3], "1.50"), repr(row))

    # A large value in both directions.
    big = "".join(chr(65 + (i * 7) % 26) for i in range(1 << 16)) * 160  # 10 MiB
    cur.execute("SELECT %s::text, md5(%s::text)", (big, big))
    echoed, digest = cur.fetchone()
    check("10 MiB round trip", echoed == big, "%d bytes back" % len(echoed))
    check("10 MiB md5", len(digest) == 32)

    # Errors keep their SQLSTATE; the transaction is aborted until rollback.
    try:
        cur.execute("SELECT 1/0")
        check("division by zero", False)
    except psycopg2.errors.DivisionByZero as e:
        check("division by zero", e.pgcode == "22012", e.pgcode)
    try:
        cur.execute("SELECT 1")
        check("aborted transaction", False)
    except psycopg2.errors.InFailedSqlTransaction as e:
        check("aborted transaction", e.pgcode == "25P02", e.pgcode)
    conn.rollback()

    # Transactions: rollback discards, commit keeps.
    cur.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, v text)")
    conn.commit()
    cur.execute("INSERT INTO t VALUES (1, 'rolled back')")
    conn.rollback()
    cur.execute("SELECT count(*) FROM t")
    check("rollback", cur.fetchone()[0] == 0)
    cur.execute("INSERT INTO t VALUES (1, 'committed')")
    conn.commit()
    try:
        cur.execute("INSERT INTO t VALUES (1, 'duplicate')")
        check("unique violation", False)
    except psycopg2.errors.UniqueViolation as e:
        check("unique violation", e.pgcode == "23505" and "t_pkey" in e.diag.constraint_name, e.pgcode)
    conn.rollback()

    # COPY both ways (copy_expert).
    data = "".join("%d\tline %d\n" % (i, i) for i in range(2, 50002))
    cur.copy_expert("COPY t FROM STDIN", io.StringIO(data))
    check("copy from rowcount", cur.rowcount == 50000, str(cur.rowcount))
    conn.commit()
    out = io.StringIO()
    cur.copy_expert("COPY (SELECT * FROM t WHERE id >= 2 ORDER BY id) TO STDOUT", out)
    check("copy to", out.getvalue() == data, "%d bytes" % len(out.getvalue()))
    try:
        cur.copy_expert("COPY t FROM STDIN", io.StringIO("x\tbad\n"))
        check("copy error", False)
    except psycopg2.errors.InvalidTextRepresentation as e:
        check("copy error", e.pgcode == "22P02", e.pgcode)
    conn.rollback()

    # Server-side cursor: DECLARE ... FETCH FORWARD itersize.
    named = conn.cursor("server_side")
    named.itersize = 333
    named.execute("SELECT g, md5(g::text) FROM generate_series(1, 5000) g")
    n, total = 0, 0
    for g, _ in named:
        n += 1
        total += g
    check("server-side cursor", (n, total) == (5000, 5000 * 5001 // 2), "%d %d" % (n, total))
    named.close()
    conn.commit()

    # Notices.
    del conn.notices[:]
    cur.execute("DO $$BEGIN RAISE NOTICE 'hello %', 42; RAISE WARNING 'careful'; END$$")
    check("notices", conn.notices == ["NOTICE:  hello 42\n", "WARNING:  careful\n"], repr(conn.notices))
    conn.commit()

    # ParameterStatus.
    cur.execute("SET application_name = 'psycopg2 via fenceproxy'")
    check("parameter status", conn.get_parameter_status("application_name") == "psycopg2 via fenceproxy",
          conn.get_parameter_status("application_name"))
    conn.commit()

    # LISTEN/NOTIFY between two sessions.
    listener = psycopg2.connect(dsn)
    listener.set_isolation_level(psycopg2.extensions.ISOLATION_LEVEL_AUTOCOMMIT)
    # A channel of this process's own: other runs may share the database.
    channel = "py_chan_%d" % os.getpid()
    listener.cursor().execute("LISTEN " + channel)
    cur.execute("SELECT pg_notify(%s, 'payload é')", (channel,))
    conn.commit()
    notifier_pid = conn.get_backend_pid()
    got = None
    deadline = time.time() + 10
    while got is None and time.time() < deadline:
        if select.select([listener], [], [], 1) != ([], [], []):
            listener.poll()
            if listener.notifies:
                got = listener.notifies.pop(0)
    check("notification", got is not None and got.channel == channel and got.payload == "payload é"
          and got.pid == notifier_pid, repr(got))
    listener.close()

    # Cancel from another thread: libpq sends a CancelRequest on a new connection.
    timer = threading.Timer(0.5, conn.cancel)
    start = time.time()
    timer.start()
    try:
        cur.execute("SELECT pg_sleep(30)")
        check("cancel", False)
    except psycopg2.errors.QueryCanceled as e:
        check("cancel", e.pgcode == "57014" and time.time() - start < 5, "%.1fs" % (time.time() - start))
    conn.rollback()
    cur.execute("SELECT 1")
    check("usable after cancel", cur.fetchone() == (1,))
    conn.rollback()

    # Autocommit and a multi-statement string.
    conn.autocommit = True
    cur.execute("INSERT INTO t VALUES (-1, 'a'); INSERT INTO t VALUES (-2, 'b'); SELECT count(*) FROM t WHERE id < 0")
    check("multi-statement", cur.fetchone()[0] == 2)

    conn.close()
    check("closed", conn.closed != 0)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
