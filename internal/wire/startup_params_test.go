package wire_test

import (
	"bufio"
	"bytes"
	"reflect"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestParamDuplicatesAsPostgreSQL (review F11): PostgreSQL reads the last
// value of a startup parameter given twice, so Param must too (the proxy proves
// its bind for the database it reads); SetParam replaces every occurrence, so
// that no earlier value survives for the server to read; DeleteParam removes
// every occurrence; ReadStartup keeps both, in order.
func TestParamDuplicatesAsPostgreSQL(t *testing.T) {
	raw := []byte("user\x00app\x00database\x00first\x00database\x00last\x00\x00")
	pkt := append([]byte{0, 0, 0, byte(8 + len(raw)), 0, 3, 0, 0}, raw...)
	s, err := wire.ReadStartup(bufio.NewReader(bytes.NewReader(pkt)))
	if err != nil {
		t.Fatal(err)
	}
	want := []wire.Param{{Name: "user", Value: "app"}, {Name: "database", Value: "first"}, {Name: "database", Value: "last"}}
	if !reflect.DeepEqual(s.Params, want) {
		t.Fatalf("ReadStartup: %v, want %v", s.Params, want)
	}
	if v, ok := s.Param("database"); !ok || v != "last" {
		t.Fatalf("Param(database) = %q, %t; want the last value, as PostgreSQL reads it", v, ok)
	}
	if v, ok := s.Param("user"); !ok || v != "app" {
		t.Fatalf("Param(user) = %q, %t", v, ok)
	}
	if _, ok := s.Param("options"); ok {
		t.Fatal("Param(options) found an absent parameter")
	}

	c := *s
	c.Params = append([]wire.Param(nil), s.Params...)
	c.SetParam("database", "set")
	want = []wire.Param{{Name: "user", Value: "app"}, {Name: "database", Value: "set"}, {Name: "database", Value: "set"}}
	if !reflect.DeepEqual(c.Params, want) {
		t.Fatalf("SetParam of a duplicate: %v, want every occurrence replaced %v", c.Params, want)
	}
	c.SetParam("options", "-c a=b")
	if v, _ := c.Param("options"); v != "-c a=b" || len(c.Params) != 4 {
		t.Fatalf("SetParam of a new parameter: %v", c.Params)
	}
	again, err := wire.ReadStartup(bufio.NewReader(bytes.NewReader(c.Encode(nil))))
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := again.Param("database"); v != "set" {
		t.Fatalf("after Encode the server would read database %q, want set", v)
	}

	c.DeleteParam("database")
	want = []wire.Param{{Name: "user", Value: "app"}, {Name: "options", Value: "-c a=b"}}
	if !reflect.DeepEqual(c.Params, want) {
		t.Fatalf("DeleteParam of a duplicate: %v, want %v", c.Params, want)
	}
}
