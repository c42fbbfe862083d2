package fence_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// fixedKey is a key whose proofs the tests below spell out.
var fixedKey = fence.Key(bytes.Repeat([]byte{0xa5}, 16))

// nmac is the proof's construction written out independently of Key.Proof: hex of
// sha256(key || sha256(key || message)).
func nmac(key []byte, msg string) string {
	inner := sha256.Sum256(append(append([]byte{}, key...), msg...))
	outer := sha256.Sum256(append(append([]byte{}, key...), inner[:]...))
	return hex.EncodeToString(outer[:])
}

func TestKeyProof(t *testing.T) {
	tests := []struct {
		name     string
		kind     string
		database string
		resource string
		token    int64
		pid      uint32
		msg      string // what the proof is the MAC of
	}{
		{"bind", "bind", "app", "billing", 34, 4242, "bind\napp\nbilling\n34\n4242"},
		{"raise", "raise", "app", "billing", 34, 4242, "raise\napp\nbilling\n34\n4242"},
		{"largest token and pid", "bind", "db", "b", 1<<63 - 1, 1<<32 - 1, "bind\ndb\nb\n9223372036854775807\n4294967295"},
		{"non-ASCII database", "bind", "Ünïcode db", "eu-west.billing_2", 1, 1, "bind\nÜnïcode db\neu-west.billing_2\n1\n1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := fixedKey.Proof(tt.kind, tt.database, tt.resource, tt.token, tt.pid)
			if want := nmac(fixedKey, tt.msg); got != want {
				t.Fatalf("Proof = %s, want %s (NMAC of %q)", got, want, tt.msg)
			}
		})
	}

	// Every input is in the MAC: changing any one of them changes the proof.
	base := fixedKey.Proof("bind", "app", "billing", 34, 4242)
	for name, other := range map[string]string{
		"kind":     fixedKey.Proof("raise", "app", "billing", 34, 4242),
		"database": fixedKey.Proof("bind", "app2", "billing", 34, 4242),
		"resource": fixedKey.Proof("bind", "app", "billing2", 34, 4242),
		"token":    fixedKey.Proof("bind", "app", "billing", 35, 4242),
		"pid":      fixedKey.Proof("bind", "app", "billing", 34, 4243),
		"key":      fence.Key(bytes.Repeat([]byte{0xa6}, 16)).Proof("bind", "app", "billing", 34, 4242),
	} {
		if other == base {
			t.Errorf("changing the %s leaves the proof unchanged", name)
		}
	}
	// Proof must not keep or change the key's bytes (it appends to a copy).
	k := make(fence.Key, 16, 64)
	copy(k, fixedKey)
	first := k.Proof("bind", "app", "billing", 34, 1)
	if k.Proof("bind", "app", "billing", 34, 1) != first || !bytes.Equal(k, fixedKey) {
		t.Fatal("Proof changed the key or depends on its spare capacity")
	}
}

func TestKeySQL(t *testing.T) {
	tests := []struct {
		name     string
		database string
		resource string
		token    int64
		pid      uint32
	}{
		{"simple", "app", "billing", 34, 4242},
		{"punctuation", "app", "eu-west.billing_2", 1, 1},
		{"largest token", "x", "b", 1<<63 - 1, 1<<32 - 1},
		{"database with a quote", "it's", "billing", 2, 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for kind, build := range map[string]func(fence.Key, string, string, int64, uint32) (string, error){
				"bind":  fence.Key.BindSQL,
				"raise": fence.Key.RaiseSQL,
			} {
				got, err := build(fixedKey, tt.database, tt.resource, tt.token, tt.pid)
				want := "SELECT fence." + kind + "('" + tt.resource + "', " + strconv.FormatInt(tt.token, 10) + ", '" +
					fixedKey.Proof(kind, tt.database, tt.resource, tt.token, tt.pid) + "')"
				if err != nil || got != want {
					t.Errorf("%sSQL = %q, %v; want %q", kind, got, err, want)
				}
			}
		})
	}
}

