// The job table's constraints and trigger, privileges and function declarations.

fn update_rejected(assignments: &str, job_id: i64, sqlstate: &str) {
    assert_table_refuses(
        &format!("UPDATE durable_jobs.durable_job SET {assignments} WHERE job_id = {job_id}"),
        sqlstate,
    );
}

#[pg_test]
fn constraints_make_bad_states_unrepresentable() {
    let job_id = enqueue("k", r#"{"p": 1}"#);
    // A running job needs the whole lease; other states hold none of it.
    update_rejected("job_state = 'running'", job_id, "23514");
    update_rejected("job_state = 'running', lease_owner = 'w', lease_token = gen_random_uuid()", job_id, "23514");
    update_rejected("lease_owner = 'w'", job_id, "23514");
    // Attempts never exceed the maximum; unknown states and codes are refused.
    update_rejected("attempt_count = max_attempts + 1", job_id, "23514");
    update_rejected("attempt_count = -1", job_id, "23514");
    update_rejected("job_state = 'paused'", job_id, "23514");
    update_rejected("last_failure_code = 'oops'", job_id, "23514");
    // A pending job keeps its payload.
    update_rejected("payload = NULL", job_id, "23514");
    update_rejected("priority = 5000", job_id, "23514");
    assert_table_refuses(
        "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, max_attempts, enqueued_by, idempotency_key)
         VALUES ('q', 'k', '{}', 1, current_user, 'key-without-fingerprint')",
        "23514",
    );
}

#[pg_test]
fn the_trigger_clears_the_payload_on_every_terminal_transition() {
    for state in ["succeeded", "failed", "cancelled"] {
        let job_id = enqueue("k", r#"{"secret": 1}"#);
        // Written directly, not through the API: the trigger still applies.
        Spi::run_with_args(
            "UPDATE durable_jobs.durable_job SET job_state = $2 WHERE job_id = $1",
            &[job_id.into(), state.into()],
        )
        .unwrap();
        assert_eq!(job_field::<bool>(job_id, "payload IS NULL AND finished_at IS NOT NULL"), Some(true), "{state}");
        // And a terminal job cannot be given a payload back.
        Spi::run_with_args("UPDATE durable_jobs.durable_job SET payload = '{\"x\": 1}' WHERE job_id = $1", &[job_id.into()])
            .unwrap();
        assert_eq!(job_field::<bool>(job_id, "payload IS NULL"), Some(true));
    }
    let inserted: i64 = one(
        "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, job_state, max_attempts, enqueued_by)
         VALUES ('q', 'k', '{\"secret\": 2}', 'succeeded', 1, current_user) RETURNING job_id",
    );
    assert_eq!(job_field::<bool>(inserted, "payload IS NULL"), Some(true));
}

#[pg_test]
fn public_can_use_nothing_after_create_extension() {
    Spi::run("CREATE ROLE dj_test_public_only").unwrap();
    let usable: i64 = one(
        "SELECT count(*) FROM (
             SELECT p.oid FROM pg_proc p
             WHERE p.pronamespace = 'durable_jobs'::regnamespace
               AND has_function_privilege('dj_test_public_only', p.oid, 'EXECUTE')
             UNION ALL
             SELECT c.oid FROM pg_class c
             WHERE c.relnamespace = 'durable_jobs'::regnamespace
               AND (has_table_privilege('dj_test_public_only', c.oid, 'SELECT, INSERT, UPDATE, DELETE')
                    OR (c.relkind = 'S' AND has_sequence_privilege('dj_test_public_only', c.oid, 'USAGE')))
         ) usable",
    );
    assert_eq!(usable, 0);
    assert!(!one::<bool>("SELECT has_schema_privilege('dj_test_public_only', 'durable_jobs', 'USAGE')"));
    // And the check itself can fail: a granted function shows up.
    Spi::run("GRANT EXECUTE ON FUNCTION durable_jobs.cancel_durable_job(bigint) TO dj_test_public_only").unwrap();
    assert!(one::<bool>(
        "SELECT has_function_privilege('dj_test_public_only', 'durable_jobs.cancel_durable_job(bigint)', 'EXECUTE')"
    ));
}

#[pg_test]
fn every_function_pins_search_path_and_declares_volatility() {
    let unpinned: Vec<String> = Spi::connect(|client| {
        client
            .select(
                "SELECT p.proname::text FROM pg_proc p
                 WHERE p.pronamespace = 'durable_jobs'::regnamespace
                   AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)
                 ORDER BY 1",
                None,
                &[],
            )
            .unwrap()
            .map(|row| row.get::<String>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(unpinned, Vec::<String>::new());
    let api_functions: i64 = one(
        "SELECT count(*) FROM pg_proc p
         WHERE p.pronamespace = 'durable_jobs'::regnamespace
           AND p.provolatile = 'v' AND p.proparallel = 'u' AND (NOT p.proisstrict OR p.pronargs = 0)
           AND NOT p.prosecdef
           AND p.proname IN ('enqueue_durable_job', 'enqueue_durable_jobs', 'claim_next_durable_job',
                             'complete_durable_job', 'fail_durable_job', 'extend_durable_job_lease',
                             'cancel_durable_job', 'register_durable_job_handler',
                             'unregister_durable_job_handler', 'durable_job_metrics',
                             'durable_job_metrics_prometheus', 'pause_durable_job_queue',
                             'resume_durable_job_queue', 'set_durable_job_queue_concurrency')",
    );
    assert_eq!(api_functions, 14);
}
