package proxy

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// keyCheckResource is the resource the start's key check names: fence.settled verifies the
// proof before it reads anything, and no configured resource's row is locked by the check.
const keyCheckResource = "fenceproxy.key-check"

// KeyMismatchError says that the proxy key is not the one stored in a database: every fenced
// session there would be refused (ZF010), or bound by nothing (no key stored, ZF007).
type KeyMismatchError struct {
	Database string
	KeyFile  string // empty: the key was given in code (Config.Key)
	Missing  bool   // no key is stored in the database at all
	Err      error  // the database's answer
}

func (e *KeyMismatchError) Error() string {
	what := "the proxy key"
	if e.KeyFile != "" {
		what = fmt.Sprintf("the proxy key in --key-file %s", e.KeyFile)
	}
	file := e.KeyFile
	if file == "" {
		file = "FILE"
	}
	if e.Missing {
		return fmt.Sprintf("no proxy key is stored in database %q, so no session there can be bound with %s: "+
			"store it with fenceproxy migrate --database <URL of %s> --key-file %s", e.Database, what, e.Database, file)
	}
	return fmt.Sprintf("%s is not the proxy key stored in database %q (fenceproxy migrate --key-file stored another), "+
		"so the database refuses every bind of this proxy there (ZF010): give fenceproxy serve the key file that "+
		"fenceproxy migrate --key-file used for that database, or store this key there with fenceproxy migrate "+
		"--database <URL of %s> --key-file %s (proxies with the old key are then refused)", what, e.Database, e.Database, file)
}

func (e *KeyMismatchError) Unwrap() error { return e.Err }

// keyAnswer classifies a database's answer to a call made with the proxy key: a
// *KeyMismatchError when it says the key is wrong or missing, nil otherwise.
func (s *Server) keyAnswer(database, code, message string, err error) *KeyMismatchError {
	switch {
	case code == fence.CodeProof:
		return &KeyMismatchError{Database: database, KeyFile: s.cfg.KeyFile, Err: err}
	case code == fence.CodeUnavailable && strings.Contains(message, "no proxy key is stored"):
		return &KeyMismatchError{Database: database, KeyFile: s.cfg.KeyFile, Missing: true, Err: err}
	}
	return nil
}

// CheckKey verifies at start, on the control database, that the proxy key is the one
// `fenceproxy migrate --key-file` stored there: it calls fence.settled with the key's proof,
// which the database verifies before anything else. It returns a *KeyMismatchError when the
// database says the key is wrong or missing there, and nil when it agrees, when there is no
// control database (the proxy has no credentials of its own: each database's key is then
// checked by the first fenced session there, which the error names), or when the database
// cannot be asked now (logged; its sessions check it then).
func (s *Server) CheckKey(ctx context.Context) error {
	if s.control == nil {
		if len(s.cfg.resources) > 0 {
			s.log.Warn("no --control-database: the proxy key cannot be checked at start; a key that is not the one stored in a database refuses the first fenced session there (ZF010, naming the key file)",
				zap.String("key_file", s.cfg.KeyFile))
		}
		return nil
	}
	actx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
	conn, err := s.control.Acquire(actx)
	cancel()
	if err != nil {
		s.log.Warn("could not check the proxy key at start: the control database is not reachable; fenced sessions check it", zap.String("database", s.controlDB), zap.Error(err))
		return nil
	}
	defer conn.Release()
	_, err = s.cfg.Key.Settled(ctx, conn.Conn(), keyCheckResource, 1)
	if err == nil {
		s.log.Info("proxy key checked: it is the key stored in the control database", zap.String("database", s.controlDB))
		return nil
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		if km := s.keyAnswer(s.controlDB, pe.Code, pe.Message, err); km != nil {
			return km
		}
	}
	s.log.Warn("could not check the proxy key at start; fenced sessions check it", zap.String("database", s.controlDB), zap.Error(err))
	return nil
}

// keyRefused is the client's error for a bind that the database refused because of the
// proxy key (nil when serverErr is not about the key), logged once per database: the
// server's ZF010 or ZF007 names no key file, and a wrong --key-file is the proxy's fault,
// not the client's.
func (sess *session) keyRefused(serverErr *pgproto3.ErrorResponse) *fatal {
	s := sess.srv
	km := s.keyAnswer(sess.database, serverErr.Code, serverErr.Message, nil)
	if km == nil {
		return nil
	}
	if _, seen := s.keyRefusals.LoadOrStore(sess.database, true); !seen {
		s.log.Error("the database refuses the proxy key: no fenced session of this database can start until the key files agree",
			zap.String("database", sess.database), zap.String("key_file", s.cfg.KeyFile), zap.String("answer", serverErr.Message))
	}
	return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: serverErr.Code,
		Message: "fenceproxy could not bind the session: " + km.Error(),
		Detail:  "The database answered: " + serverErr.Message}}
}
