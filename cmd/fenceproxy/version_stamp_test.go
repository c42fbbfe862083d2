package main_test

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// TestVersionStampedAtBuild: the version make build and the Dockerfile pass with
// -ldflags "-X main.version=..." is what `fenceproxy version` prints.
func TestVersionStampedAtBuild(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "fenceproxy")
	if out, err := exec.Command("go", "build", "-ldflags", "-X main.version=v1.2.3-4-gabcdef0-dirty", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("fenceproxy version: %v\n%s", err, out)
	}
	if string(out) != "fenceproxy v1.2.3-4-gabcdef0-dirty\n" {
		t.Fatalf("fenceproxy version: %q, want the stamped version", out)
	}
}
