package fence_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

func TestInjectedSQL(t *testing.T) {
	tests := []struct {
		name      string
		resource  string
		token     int64
		wantCheck string
		wantRaise string
	}{
		{"simple", "billing", 34, "SELECT fence.check('billing', 34)", "SELECT fence.raise('billing', 34)"},
		{"punctuation", "eu-west.billing_2", 1, "SELECT fence.check('eu-west.billing_2', 1)", "SELECT fence.raise('eu-west.billing_2', 1)"},
		{"largest token", "b", 1<<63 - 1, "SELECT fence.check('b', 9223372036854775807)", "SELECT fence.raise('b', 9223372036854775807)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := fence.CheckSQL(tt.resource, tt.token)
			if err != nil || got != tt.wantCheck {
				t.Errorf("CheckSQL = %q, %v; want %q", got, err, tt.wantCheck)
			}
			got, err = fence.RaiseSQL(tt.resource, tt.token)
			if err != nil || got != tt.wantRaise {
				t.Errorf("RaiseSQL = %q, %v; want %q", got, err, tt.wantRaise)
			}
		})
	}
	if got := fence.CheckReadOnlySQL(); got != "SELECT fence.check_readonly()" {
		t.Errorf("CheckReadOnlySQL = %q", got)
	}
}

func TestInjectedSQLRefusesBadInput(t *testing.T) {
	tests := []struct {
		name     string
		resource string
		token    int64
	}{
		{"zero token", "billing", 0},
		{"negative token", "billing", -5},
		{"empty resource", "", 1},
		{"upper case", "Billing", 1},
		{"quote", "billing'); DROP TABLE x; --", 1},
		{"backslash", `billing\`, 1},
		{"space", "bill ing", 1},
		{"newline", "billing\n", 1},
		{"non-ASCII", "billé", 1},
		{"too long", "b" + strings.Repeat("x", 63), 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for name, build := range map[string]func(string, int64) (string, error){
				"CheckSQL": fence.CheckSQL,
				"RaiseSQL": fence.RaiseSQL,
			} {
				got, err := build(tt.resource, tt.token)
				if err == nil {
					t.Fatalf("%s(%q, %d) = %q, want an error", name, tt.resource, tt.token, got)
				}
				if !errors.Is(err, fence.ErrMalformed) {
					t.Errorf("%s error %v is not ErrMalformed (ZF004)", name, err)
				}
				if got != "" {
					t.Errorf("%s returned SQL %q with its error", name, got)
				}
			}
		})
	}
}

// FuzzCheckSQL: whatever the input, the SQL is either refused or exactly the call built from a
// valid name and an integer, with nothing that could end the string literal.
func FuzzCheckSQL(f *testing.F) {
	f.Add("billing", int64(34))
	f.Add("a'b", int64(1))
	f.Add("", int64(0))
	f.Add("x\\'", int64(-1))
	f.Fuzz(func(t *testing.T, resource string, token int64) {
		got, err := fence.CheckSQL(resource, token)
		valid := fence.ValidResource(resource) && token > 0
		if (err == nil) != valid {
			t.Fatalf("CheckSQL(%q, %d) error %v, valid input %t", resource, token, err, valid)
		}
		if err != nil {
			return
		}
		want := "SELECT fence.check('" + resource + "', " + strconv.FormatInt(token, 10) + ")"
		if got != want {
			t.Fatalf("CheckSQL = %q, want %q", got, want)
		}
		if strings.ContainsAny(resource, "'\\\"$;\x00 \n") {
			t.Fatalf("accepted resource %q can end a literal", resource)
		}
	})
}

func ExampleCheckSQL() {
	q, err := fence.CheckSQL("billing", 34)
	if err != nil {
		panic(err)
	}
	fmt.Println(q)
	// Output: SELECT fence.check('billing', 34)
}

func ExampleMigrate() {
	// Installs or upgrades the fence schema; safe to run from several proxies at once.
	applied, err := fence.Migrate(context.Background(), os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println("migrate:", err)
		return
	}
	fmt.Println("applied migrations:", applied)
}
