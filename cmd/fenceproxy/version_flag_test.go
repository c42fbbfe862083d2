package main_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestVersionFlagPrintsVersion: fenceproxy --version prints what fenceproxy version prints.
func TestVersionFlagPrintsVersion(t *testing.T) {
	bin := buildBinary(t)
	flag, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("--version: %v\n%s", err, flag)
	}
	cmd, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("version: %v\n%s", err, cmd)
	}
	if !strings.HasPrefix(string(flag), "fenceproxy ") || strings.TrimSpace(string(flag)) != strings.TrimSpace(string(cmd)) {
		t.Fatalf("--version printed %q, version printed %q", flag, cmd)
	}
}