func TestKeySQLRefusesBadInput(t *testing.T) {
	tests := []struct {
		name     string
		resource string
		token    int64
	}{
		{"zero token", "billing", 0},
		{"negative token", "billing", -5},
		{"smallest token", "billing", -1 << 63},
		{"empty resource", "", 1},
		{"upper case", "Billing", 1},
		{"quote", "billing'); DROP TABLE x; --", 1},
		{"backslash", `billing\`, 1},
		{"space", "bill ing", 1},
		{"newline", "billing\n", 1},
		{"NUL", "billing\x00", 1},
		{"non-ASCII", "billé", 1},
		{"invalid UTF-8", "bill\xff", 1},
		{"too long", "b" + strings.Repeat("x", 63), 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, k := range []fence.Key{fixedKey, nil} { // a nil key must not panic either
				for name, build := range map[string]func(fence.Key, string, string, int64, uint32) (string, error){
					"BindSQL":  fence.Key.BindSQL,
					"RaiseSQL": fence.Key.RaiseSQL,
				} {
					got, err := build(k, "app", tt.resource, tt.token, 1)
					if err == nil {
						t.Fatalf("%s(%q, %d) = %q, want an error", name, tt.resource, tt.token, got)
					}
					if !errors.Is(err, fence.ErrMalformed) {
						t.Errorf("%s error %v is not ErrMalformed (ZF004)", name, err)
					}
					if fe, ok := fence.IsFencing(err); !ok || fe.Code != fence.CodeMalformed || fe.Hint == "" {
						t.Errorf("%s error %+v: want a ZF004 *fence.Error with a hint", name, fe)
					}
					if got != "" {
						t.Errorf("%s returned SQL %q with its error", name, got)
					}
				}
			}
		})
	}
}

var callPattern = regexp.MustCompile(`^SELECT fence\.(bind|raise)\('([a-z][a-z0-9_.-]{0,62})', ([1-9][0-9]*), '([0-9a-f]{64})'\)$`)

// FuzzCallSQL: whatever the input, the SQL is either refused or exactly the call built from a
// valid name, an integer and a hex proof, with nothing that could end the string literal.
func FuzzCallSQL(f *testing.F) {
	f.Add("app", "billing", int64(34), uint32(1))
	f.Add("app", "a'b", int64(1), uint32(2))
	f.Add("", "", int64(0), uint32(0))
	f.Add("x'); --", "x\\'", int64(-1), uint32(1<<32-1))
	f.Fuzz(func(t *testing.T, database, resource string, token int64, pid uint32) {
		valid := fence.ValidResource(resource) && token > 0
		for kind, build := range map[string]func(fence.Key, string, string, int64, uint32) (string, error){
			"bind":  fence.Key.BindSQL,
			"raise": fence.Key.RaiseSQL,
		} {
			got, err := build(fixedKey, database, resource, token, pid)
			if (err == nil) != valid {
				t.Fatalf("%s(%q, %q, %d) error %v, valid input %t", kind, database, resource, token, err, valid)
			}
			if err != nil {
				if !errors.Is(err, fence.ErrMalformed) || got != "" {
					t.Fatalf("%s: %q, %v; want no SQL and ZF004", kind, got, err)
				}
				continue
			}
			m := callPattern.FindStringSubmatch(got)
			if m == nil || m[1] != kind || m[2] != resource || m[3] != strconv.FormatInt(token, 10) ||
				m[4] != fixedKey.Proof(kind, database, resource, token, pid) {
				t.Fatalf("%s SQL = %q: not the call of %q, %d with its proof", kind, got, resource, token)
			}
			if strings.ContainsAny(resource, "'\\\"$;\x00 \n") {
				t.Fatalf("accepted resource %q can end a literal", resource)
			}
		}
	})
}

func TestGenerateKey(t *testing.T) {
	a, err := fence.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	b, err := fence.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != fence.KeySize || len(b) != fence.KeySize {
		t.Fatalf("key sizes %d and %d, want %d", len(a), len(b), fence.KeySize)
	}
	if bytes.Equal(a, b) {
		t.Fatal("two generated keys are equal")
	}
	if back, err := fence.ParseKey(hex.EncodeToString(a)); err != nil || !bytes.Equal(back, a) {
		t.Fatalf("ParseKey of a generated key's hex = %x, %v", back, err)
	}
}

func TestParseKey(t *testing.T) {
	hex16 := strings.Repeat("ab", 16)
	tests := []struct {
		name string
		text string
		want fence.Key // nil: an error
		msg  string    // in the error
	}{
		{"16 bytes", hex16, bytes.Repeat([]byte{0xab}, 16), ""},
		{"upper case", strings.ToUpper(hex16), bytes.Repeat([]byte{0xab}, 16), ""},
		{"white space around", " \t" + hex16 + "\r\n\n", bytes.Repeat([]byte{0xab}, 16), ""},
		{"64 bytes", strings.Repeat("01", 64), bytes.Repeat([]byte{0x01}, 64), ""},
		{"empty", "", nil, "has 0 bytes, needs 16 or more"},
		{"white space only", " \n", nil, "has 0 bytes, needs 16 or more"},
		{"too short", strings.Repeat("ab", 15), nil, "has 15 bytes, needs 16 or more"},
		{"odd length", hex16 + "a", nil, "not hex"},
		{"not hex", strings.Repeat("zz", 16), nil, "not hex"},
		{"space inside", hex16[:16] + " " + hex16[16:], nil, "not hex"},
		{"0x prefix", "0x" + hex16, nil, "not hex"},
		{"two lines", hex16 + "\n" + hex16, nil, "not hex"},
		{"raw bytes", string(bytes.Repeat([]byte{0xab}, 32)), nil, "not hex"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := fence.ParseKey(tt.text)
			if tt.want != nil {
				if err != nil || !bytes.Equal(got, tt.want) {
					t.Fatalf("ParseKey = %x, %v; want %x", got, err, tt.want)
				}
				return
			}
			if err == nil || got != nil {
				t.Fatalf("ParseKey = %x, %v; want no key and an error", got, err)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("error %q does not say %q", err, tt.msg)
			}
		})
	}
}

// FuzzParseKey: ParseKey never panics, accepts exactly what decodes as hex to 16 bytes or more
// once trimmed, and what it accepts is what WriteKeyFile writes back.
func FuzzParseKey(f *testing.F) {
	f.Add(strings.Repeat("ab", 16))
	f.Add(strings.Repeat("AB", 32) + "\n")
	f.Add(strings.Repeat("ab", 15))
	f.Add(" 0x" + strings.Repeat("0", 32))
	f.Add("not a key")
	f.Add("")
	f.Fuzz(func(t *testing.T, text string) {
		k, err := fence.ParseKey(text)
		decoded, decodeErr := hex.DecodeString(strings.TrimSpace(text))
		if want := decodeErr == nil && len(decoded) >= 16; (err == nil) != want {
			t.Fatalf("ParseKey(%q) error %v, want accepted: %t", text, err, want)
		}
		if err != nil {
			if k != nil {
				t.Fatalf("ParseKey(%q) returned %x with its error", text, k)
			}
			return
		}
		if !bytes.Equal(k, decoded) {
			t.Fatalf("ParseKey(%q) = %x, want %x", text, k, decoded)
		}
		back, err := fence.ParseKey(hex.EncodeToString(k) + "\n") // WriteKeyFile's format
		if err != nil || !bytes.Equal(back, k) {
			t.Fatalf("round trip of %x: %x, %v", k, back, err)
		}
	})
}

func TestLoadKey(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		t.Helper()
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	good := write("good", strings.Repeat("cd", 32)+"\n")
	if k, err := fence.LoadKey(good); err != nil || !bytes.Equal(k, bytes.Repeat([]byte{0xcd}, 32)) {
		t.Fatalf("LoadKey(good) = %x, %v", k, err)
	}

	tests := []struct {
		name     string
		path     string
		msg      string
		notExist bool // errors.Is(err, fs.ErrNotExist): migrate --key-file creates the file then
	}{
		{"missing file", filepath.Join(dir, "missing"), "no such file", true},
		{"a folder", dir, "key file", false},
		{"not hex", write("nothex", "this is not a key\n"), "not hex", false},
		{"too short", write("short", strings.Repeat("cd", 8)+"\n"), "has 8 bytes, needs 16 or more", false},
		{"empty", write("empty", ""), "has 0 bytes", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := fence.LoadKey(tt.path)
			if err == nil || k != nil {
				t.Fatalf("LoadKey = %x, %v; want an error", k, err)
			}
			if !strings.Contains(err.Error(), tt.msg) || !strings.Contains(err.Error(), tt.path) {
				t.Errorf("error %q does not say %q and name %s", err, tt.msg, tt.path)
			}
			if errors.Is(err, fs.ErrNotExist) != tt.notExist {
				t.Errorf("errors.Is(%v, fs.ErrNotExist) = %t, want %t", err, !tt.notExist, tt.notExist)
			}
		})
	}
}

func TestWriteKeyFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "proxy.key")
	k, err := fence.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	if err := fence.WriteKeyFile(path, k); err != nil {
		t.Fatalf("WriteKeyFile: %v", err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v, want 0600", fi.Mode().Perm())
	}
	if back, err := fence.LoadKey(path); err != nil || !bytes.Equal(back, k) {
		t.Fatalf("LoadKey after WriteKeyFile = %x, %v; want %x", back, err, k)
	}
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := hex.EncodeToString(k) + "\n"; string(before) != want {
		t.Fatalf("key file holds %q, want %q", before, want)
	}

	// Never overwritten: a second key for the same path is refused and the first one stays.
	other, err := fence.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	err = fence.WriteKeyFile(path, other)
	if err == nil || !errors.Is(err, fs.ErrExist) {
		t.Fatalf("WriteKeyFile over an existing file = %v, want an error matching fs.ErrExist", err)
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(after, before) {
		t.Fatalf("the existing key file changed: %q, was %q", after, before)
	}

	// Nor through a symbolic link (O_EXCL): the file it points to stays as it is.
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.key")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := fence.WriteKeyFile(link, k); err == nil {
		t.Fatal("WriteKeyFile through a symbolic link succeeded")
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Fatalf("the link's target was written: %q", b)
	}

	if err := fence.WriteKeyFile(filepath.Join(dir, "no such folder", "k"), k); err == nil {
		t.Fatal("WriteKeyFile into a missing folder succeeded")
	}
}

func ExampleKey_BindSQL() {
	key := fence.Key(bytes.Repeat([]byte{0xa5}, 16)) // in production: fence.LoadKey(--key-file)
	q, err := key.BindSQL("app", "billing", 34, 4242)
	if err != nil {
		panic(err)
	}
	fmt.Println(q[:strings.LastIndex(q, ", '")], "...")
	_, err = key.BindSQL("app", "Bad Name", 34, 4242)
	fmt.Println(errors.Is(err, fence.ErrMalformed))
	// Output:
	// SELECT fence.bind('billing', 34 ...
	// true
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
