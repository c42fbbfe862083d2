package fence

import (
	"context"
	"errors"
)

// MigrateTo applies the migrations up to version, or rolls back to it, for tests of upgrades
// and of the Down sections. Not part of the API: the product only ever migrates up.
func MigrateTo(ctx context.Context, databaseURL string, version int64) (err error) {
	db, err := openDB(databaseURL)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, db.Close()) }()
	p, err := newProvider(db)
	if err != nil {
		return err
	}
	unlock, err := lockAndCreateSchema(ctx, db)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, unlock()) }()
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
}
