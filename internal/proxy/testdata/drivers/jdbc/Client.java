// pgjdbc through fenceproxy: one cell of TestTransparencyMatrix (the cell's
// settings, report and stale token's handshake are fencecell.py's, in the
// folder above). The token in the `options` connection property (the second
// connection: in the URL); the transaction state right after connecting; a
// first transaction rolled back (pgjdbc sends BEGIN only when it believes the
// session idle); savepoints; server-prepared statements; COPY (CopyManager);
// LISTEN/NOTIFY; Statement.cancel(); a stale token surfacing as a
// PSQLException with SQLState ZF001. PGSSLMODE=require: sslmode=require.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.StringReader;
import java.io.StringWriter;
import java.net.URLEncoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Savepoint;
import java.sql.Statement;
import java.util.Properties;

import org.postgresql.PGConnection;
import org.postgresql.PGNotification;
import org.postgresql.core.BaseConnection;
import org.postgresql.core.TransactionState;
import org.postgresql.util.PSQLException;

public class Client {
    static final String RESOURCE = env("FENCE_RESOURCE");
    static final String TOKEN = env("FENCE_TOKEN");
    static final String SESSION = env("FENCE_SESSION");
    static final String CHANNEL = env("NOTIFY_CHANNEL"); // the cell's own
    static final long DEADLINE_MS = 30_000; // for anything that waits on the server
    static boolean failed = false;

    static String env(String name) {
        String v = System.getenv(name);
        return v == null ? "" : v;
    }

    // connect passes the token in the options property, or with inURL in the URL's
    // options parameter (both are pgjdbc's ways to pass startup options).
    static Connection connect(String token, String session, boolean inURL) throws SQLException {
        Properties p = new Properties();
        p.setProperty("user", env("PGUSER"));
        p.setProperty("prepareThreshold", "1"); // server-prepared from the first execution
        p.setProperty("connectTimeout", "60");
        if (env("PGSSLMODE").equals("require")) {
            p.setProperty("sslmode", "require");
        } else {
            p.setProperty("sslmode", "disable");
        }
        String url = "jdbc:postgresql://" + env("PGHOST") + ":" + env("PGPORT") + "/" + env("PGDATABASE");
        if (!token.isEmpty()) {
            String options = "-c fence.resource=" + RESOURCE + " -c fence.token=" + token;
            if (!session.isEmpty()) {
                options += " -c fence.session=" + session;
            }
            if (inURL) {
                url += "?options=" + URLEncoder.encode(options, StandardCharsets.UTF_8).replace("+", "%20");
            } else {
                p.setProperty("options", options);
            }
        }
        return DriverManager.getConnection(url, p);
    }

    interface Body {
        void run() throws Exception;
    }

    // check runs body as the check name and reports it; the program goes on.
    static void check(String name, Body body) {
        try {
            body.run();
            System.out.println("ok " + name);
        } catch (Throwable e) {
            failed = true;
            System.out.println("FAIL " + name + ": " + String.valueOf(e).replace("\n", " | "));
            e.printStackTrace();
        }
        System.out.flush();
    }

    static void want(boolean cond, String what) {
        if (!cond) {
            throw new AssertionError("check failed: " + what);
        }
    }

