// cancel_durable_job: states and ownership.

#[pg_test]
fn cancel_available_and_running_jobs() {
    let waiting = enqueue("k", r#"{"x": 1}"#);
    let running = enqueue("k", r#"{"x": 2}"#);
    Spi::run_with_args("UPDATE durable_jobs.durable_job SET priority = 1 WHERE job_id = $1", &[running.into()]).unwrap();
    let (claimed, token) = claim("w").unwrap();
    assert_eq!(claimed, running);
    for job_id in [waiting, running] {
        assert_eq!(
            Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[job_id.into()]),
            Ok(Some(true))
        );
        assert_eq!(job_state(job_id), "cancelled");
        assert_eq!(job_field::<bool>(job_id, "payload IS NULL AND lease_token IS NULL AND finished_at IS NOT NULL"), Some(true));
    }
    assert_eq!(complete(running, "w", token), "stale", "the cancelled job's holder is stale");
}

#[pg_test]
fn cancel_of_a_finished_or_missing_job_returns_false() {
    let job_id = enqueue("k", "{}");
    let (_, token) = claim("w").unwrap();
    complete(job_id, "w", token);
    let before = jobs_fingerprint();
    for id in [job_id, i64::MAX] {
        assert_eq!(
            Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[id.into()]),
            Ok(Some(false))
        );
    }
    assert_eq!(jobs_fingerprint(), before);
    assert_rejected("SELECT durable_jobs.cancel_durable_job(NULL)", "22004");
}

#[pg_test]
fn only_the_enqueuing_role_or_its_members_may_cancel() {
    Spi::run(
        "CREATE ROLE dj_test_owner; CREATE ROLE dj_test_stranger; CREATE ROLE dj_test_team;
         GRANT dj_test_owner TO dj_test_team;
         GRANT USAGE ON SCHEMA durable_jobs, tests TO dj_test_owner, dj_test_stranger, dj_test_team;
         GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                                   durable_jobs.cancel_durable_job(bigint)
             TO dj_test_owner, dj_test_stranger, dj_test_team;
         SET LOCAL ROLE dj_test_owner",
    )
    .unwrap();
    let first = enqueue("k", "{}");
    let second = enqueue("k", "{}");
    // To a stranger the job is not there: false, as for a missing job (42501 before 0.6.0, which
    // told the stranger the job existed).
    Spi::run("SET LOCAL ROLE dj_test_stranger").unwrap();
    assert_eq!(
        Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[first.into()]),
        Ok(Some(false))
    );
    assert_eq!(
        Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[i64::MAX.into()]),
        Ok(Some(false))
    );
    Spi::run("SET LOCAL ROLE dj_test_team").unwrap();
    assert_eq!(
        Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[first.into()]),
        Ok(Some(true))
    );
    Spi::run("SET LOCAL ROLE dj_test_owner").unwrap();
    assert_eq!(
        Spi::get_one_with_args::<bool>("SELECT durable_jobs.cancel_durable_job($1)", &[second.into()]),
        Ok(Some(true))
    );
    Spi::run("RESET ROLE").unwrap();
    assert_eq!(job_field::<String>(first, "enqueued_by::text").as_deref(), Some("dj_test_owner"));
    assert_eq!(job_state(first), "cancelled");
}
