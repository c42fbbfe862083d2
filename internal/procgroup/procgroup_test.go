package procgroup_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/procgroup"
)

// TestPinnedLeader: a leader that exits while a member of its group runs on stays a zombie
// (its pid, the group's id, stays taken) until Reap; Live sees the member and not the
// zombie; Signal reaches the group until Reap and nothing after it.
func TestPinnedLeader(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the leader is pinned on Linux only")
	}
	dir := t.TempDir()
	cmd := exec.Command("/bin/sh", "-c", `sleep 30 & echo $! > "$0/member"; exit 3`, dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	l := procgroup.Watch(cmd)
	select {
	case <-l.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("Exited not closed 10 s after the leader's exit")
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(l.Pid()) + "/stat")
	if err != nil || !strings.Contains(string(b), ") Z ") {
		t.Fatalf("the exited leader is not a zombie: %q, %v", b, err)
	}
	var member int
	for deadline := time.Now().Add(10 * time.Second); member == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		s, _ := os.ReadFile(filepath.Join(dir, "member"))
		member, _ = strconv.Atoi(strings.TrimSpace(string(s)))
	}
	if !l.Live() {
		t.Fatal("Live = false while the member runs")
	}
	if err := l.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("Signal: %v", err)
	}
	for deadline := time.Now().Add(10 * time.Second); l.Live(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Live = true 10 s after SIGKILL of the group (member %d)", member)
		}
	}
	var ee *exec.ExitError
	if err := l.Reap(); !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Errorf("Reap = %v, want exit status 3", err)
	}
	if err := l.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after Reap = %v, want os.ErrProcessDone", err)
	}
	if l.Live() {
		t.Error("Live = true after Reap")
	}
}
