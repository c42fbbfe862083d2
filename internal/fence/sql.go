package fence

import (
	"fmt"
	"strconv"
)

// The statements the proxy injects into a session. Each is a single SELECT of one function of
// the fence schema (see migrations/00001_fence_schema.sql for what the functions guarantee),
// built from a resource name that passed ValidResource and an integer token: never from text a
// client sent. A valid name holds only a-z, 0-9, '_', '.' and '-', so it cannot end the string
// literal it is put in, whatever standard_conforming_strings says, and the function names are
// schema-qualified in a schema where only its owner may create objects, so neither the
// client's search_path nor its objects can change what runs.

// CheckSQL returns the commit-time check of a fenced session, e.g.
// SELECT fence.check('billing', 34). The proxy runs it inside the client's transaction
// immediately before that transaction commits; it returns one row (void) or fails with ZF001
// when a higher token was admitted for the resource.
//
// It returns a ZF004 *Error (errors.Is(err, ErrMalformed)) for an invalid resource name or a
// token below 1, and never panics: the values come from a session's startup parameters, so a
// bad one is the client's mistake, answered with an error.
func CheckSQL(resource string, token int64) (string, error) {
	if err := validateCall(resource, token); err != nil {
		return "", err
	}
	return call("check", resource, token), nil
}

// RaiseSQL returns the statement that admits a session's token, e.g.
// SELECT fence.raise('billing', 34), to run in its own transaction (autocommit). Its one row,
// one column is the token stored afterwards: the session may proceed only when that is not
// higher than its own token. Errors as for CheckSQL.
//
// Run it outside a transaction block, read-write, under READ COMMITTED. A session whose
// default_transaction_read_only is on cannot raise at all, and under a default isolation of
// REPEATABLE READ or SERIALIZABLE two raises of one resource that race make the later one fail
// with 40001 (retry it) where READ COMMITTED would wait and re-check.
func RaiseSQL(resource string, token int64) (string, error) {
	if err := validateCall(resource, token); err != nil {
		return "", err
	}
	return call("raise", resource, token), nil
}

// CheckReadOnlySQL returns the commit-time check of an unfenced, read-only session:
// SELECT fence.check_readonly(), which fails with SQLSTATE 25006 when the transaction wrote.
func CheckReadOnlySQL() string {
	return "SELECT fence.check_readonly()"
}

func validateCall(resource string, token int64) error {
	if !ValidResource(resource) {
		return Malformed(fmt.Sprintf("resource %q must match %s", resource, resourcePattern))
	}
	if token < 1 {
		return Malformed(fmt.Sprintf("token %d must be 1 or more", token))
	}
	return nil
}

func call(function, resource string, token int64) string {
	b := make([]byte, 0, len("SELECT fence.check('', )")+len(resource)+20)
	b = append(b, "SELECT fence."...)
	b = append(b, function...)
	b = append(b, "('"...)
	b = append(b, resource...)
	b = append(b, "', "...)
	b = strconv.AppendInt(b, token, 10)
	b = append(b, ')')
	return string(b)
}
