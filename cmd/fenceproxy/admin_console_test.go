package main_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestAdminConsoleServe runs the real binary: the console's RELOAD reads the configuration
// file again as SIGHUP does (a user added to admin-users gets in, the log says who asked),
// SHOW VERSION says the binary's version, and a server database of the console's name is
// warned about at start.
func TestAdminConsoleServe(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	pg.Exec(t, "CREATE DATABASE fenceproxy")
	pg.CreateRole(t, "ops", "ops")
	pg.CreateRole(t, "dba", "dba")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	keyFile := filepath.Join(t.TempDir(), "proxy.key")
	if out, err := exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL(), "--key-file", keyFile).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	addr := freeAddr(t)
	cfgFile, writeConf := configFile(t)
	conf := map[string]any{"resource": []string{"billing"}, "key-file": keyFile, "admin-users": []string{"ops"},
		"control-database": pg.AdminURL(), "upstream": "postgres://" + net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port))}
	writeConf(conf)
	_, logs, stop := startServe(ctx, t, bin, "--config", cfgFile, "--listen", addr)
	defer stop()
	host, port, _ := net.SplitHostPort(addr)
	psql := func(user, sql string) (string, error) {
		c := exec.CommandContext(ctx, pg.Bin("psql"), "-X", "-A", "-t", "-h", host, "-p", port, "-U", user, "-d", "fenceproxy", "-c", sql)
		c.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C", "PGCONNECT_TIMEOUT=10", "PGPASSWORD=" + user}
		out, err := c.CombinedOutput()
		return string(out), err
	}
	eventually(t, time.Minute, "the console answers", func() error {
		if out, err := psql("ops", "SHOW VERSION"); err != nil || !strings.HasPrefix(out, "fenceproxy ") {
			return fmt.Errorf("%v %s", err, out)
		}
		return nil
	})
	eventually(t, time.Minute, "the warning of a shadowed database", func() error {
		if !strings.Contains(logs.String(), "the server has a database of the admin console's name") {
			return errors.New(logs.String())
		}
		return nil
	})
	if out, err := psql("dba", "SHOW FENCES"); err == nil || !strings.Contains(out, `user "dba" may not use the fenceproxy admin console`) {
		t.Fatalf("dba before the reload: %v %s", err, out)
	}
	conf["admin-users"] = []string{"ops", "dba"}
	writeConf(conf)
	if out, err := psql("ops", "RELOAD"); err != nil || !strings.Contains(out, "reloaded: admin-users [ops dba] (were [ops])") {
		t.Fatalf("RELOAD: %v %s", err, out)
	}
	if !strings.Contains(logs.String(), "reloaded (admin console RELOAD)") {
		t.Errorf("the log does not say the console reloaded:\n%s", logs.String())
	}
	if out, err := psql("dba", "SHOW FENCES"); err != nil || !strings.HasPrefix(out, "billing|") {
		t.Errorf("dba after the reload: %v %s", err, out)
	}
}
