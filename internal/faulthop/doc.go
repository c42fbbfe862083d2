// Package faulthop is a TCP hop that injects network faults between two programs on
// loopback: it listens on an address of its own and relays every connection to a target,
// and on command delays the bytes, stalls them, drops connections at random (what packet
// loss looks like from above TCP, where it shows as stalls and resets, never as missing
// bytes) or cuts every open connection at once.
//
// A hop's listening address stays the same while its target stops and starts, so that a
// client configured with the hop's address sees a server restart the way it would over a
// network: connections refused (here: closed at once) until the server is back.
//
// The package owns the relay and the faults and nothing else: it knows no protocol, reads
// no byte it forwards and logs nothing.
package faulthop
