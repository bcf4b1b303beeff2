package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/fencedoutbox/watermill-outbox/cmd/outboxctl/internal/console"
	"github.com/fencedoutbox/watermill-outbox/internal/testkit/testdb"
)

// lineWriter signals the first stdout line matching re.
type lineWriter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	re    *regexp.Regexp
	found chan string
	once  sync.Once
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if m := w.re.FindStringSubmatch(w.buf.String()); m != nil {
		w.once.Do(func() { w.found <- m[1] })
	}
	return len(p), nil
}

// The console command serves the console on the address it prints, with
// its security headers, until its context ends (SIGINT/SIGTERM); in
// read-only mode it answers pages without a sign-in and refuses actions.
func TestConsoleCommandServesUntilStopped(t *testing.T) {
	s := testdb.New(t)
	for _, readOnly := range []bool{false, true} {
		ctx, cancel := context.WithCancel(context.Background())
		out := &lineWriter{re: regexp.MustCompile(`on (http://127\.0\.0\.1:[0-9]+/)`), found: make(chan string, 1)}
		var stderr bytes.Buffer
		args := []string{"console", "--listen", "127.0.0.1:0", "--database-url", s.URL}
		env := map[string]string{}
		if readOnly {
			// The same settings from the environment, as every command takes them.
			args = []string{"console"}
			env = map[string]string{"OUTBOX_LISTEN": "127.0.0.1:0", "OUTBOX_READ_ONLY": "true", "OUTBOX_DATABASE_URL": s.URL}
		}
		done := make(chan int, 1)
		go func() { done <- run(ctx, args, out, &stderr, func(k string) string { return env[k] }) }()
		var base string
		select {
		case base = <-out.found:
		case code := <-done:
			t.Fatalf("console exited %d: %s", code, stderr.String())
		case <-time.After(time.Minute):
			t.Fatal("the console did not print its address")
		}
		resp, err := http.Get(base + "signin")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, console.ContentSecurityPolicy, resp.Header.Get("Content-Security-Policy"))
		if readOnly {
			require.Equal(t, http.StatusOK, resp.StatusCode, "redirected to the overview, answered without a sign-in")
			require.Equal(t, "/", resp.Request.URL.Path)
			resp, err = http.Post(base+"plan", "application/x-www-form-urlencoded", strings.NewReader("op=purge"))
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusForbidden, resp.StatusCode)
		} else {
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, "/signin", resp.Request.URL.Path)
		}
		cancel()
		select {
		case code := <-done:
			require.Equal(t, ExitOK, code, stderr.String())
		case <-time.After(time.Minute):
			t.Fatal("the console did not stop")
		}
	}
}

// Settings that would expose passwords or cannot work are refused before
// anything listens (exit 2).
func TestConsoleCommandRefusals(t *testing.T) {
	s := testdb.New(t)
	for name, args := range map[string][]string{
		"non-loopback without TLS": {"console", "--listen", "0.0.0.0:0", "--database-url", s.URL},
		"half TLS":                 {"console", "--tls-cert", "c.pem", "--database-url", s.URL},
		"no database URL":          {"console"},
		"key=value URL":            {"console", "--database-url", "host=127.0.0.1 password=Sekr3t-kv"},
		"bad listen":               {"console", "--listen", "nope", "--database-url", s.URL},
		"zero idle timeout":        {"console", "--idle-timeout", "0s", "--database-url", s.URL},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr, func(string) string { return "" })
		require.Equal(t, ExitUsage, code, "%s: %s", name, stderr.String())
		require.Contains(t, stderr.String(), "code: ", name)
		require.NotContains(t, stderr.String(), "Sekr3t", name)
	}
}

// With --tls-cert and --tls-key the console serves HTTPS, may listen beyond
// loopback, and its cookies are Secure.
func TestConsoleCommandServesTLS(t *testing.T) {
	s := testdb.New(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "console-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &lineWriter{re: regexp.MustCompile(`on https://\S*:([0-9]+)/`), found: make(chan string, 1)}
	var stderr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"console", "--listen", "0.0.0.0:0", "--tls-cert", certFile, "--tls-key", keyFile, "--database-url", s.URL},
			out, &stderr, func(string) string { return "" })
	}()
	var port string
	select {
	case port = <-out.found:
	case code := <-done:
		t.Fatalf("console exited %d: %s", code, stderr.String())
	case <-time.After(time.Minute):
		t.Fatal("the console did not print its address")
	}
	pool := x509.NewCertPool()
	pool.AddCert(must(x509.ParseCertificate(der)))
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := client.Get("https://127.0.0.1:" + port + "/signin")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NotEmpty(t, resp.Header.Get("Strict-Transport-Security"))
	cookies := resp.Cookies()
	require.NotEmpty(t, cookies)
	for _, c := range cookies {
		require.True(t, c.Secure, c.Name)
		require.True(t, c.HttpOnly, c.Name)
	}
	cancel()
	select {
	case code := <-done:
		require.Equal(t, ExitOK, code, stderr.String())
	case <-time.After(time.Minute):
		t.Fatal("the console did not stop")
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
