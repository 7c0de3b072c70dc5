#!/usr/bin/env bash
# The background worker's batched drain of this tree beside a previous release, in one run:
# both are built as release packages, then installed in turn, each round on a fresh cluster
# with the same settings, so that the two share the machine's state of the moment. Prints each
# round and the ratio of the medians (this tree / the release). Never passes or fails on speed.
#   bench/against_release.sh [ref]   ref: a tag or commit of a release (default v0.5.0)
#   ROUNDS (default 3), DRAIN_JOBS (default 20000): jobs per drain, BATCH (default 50).
# Two drains per round: every job succeeds; and a tenth of the jobs fail (invalid_request, which
# since 0.6.0 writes an attempt with its error message). Installs over the extension installed
# now: reinstall the build you want afterwards (scripts/install-extension.sh). Do not run it
# beside tests or another benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."

ref=${1:-v0.5.0}
ROUNDS=${ROUNDS:-3}
DRAIN_JOBS=${DRAIN_JOBS:-20000}
BATCH=${BATCH:-50}
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
bindir=$("$PG_CONFIG" --bindir)
work=/var/tmp/durable_jobs_against_release
source bench/cluster.sh
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)

mkdir -p "$work"
[ "$(id -u)" -ne 0 ] || chown postgres: "$work"

# A release package of `tree` in `out`, built in `target` (the release's its own, kept between
# runs; this tree's its usual one).
package() {  # $1 tree, $2 out, $3 target directory
    rm -rf "$2"
    (cd "$1" && CARGO_TARGET_DIR="$3" cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$2" >/dev/null)
    # The kept install scripts of released versions, as scripts/install-extension.sh adds them.
    local extension_dir
    extension_dir=$("$PG_CONFIG" --sharedir)/extension
    for script in "$1"/sql/durable_jobs--*.sql; do
        case "$(basename "$script")" in *--*--*) continue ;; esac
        [ -e "$2$extension_dir/$(basename "$script")" ] || install -D -m 644 "$script" "$2$extension_dir/$(basename "$script")"
    done
}
install_package() {  # $1 package directory
    (cd "$1" && find . -type f) | while read -r file; do
        "${as_root[@]}" install -D -m 644 "$1${file#.}" "${file#.}"
    done
}

echo "building $ref and this tree (release)"
rm -rf "$work/release-tree"
git worktree remove --force "$work/release-tree" >/dev/null 2>&1 || true
git worktree add --detach "$work/release-tree" "$ref" >/dev/null
package "$work/release-tree" "$work/release" "$work/target-release"
package "$PWD" "$work/current" "$PWD/target"
git worktree remove --force "$work/release-tree"

drain() {  # $1 fail every Nth job (0: none) -> jobs/s
    psql_q -c "ALTER SYSTEM SET durable_jobs.worker_enabled = off" -c "SELECT pg_reload_conf()" >/dev/null
    psql_q -c "TRUNCATE durable_jobs.durable_job" \
        -c "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('bench',
                ARRAY(SELECT jsonb_build_object('fail', $1 > 0 AND n % GREATEST($1, 1) = 0)
                      FROM generate_series(1, $DRAIN_JOBS) n))" \
        -c "VACUUM ANALYZE durable_jobs.durable_job" >/dev/null
    local start end
    start=$(date +%s.%N)
    psql_q -c "ALTER SYSTEM SET durable_jobs.worker_enabled = on" -c "SELECT pg_reload_conf()" >/dev/null
    until [ "$(psql_q -c "SELECT count(*) FROM durable_jobs.durable_job WHERE finished_at IS NULL")" = 0 ]; do
        sleep 0.05
    done
    end=$(date +%s.%N)
    python3 -c "print(f'{$DRAIN_JOBS / ($end - $start):.0f}')"
}

round() {  # $1 package -> "succeeding failing"
    install_package "$1"
    stop_cluster
    rm -rf "$work/data"
    as_postgres "$bindir/initdb" -D "$work/data" --auth=trust -U postgres >/dev/null
    cat <<CONF | as_postgres tee -a "$work/data/postgresql.conf" >/dev/null
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$work'
shared_buffers = '256MB'
shared_preload_libraries = 'durable_jobs'
durable_jobs.worker_count = 1
durable_jobs.claim_batch_size = $BATCH
durable_jobs.poll_interval = '1s'
autovacuum_naptime = '5s'
CONF
    as_postgres "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null
    psql_q >/dev/null <<'SQL'
CREATE EXTENSION durable_jobs;
CREATE FUNCTION public.bench(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF (payload->>'fail')::boolean THEN
        RAISE EXCEPTION 'job % refused', payload USING ERRCODE = 'data_exception';
    END IF;
END $$;
SELECT durable_jobs.register_durable_job_handler('bench', 'public.bench(jsonb)');
SQL
    echo "$(drain 0) $(drain 10)"
    stop_cluster
}

printf '%-8s %-10s %14s %14s\n' round build "all succeed" "a tenth fail"
declare -a release_ok release_fail current_ok current_fail
for r in $(seq 1 "$ROUNDS"); do
    read -r ok fail <<<"$(round "$work/release")"
    release_ok+=("$ok"); release_fail+=("$fail")
    printf '%-8s %-10s %14s %14s\n' "$r" "$ref" "$ok" "$fail"
    read -r ok fail <<<"$(round "$work/current")"
    current_ok+=("$ok"); current_fail+=("$fail")
    printf '%-8s %-10s %14s %14s\n' "$r" "this tree" "$ok" "$fail"
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}x')" "$1" "$2"; }
echo
printf '%-34s %10s %10s %8s\n' "median jobs/s, batch $BATCH, 1 worker" "$ref" "this tree" ratio
for kind in ok fail; do
    declare -n rel="release_$kind" cur="current_$kind"
    label=$([ "$kind" = ok ] && echo "all succeed" || echo "a tenth fail")
    a=$(median "${rel[@]}"); b=$(median "${cur[@]}")
    printf '%-34s %10s %10s %8s\n' "$label" "$a" "$b" "$(ratio "$b" "$a")"
    unset -n rel cur
done
