// Helpers shared by the suites (included into the `tests` schema module by src/lib.rs).


extension_sql!(
    r#"
    -- The SQLSTATE a statement raises, or NULL when it succeeds; its effects are rolled back.
    CREATE FUNCTION tests.sqlstate_of(statement text) RETURNS text
        LANGUAGE plpgsql AS $$
    BEGIN
        EXECUTE statement;
        RETURN NULL;
    EXCEPTION WHEN OTHERS THEN
        RETURN SQLSTATE;
    END
    $$;
    -- The last job_id this session drew (NULL: none yet). Neither rollbacks nor other sessions
    -- move it, unlike the sequence's position, which tests running beside this one move.
    CREATE FUNCTION tests.last_job_id_drawn() RETURNS bigint
        LANGUAGE plpgsql AS $$
    BEGIN
        RETURN pg_catalog.currval('durable_jobs.durable_job_job_id_seq');
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        RETURN NULL;
    END
    $$;
    "#,
    name = "test_support"
);

pub fn sqlstate_of(statement: &str) -> Option<String> {
    Spi::get_one_with_args::<String>("SELECT tests.sqlstate_of($1)", &[statement.into()])
        .expect("sqlstate_of")
}

/// Asserts that `statement` fails with `sqlstate` and leaves every job as it was. The failed
/// statement's subtransaction rolls back any row it wrote, so the digest alone cannot fail; the
/// last job_id this session drew, which no rollback moves back, shows whether it got as far as
/// an insert. Broken on purpose: the 0.4.0 enqueue, which tried its insert before looking the
/// key up, failed here for a key bound to another payload (and tests/security.rs likewise).
pub fn assert_rejected(statement: &str, sqlstate: &str) {
    let before = (jobs_fingerprint(), last_job_id_drawn());
    assert_eq!(sqlstate_of(statement).as_deref(), Some(sqlstate), "{statement}");
    assert_eq!(jobs_fingerprint(), before.0, "{statement} changed jobs");
    assert_eq!(last_job_id_drawn(), before.1, "{statement} drew a job_id");
}

/// For statements on the table itself, which draw their job_id before its constraints refuse
/// the row: only the SQLSTATE says anything (the rollback undoes the rest).
pub fn assert_table_refuses(statement: &str, sqlstate: &str) {
    assert_eq!(sqlstate_of(statement).as_deref(), Some(sqlstate), "{statement}");
}

pub fn last_job_id_drawn() -> Option<i64> {
    Spi::get_one::<i64>("SELECT tests.last_job_id_drawn()").expect("last_job_id_drawn")
}

/// A digest of every job row, to show that a rejected call changed nothing.
pub fn jobs_fingerprint() -> String {
    Spi::get_one::<String>(
        "SELECT md5(coalesce(string_agg(j::text, '|' ORDER BY job_id), ''))
         FROM durable_jobs.durable_job j",
    )
    .expect("fingerprint")
    .expect("fingerprint is not null")
}

pub fn one<T: pgrx::FromDatum + pgrx::IntoDatum>(query: &str) -> T {
    Spi::get_one::<T>(query).expect(query).expect("value is not NULL")
}

pub fn enqueue(job_kind: &str, payload: &str) -> i64 {
    Spi::get_one_with_args::<i64>(
        "SELECT durable_jobs.enqueue_durable_job($1, $2::jsonb)",
        &[job_kind.into(), payload.into()],
    )
    .expect("enqueue")
    .expect("job_id")
}

/// A claim as a worker would make it: (job_id, lease_token), or None when nothing is ready.
pub fn claim(worker_id: &str) -> Option<(i64, pgrx::Uuid)> {
    claimed(Spi::get_two_with_args::<i64, pgrx::Uuid>(
        "SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job($1)",
        &[worker_id.into()],
    ))
}

/// A claim restricted to one queue.
pub fn claim_from(queue: &str) -> Option<(i64, pgrx::Uuid)> {
    claimed(Spi::get_two_with_args::<i64, pgrx::Uuid>(
        "SELECT job_id, lease_token FROM durable_jobs.claim_next_durable_job('w', ARRAY[$1])",
        &[queue.into()],
    ))
}

/// A claim's row, None when it returned none; any other SPI error (a column of another type, a
/// missing one) fails the test instead of passing for "no job". (It was read as no job before.)
fn claimed(row: Result<(Option<i64>, Option<pgrx::Uuid>), pgrx::spi::SpiError>) -> Option<(i64, pgrx::Uuid)> {
    match row {
        Ok((job, token)) => Some((job.expect("a claimed job_id"), token.expect("a claimed lease_token"))),
        Err(pgrx::spi::SpiError::InvalidPosition) => None,
        Err(error) => panic!("the claim failed: {error}"),
    }
}

/// Calls complete or fail (`call` is the SQL call with $1 job_id, $2 worker_id, $3 lease_token).
pub fn fenced(call: &str, job_id: i64, worker_id: &str, lease_token: pgrx::Uuid) -> String {
    Spi::get_one_with_args::<String>(
        &format!("SELECT durable_jobs.{call}"),
        &[job_id.into(), worker_id.into(), lease_token.into()],
    )
    .expect(call)
    .expect("fenced call returns a word")
}

pub fn complete(job_id: i64, worker_id: &str, lease_token: pgrx::Uuid) -> String {
    fenced("complete_durable_job($1, $2, $3)", job_id, worker_id, lease_token)
}

pub fn fail(job_id: i64, worker_id: &str, lease_token: pgrx::Uuid, code: &str) -> String {
    fenced(&format!("fail_durable_job($1, $2, $3, '{code}')"), job_id, worker_id, lease_token)
}

/// One column of one job, e.g. `job_field::<String>(id, "job_state")`.
pub fn job_field<T: pgrx::FromDatum + pgrx::IntoDatum>(job_id: i64, column: &str) -> Option<T> {
    Spi::get_one_with_args::<T>(
        &format!("SELECT {column} FROM durable_jobs.durable_job WHERE job_id = $1"),
        &[job_id.into()],
    )
    .expect(column)
}

pub fn job_state(job_id: i64) -> String {
    job_field::<String>(job_id, "job_state").expect("job exists")
}

/// Makes a job's lease lapse now, as if its holder had stalled past the expiry.
pub fn expire_lease(job_id: i64) {
    Spi::run_with_args(
        "UPDATE durable_jobs.durable_job
         SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE job_id = $1",
        &[job_id.into()],
    )
    .expect("expire lease");
}

/// Taken first by every test that runs ANALYZE and then checks a plan: ANALYZE writes the
/// table's row count in place (not rolled back with the test), and one test's count planned
/// another's statement when they ran side by side.
pub fn serialize_tests_that_analyze() {
    Spi::run("SELECT pg_advisory_xact_lock(pg_catalog.hashtext('durable_jobs tests that analyze'))").unwrap();
}
