#!/usr/bin/env bash
# Installs what fenceproxy's build, tests, demo and benchmark need on Debian 12, then
# downloads the Go modules (and builds the test Consul agent when that script exists, unless
# DEPS_CONSUL=0).
# Idempotent: when everything is present it only checks, in seconds, and needs no root.
#
# Installing postgresql-15 creates a system cluster (15/main) and pgbouncer a daemon on the
# default ports. The tests never use them (they start private servers on private ports), so
# this script keeps them from starting and stops them if they started anyway.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
packages=(
  postgresql-15 postgresql-client-15 # server binaries for tests; psql, pgbench
  postgresql-15-pgtap                # SQL tests of the fence schema
  libtap-parser-sourcehandler-pgtap-perl # pg_prove
  pgbouncer                          # comparison in the benchmark
  python3-psycopg2                   # a second driver in the tests
  python3-psycopg                    # psycopg 3, a driver in the tests
  libpostgresql-jdbc-java            # pgjdbc, a driver in the tests
  default-jdk-headless               # javac and java for the pgjdbc test program
  docker-compose                     # the demo's compose file
  prometheus                         # promtool checks the alert rules (its server is kept stopped)
  chromium                           # headless browser test of the status page
  zookeeper                          # ZooKeeper's jars: the lease store tests run a private server
  spin                               # model checker of model/fence.pml (make model, make test)
)

prog=deps
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

missing=()
for p in "${packages[@]}"; do
  if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  say "Debian packages: all ${#packages[@]} present"
else
  say "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d exit 101 = "action forbidden": invoke-rc.d and deb-systemd-invoke then
  # leave the services stopped. Only ours is removed afterwards.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
    trap 'as_root rm -f "$policy"' EXIT
  fi
  as_root apt-get update -qq
  as_root apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends "${missing[@]}"

  # Belt and braces for what the packages just set up: stop it and keep it from starting
  # at boot. Clusters and daemons that existed before this run are left alone.
  for p in "${missing[@]}"; do
    case "$p" in
    postgresql-15)
      if [ -f /etc/postgresql/15/main/start.conf ]; then
        as_root pg_ctlcluster 15 main stop 2>/dev/null || true
        echo manual | as_root tee /etc/postgresql/15/main/start.conf >/dev/null
        say "system cluster 15/main stopped, start.conf set to manual"
      fi
      ;;
    pgbouncer)
      if [ -d /run/systemd/system ]; then
        as_root systemctl disable --now pgbouncer >/dev/null 2>&1 || true
      else
        as_root service pgbouncer stop >/dev/null 2>&1 || true
      fi
      say "system pgbouncer stopped"
      ;;
    prometheus)
      if [ -d /run/systemd/system ]; then
        as_root systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
      else
        as_root service prometheus stop >/dev/null 2>&1 || true
      fi
      say "system prometheus stopped"
      ;;
    esac
  done
  say "installed ${#missing[@]} package(s)"
fi

# node-postgres for the driver tests (TestTransparencyMatrix): npm ci from the lockfile next to the test
# program; skipped when node_modules already matches the lockfile.
node_dir=internal/proxy/testdata/drivers/node
if cmp -s "$node_dir/package-lock.json" "$node_dir/node_modules/.deps-lock" 2>/dev/null; then
  say "node-postgres: present"
else
  if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    echo "deps: node and npm are not on PATH: install Node.js 20 with npm (the driver tests run node-postgres)" >&2
    exit 1
  fi
  (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$node_dir/package-lock.json" "$node_dir/node_modules/.deps-lock"
  say "node-postgres: installed with npm ci ($(node --version))"
fi

if ! command -v go >/dev/null; then
  echo "deps: go is not on PATH: install the Go version go.mod names" >&2
  exit 1
fi
go mod download
say "Go modules: downloaded ($(go version | cut -d' ' -f3))"

# DEPS_CONSUL=0 (make demo STORE=postgres): nothing needs Consul, so it is not built.
if [ "${DEPS_CONSUL:-1}" != 0 ] && [ -f scripts/build-consul.sh ]; then
  bash scripts/build-consul.sh
fi
say "done in $((SECONDS - started))s"
