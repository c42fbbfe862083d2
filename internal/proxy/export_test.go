package proxy

// UpstreamHosts is --upstream as the proxy reads it: each host (host:port, or a socket's
// path) in order, and target_session_attrs.
func UpstreamHosts(raw string) (hosts []string, attrs string, err error) {
	set, err := parseUpstream(raw, "", "")
	if err != nil {
		return nil, "", err
	}
	for _, h := range set.hosts {
		hosts = append(hosts, h.String())
	}
	return hosts, set.attrs, nil
}
