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

/// Each C function behind a CHECK constraint or the trigger's WHEN (src/pg/constraints.rs) against
/// the SQL it stands for (that of 0.3.0 and the first 0.4.0 builds), over every combination of
/// telling values, NULLs included: a CHECK passes where its SQL is true or NULL, a WHEN fires
/// where it is true.
#[pg_test]
fn the_compiled_constraints_decide_as_their_sql() {
    let texts = "(VALUES (NULL::text), (''), ('available'), ('running'), ('succeeded'), ('failed'),
                         ('cancelled'), ('paused'), ('Running'), ('running '), ('lease_expired'),
                         ('target_rejected'), ('invalid_request'), ('integrity_violation'),
                         ('target_unavailable'), ('unexpected_failure'), ('oops'), ('P0001'),
                         ('4000'), ('400000'), ('éééé'))";
    let ints = "(VALUES (NULL::int4), (-1001), (-1000), (-1), (0), (1), (2), (999), (1000), (1001))";
    let payloads = "(VALUES (NULL::jsonb), ('{}'))";
    let times = "(VALUES (NULL::timestamptz), (now()))";
    let cases = [
        ("durable_job_state_known(a)", format!("{texts} a(a)"),
         "a IN ('available', 'running', 'succeeded', 'failed', 'cancelled')"),
        ("durable_job_names_not_empty(a, b)", format!("{texts} a(a), {texts} b(b)"), "a <> '' AND b <> ''"),
        ("durable_job_priority_range(a)", format!("{ints} a(a)"), "a BETWEEN -1000 AND 1000"),
        ("durable_job_attempts_within_max(m, c)", format!("{ints} m(m), {ints} c(c)"),
         "m BETWEEN 1 AND 1000 AND c BETWEEN 0 AND m"),
        ("durable_job_payload_only_while_pending(s, p)", format!("{texts} s(s), {payloads} p(p)"),
         "(s IN ('available', 'running')) = (p IS NOT NULL)"),
        ("durable_job_lease_only_while_running(s, o, k, e)",
         format!("{texts} s(s), (VALUES (NULL::text), ('w')) o(o),
                  (VALUES (NULL::uuid), (gen_random_uuid())) k(k), {times} e(e)"),
         "CASE WHEN s = 'running' THEN o IS NOT NULL AND k IS NOT NULL AND e IS NOT NULL
               ELSE o IS NULL AND k IS NULL AND e IS NULL END"),
        ("durable_job_finished_only_when_terminal(s, f)", format!("{texts} s(s), {times} f(f)"),
         "(s IN ('succeeded', 'failed', 'cancelled')) = (f IS NOT NULL)"),
        ("durable_job_failure_code_known(a)", format!("{texts} a(a)"),
         "a IS NULL OR a IN ('invalid_request', 'integrity_violation', 'target_rejected',
                            'target_unavailable', 'unexpected_failure', 'lease_expired')"),
        ("durable_job_status_fields_valid(v, r, q)",
         format!("(VALUES (NULL::int8), (-1), (0), (1), (2)) v(v), {ints} r(r), {texts} q(q)"),
         "v >= 1 AND r >= 0 AND (q IS NULL OR pg_catalog.octet_length(q) = 5)"),
    ];
    for (call, from, sql) in cases {
        check_compiled(&format!("durable_jobs.{call}"), &from, &format!("({sql}) IS NOT FALSE"));
    }
    check_compiled(
        "durable_jobs.durable_job_terminal_row_uncleared(s, p, f)",
        &format!("{texts} s(s), {payloads} p(p), {times} f(f)"),
        "(s IN ('succeeded', 'failed', 'cancelled') AND (p IS NOT NULL OR f IS NULL)) IS TRUE",
    );
}

/// `call` decides as `expected` on every row of `from`, and both ways on some.
fn check_compiled(call: &str, from: &str, expected: &str) {
    let (mismatches, passing, failing) = Spi::connect(|client| {
        let row = client
            .select(
                &format!(
                    "SELECT count(*) FILTER (WHERE ({call}) IS DISTINCT FROM ({expected})),
                            count(*) FILTER (WHERE ({expected})), count(*) FILTER (WHERE NOT ({expected}))
                     FROM {from}"
                ),
                None,
                &[],
            )
            .unwrap()
            .first();
        (row.get::<i64>(1).unwrap(), row.get::<i64>(2).unwrap(), row.get::<i64>(3).unwrap())
    });
    assert_eq!(mismatches, Some(0), "{call} against {expected}");
    assert!(passing > Some(0) && failing > Some(0), "{call}: {passing:?} true, {failing:?} false");
}

/// A value the row keeps out of line (TOAST) reaches a compiled constraint as a pointer, which
/// it reads through: a row with a long incompressible payload is updated, and still checked, and
/// an out-of-line SQLSTATE is read and refused. (A kind is indexed for claims, so no kind is
/// long enough to be kept out of line; the payload's check reads its value.)
#[pg_test]
fn the_compiled_constraints_read_values_stored_out_of_line() {
    let job_id: i64 = one(
        "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, max_attempts, enqueued_by)
         SELECT 'q', 'k', jsonb_build_object('blob', string_agg(md5(i::text), '')), 1, current_user
         FROM generate_series(1, 1000) i
         RETURNING job_id",
    );
    let toast: String =
        one("SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'durable_jobs.durable_job'::regclass");
    assert!(one::<i64>(&format!("SELECT count(*) FROM {toast}")) > 0, "stored out of line");
    Spi::run(&format!("UPDATE durable_jobs.durable_job SET priority = 1 WHERE job_id = {job_id}")).unwrap();
    update_rejected("priority = 5000", job_id, "23514");
    update_rejected("last_failure_sqlstate = repeat('x', 20000)", job_id, "23514");
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
                   AND p.proname <> ALL ($1)
                 ORDER BY 1",
                None,
                &[crate::pg::constraints::C_FUNCTIONS
                    .iter()
                    .chain(&crate::jobs::held_rows::C_FUNCTIONS)
                    .chain(&crate::jobs::slots::C_FUNCTIONS)
                    .chain(&crate::jobs::rates::C_FUNCTIONS)
                    .copied()
                    .collect::<Vec<_>>()
                    .into()],
            )
            .unwrap()
            .map(|row| row.get::<String>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(unpinned, Vec::<String>::new());
    // The compiled constraints run no SQL and look no name up: immutable C functions, no SET.
    let compiled: i64 = Spi::get_one_with_args(
        "SELECT count(*) FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = 'durable_jobs'::regnamespace AND p.proname = ANY ($1)
           AND l.lanname = 'c' AND p.provolatile = 'i' AND p.proconfig IS NULL AND NOT p.prosecdef",
        &[crate::pg::constraints::C_FUNCTIONS.to_vec().into()],
    )
    .unwrap()
    .unwrap();
    assert_eq!(compiled, crate::pg::constraints::C_FUNCTIONS.len() as i64);
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