    static long one(Connection c, String sql) throws SQLException {
        try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery(sql)) {
            want(rs.next(), sql);
            return rs.getLong(1);
        }
    }

    static void exec(Connection c, String sql) throws SQLException {
        try (Statement s = c.createStatement()) {
            s.execute(sql);
        }
    }

    static String ids(Connection c) throws SQLException {
        StringBuilder b = new StringBuilder();
        try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SELECT id FROM t ORDER BY id")) {
            while (rs.next()) {
                b.append(b.length() == 0 ? "" : ",").append(rs.getInt(1));
            }
        }
        return b.toString();
    }

    public static void main(String[] args) throws Exception {
        Connection conn = connect(TOKEN, SESSION, false);
        PGConnection pgc = conn.unwrap(PGConnection.class);

        check("idle after connect", () -> {
            TransactionState s = conn.unwrap(BaseConnection.class).getTransactionState();
            want(s == TransactionState.IDLE, "transaction state " + s);
        });

        check("rollback leaves nothing", () -> {
            conn.setAutoCommit(false);
            exec(conn, "CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')");
            exec(conn, "INSERT INTO t VALUES (1, 'rolled back')");
            conn.rollback();
            conn.setAutoCommit(true);
            want(one(conn, "SELECT (to_regclass('pg_temp.t') IS NOT NULL)::int") == 0, "the rolled-back first transaction's table is left");
        });
        conn.setAutoCommit(true);

        check("transaction and savepoints", () -> {
            exec(conn, "DROP TABLE IF EXISTS pg_temp.t");
            exec(conn, "CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')");
            conn.setAutoCommit(false);
            exec(conn, "INSERT INTO t VALUES (1, 'kept')");
            Savepoint sp = conn.setSavepoint("s");
            exec(conn, "INSERT INTO t VALUES (2, 'undone')");
            conn.rollback(sp);
            try (PreparedStatement ps = conn.prepareStatement("INSERT INTO t VALUES (?, ?)")) {
                ps.setInt(1, 3);
                ps.setString(2, "kept");
                ps.executeUpdate();
            }
            conn.commit();
            try {
                exec(conn, "SELECT 1/0");
                throw new AssertionError("no division by zero error");
            } catch (PSQLException e) {
                want("22012".equals(e.getSQLState()), "division by zero: " + e.getSQLState());
            }
            conn.rollback();
            conn.setAutoCommit(true);
            String got = ids(conn);
            want(got.equals("1,3"), "rows " + got);
        });
        conn.setAutoCommit(true);

        check("prepared statement", () -> {
            try (PreparedStatement ps = conn.prepareStatement("SELECT ?::int * 2")) {
                for (int i = 1; i <= 3; i++) {
                    ps.setInt(1, i);
                    try (ResultSet rs = ps.executeQuery()) {
                        want(rs.next() && rs.getInt(1) == 2 * i, "prepared statement result");
                    }
                }
                want(ps.unwrap(org.postgresql.PGStatement.class).isUseServerPrepare(), "server-prepared");
            }
        });

        check("copy in", () -> {
            StringBuilder in = new StringBuilder();
            for (int i = 4; i <= 1000; i++) {
                in.append(i).append("\n");
            }
            long copied = pgc.getCopyAPI().copyIn("COPY t (id) FROM STDIN", new StringReader(in.toString()));
            want(copied == 997, "COPY in: " + copied);
            want(one(conn, "SELECT count(*) FROM t") == 999, "rows after COPY in");
        });

        check("copy out", () -> {
            StringWriter out = new StringWriter();
            pgc.getCopyAPI().copyOut("COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT", out);
            String s = out.toString();
            want(s.split("\n").length == 999 && s.startsWith("1\tkept\n3\tkept\n4\tcopied\n"), "COPY out: " + s.substring(0, Math.min(40, s.length())));
        });

        Connection other = connect(TOKEN, SESSION, true);
        check("listen notify", () -> {
            exec(conn, "LISTEN " + CHANNEL);
            exec(other, "NOTIFY " + CHANNEL + ", 'hello from jdbc'");
            PGNotification[] ns = pgc.getNotifications((int) DEADLINE_MS);
            want(ns != null && ns.length == 1 && ns[0].getName().equals(CHANNEL) && ns[0].getParameter().equals("hello from jdbc"), "notification");
        });

        check("cancel", () -> {
            int pid = pgc.getBackendPID();
            Statement sleeper = conn.createStatement();
            Thread canceller = new Thread(() -> {
                // A CancelRequest for an idle backend cancels nothing.
                long end = System.currentTimeMillis() + DEADLINE_MS;
                try (PreparedStatement ps = other.prepareStatement("SELECT count(*) FROM pg_stat_activity WHERE pid = ? AND state = 'active' AND query LIKE '%pg_sleep%'")) {
                    ps.setInt(1, pid);
                    while (System.currentTimeMillis() < end) {
                        try (ResultSet rs = ps.executeQuery()) {
                            rs.next();
                            if (rs.getInt(1) == 1) {
                                sleeper.cancel();
                                return;
                            }
                        }
                        Thread.sleep(20);
                    }
                } catch (Exception e) {
                    e.printStackTrace();
                }
            });
            canceller.start();
            try {
                sleeper.execute("SELECT pg_sleep(60)");
                throw new AssertionError("pg_sleep was not cancelled");
            } catch (PSQLException e) {
                want("57014".equals(e.getSQLState()), "cancel: " + e.getSQLState() + " " + e.getMessage());
            } finally {
                canceller.join();
            }
        });

        if (!TOKEN.isEmpty()) {
            // A new holder's session makes this one stale: its next statement
            // fails with ZF001.
            check("stale token", () -> {
                System.out.println("stale?");
                System.out.flush();
                String[] next = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8)).readLine().split(" ");
                try (Connection higher = connect(next[0], next[1].equals("-") ? "" : next[1], false)) {
                    one(higher, "SELECT 1");
                }
                try {
                    one(conn, "SELECT 1");
                    throw new AssertionError("the stale session ran a statement");
                } catch (PSQLException e) {
                    want("ZF001".equals(e.getSQLState()), "stale: " + e.getSQLState() + " " + e.getMessage());
                    System.out.println("stale: PSQLException " + e.getSQLState() + " " + e.getMessage().split("\n")[0]);
                }
            });
        }
        conn.close();
        other.close();
        System.out.println(failed ? "SOME FAILED" : "ALL OK");
        System.exit(failed ? 1 : 0);
    }
}
