package main

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// MigrateCmd installs or upgrades the fence schema.
type MigrateCmd struct {
	Database string `help:"Database URL to install the fence schema in (a role that may create schemas)." required:""`
}

// Run applies the embedded migrations.
func (m *MigrateCmd) Run(ctx context.Context, log *zap.Logger) error {
	applied, err := fence.Migrate(ctx, m.Database)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if len(applied) == 0 {
		fmt.Println("fence schema is up to date")
	}
	for _, v := range applied {
		fmt.Printf("applied migration %d\n", v)
	}
	log.Debug("migrations applied", zap.Int64s("versions", applied))
	return nil
}
