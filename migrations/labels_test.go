package migrations_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/migrations"
)

var (
	// definedLabel is a list item of docs/proof.md that defines an obligation: - **(P1)** ...
	definedLabel = regexp.MustCompile(`(?m)^- \*\*\(([A-Z][0-9]+'?)\)\*\*`)
	// dischargedIn is the line under a definition that names the files discharging it.
	dischargedIn = regexp.MustCompile("^  \\*Discharged in:\\* (.*)\\.$")
	parenthesis  = regexp.MustCompile(`\(([^()]*)\)`)
	// citedLabel is one part of a parenthesis that cites labels: P1, L1', P1-P7, C1-C5, and
	// L1'' inside an SQL string literal.
	citedLabel = regexp.MustCompile(`^([A-Z])([0-9]+)('*)(?:\s*-\s*([A-Z]?)([0-9]+))?(?:[\s:]|$)`)
)

// citations returns the labels that text cites: a parenthesis whose first part is a label or
// a range of labels ("(P2)", "(L1', L2, L3)", "(P1-P3)", "(C5, migration 8)", "(P1: ...)")
// cites it and every later part that is one.
func citations(text string) []string {
	var labels []string
	for _, m := range parenthesis.FindAllStringSubmatch(text, -1) {
		for i, part := range strings.FieldsFunc(m[1], func(r rune) bool { return r == ',' || r == ';' }) {
			l := citedLabel.FindStringSubmatch(strings.TrimSpace(part))
			if l == nil {
				if i == 0 {
					break
				}
				continue
			}
			first, _ := strconv.Atoi(l[2])
			last := first
			if l[5] != "" && (l[4] == "" || l[4] == l[1]) {
				last, _ = strconv.Atoi(l[5])
			}
			prime := ""
			if l[3] != "" {
				prime = "'"
			}
			for n := first; n <= last && n-first < 50; n++ {
				labels = append(labels, l[1]+strconv.Itoa(n)+prime)
			}
		}
	}
	return labels
}

func TestCitations(t *testing.T) {
	for text, want := range map[string][]string{
		"-- (P2) ends":                   {"P2"},
		"(L1', L2, L3) the update":       {"L1'", "L2", "L3"},
		"'... (L1'', migration 8)'":      {"L1'"},
		"(P1-P3)":                        {"P1", "P2", "P3"},
		"(P1: a bind that waited)":       {"P1"},
		"(P7, D1; 25_durable.sql)":       {"P7", "D1"},
		"(The test cluster runs, P1)":    nil,
		"(fence.notify) and (ZF004)":     nil,
		"(P6, L5, H2, C4) and (P2 ends)": {"P6", "L5", "H2", "C4", "P2"},
	} {
		if got := citations(text); !slices.Equal(got, want) {
			t.Errorf("citations(%q) = %q, want %q", text, got, want)
		}
	}
}

// TestProofLabels: every obligation of docs/proof.md is cited by at least one pgTAP test
// (test/sql/*.sql); every label that a pgTAP test, a function file or the baseline cites is
// defined there, once; and each definition's "Discharged in" names exactly the schema files
// that cite it.
func TestProofLabels(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "docs", "proof.md"))
	if err != nil {
		t.Fatal(err)
	}
	defined := map[string]bool{}
	discharged := map[string][]string{}
	lines := strings.Split(string(doc), "\n")
	var current string
	for _, line := range lines {
		if m := definedLabel.FindStringSubmatch(line); m != nil {
			if defined[m[1]] {
				t.Errorf("docs/proof.md defines (%s) twice", m[1])
			}
			defined[m[1]] = true
			current = m[1]
			continue
		}
		if m := dischargedIn.FindStringSubmatch(line); m != nil && current != "" {
			for _, f := range strings.Split(m[1], ", ") {
				discharged[current] = append(discharged[current], strings.Trim(f, "`"))
			}
			current = ""
		}
	}
	if len(defined) < 20 {
		t.Fatalf("docs/proof.md defines %d labels; is its format (- **(P1)** ...) still the one this test reads?", len(defined))
	}

	tests, err := filepath.Glob(filepath.Join("..", "test", "sql", "*.sql"))
	if err != nil || len(tests) == 0 {
		t.Fatalf("no pgTAP tests: %v", err)
	}
	citedByTests := map[string]bool{}
	for _, f := range tests {
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range citations(string(text)) {
			citedByTests[l] = true
			if !defined[l] {
				t.Errorf("%s cites (%s), which docs/proof.md does not define", filepath.ToSlash(f), l)
			}
		}
	}
	for l := range defined {
		if !citedByTests[l] {
			t.Errorf("docs/proof.md defines (%s), which no pgTAP test in test/sql cites", l)
		}
	}

	schemaFiles, err := fs.Glob(migrations.FS, "functions/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	schemaFiles = append(schemaFiles, "baseline.sql")
	citing := map[string][]string{}
	for _, f := range schemaFiles {
		text, err := fs.ReadFile(migrations.FS, f)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, l := range citations(string(text)) {
			if !defined[l] {
				t.Errorf("migrations/%s cites (%s), which docs/proof.md does not define", f, l)
			}
			if !seen[l] {
				seen[l] = true
				citing[l] = append(citing[l], f)
			}
		}
	}
	for l := range defined {
		got, want := discharged[l], citing[l]
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("docs/proof.md: (%s) is discharged in %q, but the schema files that cite it are %q", l, got, want)
		}
	}
}
