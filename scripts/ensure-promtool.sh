#!/usr/bin/env bash
# Make sure promtool (Prometheus's rule checker) is on PATH and print its path
# on stdout (everything else goes to stderr). When it is missing and we are
# root on Debian/Ubuntu, install Debian's `prometheus` package, which ships
# promtool. Exit 3 (with the reason on stderr) when it cannot be had; the
# rules test then skips with a message naming promtool.
set -euo pipefail

log() { echo "ensure-promtool: $*" >&2; }

if p="$(command -v promtool 2>/dev/null)"; then echo "$p"; exit 0; fi

if [[ "$(id -u)" != "0" ]]; then
  log "promtool is not installed and we are not root: install Debian's 'prometheus' package (it ships promtool)"
  exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "promtool is not installed and there is no apt-get: install promtool (from the 'prometheus' package or release)"
  exit 3
fi
log "installing Debian's prometheus package for promtool"
export DEBIAN_FRONTEND=noninteractive
# The package's post-install starts no service where there is no init system;
# policy-rc.d keeps it from starting one where there is.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [[ ! -e "$policy" ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
fi
trap '[[ $made_policy == 1 ]] && rm -f "$policy"' EXIT
if ! apt-get install -y --no-install-recommends prometheus >&2; then
  apt-get update >&2 || true
  apt-get install -y --no-install-recommends prometheus >&2 || { log "apt-get install prometheus failed"; exit 3; }
fi
if p="$(command -v promtool 2>/dev/null)"; then echo "$p"; exit 0; fi
log "the prometheus package installed no promtool on PATH"
exit 3
