// pgjdbc through fenceproxy (compiled and run by the Go test TestDrivers): a
// token in the `options` connection property, server-prepared statements,
// transactions, COPY (CopyManager), LISTEN/NOTIFY, Statement.cancel() and,
// with FENCE_TOKEN set, a stale token surfacing as a PSQLException with
// SQLState ZF001. Connection settings come from PGHOST, PGPORT, PGUSER,
// PGDATABASE; FENCE_RESOURCE and FENCE_TOKEN name the token (none: an
// unfenced session). Prints "ok <check>" per check, then "ALL OK".

import java.io.StringReader;
import java.io.StringWriter;
import java.net.URLEncoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.Properties;

import org.postgresql.PGConnection;
import org.postgresql.PGNotification;
import org.postgresql.util.PSQLException;

public class Client {
    static final String RESOURCE = env("FENCE_RESOURCE");
    static final String TOKEN = env("FENCE_TOKEN");
    static final long DEADLINE_MS = 30_000; // for anything that waits on the server

    static String env(String name) {
        String v = System.getenv(name);
        return v == null ? "" : v;
    }

    // connect passes the token in the options property, or with inURL in the URL's
    // options parameter (both are pgjdbc's ways to pass startup options).
    static Connection connect(String token, boolean inURL) throws SQLException {
        Properties p = new Properties();
        p.setProperty("user", env("PGUSER"));
        p.setProperty("prepareThreshold", "1"); // server-prepared from the first execution
        p.setProperty("connectTimeout", "60");
        String url = "jdbc:postgresql://" + env("PGHOST") + ":" + env("PGPORT") + "/" + env("PGDATABASE");
        if (!token.isEmpty()) {
            String options = "-c fence.resource=" + RESOURCE + " -c fence.token=" + token;
            if (inURL) {
                url += "?options=" + URLEncoder.encode(options, StandardCharsets.UTF_8).replace("+", "%20");
            } else {
                p.setProperty("options", options);
            }
        }
        return DriverManager.getConnection(url, p);
    }

    static void ok(String name) {
        System.out.println("ok " + name);
        System.out.flush();
    }

    static void check(boolean cond, String what) {
        if (!cond) {
            throw new AssertionError("check failed: " + what);
        }
    }

    static long one(Connection c, String sql) throws SQLException {
        try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery(sql)) {
            check(rs.next(), sql);
            return rs.getLong(1);
        }
    }

    static void exec(Connection c, String sql) throws SQLException {
        try (Statement s = c.createStatement()) {
            s.execute(sql);
        }
    }

    public static void main(String[] args) throws Exception {
        Connection conn = connect(TOKEN, false);
        check(one(conn, "SELECT 1") == 1, "SELECT 1");
        ok("connect");

        try (PreparedStatement ps = conn.prepareStatement("SELECT ?::int * 2")) {
            for (int i = 1; i <= 3; i++) {
                ps.setInt(1, i);
                try (ResultSet rs = ps.executeQuery()) {
                    check(rs.next() && rs.getInt(1) == 2 * i, "prepared statement result");
                }
            }
            check(ps.unwrap(org.postgresql.PGStatement.class).isUseServerPrepare(), "server-prepared");
        }
        ok("prepared statement");

        exec(conn, "CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL)");
        conn.setAutoCommit(false);
        exec(conn, "INSERT INTO t VALUES (1, 'rolled back')");
        conn.rollback();
        try (PreparedStatement ps = conn.prepareStatement("INSERT INTO t VALUES (?, ?)")) {
            ps.setInt(1, 1);
            ps.setString(2, "kept");
            ps.executeUpdate();
        }
        conn.commit();
        try {
            exec(conn, "SELECT 1/0");
            throw new AssertionError("no division by zero error");
        } catch (PSQLException e) {
            check("22012".equals(e.getSQLState()), "division by zero: " + e.getSQLState());
        }
        conn.rollback();
        conn.setAutoCommit(true);
        try (Statement s = conn.createStatement(); ResultSet rs = s.executeQuery("SELECT tag FROM t")) {
            check(rs.next() && rs.getString(1).equals("kept") && !rs.next(), "transaction");
        }
        ok("transaction");

        PGConnection pgc = conn.unwrap(PGConnection.class);
        StringBuilder in = new StringBuilder();
        for (int i = 2; i <= 1000; i++) {
            in.append(i).append("\trow ").append(i).append("\n");
        }
        long copied = pgc.getCopyAPI().copyIn("COPY t FROM STDIN", new StringReader(in.toString()));
        check(copied == 999, "COPY in: " + copied);
        StringWriter out = new StringWriter();
        pgc.getCopyAPI().copyOut("COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT", out);
        String s = out.toString();
        check(s.split("\n").length == 1000 && s.startsWith("1\tkept\n2\trow 2\n"), "COPY out");
        ok("copy");

        Connection other = connect(TOKEN, true);
        exec(conn, "LISTEN jdbc_chan");
        exec(other, "NOTIFY jdbc_chan, 'hello from jdbc'");
        PGNotification[] ns = pgc.getNotifications((int) DEADLINE_MS);
        check(ns != null && ns.length == 1 && ns[0].getName().equals("jdbc_chan") && ns[0].getParameter().equals("hello from jdbc"), "notification");
        ok("listen/notify");

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
            check("57014".equals(e.getSQLState()), "cancel: " + e.getSQLState() + " " + e.getMessage());
        }
        canceller.join();
        ok("cancel");

        if (!TOKEN.isEmpty()) {
            // A higher token admitted through another session makes this one
            // stale: its next statement fails with ZF001.
            try (Connection higher = connect(String.valueOf(Long.parseLong(TOKEN) + 1), false)) {
                one(higher, "SELECT 1");
            }
            try {
                one(conn, "SELECT 1");
                throw new AssertionError("the stale session ran a statement");
            } catch (PSQLException e) {
                check("ZF001".equals(e.getSQLState()), "stale: " + e.getSQLState() + " " + e.getMessage());
                System.out.println("stale: PSQLException " + e.getSQLState() + " " + e.getMessage().split("\n")[0]);
            }
            ok("stale token");
        }
        conn.close();
        other.close();
        System.out.println("ALL OK");
    }
}
