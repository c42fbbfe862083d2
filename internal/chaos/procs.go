package chaos

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// procStat is what /proc/PID/stat says after the command name: state, ppid.
func procStat(pid int) (state byte, ppid int, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(f[1])
	return f[0][0], ppid, err == nil
}

// workers are the live processes running the worker binary (children of the replicas, or
// orphans of a killed supervisor).
func (e *env) workers() []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink("/proc/" + en.Name() + "/exe"); err != nil || exe != e.chaosBin {
			continue
		}
		if state, _, ok := procStat(pid); ok && state != 'Z' {
			pids = append(pids, pid)
		}
	}
	return pids
}

// leader is the replica whose supervisor runs a worker (only the lock holder does), with
// the worker's pid and the token in its environment. A worker whose supervisor was killed
// writes on as long as its token is admitted: it counts as the leader, with replica -1.
// A frozen worker is skipped: another fault of the round already holds it. ok is false when
// there is none (a handover in progress).
func (e *env) leader() (replica, worker int, token int64, ok bool) {
	orphan := 0
	for _, w := range e.workers() {
		state, ppid, found := procStat(w)
		if !found || state == 'T' {
			continue
		}
		for i, p := range e.replicas {
			if p.Running() && p.Pid() == ppid {
				return i, w, envToken(w), true
			}
		}
		orphan = w
	}
	if orphan != 0 {
		return -1, orphan, envToken(orphan), true
	}
	return -1, 0, 0, false
}

// awaitLeader waits up to 2 x TTL for a leader (keeping the replicas running meanwhile).
func (e *env) awaitLeader() (replica, worker int, token int64, ok bool) {
	deadline := time.Now().Add(2 * e.cfg.TTL)
	for {
		replica, worker, token, ok = e.leader()
		if ok || time.Now().After(deadline) {
			return replica, worker, token, ok
		}
		e.supervise()
		time.Sleep(20 * time.Millisecond)
	}
}

func envToken(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return 0
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Split(func(data []byte, atEOF bool) (int, []byte, error) {
		if i := bytes.IndexByte(data, 0); i >= 0 {
			return i + 1, data[:i], nil
		}
		if atEOF && len(data) > 0 {
			return len(data), data, nil
		}
		return 0, nil, nil
	})
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "FENCE_TOKEN="); ok {
			t, _ := strconv.ParseInt(v, 10, 64)
			return t
		}
	}
	return 0
}

// sweepWorkers kills workers left behind (orphans of killed supervisors).
func (e *env) sweepWorkers() {
	for _, pid := range e.workers() {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}
