#!/usr/bin/env bash
# Installs the Debian packages behind the local services (`rtrl services up`): PostgreSQL, Redis,
# and Java 17 + Maven (the Kafka broker comes from Maven Central), when they are missing. With
# --test also what the tests need: Prometheus (its `promtool` checks infra/prometheus/rtrl.rules.yml)
# and Chromium (headless, opens the page `rtrl report` writes).
# Idempotent: nothing is installed when everything is present. As root it installs what is
# missing (one `apt-get update`, one `apt-get install`); otherwise it prints the one command to
# run and exits 1. `make demo` runs it, `make test` runs it with --test (CI through `make test`).
set -euo pipefail

for_tests=false
case "${1:-}" in
  --test) for_tests=true ;;
  "") ;;
  *) echo "usage: bash infra/system-deps.sh [--test]" >&2; exit 2 ;;
esac

missing=()
# postgresql: the server binaries live in /usr/lib/postgresql/<ver>/bin (not on PATH).
if ! compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null; then
  missing+=(postgresql)
fi
command -v redis-server >/dev/null || missing+=(redis-server)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
if $for_tests; then
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v chromium >/dev/null || missing+=(chromium)
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: missing ${missing[*]}; install them with:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi

echo "system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
# Debian starts the packaged services on their default ports; rtrl runs its own instances on its own
# ports and data dirs (and only `promtool` of the prometheus package is used: nothing may listen on
# 9090 that rtrl did not start), so stop the packaged ones where a service manager started them.
if command -v service >/dev/null; then
  for svc in postgresql redis-server prometheus; do
    service "$svc" stop >/dev/null 2>&1 || true
  done
fi
