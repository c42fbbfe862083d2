package wire

import (
	"github.com/jackc/pgx/v5/pgproto3"
)

// Severities of ErrorResponse (and NoticeResponse: WARNING).
const (
	SeverityWarning = "WARNING"
	SeverityError   = "ERROR"
	SeverityFatal   = "FATAL"
)

// Standard SQLSTATEs the proxy itself reports.
const (
	CodeProtocolViolation    = "08P01"
	CodeConnectionFailure    = "08006"
	CodeResolutionUnknown    = "08007" // transaction_resolution_unknown
	CodeQueryCanceled        = "57014"
	CodeCannotConnectNow     = "57P03"
	CodeTooManyConnections   = "53300"
	CodeProgramLimitExceeded = "54000"
	CodeAdminShutdown        = "57P01"
	CodeInvalidAuthorization = "28000"
	CodeFeatureNotSupported  = "0A000"
	// The admin console's (internal/proxy/console.go).
	CodeSyntaxError                  = "42601"
	CodeUndefinedObject              = "42704"
	CodeObjectNotInPrerequisiteState = "55000"
	CodeConfigFileError              = "F0000"
	CodeInternalError                = "XX000"
)

// AppendError appends an ErrorResponse message to dst.
func AppendError(dst []byte, e *pgproto3.ErrorResponse) []byte {
	if e.SeverityUnlocalized == "" {
		e.SeverityUnlocalized = e.Severity
	}
	out, err := e.Encode(dst)
	if err != nil {
		// Encode fails only for messages over 4 GB, which the proxy never builds.
		panic(err)
	}
	return out
}

// AppendErrorV2 appends an error in protocol 2's format, the one a client
// that asked for protocol 2 reads: 'E', then "SEVERITY:  message\n" and a
// NUL, without a length (as PostgreSQL's send_message_to_frontend writes it).
func AppendErrorV2(dst []byte, severity, message string) []byte {
	dst = append(dst, 'E')
	dst = append(dst, severity...)
	dst = append(dst, ":  "...)
	dst = append(dst, message...)
	return append(dst, '\n', 0)
}

// DecodeError decodes an ErrorResponse or NoticeResponse body.
func DecodeError(body []byte) (*pgproto3.ErrorResponse, error) {
	var e pgproto3.ErrorResponse
	if err := e.Decode(body); err != nil {
		return nil, err
	}
	return &e, nil
}
