package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/migrations"
)

// MigrateCmd installs or upgrades the fence schema.
type MigrateCmd struct {
	Database string `help:"Database URL to install the fence schema in (a role that may create schemas)." required:""`
	KeyFile  string `help:"Proxy key file: created with a new random key if missing, then stored in the database (the proxies' --key-file)." type:"path"`
}

// Run installs or upgrades the fence schema (docs/schema.md) and stores the proxy key.
func (m *MigrateCmd) Run(ctx context.Context, log *zap.Logger) error {
	applied, err := fence.Migrate(ctx, m.Database)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	for _, v := range applied {
		fmt.Printf("applied migration %d\n", v)
	}
	switch {
	case len(applied) == 0:
		fmt.Printf("fence schema is up to date (version %d)\n", migrations.Version)
	case applied[0] == 1:
		fmt.Printf("fence schema installed: now at version %d\n", migrations.Version)
	default:
		fmt.Printf("fence schema upgraded from version %d: now at version %d\n", applied[0]-1, migrations.Version)
	}
	if m.KeyFile != "" {
		key, err := fence.LoadKey(m.KeyFile)
		if errors.Is(err, fs.ErrNotExist) {
			if key, err = fence.GenerateKey(); err == nil {
				err = fence.WriteKeyFile(m.KeyFile, key)
			}
			if err == nil {
				fmt.Printf("created key file %s\n", m.KeyFile)
			}
		}
		if err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		if err := fence.SetKey(ctx, m.Database, key); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		fmt.Println("proxy key stored in the database")
	}
	log.Debug("migrations applied", zap.Int64s("versions", applied))
	return nil
}
