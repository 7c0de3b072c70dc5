// prune_durable_jobs: which jobs it deletes, how many, who may call it, and bad input.

/// Jobs in every state; the finished ones end `days_ago` days back (oldest first by job_id).
/// Returns (succeeded, failed, cancelled, available, running) job ids.
fn jobs_in_every_state(days_ago: &[i32; 3]) -> [i64; 5] {
    let succeeded = enqueue("k", "{}");
    let failed = enqueue("k", "{}");
    let cancelled = enqueue("k", "{}");
    for (job_id, outcome) in [
        (succeeded, "complete_durable_job($1, $2, $3)"),
        (failed, "fail_durable_job($1, $2, $3, 'invalid_request')"),
    ] {
        let (claimed, token) = claim("w").expect("a job to claim");
        assert_eq!(claimed, job_id);
        fenced(outcome, job_id, "w", token);
    }
    Spi::run(&format!("SELECT durable_jobs.cancel_durable_job({cancelled})")).unwrap();
    for (job_id, days) in [succeeded, failed, cancelled].iter().zip(days_ago) {
        Spi::run(&format!(
            "UPDATE durable_jobs.durable_job SET finished_at = now() - interval '{days} days' WHERE job_id = {job_id}"
        ))
        .unwrap();
    }
    let available = enqueue("k", "{}");
    let running = enqueue("k", "{}");
    Spi::run(&format!(
        "UPDATE durable_jobs.durable_job SET run_after = now() + interval '1 hour' WHERE job_id = {available}"
    ))
    .unwrap();
    assert_eq!(claim("w").map(|(job, _)| job), Some(running));
    [succeeded, failed, cancelled, available, running]
}

fn remaining_jobs() -> Vec<i64> {
    Spi::get_one::<Vec<i64>>(
        "SELECT coalesce(array_agg(job_id ORDER BY job_id), '{}') FROM durable_jobs.durable_job",
    )
    .unwrap()
    .unwrap()
}

#[pg_test]
fn prune_deletes_finished_jobs_older_than_asked_oldest_first_up_to_max_jobs() {
    let [succeeded, failed, cancelled, available, running] = jobs_in_every_state(&[30, 20, 2]);
    assert_eq!(remaining_jobs(), vec![succeeded, failed, cancelled, available, running]);
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '10 days', 1)"), 1);
    assert_eq!(remaining_jobs(), vec![failed, cancelled, available, running], "the oldest goes first");
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '10 days')"), 1);
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '10 days')"), 0);
    assert_eq!(remaining_jobs(), vec![cancelled, available, running]);
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '0')"), 1);
    assert_eq!(remaining_jobs(), vec![available, running], "unfinished jobs are never pruned");
}

/// An interval is negative as PostgreSQL compares it, not when one of its fields is: '1 day -1
/// hour' is 23 hours. Broken before: refused with 22023.
#[pg_test]
fn prune_takes_an_interval_whose_fields_have_mixed_signs() {
    let [succeeded, _, _, available, running] = jobs_in_every_state(&[30, 1, 1]);
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '20 days -1 hour')"), 1);
    assert!(!remaining_jobs().contains(&succeeded));
    assert!(remaining_jobs().ends_with(&[available, running]));
}

#[pg_test]
fn prune_rejects_bad_input_and_deletes_nothing() {
    jobs_in_every_state(&[30, 30, 30]);
    for (statement, sqlstate) in [
        ("SELECT durable_jobs.prune_durable_jobs(NULL)", "22004"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '-1 second')", "22023"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '1 day -25 hours')", "22023"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '1 month -31 days')", "22023"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '300000 years')", "22008"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '1 day', NULL)", "22004"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '1 day', 0)", "22023"),
        ("SELECT durable_jobs.prune_durable_jobs(interval '1 day', 100001)", "22023"),
    ] {
        assert_rejected(statement, sqlstate);
    }
}

#[pg_test]
fn prune_needs_only_execute_and_is_not_granted_to_public() {
    jobs_in_every_state(&[30, 30, 30]);
    Spi::run(
        "CREATE ROLE dj_test_janitor; CREATE ROLE dj_test_nobody;
         GRANT USAGE ON SCHEMA durable_jobs, tests TO dj_test_janitor, dj_test_nobody;
         GRANT EXECUTE ON FUNCTION durable_jobs.prune_durable_jobs(interval, integer) TO dj_test_janitor;
         SET LOCAL ROLE dj_test_nobody",
    )
    .unwrap();
    // (As this role, only the function is reachable, not the table assert_rejected reads.)
    let refused = sqlstate_of("SELECT durable_jobs.prune_durable_jobs(interval '1 day')");
    assert_eq!(refused.as_deref(), Some("42501"));
    Spi::run("SET LOCAL ROLE dj_test_janitor").unwrap();
    assert_eq!(one::<i64>("SELECT durable_jobs.prune_durable_jobs(interval '1 day')"), 3);
    Spi::run("RESET ROLE").unwrap();
    assert_eq!(remaining_jobs().len(), 2);
}

#[pg_test]
fn pruning_reads_only_the_expired_part_of_the_finished_index() {
    serialize_tests_that_analyze();
    Spi::run(
        "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[5000]));
         UPDATE durable_jobs.durable_job SET job_state = 'cancelled';
         ANALYZE durable_jobs.durable_job",
    )
    .unwrap();
    let plan = Spi::explain_with_args(
        crate::jobs::retention::DELETE_FINISHED,
        &[pgrx::datum::Interval::from_days(7).into(), 1000i64.into()],
    )
    .unwrap();
    let plan = format!("{:?}", plan.0);
    assert!(plan.contains("durable_job_finished_idx"), "{plan}");
    assert!(
        plan.contains("\"Index Cond\": String(\"(finished_at <"),
        "a bounded range scan: {plan}"
    );
}
