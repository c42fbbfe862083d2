package bench

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Median is the median of xs (the mean of the middle two for an even count), NaN for none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Percentile is the nearest-rank p-th percentile (0 < p <= 100) of sorted, NaN for none.
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// PgbenchResult is what a pgbench run prints at its end.
type PgbenchResult struct {
	TPS          float64 // "tps = X (without initial connection time)", or with -C "(including reconnection times)"
	LatencyMs    float64 // "latency average = X ms"
	ConnectionMs float64 // "average connection time = X ms" (NaN when absent)
	Transactions int64   // "number of transactions actually processed: N"
	Failed       int64   // "number of failed transactions: N"
}

var (
	reTPS     = regexp.MustCompile(`(?m)^tps = ([0-9.]+) \((?:without initial connection time|including reconnection times)\)$`)
	reLatency = regexp.MustCompile(`(?m)^latency average = ([0-9.]+) ms$`)
	reConn    = regexp.MustCompile(`(?m)^average connection time = ([0-9.]+) ms$`)
	reTx      = regexp.MustCompile(`(?m)^number of transactions actually processed: ([0-9]+)`)
	reFailed  = regexp.MustCompile(`(?m)^number of failed transactions: ([0-9]+)`)
	reAborted = regexp.MustCompile(`(?i)aborted|error`)
)

// ErrNoTransactions is ParsePgbench's error for a run that processed no transaction.
var ErrNoTransactions = errors.New("pgbench processed no transaction")

// ParsePgbench reads pgbench's summary. It is an error when the run reported no throughput
// or an aborted client or error: such a run measured something else than the cell.
func ParsePgbench(out string) (PgbenchResult, error) {
	r := PgbenchResult{ConnectionMs: math.NaN()}
	if m := reTx.FindStringSubmatch(out); m != nil && m[1] == "0" {
		return r, ErrNoTransactions
	}
	m := reTPS.FindStringSubmatch(out)
	if m == nil {
		return r, fmt.Errorf("pgbench printed no tps line")
	}
	r.TPS, _ = strconv.ParseFloat(m[1], 64)
	if m := reLatency.FindStringSubmatch(out); m != nil {
		r.LatencyMs, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reConn.FindStringSubmatch(out); m != nil {
		r.ConnectionMs, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reTx.FindStringSubmatch(out); m != nil {
		r.Transactions, _ = strconv.ParseInt(m[1], 10, 64)
	}
	if m := reFailed.FindStringSubmatch(out); m != nil {
		r.Failed, _ = strconv.ParseInt(m[1], 10, 64)
	}
	if reAborted.MatchString(out) {
		return r, fmt.Errorf("pgbench reported an aborted client or an error")
	}
	return r, nil
}

// ReadLatencyLog reads pgbench -l's per-transaction logs: every file prefix.* (one per
// pgbench process, or thread), whose third field is the transaction's latency in µs.
// It returns the latencies, sorted.
func ReadLatencyLog(prefix string) ([]float64, error) {
	files, err := filepath.Glob(prefix + ".*")
	if err != nil {
		return nil, err
	}
	var lat []float64
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		lat, err = appendLatencies(lat, f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	slices.Sort(lat)
	return lat, nil
}

func appendLatencies(lat []float64, r io.Reader) ([]float64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 {
			continue
		}
		v, err := strconv.ParseFloat(f[2], 64)
		if err != nil {
			return nil, fmt.Errorf("latency %q: %w", f[2], err)
		}
		lat = append(lat, v)
	}
	return lat, sc.Err()
}

// Mean is the arithmetic mean of xs, NaN for none.
func Mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
