// Command idle measures the memory an idle session costs a middleman (fenceproxy or
// PgBouncer): it reads the resident set of the process -pid (VmRSS in /proc/PID/status), opens
// -n sessions through -url, -parallel at a time, waits until they are all ready and idle,
// reads the resident set again, and closes them. bench/bench.sh runs it once per target after
// its rounds; on its own:
//
//	go run ./bench/idle -url 'postgres://postgres@127.0.0.1:6432/bench?sslmode=disable' \
//	    -pid "$(pgrep -x fenceproxy)" -n 1000
//
// It prints "idle sessions=N rss_before_kib=A rss_after_kib=B per_session_kib=C", C being
// (B - A) / N: what each idle session adds, buffers, goroutines and the heap's slack included.
// The server needs max_connections above N (each session holds a backend).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func main() {
	url := flag.String("url", "", "URL of the database through the middleman")
	pid := flag.Int("pid", 0, "process id of the middleman whose memory is measured")
	n := flag.Int("n", 1000, "sessions to open")
	parallel := flag.Int("parallel", 8, "sessions opened at a time")
	settle := flag.Duration("settle", 2*time.Second, "time to wait with all sessions open before reading the resident set")
	timeout := flag.Duration("timeout", 5*time.Minute, "time allowed for opening them all")
	flag.Parse()
	if *url == "" || *pid <= 0 || *n < 1 || *parallel < 1 {
		fmt.Fprintln(os.Stderr, "idle: -url and -pid are required, -n and -parallel must be at least 1")
		flag.Usage()
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	before, err := rssKiB(*pid)
	if err != nil {
		fatalf("%v", err)
	}
	conns := make([]*pgconn.PgConn, *n)
	errs := make([]error, *n)
	var wg sync.WaitGroup
	next := make(chan int)
	for range *parallel {
		wg.Go(func() {
			for i := range next {
				conns[i], errs[i] = pgconn.Connect(ctx, *url)
			}
		})
	}
	for i := range *n {
		next <- i
	}
	close(next)
	wg.Wait()
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close(context.Background()) //nolint:errcheck
			}
		}
	}()
	for i, err := range errs {
		if err != nil {
			fatalf("session %d of %d: %v", i+1, *n, err)
		}
	}
	time.Sleep(*settle)
	after, err := rssKiB(*pid)
	if err != nil {
		fatalf("%v", err)
	}
	fmt.Printf("idle sessions=%d rss_before_kib=%d rss_after_kib=%d per_session_kib=%.1f\n",
		*n, before, after, float64(after-before)/float64(*n))
}

// rssKiB reads VmRSS of process pid.
func rssKiB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read the memory of process %d: %w", pid, err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "idle: "+format+"\n", args...)
	os.Exit(1)
}
