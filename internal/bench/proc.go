package bench

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// ticksPerSecond is USER_HZ, the unit of /proc/PID/stat's and /proc/stat's times: 100 on
// every Linux architecture Go supports (the kernel converts to it whatever its HZ).
const ticksPerSecond = 100

// statFields are the fields of /proc/PID/stat after the command name (which may hold spaces
// and parentheses, so the split is at the last ")"): [0] state, [1] ppid, [11] utime,
// [12] stime, [13] cutime, [14] cstime.
func statFields(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return nil, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	return f, nil
}

// CPUTicks is the user and system CPU time of pid, in ticks; with reaped, plus that of the
// children it has waited for (cutime, cstime).
func CPUTicks(pid int, reaped bool) (int64, error) {
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	var sum int64
	idx := []int{11, 12}
	if reaped {
		idx = append(idx, 13, 14)
	}
	for _, i := range idx {
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat field %d: %w", pid, i, err)
		}
		sum += v
	}
	return sum, nil
}

// TreeTicks is the CPU time of a server with a process per connection (the postmaster):
// its own, its reaped children's and every live child's. A child reaped while the children
// are read would be counted twice or not at all (its time moves into the parent's cutime),
// so the reads repeat until the parent's total stays put.
func TreeTicks(parent int) (int64, error) {
	for range 20 {
		first, err := CPUTicks(parent, true)
		if err != nil {
			return 0, err
		}
		total := first
		for _, child := range testenv.Children(parent) {
			t, err := CPUTicks(child, false)
			if err == nil { // a child gone meanwhile is in the parent's total on the next try
				total += t
			}
		}
		if again, err := CPUTicks(parent, true); err == nil && again == first {
			return total, nil
		}
	}
	return 0, fmt.Errorf("the CPU time of process %d's children kept moving", parent)
}

// MachineTicks are the machine's busy (user, nice, system, irq, softirq, steal) and idle
// (idle, iowait) times, all CPUs, from /proc/stat.
func MachineTicks() (busy, idle int64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	v := make([]int64, 9)
	for i := 1; i < 9; i++ {
		v[i], _ = strconv.ParseInt(f[i], 10, 64)
	}
	return v[1] + v[2] + v[3] + v[6] + v[7] + v[8], v[4] + v[5], nil
}

// ContextSwitches is the sum of voluntary and involuntary context switches of every thread
// of pid (/proc/PID/task/*/status).
func ContextSwitches(pid int) (int64, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		return 0, fmt.Errorf("no threads of process %d", pid)
	}
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // a thread that exited meanwhile
		}
		for _, field := range []string{"voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"} {
			v, _ := fieldValue(string(b), field)
			n += v
		}
	}
	return n, nil
}

// ReadWriteCalls is read(2)- and write(2)-family calls of pid (/proc/PID/io syscr + syscw),
// which count neither recv nor send, epoll or futex: the fallback when perf cannot count.
func ReadWriteCalls(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0, err
	}
	r, err1 := fieldValue(string(b), "syscr")
	w, err2 := fieldValue(string(b), "syscw")
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/io: no syscr or syscw", pid)
	}
	return r + w, nil
}

// StatusKiB is a kB field of /proc/PID/status (VmRSS, VmHWM).
func StatusKiB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return fieldValue(string(b), field)
}

// fieldValue is the number after "name:" on a line of text (a trailing " kB" dropped).
func fieldValue(text, name string) (int64, error) {
	for line := range strings.SplitSeq(text, "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s", name)
}

// ThreadCount is the Threads field of /proc/PID/status.
func ThreadCount(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return fieldValue(string(b), "Threads")
}
