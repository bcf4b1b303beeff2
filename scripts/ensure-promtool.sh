#!/usr/bin/env bash
# Print the path of promtool (Prometheus's rule checker), installing Debian's
# prometheus package first when it is missing and we are root. Exit 1 with a
# message on stderr when it cannot be had.
set -euo pipefail
if p="$(command -v promtool)"; then echo "$p"; exit 0; fi
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "ensure-promtool: installing Debian's prometheus package for promtool" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y prometheus >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y prometheus >&2; }
  if p="$(command -v promtool)"; then echo "$p"; exit 0; fi
fi
echo "ensure-promtool: promtool is not on PATH and cannot be installed here (needs root and apt-get)" >&2
exit 1
