package main

import (
	"fmt"
	"net"
	"net/url"
	"strings"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/Shopify/toxiproxy/v2/toxics" // registers the latency toxic
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// viaLatencyProxy puts an in-process toxiproxy in front of the database at
// dbURL that delays every reply by ms milliseconds, and returns the URL that
// goes through it: the relays measured as they run against a database over
// a network rather than on the same machine.
func viaLatencyProxy(dbURL string, ms int) (string, func(), error) {
	u, err := url.Parse(dbURL)
	if err != nil || u.Host == "" {
		return "", nil, fmt.Errorf("-db-latency-ms needs the database as a URL with a host, got %q", dbURL)
	}
	upstream := u.Host
	if u.Port() == "" {
		upstream = net.JoinHostPort(u.Hostname(), "5432")
	}
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(srv, "postgres", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		return "", nil, fmt.Errorf("latency proxy: %w", err)
	}
	toxic := fmt.Sprintf(`{"name":"db_latency","type":"latency","stream":"downstream","attributes":{"latency":%d}}`, ms)
	if _, err := p.Toxics.AddToxicJson(strings.NewReader(toxic)); err != nil {
		p.Stop()
		return "", nil, fmt.Errorf("latency proxy: %w", err)
	}
	u.Host = p.Listen
	return u.String(), p.Stop, nil
}
