package proxy_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// A rawStep sends messages and reads the answer: up to rfq ReadyForQuery,
// or up to the first message of type stop, or to the end of the connection.
type rawStep struct {
	msgs []pgproto3.FrontendMessage
	rfq  int
	stop string
	eof  bool
}

func q(sql string) pgproto3.FrontendMessage { return &pgproto3.Query{String: sql} }

func step(rfq int, msgs ...pgproto3.FrontendMessage) rawStep { return rawStep{msgs: msgs, rfq: rfq} }

func stepUntil(stop string, msgs ...pgproto3.FrontendMessage) rawStep {
	return rawStep{msgs: msgs, stop: stop}
}

var syncMsg = &pgproto3.Sync{}

// transcripts are protocol conversations that drivers rarely or never have;
// each runs on a fresh session, directly against PostgreSQL and through the
// proxy, and the two transcripts must be identical (process IDs and cancel
// keys aside).
var transcripts = []struct {
	name string
	// want are fragments the direct transcript must contain, so that the
	// scenario proves what it is named after.
	want  []string
	steps []rawStep
}{
	{"portal with row limits", []string{`PortalSuspended`}, []rawStep{
		step(1,
			&pgproto3.Parse{Query: "SELECT g FROM generate_series(1, 10) g"},
			&pgproto3.Bind{DestinationPortal: "p"},
			&pgproto3.Describe{ObjectType: 'P', Name: "p"},
			&pgproto3.Execute{Portal: "p", MaxRows: 3},
			&pgproto3.Execute{Portal: "p", MaxRows: 3},
			&pgproto3.Execute{Portal: "p"},
			syncMsg),
	}},
	{"portal across syncs in a block", []string{`PortalSuspended`, `"FETCH 1"`, `"34000"`}, []rawStep{
		step(1, q("BEGIN")),
		step(1,
			&pgproto3.Parse{Name: "s", Query: "SELECT g, repeat('x', g) FROM generate_series(1, 5) g"},
			&pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s"},
			&pgproto3.Execute{Portal: "p", MaxRows: 2},
			syncMsg),
		step(1, &pgproto3.Execute{Portal: "p", MaxRows: 2}, syncMsg),
		step(1, q("FETCH ALL FROM p")),
		step(1, &pgproto3.Execute{Portal: "p", MaxRows: 1}, &pgproto3.Close{ObjectType: 'P', Name: "p"}, syncMsg),
		step(1, q("COMMIT")),
		step(1, &pgproto3.Execute{Portal: "p"}, syncMsg),
	}},
	{"named and unnamed statements", []string{`ParameterDescription`, `"26000"`, `"42P05"`, `CloseComplete`}, []rawStep{
		step(1,
			&pgproto3.Parse{Name: "s1", Query: "SELECT $1::int + 1 AS n", ParameterOIDs: []uint32{23}},
			&pgproto3.Describe{ObjectType: 'S', Name: "s1"},
			syncMsg),
		step(1,
			&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{[]byte("41")}},
			&pgproto3.Describe{ObjectType: 'P'},
			&pgproto3.Execute{},
			&pgproto3.Bind{PreparedStatement: "s1", Parameters: [][]byte{{0, 0, 0, 9}}, ParameterFormatCodes: []int16{1}, ResultFormatCodes: []int16{1}},
			&pgproto3.Execute{},
			&pgproto3.Parse{Query: "SELECT 'unnamed'::text, NULL::int"},
			&pgproto3.Bind{},
			&pgproto3.Describe{ObjectType: 'P'},
			&pgproto3.Execute{},
			&pgproto3.Close{ObjectType: 'S', Name: "s1"},
			syncMsg),
		step(1, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, syncMsg),
		step(1, &pgproto3.Parse{Name: "dup", Query: "SELECT 1"}, &pgproto3.Parse{Name: "dup", Query: "SELECT 2"}, syncMsg),
		step(1, q("PREPARE sq(int) AS SELECT $1 * 2; EXECUTE sq(21); DEALLOCATE sq")),
	}},
	{"pipeline with several syncs and an error", []string{`"42601"`, `"22012"`, `{"text":"3"}`}, []rawStep{
		step(4,
			&pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg,
			&pgproto3.Parse{Query: "SELEC 2"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg,
			&pgproto3.Parse{Query: "SELECT 1/0"}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Parse{Query: "SELECT 'skipped'"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg,
			&pgproto3.Parse{Query: "SELECT 3"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
	}},
	{"flush without sync", []string{`ParseComplete`}, []rawStep{
		stepUntil("ParseComplete", &pgproto3.Parse{Query: "SELECT 42"}, &pgproto3.Flush{}),
		stepUntil("CommandComplete", &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Flush{}),
		step(1, syncMsg),
	}},
	{"simple query protocol", []string{`EmptyQueryResponse`, `"25P02"`, `"TxStatus":"E"`}, []rawStep{
		step(1, q("SELECT 1; SELECT 1/0; SELECT 3")),
		step(1, q("")),
		step(1, q(";")),
		step(1, q("BEGIN")),
		step(1, q("SELECT 1/0")),
		step(1, q("SELECT 1")),
		step(1, q("ROLLBACK")),
		step(1, q("SELECT 1 AS a; BEGIN; SELECT 2 AS b; COMMIT; SELECT 3 AS c")),
		step(1, q("SELECT NULL::text, ''::text, 'x'::bytea, 1.5::numeric, '{1,2}'::int[]")),
	}},
	{"copy from stdin", []string{`"COPY 2"`, `client gave up`, `"22P02"`, `{"binary":"66690a7665"}`}, []rawStep{
		step(1, q("CREATE TEMP TABLE c (a int, b text)")),
		stepUntil("CopyInResponse", q("COPY c FROM STDIN")),
		step(1, &pgproto3.CopyData{Data: []byte("1\tone\n2\t")}, &pgproto3.CopyData{Data: []byte("two\n")}, &pgproto3.CopyDone{}),
		stepUntil("CopyInResponse", q("COPY c FROM STDIN")),
		step(1, &pgproto3.CopyData{Data: []byte("3\tthree\n")}, &pgproto3.CopyFail{Message: "client gave up"}),
		stepUntil("CopyInResponse", q("COPY c FROM STDIN")),
		step(1, &pgproto3.CopyData{Data: []byte("x\tbad\n")}, &pgproto3.CopyDone{}),
		stepUntil("CopyInResponse", q("COPY c FROM STDIN (FORMAT csv)")),
		step(1, &pgproto3.CopyData{Data: []byte("4,four\n5,\"fi\nve\"\n")}, &pgproto3.CopyDone{}),
		step(1, q("SELECT * FROM c ORDER BY a")),
	}},
	{"copy in the extended protocol", []string{`CopyOutResponse`, `"COPY 2"`}, []rawStep{
		step(1, q("CREATE TEMP TABLE c (a int)")),
		stepUntil("CopyInResponse", &pgproto3.Parse{Query: "COPY c FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
		step(1, &pgproto3.CopyData{Data: []byte("7\n8\n")}, &pgproto3.CopyDone{}, syncMsg),
		step(1, &pgproto3.Parse{Query: "COPY c TO STDOUT"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
	}},
	{"copy in the extended protocol, refused", []string{`"42P01"`, `"TxStatus":"I"`}, []rawStep{
		// The COPY fails before copy-in mode: the Sync sent with it is a real one.
		step(1, &pgproto3.Parse{Query: "COPY no_such_table FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
		step(1, q("SELECT 1")),
	}},
	{"copy in the extended protocol, in a block", []string{`"COPY 1"`, `"COMMIT"`}, []rawStep{
		step(1, q("CREATE TEMP TABLE cb (a int); BEGIN")),
		stepUntil("CopyInResponse", &pgproto3.Parse{Query: "COPY cb FROM STDIN"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Flush{}),
		step(1, &pgproto3.CopyData{Data: []byte("9\n")}, &pgproto3.CopyDone{}, syncMsg),
		step(1, q("COMMIT")),
		step(1, q("SELECT count(*) FROM cb")),
	}},
	{"copy to stdout", []string{`CopyOutResponse`, `CopyDone`, `"COPY 200"`}, []rawStep{
		step(1, q("COPY (SELECT g, repeat('x', g), g % 3 = 0 FROM generate_series(1, 200) g) TO STDOUT")),
		step(1, q("COPY (SELECT g, 'a\tb' FROM generate_series(1, 3) g) TO STDOUT (FORMAT binary)")),
		step(1, q("COPY (SELECT 1/0) TO STDOUT")),
	}},
	{"function call", []string{`FunctionCallResponse`}, []rawStep{
		// 177 is int4pl, fixed in PostgreSQL's catalog.
		step(1, &pgproto3.FunctionCall{Function: 177, ArgFormatCodes: []uint16{0}, Arguments: [][]byte{[]byte("2"), []byte("3")}}),
		step(1, &pgproto3.FunctionCall{Function: 177, ArgFormatCodes: []uint16{1}, Arguments: [][]byte{{0, 0, 0, 2}, nil}, ResultFormatCode: 1}),
		step(1, &pgproto3.FunctionCall{Function: 0, Arguments: nil}),
	}},
	{"notices, parameter status and notifications", []string{`NoticeResponse {`, `"WARNING"`, `NotificationResponse`, `"at commit"`, `"Asia/Tokyo"`, `"dbg"`}, []rawStep{
		step(1, q("SET application_name = 'raw'; SET TimeZone = 'Asia/Tokyo'; SET DateStyle = 'SQL, DMY'")),
		step(1, q("DO $$BEGIN RAISE NOTICE 'n1 %', 1; RAISE WARNING 'w1' USING DETAIL = 'd', HINT = 'h'; END$$")),
		step(1, q("SET client_min_messages = debug1; DO $$BEGIN RAISE DEBUG 'dbg'; END$$")),
		step(1, q("LISTEN transcript_chan; NOTIFY transcript_chan, 'self'; SELECT pg_notify('transcript_chan', repeat('p', 7000))")),
		step(1, q("BEGIN; NOTIFY transcript_chan, 'at commit'; SELECT 1")),
		step(1, q("COMMIT")),
		step(1, q("RESET ALL")),
	}},
	{"transaction status", []string{`"TxStatus":"E"`, `"25P01"`}, []rawStep{
		step(1, q("BEGIN ISOLATION LEVEL SERIALIZABLE")),
		step(1, &pgproto3.Parse{Query: "SELECT 1/0"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
		step(1, &pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Bind{}, &pgproto3.Execute{}, syncMsg),
		step(1, q("ROLLBACK")),
		step(1, q("COMMIT")),
		step(1, q("SAVEPOINT s")),
		step(1, q("BEGIN; SAVEPOINT s; SELECT 1/0")),
		step(1, q("ROLLBACK TO s")),
		step(1, q("RELEASE s; COMMIT")),
	}},
	{"terminate", nil, []rawStep{
		step(1, q("SELECT 1")),
		{msgs: []pgproto3.FrontendMessage{&pgproto3.Terminate{}}, eof: true},
	}},
}

// runTranscript starts a session at addr with the startup params and runs
// steps, returning the normalised transcript, startup included.
func runTranscript(t *testing.T, addr string, params []string, steps []rawStep) []string {
	t.Helper()
	r := dialRaw(t, addr)
	out := r.startup(3<<16, params...)
	for i, s := range steps {
		r.send(s.msgs...)
		got, err := r.readUntil(s.rfq, s.stop)
		out = append(out, got...)
		if s.eof {
			if err == nil || !isClosed(err) {
				t.Fatalf("step %d: want the connection closed, got %v", i, err)
			}
			out = append(out, "EOF")
			continue
		}
		if err != nil {
			t.Fatalf("step %d: %v\n%q", i, err, out)
		}
	}
	return out
}

// sameTranscript fails the test unless the two transcripts are identical,
// message by message.
func sameTranscript(t *testing.T, direct, proxied []string) {
	t.Helper()
	if len(direct) != len(proxied) {
		t.Fatalf("transcripts differ\n%s", diffLines(direct, proxied))
	}
	for i := range direct {
		if direct[i] != proxied[i] {
			t.Fatalf("transcripts differ\n%s", diffLines(direct, proxied))
		}
	}
}

// testWireTranscripts: the proxy must be indistinguishable from the server
// at the message level.
func testWireTranscripts(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	params := []string{"user", testenv.AdminUser, "database", "postgres"}
	for _, tt := range transcripts {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			direct := runTranscript(t, pgAddr(pg), params, tt.steps)
			all := strings.Join(direct, "\n")
			for _, w := range tt.want {
				if !strings.Contains(all, w) {
					t.Errorf("direct transcript lacks %s:\n%s", w, all)
				}
			}
			sameTranscript(t, direct, runTranscript(t, proxyAddr(p), params, tt.steps))
		})
	}
}
