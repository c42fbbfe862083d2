"""psycopg 2 through fenceproxy: one cell of TestTransparencyMatrix
(fencecell.py says how it is run and reports).

The token in libpq's `options`; the transaction status right after
connecting; a first transaction rolled back; savepoints; PREPARE/EXECUTE
(psycopg 2 has no protocol-level prepare); COPY both ways (copy_expert);
LISTEN/NOTIFY; cancel; a stale token surfacing as a psycopg2.Error with
pgcode ZF001.
"""

import io
import select
import time

import psycopg2
import psycopg2.errors
import psycopg2.extensions as ext

import fencecell as cell
from fencecell import check


def connect(opts=None):
    opts = cell.options() if opts is None else opts
    return psycopg2.connect(options=opts, connect_timeout=60) if opts else psycopg2.connect(connect_timeout=60)


def one(cur, sql, args=None):
    cur.execute(sql, args)
    return cur.fetchone()[0]


def main():
    conn = connect()  # not autocommit: psycopg2 begins a transaction before the first statement
    cur = conn.cursor()

    @check("idle after connect")
    def _():
        assert conn.get_transaction_status() == ext.TRANSACTION_STATUS_IDLE, conn.get_transaction_status()

    @check("rollback leaves nothing")
    def _():
        cur.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
        cur.execute("INSERT INTO t VALUES (1, 'rolled back')")
        conn.rollback()
        left = one(cur, "SELECT to_regclass('pg_temp.t') IS NOT NULL")
        conn.rollback()
        assert not left, "the rolled-back first transaction's table is left"

    conn.autocommit = True

    @check("transaction and savepoints")
    def _():
        cur.execute("DROP TABLE IF EXISTS pg_temp.t")
        cur.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
        cur.execute("BEGIN")
        cur.execute("INSERT INTO t VALUES (1, 'kept')")
        cur.execute("SAVEPOINT s")
        cur.execute("INSERT INTO t VALUES (2, 'undone')")
        cur.execute("ROLLBACK TO SAVEPOINT s")
        cur.execute("INSERT INTO t VALUES (%s, %s)", (3, "kept"))
        cur.execute("COMMIT")
        cur.execute("BEGIN")
        try:
            cur.execute("SELECT 1/0")
        except psycopg2.errors.DivisionByZero as e:
            assert e.pgcode == "22012"
        else:
            raise AssertionError("no division by zero error")
        cur.execute("ROLLBACK")
        cur.execute("SELECT id FROM t ORDER BY id")
        ids = [r[0] for r in cur.fetchall()]
        assert ids == [1, 3], ids

    @check("prepared statement")
    def _():
        cur.execute("PREPARE double(int) AS SELECT $1 * 2")
        for i in (1, 2, 3):
            assert one(cur, "EXECUTE double(%s)", (i,)) == 2 * i

    @check("copy in")
    def _():
        cur.copy_expert("COPY t (id) FROM STDIN", io.StringIO("".join(f"{i}\n" for i in range(4, 1001))))
        assert one(cur, "SELECT count(*) FROM t") == 999

    @check("copy out")
    def _():
        out = io.StringIO()
        cur.copy_expert("COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT", out)
        lines = out.getvalue().splitlines()
        assert len(lines) == 999 and lines[:3] == ["1\tkept", "3\tkept", "4\tcopied"], lines[:3]

    other = connect()
    other.autocommit = True
    ocur = other.cursor()

    @check("listen notify")
    def _():
        cur.execute("LISTEN " + cell.CHANNEL)
        ocur.execute("NOTIFY " + cell.CHANNEL + ", 'hello from psycopg2'")
        deadline = time.monotonic() + cell.DEADLINE
        while not conn.notifies and time.monotonic() < deadline:
            select.select([conn], [], [], 0.5)
            conn.poll()
        n = conn.notifies
        assert n and n[0].channel == cell.CHANNEL and n[0].payload == "hello from psycopg2", n

    @check("cancel")
    def _():
        pid = conn.get_backend_pid()
        q = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND state = 'active' AND query LIKE %s"
        e = cell.cancelled(lambda: cur.execute("SELECT pg_sleep(60)"), lambda: one(ocur, q, (pid, "%pg_sleep%")) == 1, conn.cancel)
        assert isinstance(e, psycopg2.errors.QueryCanceled) and e.pgcode == "57014", repr(e)

    if cell.TOKEN:

        @check("stale token")
        def _():
            def new_holder(opts):
                higher = connect(opts)
                higher.cursor().execute("SELECT 1")
                higher.close()

            e = cell.stale(new_holder, lambda: cur.execute("SELECT 1"))
            assert isinstance(e, psycopg2.Error) and e.pgcode == "ZF001", (type(e), str(e))
            print("stale:", type(e).__name__, e.pgcode, str(e).strip().split("\n")[0], flush=True)

    conn.close()
    other.close()
    cell.done()


if __name__ == "__main__":
    main()
