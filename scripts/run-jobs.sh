#!/usr/bin/env bash
# Runs test jobs concurrently, at most JOBS at a time (default 2), and fails
# loudly when any fails. Each job is one argument "NAME=COMMAND" (run with
# bash -c, from the repository's root); jobs start in the order given, so
# give the longest first. A job's output goes to its own log and is printed
# whole when it ends, under a "== NAME" header with its result and time, so
# the outputs of concurrent jobs never interleave. At the end, the failed
# jobs are named again, after every log, and the exit status is 1.
#
#   scripts/run-jobs.sh "root=go test ./..." "cdcrelay=cd cdcrelay && go test ./..."
set -euo pipefail
cd "$(dirname "$0")/.."
max_jobs="${JOBS:-2}"
declare -A name_of start_of
logs="$(mktemp -d "${TMPDIR:-/tmp}/outbox-jobs.XXXXXX")"
trap 'rm -rf "$logs"' EXIT
# Interrupted: stop the jobs still running, each with its go test and test
# binaries (every job runs in a session of its own), then exit.
trap 'for p in "${!name_of[@]}"; do kill -- "-$p" 2>/dev/null || true; done; exit 130' INT TERM

failed=()
running=0

report() { # pid status
	local pid=$1 rc=$2 name took
	name="${name_of[$pid]}"
	took=$(($(date +%s) - start_of[$pid]))
	if [[ $rc -eq 0 ]]; then
		echo "== $name: ok (${took}s)"
	else
		echo "== $name: FAILED, exit status $rc (${took}s)"
		failed+=("$name")
	fi
	cat "$logs/$name.log"
	echo "== end of $name"
}

reap() { # waits for one job to end
	local pid rc=0
	wait -n -p pid || rc=$?
	report "$pid" "$rc"
	running=$((running - 1))
}

i=0
for job in "$@"; do
	name="${job%%=*}"
	cmd="${job#*=}"
	if [[ -z "$name" || "$name" == "$job" ]]; then
		echo "run-jobs: want NAME=COMMAND, got: $job" >&2
		exit 2
	fi
	i=$((i + 1))
	name="$(printf '%02d-%s' "$i" "${name//\//_}")"
	while ((running >= max_jobs)); do reap; done
	echo "== $name: started: $cmd"
	setsid bash -c "$cmd" >"$logs/$name.log" 2>&1 </dev/null &
	name_of[$!]="$name"
	start_of[$!]=$(date +%s)
	running=$((running + 1))
done
while ((running > 0)); do reap; done

if ((${#failed[@]} > 0)); then
	echo "FAILED jobs: ${failed[*]}"
	exit 1
fi
echo "all ${i} jobs passed"
