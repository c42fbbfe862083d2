"""psycopg 3 through fenceproxy: one cell of TestTransparencyMatrix
(fencecell.py says how it is run and reports).

The token in libpq's `options`; the transaction status right after
connecting; a first transaction rolled back (psycopg begins it only when
libpq says idle); savepoints; server-prepared statements; COPY both ways;
LISTEN/NOTIFY; cancel; a stale token surfacing as a psycopg.Error with
sqlstate ZF001.
"""

import time

import psycopg
from psycopg.pq import TransactionStatus

import fencecell as cell
from fencecell import check


def connect(opts=None, **kw):
    opts = cell.options() if opts is None else opts
    if opts:
        kw["options"] = opts
    return psycopg.connect(connect_timeout=60, **kw)


def main():
    conn = connect()  # not autocommit: psycopg sends BEGIN when libpq says idle

    @check("idle after connect")
    def _():
        assert conn.info.transaction_status == TransactionStatus.IDLE, conn.info.transaction_status

    @check("rollback leaves nothing")
    def _():
        conn.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
        conn.execute("INSERT INTO t VALUES (1, 'rolled back')")
        conn.rollback()
        left = conn.execute("SELECT to_regclass('pg_temp.t') IS NOT NULL").fetchone()[0]
        conn.rollback()
        assert not left, "the rolled-back first transaction's table is left"

    conn.autocommit = True

    @check("transaction and savepoints")
    def _():
        conn.execute("DROP TABLE IF EXISTS pg_temp.t")
        conn.execute("CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')")
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (1, 'kept')")
            with conn.transaction():
                conn.execute("INSERT INTO t VALUES (2, 'undone')")
                raise psycopg.Rollback()
            conn.execute("INSERT INTO t VALUES (%s, %s)", (3, "kept"))
        try:
            with conn.transaction():
                conn.execute("SELECT 1/0")
        except psycopg.errors.DivisionByZero as e:
            assert e.sqlstate == "22012"
        else:
            raise AssertionError("no division by zero error")
        ids = [r[0] for r in conn.execute("SELECT id FROM t ORDER BY id")]
        assert ids == [1, 3], ids

    @check("prepared statement")
    def _():
        with conn.cursor() as cur:
            for i in (1, 2, 3, 4, 5, 6):
                cur.execute("SELECT %s::int * 2", (i,), prepare=True)
                assert cur.fetchone() == (2 * i,)

    @check("copy in")
    def _():
        with conn.cursor() as cur:
            with cur.copy("COPY t (id) FROM STDIN") as copy:
                for i in range(4, 1001):
                    copy.write_row((i,))
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (999,)

    @check("copy out")
    def _():
        out = bytearray()
        with conn.cursor() as cur:
            with cur.copy("COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT") as copy:
                for data in copy:
                    out += data
        lines = bytes(out).decode().splitlines()
        assert len(lines) == 999 and lines[:3] == ["1\tkept", "3\tkept", "4\tcopied"], lines[:3]

    other = connect(autocommit=True)

    @check("listen notify")
    def _():
        got = []
        conn.add_notify_handler(got.append)
        conn.execute("LISTEN " + cell.CHANNEL)
        other.execute("NOTIFY " + cell.CHANNEL + ", 'hello from psycopg'")
        deadline = time.monotonic() + cell.DEADLINE
        while not got and time.monotonic() < deadline:
            conn.execute("SELECT 1")  # reads what the server sent meanwhile
            time.sleep(0.02)
        assert got and got[0].channel == cell.CHANNEL and got[0].payload == "hello from psycopg", got

    @check("cancel")
    def _():
        pid = conn.info.backend_pid
        q = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND state = 'active' AND query LIKE %s"
        e = cell.cancelled(
            lambda: conn.execute("SELECT pg_sleep(60)"),
            lambda: other.execute(q, (pid, "%pg_sleep%")).fetchone()[0] == 1,
            conn.cancel,
        )
        assert isinstance(e, psycopg.errors.QueryCanceled) and e.sqlstate == "57014", repr(e)

    if cell.TOKEN:

        @check("stale token")
        def _():
            def new_holder(opts):
                with connect(opts) as higher:
                    higher.execute("SELECT 1")

            e = cell.stale(new_holder, lambda: conn.execute("SELECT 1"))
            assert isinstance(e, psycopg.Error) and e.sqlstate == "ZF001", (type(e), str(e))
            print("stale:", type(e).__name__, e.sqlstate, str(e).strip(), flush=True)

    conn.close()
    other.close()
    cell.done()


if __name__ == "__main__":
    main()
