package main_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// quickstartBlocks are the README's code blocks marked ```sh quickstart, in order.
var quickstartBlocks = regexp.MustCompile("(?ms)^```sh quickstart\n(.*?)^```\n")

// TestReadmeQuickstart runs the README's quickstart as written, against a private
// PostgreSQL (scram-sha-256, as a real one; its superuser is postgres with password
// postgres, as the README's docker command makes it), with the README's ports replaced by
// free ones: 5432 (PostgreSQL), 7432 (the proxy), 9187 (its admin listener). The README's
// build line is the one thing not run: buildBinary builds the same package, and the folder
// with the binary and PostgreSQL's psql comes first on PATH. The last block is the stale
// write, which must fail with ZF001's message; every block before it must succeed.
func TestReadmeQuickstart(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	for _, m := range quickstartBlocks.FindAllSubmatch(readme, -1) {
		blocks = append(blocks, string(m[1]))
	}
	if len(blocks) < 2 {
		t.Fatalf("README.md has %d blocks marked ```sh quickstart, want the quickstart", len(blocks))
	}
	for _, tool := range []string{"bash", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed to run the quickstart (scripts/deps.sh installs it): %v", tool, err)
		}
	}
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t, testenv.WithAuth("scram-sha-256"))
	proxyPort := strings.TrimPrefix(freeAddr(t), "127.0.0.1:")
	adminPort := strings.TrimPrefix(freeAddr(t), "127.0.0.1:")
	ports := strings.NewReplacer(":5432", ":"+strconv.Itoa(pg.Port), ":7432", ":"+proxyPort, ":9187", ":"+adminPort)

	// set -e for every block but the last; the last must fail. The proxy started in the
	// background is ended when the script exits, however it exits.
	var script strings.Builder
	script.WriteString("set -eu\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n")
	for _, b := range blocks[:len(blocks)-1] {
		script.WriteString(ports.Replace(b))
	}
	script.WriteString("echo '--- the stale write'\nif (\n" + ports.Replace(blocks[len(blocks)-1]) + ") 2>&1; then\n  echo 'QUICKSTART: the stale write was not refused'; exit 1\nfi\n")

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	cmd := exec.CommandContext(ctx, "bash", "-c", script.String())
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") && !strings.HasPrefix(kv, "FENCEPROXY_") && !strings.HasPrefix(kv, "PATH=") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "PATH="+filepath.Dir(bin)+":"+pg.BinDir+":"+os.Getenv("PATH"), "PSQLRC=/dev/null")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	if log, _ := os.ReadFile(filepath.Join(dir, "fenceproxy.log")); t.Failed() || err != nil {
		t.Logf("fenceproxy.log:\n%s", log)
	}
	if err != nil {
		t.Fatalf("the quickstart failed: %v\n%s", err, out.String())
	}
	_, stale, _ := strings.Cut(out.String(), "--- the stale write")
	if !strings.Contains(stale, `stale fencing token: resource "billing" token 1 is lower than the highest admitted token 2`) {
		t.Fatalf("the stale write was not refused with ZF001's message:\n%s", out.String())
	}
	if got := strings.Count(out.String(), "INSERT 0 1"); got != 2 {
		t.Errorf("%d writes committed, want the two leaders' writes:\n%s", got, out.String())
	}
	t.Logf("quickstart output:\n%s", out.String())
}
