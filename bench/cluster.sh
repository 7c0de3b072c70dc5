# Sourced by the benchmark scripts: a free loopback port for their throwaway cluster, PostgreSQL's
# programs run as the postgres user when the script runs as root, psql against the cluster, and
# the cluster stopped when the script exits. The script sets `bindir` (PostgreSQL's programs) and
# `work` (the cluster's directory, its data in `$work/data`) before sourcing it.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

as_postgres() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
psql_q() { as_postgres "$bindir/psql" -X -q -t -A -h 127.0.0.1 -p "$port" -d postgres -v ON_ERROR_STOP=1 "$@"; }
stop_cluster() { as_postgres "$bindir/pg_ctl" -D "$work/data" -m fast -w stop >/dev/null 2>&1 || true; }
trap stop_cluster EXIT
