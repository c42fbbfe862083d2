package fence

import (
	"context"
	"strconv"

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

// BindSQL and RaiseSQL are a bind's and a raise's call as one literal statement, for tests that
// bind or raise on a connection of their own with a plain Exec.
func (k Key) BindSQL(database, resource string, token int64, pid uint32) (string, error) {
	return k.literal("bind", database, resource, token, pid)
}

func (k Key) RaiseSQL(database, resource string, token int64, pid uint32) (string, error) {
	return k.literal("raise", database, resource, token, pid)
}

func (k Key) literal(kind, database, resource string, token int64, pid uint32) (string, error) {
	c, err := k.call(kind, database, resource, token, pid)
	if err != nil {
		return "", err
	}
	return "SELECT fence." + kind + "('" + c.Resource + "', " + strconv.FormatInt(c.Token, 10) + ", '" + c.Proof + "')", nil
}
