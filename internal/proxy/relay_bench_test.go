package proxy

import (
	"bufio"
	"io"
	"net"
	"testing"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// BenchmarkRelayRoundTrip measures the relay's passthrough alone: a client
// sends a Query, a server answers with the four messages of a one-row SELECT,
// over loopback TCP through both directions of a session (no PostgreSQL). Its
// allocs/op is the relay's allocations per round trip (the two ends here
// allocate nothing), which the hot path keeps at zero:
//
//	go test -run '^$' -bench RelayRoundTrip -benchmem ./internal/proxy/
func BenchmarkRelayRoundTrip(b *testing.B) {
	for _, mode := range []struct {
		name string
		mode sessionMode
	}{{"unfenced", modeUnfenced}, {"fenced", modeFenced}} {
		b.Run(mode.name, func(b *testing.B) {
			client, proxyClient := tcpPair(b)
			proxyServer, server := tcpPair(b)
			sess := &session{log: zap.NewNop(), client: proxyClient, server: proxyServer, mode: mode.mode, status: 'I',
				done: make(chan struct{}), staleCh: make(chan struct{}), endedCh: make(chan struct{})}
			sess.cr = wire.NewReader(proxyClient, bufSize, 0)
			sess.sr = wire.NewReader(proxyServer, bufSize, 0)
			sess.cw = bufio.NewWriterSize(proxyClient, writeBufSize)
			sess.sw = bufio.NewWriterSize(proxyServer, writeBufSize)
			errc := make(chan error, 2)
			go func() { errc <- sess.clientToServer() }()
			go func() { errc <- sess.serverToClient() }()

			query := wire.AppendMessage(nil, 'Q', []byte("SELECT 1\x00"))
			var answer []byte
			answer = wire.AppendMessage(answer, 'T', []byte("\x00\x01?column?\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x17\x00\x04\xff\xff\xff\xff\x00\x00"))
			answer = wire.AppendMessage(answer, 'D', []byte("\x00\x01\x00\x00\x00\x011"))
			answer = wire.AppendMessage(answer, 'C', []byte("SELECT 1\x00"))
			answer = wire.AppendMessage(answer, 'Z', []byte{'I'})
			// The server: answers each query it reads.
			go func() {
				buf := make([]byte, len(query))
				for {
					if _, err := io.ReadFull(server, buf); err != nil {
						return
					}
					if _, err := server.Write(answer); err != nil {
						return
					}
				}
			}()
			buf := make([]byte, len(answer))
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := client.Write(query); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(client, buf); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			client.Close()
			server.Close()
			<-errc
			proxyClient.Close()
			proxyServer.Close()
			<-errc
		})
	}
}

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(b *testing.B) (net.Conn, net.Conn) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		b.Fatal(err)
	}
	return c, s
}
