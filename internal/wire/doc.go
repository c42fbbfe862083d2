// Package wire holds the pieces of the PostgreSQL frontend/backend protocol that
// fenceproxy needs beyond what pgproto3 offers: parsing of startup packets
// (StartupMessage of any 3.x minor version, SSLRequest, GSSENCRequest,
// CancelRequest with keys of any length), libpq's `options` parameter, and a
// message framer that enforces a maximum message size and can stream large
// bodies instead of buffering them.
//
// The package owns decoding and encoding only. It does not log, does not know
// about fencing and never keeps a message body past the next read: callers that
// need a value must copy it.
package wire
