package testdb

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// LogicalURLEnv names a server with wal_level=logical to use instead of
// starting a throwaway cluster.
const LogicalURLEnv = "OUTBOX_TEST_LOGICAL_URL"

// Logical returns the connection URL of a PostgreSQL database whose server
// runs with wal_level=logical, for tests of logical replication.
//
// The shared test server runs with wal_level=replica and must never be
// restarted or reconfigured, so, in order:
//   - OUTBOX_TEST_LOGICAL_URL, when set, is used as is;
//   - the shared server (URL()) is used when it already has wal_level=logical;
//   - otherwise a throwaway cluster is created with initdb in a temporary
//     directory, started with pg_ctl on a free loopback port (trust auth,
//     wal_level=logical, fsync=off) and stopped with `pg_ctl stop -m
//     immediate` in t.Cleanup. Running as root, initdb and pg_ctl run as the
//     postgres OS user (PostgreSQL refuses root).
//
// The test is skipped, with the reason, only when none of these can give a
// logical-capable server (no initdb/pg_ctl installed, or running as root with
// no postgres user). A cluster that fails to start fails the test.
func Logical(t testing.TB) string {
	t.Helper()
	return LogicalCluster(t).URL
}

// Cluster is a logical-capable server for a test. Stop and Start control it
// when it is a throwaway cluster this process started; on a server given by
// OUTBOX_TEST_LOGICAL_URL or the shared server they are nil (Controllable
// reports which), because those must never be stopped.
type Cluster struct {
	URL string
	// Stop runs `pg_ctl stop -m <mode> -t <timeout>` and returns its error
	// (pg_ctl's output included), e.g. "server does not shut down".
	Stop func(mode string, timeout time.Duration) error
	// Start starts the stopped cluster again with the same settings, on the
	// same port.
	Start func() error
	// Exec runs SQL as the superuser on the cluster's postgres database
	// (ALTER SYSTEM, CHECKPOINT, pg_reload_conf).
	Exec func(query string) error
}

// Controllable reports whether Stop and Start may be used.
func (c *Cluster) Controllable() bool { return c.Stop != nil }

// LogicalCluster is Logical with control over a throwaway cluster (see
// Cluster). Tests that stop the server skip when it is not Controllable.
func LogicalCluster(t testing.TB) *Cluster {
	t.Helper()
	if v := os.Getenv(LogicalURLEnv); v != "" {
		return &Cluster{URL: v}
	}
	if walLevel(URL()) == "logical" {
		return &Cluster{URL: URL()}
	}
	return throwawayLogical(t, fmt.Sprintf("the server at %s has wal_level != logical (it must not be reconfigured), %s is unset, and", URL(), LogicalURLEnv))
}

// ControllableLogicalCluster is a throwaway logical-capable cluster
// (Throwaway with wal_level=logical), for tests that reconfigure, stop and
// restart their server: never the shared server, even when it runs with
// wal_level=logical. The test is skipped, with the reason, when
// OUTBOX_TEST_LOGICAL_URL is set (the caller chose a server that must not be
// stopped) or when no throwaway cluster can be started here.
func ControllableLogicalCluster(t testing.TB) *Cluster {
	t.Helper()
	if v := os.Getenv(LogicalURLEnv); v != "" {
		t.Skipf("this test reconfigures and stops its PostgreSQL server; the server %s names cannot be used (unset it)", LogicalURLEnv)
	}
	return throwawayLogical(t, "this test needs a throwaway cluster it may stop, and")
}

func throwawayLogical(t testing.TB, why string) *Cluster {
	t.Helper()
	c, err := Throwaway(t, "-c wal_level=logical -c max_replication_slots=10 -c max_wal_senders=10 -c max_connections=30 -c shared_buffers=16MB")
	if err != nil {
		t.Skipf("testdb: no logical-capable PostgreSQL: %s %v", why, err)
	}
	if lvl := walLevel(c.URL); lvl != "logical" {
		t.Fatalf("testdb: throwaway cluster at %s reports wal_level=%q", c.URL, lvl)
	}
	return c
}

// ErrNoThrowaway is what Throwaway returns (wrapped, with the reason) when
// no throwaway cluster can be started here: no initdb/pg_ctl, or running as
// root without a postgres OS user.
var ErrNoThrowaway = errors.New("no throwaway PostgreSQL cluster can be started here")

