package main

import (
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// TestLogDurationsHaveUnits: a duration in a log line carries its unit ("10m0s"), in both log
// formats; the JSON format wrote bare seconds ("window":600).
func TestLogDurationsHaveUnits(t *testing.T) {
	for format, want := range map[string]string{"json": `"window":"10m0s"`, "console": `"window": "10m0s"`} {
		cfg := logConfig(format)
		var enc zapcore.Encoder
		if cfg.Encoding == "json" {
			enc = zapcore.NewJSONEncoder(cfg.EncoderConfig)
		} else {
			enc = zapcore.NewConsoleEncoder(cfg.EncoderConfig)
		}
		buf, err := enc.EncodeEntry(zapcore.Entry{Level: zapcore.WarnLevel, Time: time.Now(), Message: "leader flapping"},
			[]zap.Field{zap.Duration("window", 10*time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(buf.String(), want) {
			t.Errorf("%s log line %q: want %s", format, buf.String(), want)
		}
	}
}
