//go:build !linux

package proxy

// loopSession is the event loop's state of a session; the loop is Linux's (loop_linux.go).
type loopSession struct{}

func (sess *session) relayInLoop() {}

func (sess *session) recall() {}
