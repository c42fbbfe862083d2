package testenv_test

import (
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestProcess checks what the chaos campaign relies on: a process group that can be frozen,
// killed and started again with the same command, its output in its log.
func TestProcess(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// A child that outlives its parent's SIGKILL only if Kill misses the group.
	p := testenv.StartProcess(t, dir, "sh", []string{"/bin/sh", "-c", "echo started; sleep 60 & wait"}, nil)
	if !p.Running() || p.Pid() == 0 {
		t.Fatalf("not running after StartProcess")
	}
	waitLog(t, p, 1)
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if p.Wait(100 * time.Millisecond) {
		t.Fatal("a stopped process exited")
	}
	if err := p.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	first := p.Pid()
	p.Kill(t)
	if p.Running() {
		t.Fatal("running after Kill")
	}
	// Its orphaned sleep is killed too (reaped by init a moment later).
	for deadline := time.Now().Add(5 * time.Second); syscall.Kill(-first, 0) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("process group %d still has members 5 s after Kill", first)
		}
	}
	if err := p.Signal(syscall.SIGTERM); err != os.ErrProcessDone {
		t.Errorf("Signal after exit: %v, want os.ErrProcessDone", err)
	}
	p.Start(t)
	if !p.Running() || p.Pid() == first {
		t.Fatalf("Start again: running %t, pid %d (was %d)", p.Running(), p.Pid(), first)
	}
	waitLog(t, p, 2)
	p.Stop(t, 5*time.Second)
	if p.Running() {
		t.Fatal("running after Stop")
	}
}

// waitLog waits until p's log shows n runs' output.
func waitLog(t *testing.T, p *testenv.Process, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile(p.LogFile)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Count(string(b), "started\n") == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("log %s: %q, want %d runs' output", p.LogFile, b, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
