#!/usr/bin/env bash
# Checks that the cluster scripts/install-and-start.sh started is up, with the postmaster it
# started (not one restarted since), and that its background worker runs a job end to end, as
# the README's quick start does. Used by .ci/run after the tests have run beside it.
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGPORT=${PGPORT:-5433}
PGDATA=${DURABLE_JOBS_PGDATA:-/var/lib/postgresql/durable_jobs}
bindir=$("$PG_CONFIG" --bindir)
as_postgres() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}
psql_first() { as_postgres "$bindir/psql" -h /var/run/postgresql -p "$PGPORT" -d postgres -qXAt -v ON_ERROR_STOP=1 "$@"; }

as_postgres "$bindir/pg_ctl" -D "$PGDATA" status >/dev/null
# A process that crashed makes the postmaster restart every process, and a library missing from
# its path fails new sessions: the log says so. Only what
# was logged since FIRST_LOG_OFFSET (bytes) counts.
if tail -c +"$(( ${FIRST_LOG_OFFSET:-0} + 1 ))" "$PGDATA/server.log" |
    grep -E "terminated by signal|was terminated|terminating any other active server processes|could not access file"; then
    echo "the first cluster lost a process while the tests ran (above, from $PGDATA/server.log)" >&2
    exit 1
fi
psql_first <<'SQL' >/dev/null
CREATE TABLE IF NOT EXISTS public.first_cluster_check (n integer);
CREATE OR REPLACE FUNCTION public.first_cluster_check(payload jsonb) RETURNS void LANGUAGE sql
    AS $$ INSERT INTO public.first_cluster_check VALUES ((payload->>'n')::integer) $$;
SELECT durable_jobs.register_durable_job_handler('first_cluster_check', 'public.first_cluster_check(jsonb)');
SQL
job_id=$(psql_first -c "SELECT durable_jobs.enqueue_durable_job('first_cluster_check', '{\"n\": 1}')")
state=$(psql_first -c "SELECT job_state FROM durable_jobs.wait_for_durable_job($job_id, NULL, 60)")
if [ "$state" != succeeded ]; then
    echo "the first cluster's worker did not run job $job_id (state: $state)" >&2
    exit 1
fi
echo "the first cluster is up and its worker ran job $job_id"
