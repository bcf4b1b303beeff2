package main

import (
	"context"
	"database/sql"
	"os"
	"strconv"
	"strings"
	"time"
)

// serverCPU reads the CPU time of a PostgreSQL server running on this
// machine: every process the postmaster started (backends, the WAL writer,
// the checkpointer, autovacuum), live or already exited, and the postmaster
// itself. A cell reads it before and after its drain: the difference is what
// relaying cost the database's machine, the other half of the relay's cost
// beside its own process's CPU. pid is the postmaster's; 0 (a server
// elsewhere, or /proc unreadable) gives 0.
type serverCPU struct{ postmaster int }

// newServerCPU finds the postmaster of db's server through one of its
// backends (its parent process), or returns a reader of 0 when the server
// does not run here.
func newServerCPU(ctx context.Context, db *sql.DB) serverCPU {
	var backend int
	if err := db.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return serverCPU{}
	}
	f, err := procStat(backend)
	if err != nil || len(f) < 2 {
		return serverCPU{}
	}
	pm, err := strconv.Atoi(f[1]) // ppid
	if err != nil {
		return serverCPU{}
	}
	if _, err := procStat(pm); err != nil {
		return serverCPU{}
	}
	return serverCPU{postmaster: pm}
}

// procStat returns the fields of /proc/<pid>/stat after the command name:
// [0] state, [1] ppid, ... [11] utime, [12] stime, [13] cutime, [14] cstime.
func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+1:]
	}
	return strings.Fields(s), nil
}

// clockTick is the unit of /proc's CPU times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

func ticks(f []string, from, to int) time.Duration {
	var t int64
	for i := from; i <= to && i < len(f); i++ {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		t += n
	}
	return time.Duration(t) * clockTick
}

// read returns the server's CPU time so far (0 when it is not here): the
// postmaster's own and its reaped children's (cutime, cstime), and every
// live child's. A child reaped between reading the postmaster and finding
// the child in /proc would be counted in neither (a drop of its whole CPU,
// which once made a cell's server CPU negative), so the postmaster is read
// again after the scan, and the reading is taken again while its reaped
// children's times moved meanwhile.
func (s serverCPU) read() time.Duration {
	if s.postmaster == 0 {
		return 0
	}
	var total time.Duration
	for range 10 {
		before, err := procStat(s.postmaster)
		if err != nil {
			return 0
		}
		children, ok := s.children()
		if !ok {
			return 0
		}
		after, err := procStat(s.postmaster)
		if err != nil {
			return 0
		}
		total = ticks(after, 11, 14) + children
		if ticks(before, 13, 14) == ticks(after, 13, 14) {
			break
		}
	}
	return total
}

// children is the CPU time of the postmaster's live children.
func (s serverCPU) children() (time.Duration, bool) {
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, false
	}
	var total time.Duration
	ppid := strconv.Itoa(s.postmaster)
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if f, err := procStat(pid); err == nil && len(f) > 12 && f[1] == ppid {
			total += ticks(f, 11, 12)
		}
	}
	return total, true
}