// Throwaway always starts a new PostgreSQL cluster for the test, whatever the
// shared server is: initdb into a temporary directory, pg_ctl start on a free
// loopback port (trust auth, fsync=off), `pg_ctl stop -m immediate` and the
// directory removed in t.Cleanup. settings are extra server options
// ("-c name=value ..."), after the defaults. The Cluster is Controllable:
// tests may stop and restart it (the shared server must never be).
//
// It returns an error wrapping ErrNoThrowaway, with the reason, when no
// cluster can be started here (the caller decides whether that skips
// anything); a cluster that fails to start fails the test.
func Throwaway(t testing.TB, settings ...string) (*Cluster, error) {
	t.Helper()
	bin := findPGBin()
	if bin == "" {
		return nil, fmt.Errorf("%w: no initdb/pg_ctl was found in %s, /usr/lib/postgresql/*/bin or PATH", ErrNoThrowaway, PGBinEnv)
	}
	cred, owner, err := runAs()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoThrowaway, err)
	}
	// Not t.TempDir(): its parent directory is private to the test user
	// (mode 0700), and the postgres OS user must be able to enter it.
	dir, err := os.MkdirTemp("", "outbox-logical-")
	if err != nil {
		t.Fatalf("testdb: temp dir: %v", err)
	}
	data, sock := filepath.Join(dir, "data"), filepath.Join(dir, "sock")
	if err := os.Mkdir(sock, 0o700); err != nil {
		t.Fatalf("testdb: socket dir: %v", err)
	}
	if owner != nil {
		for _, p := range []string{dir, sock} {
			if err := os.Chown(p, owner.uid, owner.gid); err != nil {
				t.Fatalf("testdb: chown %s to postgres: %v", p, err)
			}
		}
	}
	run := func(name string, args ...string) error {
		cmd := exec.Command(filepath.Join(bin, name), args...)
		cmd.Dir = dir
		cmd.Env = []string{"LC_ALL=C", "LANG=C", "PATH=" + os.Getenv("PATH"), "HOME=" + dir}
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if cred != nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		}
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %v: %w\n%s", name, args, err, out.String())
		}
		return nil
	}
	t.Cleanup(func() {
		_ = run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
		_ = os.RemoveAll(dir)
	})
	if err := run("initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"); err != nil {
		t.Fatalf("testdb: initdb: %v", err)
	}
	port, err := freePort()
	if err != nil {
		t.Fatalf("testdb: free port: %v", err)
	}
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off", port, sock)
	for _, s := range settings {
		opts += " " + s
	}
	start := func() error {
		if err := run("pg_ctl", "-D", data, "-l", filepath.Join(dir, "server.log"), "-w", "-t", "60", "-o", opts, "start"); err != nil {
			log, _ := os.ReadFile(filepath.Join(dir, "server.log"))
			return fmt.Errorf("%w\n%s", err, log)
		}
		return nil
	}
	if err := start(); err != nil {
		t.Fatalf("testdb: start throwaway cluster: %v", err)
	}
	u := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	return &Cluster{
		URL:   u,
		Start: start,
		Stop: func(mode string, timeout time.Duration) error {
			return run("pg_ctl", "-D", data, "-m", mode, "-w", "-t", strconv.Itoa(max(1, int(timeout.Seconds()))), "stop")
		},
		Exec: func(query string) error {
			db, err := sql.Open("postgres", u)
			if err != nil {
				return err
			}
			defer db.Close()
			_, err = db.Exec(query)
			return err
		},
	}, nil
}

// NewOn creates a fresh migrated schema on the server at base (for example
// the URL Logical returns), like New does on the shared server. The schema is
// dropped in t.Cleanup.
func NewOn(t testing.TB, base string) *Schema {
	t.Helper()
	admin, err := sql.Open("postgres", base)
	if err != nil {
		t.Fatalf("testdb: open %s: %v", base, err)
	}
	defer admin.Close()
	s := newSchema(t, admin, base)
	s.DB.SetMaxOpenConns(6)
	return s
}

// ReplicationURL returns u (a postgres:// URL) with replication=database, the
// form a logical replication connection needs.
func ReplicationURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return u + " replication=database"
	}
	q := p.Query()
	q.Set("replication", "database")
	p.RawQuery = q.Encode()
	return p.String()
}

func walLevel(u string) string {
	db, err := sql.Open("postgres", u)
	if err != nil {
		return ""
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var lvl string
	if err := db.QueryRowContext(ctx, "SHOW wal_level").Scan(&lvl); err != nil {
		return ""
	}
	return lvl
}

// PGBinEnv names the directory of the initdb and pg_ctl that throwaway
// clusters use, before any other (`make test-versions` points it at the
// binaries of the major under test).
const PGBinEnv = "OUTBOX_TEST_PG_BIN"

// findPGBin returns a directory holding both initdb and pg_ctl: the one
// OUTBOX_TEST_PG_BIN names, else the newest /usr/lib/postgresql/<major>/bin,
// then PATH.
func findPGBin() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return majorOf(dirs[i]) > majorOf(dirs[j]) })
	if d := os.Getenv(PGBinEnv); d != "" {
		dirs = append([]string{d}, dirs...)
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	}
	for _, d := range dirs {
		if isExec(filepath.Join(d, "initdb")) && isExec(filepath.Join(d, "pg_ctl")) {
			return d
		}
	}
	return ""
}

func majorOf(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

type ids struct{ uid, gid int }

// runAs returns the credential to run PostgreSQL binaries with: nil when the
// test does not run as root, the postgres OS user's when it does.
func runAs() (*syscall.Credential, *ids, error) {
	if os.Geteuid() != 0 {
		return nil, nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, nil, fmt.Errorf("running as root and there is no postgres OS user to run initdb as: %w", err)
	}
	uid, err1 := strconv.Atoi(u.Uid)
	gid, err2 := strconv.Atoi(u.Gid)
	if err1 != nil || err2 != nil {
		return nil, nil, fmt.Errorf("postgres OS user has non-numeric ids %q/%q", u.Uid, u.Gid)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, &ids{uid, gid}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
