#!/usr/bin/env bash
# A throwaway PostgreSQL server for tests and CI, from Debian's packages.
#
#   scripts/postgres.sh start DIR   initdb into DIR, start a server, create database `dsec`;
#                                   prints exactly one line on stdout: the server's URL
#   scripts/postgres.sh stop DIR    fast shutdown, then remove DIR
#
# The server listens on 127.0.0.1 only, on a free port, with its unix socket inside DIR;
# authentication is `trust`, for local and 127.0.0.1 connections only (nothing else is
# accepted), so it is for tests on one machine, never a deployment. Durability is off
# (fsync, synchronous_commit) for speed: the data dies with DIR anyway.
#
# PostgreSQL refuses to run as root: as root, DIR is handed to the `postgres` OS user and
# every server command runs as that user; the user must be able to traverse DIR's parents
# (a directory from `mktemp -d` under /tmp is fine). As any other user, they run as that user.
#
# PG_BIN selects the binaries (default: the newest /usr/lib/postgresql/*/bin).
set -euo pipefail

usage() {
  echo "usage: $0 start DIR | stop DIR" >&2
  exit 2
}
[ $# -eq 2 ] || usage
cmd=$1
dir=$2
MARKER=.dsec-postgres

pg_bin() {
  if [ -n "${PG_BIN:-}" ]; then
    echo "$PG_BIN"
    return
  fi
  local newest
  newest=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$newest" ] || {
    echo "postgres.sh: no PostgreSQL binaries in /usr/lib/postgresql (apt-get install postgresql)" >&2
    exit 1
  }
  echo "$newest"
}

# Runs a server command as the user that owns the cluster.
as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

stop_server() {
  local bin
  bin=$(pg_bin)
  if [ -f "$dir/data/postmaster.pid" ]; then
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null 2>&1 ||
      as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w -t 10 stop >/dev/null 2>&1 || true
  fi
}

case "$cmd" in
start)
  bin=$(pg_bin)
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [ -n "$(ls -A "$dir")" ]; then
    echo "postgres.sh: $dir is not empty" >&2
    exit 1
  fi
  touch "$dir/$MARKER"
  # Unix socket paths are limited to 107 bytes.
  if [ ${#dir} -gt 80 ]; then
    echo "postgres.sh: $dir is too long for the server's unix socket; use a shorter path" >&2
    exit 1
  fi
  [ "$(id -u)" -ne 0 ] || chown postgres: "$dir"
  fail() {
    echo "postgres.sh: $1" >&2
    for log in "$dir/initdb.log" "$dir/server.log"; do
      [ -f "$log" ] && tail -n 30 "$log" >&2
    done
    stop_server
    exit 1
  }
  as_owner "$bin/initdb" -D "$dir/data" -U dsec --auth=trust --encoding=UTF8 --no-locale \
    --no-sync >"$dir/initdb.log" 2>&1 || fail "initdb failed"
  # Only local and 127.0.0.1 connections, and nothing else.
  printf '%s\n' \
    'local all all trust' \
    'host  all all 127.0.0.1/32 trust' >"$dir/data/pg_hba.conf"
  for attempt in $(seq 1 20); do
    port=$((20000 + RANDOM % 40000))
    port_free "$port" || continue
    cat >"$dir/data/postgresql.auto.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
EOF
    if as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 start >/dev/null 2>&1; then
      as_owner "$bin/createdb" -h "$dir" -p "$port" -U dsec dsec >>"$dir/server.log" 2>&1 ||
        fail "createdb failed"
      echo "postgresql://dsec@127.0.0.1:$port/dsec"
      exit 0
    fi
    # Another process took the port between the check and the bind: try another.
    [ "$attempt" -lt 20 ] || fail "the server did not start"
  done
  fail "the server did not start"
  ;;
stop)
  [ -d "$dir" ] || exit 0
  if [ ! -f "$dir/$MARKER" ]; then
    echo "postgres.sh: $dir was not made by 'postgres.sh start'; not removing it" >&2
    exit 1
  fi
  stop_server
  rm -rf "$dir"
  ;;
*)
  usage
  ;;
esac
