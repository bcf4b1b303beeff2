#!/usr/bin/env bash
# Make sure a Chromium the console's browser test can drive is installed and
# print its path on stdout (everything else goes to stderr). When it is
# missing and we are root with apt-get (Debian/Ubuntu), install Debian's
# `chromium` package. Exit 3 (with the reason on stderr) when it cannot be
# had; the browser test (cmd/outboxctl/internal/console, TestConsoleInABrowser)
# then skips with a message naming chromium.
set -euo pipefail

log() { echo "ensure-chromium: $*" >&2; }

find_chromium() {
  for c in "${OUTBOX_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
    if [[ -n "$c" && -x "$c" ]]; then echo "$c"; return 0; fi
  done
  return 1
}

if find_chromium; then exit 0; fi

if [[ "$(id -u)" != "0" ]]; then
  log "chromium is not installed and we are not root: install Debian's 'chromium' package (or set OUTBOX_CHROMIUM)"
  exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "chromium is not installed and there is no apt-get: install Chromium and set OUTBOX_CHROMIUM to it"
  exit 3
fi
log "installing Debian's chromium package"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends chromium >&2; then
  apt-get update >&2 || true
  apt-get install -y --no-install-recommends chromium >&2 || { log "apt-get install chromium failed"; exit 3; }
fi
if find_chromium; then exit 0; fi
log "the chromium package installed no /usr/bin/chromium"
exit 3
