package fence

import (
	"context"

	"github.com/pressly/goose/v3"
)

// MigrateTo applies the migrations up to version, or rolls back to it, for tests of upgrades
// and of the Down sections. Not part of the API: the product only ever migrates up.
func MigrateTo(ctx context.Context, databaseURL string, version int64) error {
	return underLock(ctx, databaseURL, func(p *goose.Provider) error {
		current, err := p.GetDBVersion(ctx)
		if err != nil {
			return err
		}
		if version >= current {
			_, err = p.UpTo(ctx, version)
		} else {
			_, err = p.DownTo(ctx, version)
		}
		return err
	})
}
