// claim, complete, fail, extend: the fenced lease state machine.

#[pg_test]
fn claim_on_an_empty_queue_returns_no_row() {
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.claim_next_durable_job('w')"), 0);
}

#[pg_test]
fn claim_takes_priority_then_run_after_then_job_id() {
    let enqueue_at = |priority: i32, seconds_ago: i32| -> i64 {
        Spi::get_one_with_args::<i64>(
            "SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default',
                    now() - make_interval(secs => $2), NULL, $1)",
            &[priority.into(), seconds_ago.into()],
        )
        .unwrap()
        .unwrap()
    };
    let low_old = enqueue_at(0, 100);
    let high_new = enqueue_at(5, 1);
    let high_old = enqueue_at(5, 50);
    let high_old_twin = enqueue_at(5, 50);
    let order: Vec<i64> = (0..4).map(|_| claim("w").unwrap().0).collect();
    assert_eq!(order, vec![high_old, high_old_twin, high_new, low_old]);
    assert!(claim("w").is_none());
}

#[pg_test]
fn claim_skips_future_jobs_and_other_queues() {
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now() + interval '1 minute')")
        .unwrap();
    let other: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'other')");
    assert_eq!(
        one::<i64>("SELECT count(*) FROM durable_jobs.claim_next_durable_job('w', ARRAY['default'])"),
        0
    );
    let claimed: i64 = one("SELECT job_id FROM durable_jobs.claim_next_durable_job('w', ARRAY['x', 'other'])");
    assert_eq!(claimed, other);
}

#[pg_test]
fn claim_takes_only_the_kinds_asked_for() {
    let mail: i64 = one("SELECT durable_jobs.enqueue_durable_job('mail', '{}')");
    let resize: i64 = one("SELECT durable_jobs.enqueue_durable_job('resize', '{}', priority => 10)");
    // The best job is a resize; a worker that handles mail only never sees it.
    assert_eq!(one::<i64>("SELECT job_id FROM durable_jobs.claim_next_durable_job('w', job_kinds => ARRAY['mail'])"), mail);
    assert_eq!(
        one::<i64>("SELECT count(*) FROM durable_jobs.claim_next_durable_job('w', NULL, NULL, ARRAY['mail', 'sms'])"),
        0
    );
    assert_eq!(one::<String>(&format!("SELECT job_state FROM durable_jobs.durable_job WHERE job_id = {resize}")), "available");
    // NULL: any kind, as the three-argument call always did.
    assert_eq!(one::<i64>("SELECT job_id FROM durable_jobs.claim_next_durable_job('w', NULL, NULL, NULL)"), resize);
}

#[pg_test]
fn claim_returns_and_records_the_lease() {
    let job_id = enqueue("resize", r#"{"image": 3}"#);
    // The claim's own row, compared with the table in a later statement (a statement does not
    // see the writes of functions it calls).
    Spi::run("CREATE TEMP TABLE claimed AS SELECT * FROM durable_jobs.claim_next_durable_job('worker-9')")
        .unwrap();
    let row = Spi::get_one::<bool>(
        "SELECT c.job_id = j.job_id AND c.lease_token = j.lease_token
                AND c.lease_expires_at = j.lease_expires_at AND c.job_kind = 'resize'
                AND c.payload = '{\"image\": 3}' AND c.attempt_count = 1 AND c.max_attempts = 5
                AND j.job_state = 'running' AND j.lease_owner = 'worker-9'
                AND j.lease_expires_at BETWEEN clock_timestamp() + interval '59 seconds'
                                           AND clock_timestamp() + interval '60 seconds'
         FROM claimed c JOIN durable_jobs.durable_job j USING (job_id)",
    );
    assert_eq!(row, Ok(Some(true)));
    assert_eq!(job_field::<i32>(job_id, "attempt_count"), Some(1));
}

#[pg_test]
fn lease_length_follows_the_settings_and_bounds() {
    enqueue("k", "{}");
    enqueue("k", "{}");
    Spi::run("SET LOCAL durable_jobs.lease_duration = 10").unwrap();
    // Both bounds: a lease of the default's length, not merely one no longer than it.
    let short: bool = one(
        "SELECT lease_expires_at BETWEEN clock_timestamp() + interval '9.5 seconds'
                                     AND clock_timestamp() + interval '10 seconds'
         FROM durable_jobs.claim_next_durable_job('w')",
    );
    assert!(short);
    // The default never exceeds the maximum, which it then is.
    Spi::run("SET LOCAL durable_jobs.lease_duration = 100; SET LOCAL durable_jobs.max_lease_duration = 5")
        .unwrap();
    let capped: bool = one(
        "SELECT lease_expires_at BETWEEN clock_timestamp() + interval '4.5 seconds'
                                     AND clock_timestamp() + interval '5 seconds'
         FROM durable_jobs.claim_next_durable_job('w')",
    );
    assert!(capped);
    assert_rejected("SELECT * FROM durable_jobs.claim_next_durable_job('w', NULL, 6)", "22023");
}

#[pg_test]
fn claim_rejects_bad_input() {
    enqueue("k", "{}");
    for (arguments, sqlstate) in [
        ("NULL", "22004"),
        ("''", "22023"),
        ("'bad worker'", "22023"),
        ("'w', ARRAY[]::text[]", "22023"),
        ("'w', ARRAY['default', NULL]", "22004"),
        ("'w', ARRAY['no spaces please']", "22023"),
        ("'w', NULL, 0", "22023"),
        ("'w', NULL, -5", "22023"),
        ("'w', NULL, 3601", "22023"),
        ("'w', NULL, NULL, ARRAY[]::text[]", "22023"),
        ("'w', NULL, NULL, ARRAY['mail', NULL]", "22004"),
        ("'w', NULL, NULL, ARRAY['no spaces please']", "22023"),
    ] {
        assert_rejected(&format!("SELECT * FROM durable_jobs.claim_next_durable_job({arguments})"), sqlstate);
    }
}

#[pg_test]
fn lease_tokens_are_distinct_version_4_uuids_across_refills_of_the_pool() {
    // 600 tokens draw 9,600 bytes: more than two refills of the 4 KiB pool.
    Spi::run("SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[600]))")
        .unwrap();
    Spi::run(
        "CREATE TEMP TABLE tokens AS
         SELECT c.lease_token FROM generate_series(1, 600) AS g(n),
              LATERAL durable_jobs.claim_next_durable_job('w-' || g.n) c",
    )
    .unwrap();
    let checks = Spi::get_three::<i64, i64, i64>(
        "SELECT count(*), count(DISTINCT lease_token),
                count(*) FILTER (WHERE substr(lease_token::text, 15, 1) = '4'
                                   AND substr(lease_token::text, 20, 1) IN ('8', '9', 'a', 'b'))
         FROM tokens",
    );
    assert_eq!(checks, Ok((Some(600), Some(600), Some(600))));
    // No token repeats a stretch of another's bytes (a pool handed out twice would).
    let halves = one::<i64>(
        "SELECT count(DISTINCT substr(lease_token::text, 25, 12)) FROM tokens",
    );
    assert_eq!(halves, 600);
}

#[pg_test]
fn an_expired_lease_is_reclaimed_with_a_new_token() {
    let job_id = enqueue("k", "{}");
    let (_, first_token) = claim("w1").unwrap();
    assert!(claim("w2").is_none(), "a live lease is not reclaimed");
    expire_lease(job_id);
    let (again, second_token) = claim("w2").unwrap();
    assert_eq!(again, job_id);
    assert_ne!(first_token, second_token);
    assert_eq!(job_field::<i32>(job_id, "attempt_count"), Some(2));
    assert_eq!(job_field::<String>(job_id, "lease_owner").as_deref(), Some("w2"));
    assert_eq!(complete(job_id, "w1", first_token), "stale");
    assert_eq!(complete(job_id, "w2", second_token), "succeeded");
}

#[pg_test]
fn an_expired_lease_without_attempts_left_fails_as_lease_expired() {
    let job_id: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now(), 1)");
    let waiting = enqueue("k", "{}");
    claim("w1").unwrap();
    expire_lease(job_id);
    let (next, _) = claim("w2").unwrap();
    assert_eq!(next, waiting, "the exhausted job is not claimed again");
    assert_eq!(job_state(job_id), "failed");
    assert_eq!(job_field::<String>(job_id, "last_failure_code").as_deref(), Some("lease_expired"));
    assert_eq!(job_field::<bool>(job_id, "payload IS NULL AND lease_token IS NULL AND finished_at IS NOT NULL"), Some(true));
}

#[pg_test]
fn complete_marks_succeeded_and_clears_payload_and_lease() {
    let job_id = enqueue("k", r#"{"secret": "x"}"#);
    let (_, token) = claim("w").unwrap();
    assert_eq!(complete(job_id, "w", token), "succeeded");
    assert_eq!(job_state(job_id), "succeeded");
    assert_eq!(
        job_field::<bool>(job_id, "payload IS NULL AND lease_owner IS NULL AND lease_token IS NULL
                                   AND lease_expires_at IS NULL AND finished_at IS NOT NULL"),
        Some(true)
    );
    assert_eq!(complete(job_id, "w", token), "stale", "a second completion is stale");
}

#[pg_test]
fn complete_is_fenced_on_owner_token_and_expiry() {
    let job_id = enqueue("k", "{}");
    let (_, token) = claim("w").unwrap();
    let before = jobs_fingerprint();
    let other_token = one::<pgrx::Uuid>("SELECT gen_random_uuid()");
    assert_eq!(complete(job_id, "someone-else", token), "stale");
    assert_eq!(complete(job_id, "w", other_token), "stale");
    assert_eq!(complete(job_id + 1000, "w", token), "stale");
    assert_eq!(fail(job_id, "someone-else", token, "invalid_request"), "stale");
    assert_eq!(jobs_fingerprint(), before, "stale calls change nothing");
    expire_lease(job_id);
    let expired = jobs_fingerprint();
    assert_eq!(complete(job_id, "w", token), "stale");
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "stale");
    assert_eq!(jobs_fingerprint(), expired);
}

/// The background worker's completion of a batch matches only the exact live leases, column by
/// column, as the SQL API's completion does, whether it waits for a held row or skips it.
/// Broken on purpose: dropping the token from COMPLETE_BATCH's fence completed the job for a
/// stale token (1 row, not 0).
#[pg_test]
fn the_workers_batch_completion_is_fenced_on_owner_token_and_expiry() {
    for skip_held in [false, true] {
        let complete_jobs = |leases: &[(i64, pgrx::Uuid)], owner: &str| {
            crate::jobs::lease::complete_jobs(leases, owner, skip_held).len()
        };
        let job_id = enqueue("k", "{}");
        let (claimed, token) = claim("w").unwrap();
        assert_eq!(claimed, job_id);
        let other_token = one::<pgrx::Uuid>("SELECT gen_random_uuid()");
        let before = jobs_fingerprint();
        for (id, owner, lease_token) in [(job_id, "someone-else", token), (job_id, "w", other_token), (job_id + 1000, "w", token)] {
            assert_eq!(complete_jobs(&[(id, lease_token)], owner), 0, "{id} {owner} {lease_token} {skip_held}");
        }
        assert_eq!(jobs_fingerprint(), before, "stale calls change nothing");
        expire_lease(job_id);
        let expired = jobs_fingerprint();
        assert_eq!(complete_jobs(&[(job_id, token)], "w"), 0);
        assert_eq!(jobs_fingerprint(), expired);
        // Of two live leases, the one given exactly (the expired job out of the way of the claims).
        assert!(one::<bool>(&format!("SELECT durable_jobs.cancel_durable_job({job_id})")));
        let (first, second) = (enqueue("k", "{}"), enqueue("k", "{}"));
        let (claimed_first, first_token) = claim("w").unwrap();
        let (claimed_second, second_token) = claim("w").unwrap();
        assert_eq!((claimed_first, claimed_second), (first, second));
        assert_eq!(complete_jobs(&[(first, first_token), (second, other_token)], "w"), 1);
        assert_eq!((job_state(first), job_state(second)), ("succeeded".to_string(), "running".to_string()));
        assert_eq!(complete_jobs(&[(second, second_token)], "w"), 1);
    }
}

#[pg_test]
fn a_transient_failure_is_retried_with_backoff() {
    let job_id = enqueue("k", r#"{"keep": "me"}"#);
    let (_, token) = claim("w").unwrap();
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "retried");
    assert_eq!(job_state(job_id), "available");
    // First retry: base delay 1 s with jitter in [0.5, 1), from the failure's own clock
    // (run_after and updated_at come from one UPDATE; a later statement's clock left 0.1 s of
    // slack before).
    assert_eq!(
        job_field::<bool>(job_id, "run_after - updated_at BETWEEN interval '0.499 seconds' AND interval '1 second'
                                   AND payload = '{\"keep\": \"me\"}' AND lease_token IS NULL
                                   AND finished_at IS NULL AND last_failure_code = 'target_unavailable'"),
        Some(true)
    );
    // Its backoff runs by the clock (a claim compares run_after with clock_timestamp()); also
    // claimed across transactions in tests/multi_connection.rs
    // (`a_retried_job_is_claimable_only_after_its_backoff`).
    assert!(claim("w").is_none());
}

#[pg_test]
fn backoff_doubles_per_attempt_up_to_the_maximum() {
    Spi::run("SET LOCAL durable_jobs.retry_base_delay = '10s'; SET LOCAL durable_jobs.retry_max_delay = '25s'")
        .unwrap();
    let job_id: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now(), 10)");
    let mut delays = Vec::new();
    for _ in 0..3 {
        Spi::run_with_args("UPDATE durable_jobs.durable_job SET run_after = now() WHERE job_id = $1", &[job_id.into()])
            .unwrap();
        let (_, token) = claim("w").unwrap();
        assert_eq!(fail(job_id, "w", token, "unexpected_failure"), "retried");
        delays.push(job_field::<f64>(job_id, "extract(epoch FROM run_after - updated_at)::float8").unwrap());
    }
    // 10 s, 20 s, then capped at 25 s, each times a jitter factor in [0.5, 1), from the failure's
    // own clock (run_after and updated_at come from one UPDATE).
    assert!((4.9..10.0).contains(&delays[0]), "{delays:?}");
    assert!((9.9..20.0).contains(&delays[1]), "{delays:?}");
    assert!((12.4..25.0).contains(&delays[2]), "{delays:?}");
}

#[pg_test]
fn the_last_attempt_fails_terminally_even_when_retryable() {
    let job_id: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{\"p\": 1}', NULL, 'default', now(), 1)");
    let (_, token) = claim("w").unwrap();
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "failed");
    assert_eq!(job_state(job_id), "failed");
    assert_eq!(job_field::<bool>(job_id, "payload IS NULL AND finished_at IS NOT NULL"), Some(true));
}

#[pg_test]
fn terminal_codes_fail_at_once() {
    for code in ["invalid_request", "integrity_violation", "target_rejected"] {
        let job_id = enqueue("k", "{}");
        let (_, token) = claim("w").unwrap();
        assert_eq!(fail(job_id, "w", token, code), "failed", "{code}");
        assert_eq!(job_field::<String>(job_id, "last_failure_code").as_deref(), Some(code));
        assert_eq!(job_field::<i32>(job_id, "attempt_count"), Some(1));
    }
}

#[pg_test]
fn fail_rejects_bad_input() {
    let job_id = enqueue("k", "{}");
    let (_, token) = claim("w").unwrap();
    for (code, sqlstate) in [
        ("NULL", "22004"),
        ("'no_such_code'", "22023"),
        ("''", "22023"),
        ("'lease_expired'", "22023"),
        ("'TARGET_UNAVAILABLE'", "22023"),
    ] {
        assert_rejected(
            &format!("SELECT durable_jobs.fail_durable_job({job_id}, 'w', '{token}', {code})"),
            sqlstate,
        );
    }
    for arguments in [format!("NULL, 'w', '{token}'"), format!("{job_id}, NULL, '{token}'"), format!("{job_id}, 'w', NULL")] {
        assert_rejected(&format!("SELECT durable_jobs.complete_durable_job({arguments})"), "22004");
        assert_rejected(&format!("SELECT durable_jobs.fail_durable_job({arguments}, 'invalid_request')"), "22004");
        assert_rejected(&format!("SELECT durable_jobs.extend_durable_job_lease({arguments})"), "22004");
    }
    assert_eq!(job_state(job_id), "running");
}

#[pg_test]
fn extend_moves_the_expiry_and_is_fenced() {
    let job_id = enqueue("k", "{}");
    let (_, token) = claim("w").unwrap();
    let extended = Spi::get_one_with_args::<TimestampWithTimeZone>(
        "SELECT durable_jobs.extend_durable_job_lease($1, 'w', $2, 300)",
        &[job_id.into(), token.into()],
    )
    .unwrap()
    .expect("a live lease is extended");
    let recorded = Spi::get_one_with_args::<bool>(
        "SELECT lease_expires_at = $2 AND $2 > clock_timestamp() + interval '299 seconds'
         FROM durable_jobs.durable_job WHERE job_id = $1",
        &[job_id.into(), extended.into()],
    );
    assert_eq!(recorded, Ok(Some(true)));
    let stale = Spi::get_one_with_args::<TimestampWithTimeZone>(
        "SELECT durable_jobs.extend_durable_job_lease($1, 'other', $2)",
        &[job_id.into(), token.into()],
    );
    assert_eq!(stale, Ok(None));
    assert_rejected(&format!("SELECT durable_jobs.extend_durable_job_lease({job_id}, 'w', '{token}', 0)"), "22023");
    assert_rejected(&format!("SELECT durable_jobs.extend_durable_job_lease({job_id}, 'w', '{token}', 99999)"), "22023");
    expire_lease(job_id);
    let late = Spi::get_one_with_args::<TimestampWithTimeZone>(
        "SELECT durable_jobs.extend_durable_job_lease($1, 'w', $2)",
        &[job_id.into(), token.into()],
    );
    assert_eq!(late, Ok(None), "an expired lease cannot be revived");
}

#[pg_test]
fn lapsed_and_available_jobs_compete_in_claim_order() {
    let enqueue_with_priority = |priority: i32| -> i64 {
        Spi::get_one_with_args::<i64>(
            "SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'default', now(), NULL, $1)",
            &[priority.into()],
        )
        .unwrap()
        .unwrap()
    };
    let lapsed_low = enqueue_with_priority(1);
    let lapsed_high = enqueue_with_priority(9);
    for _ in 0..2 {
        claim("w1").unwrap();
    }
    expire_lease(lapsed_low);
    expire_lease(lapsed_high);
    let available_mid = enqueue_with_priority(5);
    let order: Vec<i64> = (0..3).map(|_| claim("w2").unwrap().0).collect();
    assert_eq!(order, vec![lapsed_high, available_mid, lapsed_low]);
}

/// The planner settings a statement runs under (plans::CLAIM_PLANNER_SETTINGS,
/// plans::BATCH_PLANNER_SETTINGS), for this transaction: a plan explained here is the one the
/// statement gets.
/// `tokens` as the elements of an array literal.
fn uuid_list(tokens: &[pgrx::Uuid]) -> String {
    tokens.iter().map(|token| token.to_string()).collect::<Vec<_>>().join(",")
}

/// Lease tokens for `count` jobs, as the claims take them.
fn lease_tokens(count: usize) -> Vec<pgrx::Uuid> {
    (0..count).map(|_| crate::pg::randomness::new_uuid()).collect()
}

fn planner_settings(settings: &[(&std::ffi::CStr, &std::ffi::CStr)]) {
    for (name, value) in settings {
        Spi::run(&format!("SET LOCAL {} = {}", name.to_str().unwrap(), value.to_str().unwrap())).unwrap();
    }
}

/// The JSON plan of `statement` prepared with parameters of `types` and executed with
/// `arguments` (SQL text), under `options` of EXPLAIN: the kept plan a session gets.
fn explain_prepared(types: &str, statement: &str, arguments: &str, options: &str) -> String {
    Spi::run(&format!("PREPARE explained({types}) AS {statement}")).unwrap();
    let plan = Spi::get_one::<pgrx::Json>(&format!("EXPLAIN ({options}FORMAT JSON) EXECUTE explained({arguments})"))
        .unwrap()
        .unwrap()
        .0
        .to_string();
    Spi::run("DEALLOCATE explained").unwrap();
    plan
}

#[pg_test]
fn the_claim_is_an_index_scan_in_claim_order() {
    a_large_analyzed_queue();
    planner_settings(crate::pg::plans::CLAIM_PLANNER_SETTINGS);
    // Any kind: the claim order; some kinds: the kinds' ranges of it, a few rows of each.
    for kinds in [None, Some(vec!["k".to_string()])] {
        let queues: Option<Vec<String>> = None;
        let by_kind = kinds.is_some();
        let plan = Spi::explain_with_args(
            &crate::jobs::lease::claim_text(crate::jobs::statements::CLAIM, 1, by_kind.then_some("$5")),
            &[queues.into(), "w".into(), 60.0f64.into(), false.into(), kinds.into(), lease_tokens(1).into()],
        )
        .unwrap();
        let plan = format!("{:?}", plan.0);
        if by_kind {
            assert!(plan.contains("durable_job_kind_claim_order_idx"), "{plan}");
            assert!(!plan.contains("Seq Scan"), "{plan}");
        } else {
            assert!(plan.contains("durable_job_claim_order_idx"), "{plan}");
            // A sort in claim order would sort the whole queue (sorting the few exhausted leases is fine).
            assert!(!plan.contains("priority DESC"), "no sort of the whole queue: {plan}");
        }
    }
}

/// 5,000 jobs of kind `k` and 5,000 of kind `other`, analyzed: statistics under which a plan's
/// choices show.
fn a_large_analyzed_queue() {
    serialize_tests_that_analyze();
    Spi::run(
        "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[5000]));
         SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('other', array_fill('{}'::jsonb, ARRAY[5000]));
         ANALYZE durable_jobs.durable_job",
    )
    .unwrap();
}

/// The plan PostgreSQL keeps for the claim after five calls (the generic one, which knows no
/// argument), under the claim's planner settings, takes the claimed rows by primary key, for one
/// job and for a worker's batch. Broken on purpose: with the limit as a parameter, the generic
/// plan hash-joined the whole job table (a sequential scan per call), so every call had to be
/// planned anew.
#[pg_test]
fn the_kept_claim_plan_needs_no_argument_to_be_an_index_scan() {
    a_large_analyzed_queue();
    Spi::run("SET LOCAL plan_cache_mode = force_generic_plan").unwrap();
    planner_settings(crate::pg::plans::CLAIM_PLANNER_SETTINGS);
    // The API's claim of any kind reads the claim order, the worker's claim its registered kinds'.
    for (name, statement, kinds, index) in [
        ("api", crate::jobs::statements::CLAIM, None, "durable_job_claim_order_idx"),
        ("worker", crate::jobs::statements::CLAIM_FOR_WORKER, Some("$7"), "durable_job_kind_claim_order_idx"),
    ] {
        for limit in [1, 50] {
            let plan = explain_prepared(
                "text[], text, float8, bool, text[], uuid[], text[]",
                &crate::jobs::lease::claim_text(statement, limit, kinds),
                &format!("NULL, 'w', 60, false, NULL, '{{{}}}', ARRAY['k']", uuid_list(&lease_tokens(50))),
                "",
            );
            let job_table_scans = Spi::get_one_with_args::<String>(
                r#"SELECT string_agg(concat_ws(' ', n ->> 'Node Type', n ->> 'Index Name'), ', ')
                   FROM jsonb_path_query($1::jsonb, '$.** ? (@."Relation Name" == "durable_job")') AS n
                   WHERE n ->> 'Node Type' <> 'ModifyTable'"#,
                &[plan.clone().into()],
            )
            .unwrap()
            .unwrap_or_default();
            assert!(!job_table_scans.contains("Seq Scan"), "{name} {limit}: {job_table_scans}: {plan}");
            assert!(job_table_scans.contains(index), "{name} {limit}: {plan}");
        }
    }
}

/// The statements that act on given leases find their jobs by primary key, whatever the
/// statistics say. Broken on purpose before the fix: with statistics taken while no job ran (a
/// vacuum of a queue at rest), complete, fail and extend took the partial lease index and read
/// every running job's entries to find one, dead ones included: 100 buffers a job while long
/// statements held the horizon.
#[pg_test]
fn statements_on_given_leases_find_their_jobs_by_primary_key() {
    a_large_analyzed_queue();
    let (job_id, token) = claim("w").unwrap();
    use pgrx::datum::DatumWithOid;
    let one = || -> Vec<DatumWithOid<'static>> { vec![job_id.into(), "w".into(), token.into()] };
    let many = || -> Vec<DatumWithOid<'static>> { vec![vec![job_id].into(), vec![token].into(), "w".into()] };
    let with = |mut args: Vec<DatumWithOid<'static>>, more: Vec<DatumWithOid<'static>>| {
        args.extend(more);
        args
    };
    let statements = [
        ("complete", crate::jobs::statements::COMPLETE, one()),
        (
            "fail",
            crate::jobs::statements::FAIL,
            with(
                one(),
                vec![
                    true.into(),
                    1000i32.into(),
                    3600i32.into(),
                    "target_rejected".into(),
                    "P0001".into(),
                    "the error's message".into(),
                ],
            ),
        ),
        ("extend", crate::jobs::statements::EXTEND, with(one(), vec![60.0f64.into()])),
        ("renew", crate::jobs::statements::RENEW_BATCH, with(many(), vec![60.0f64.into()])),
        ("renew skipping held", crate::jobs::statements::RENEW_BATCH_SKIPPING_HELD, with(many(), vec![60.0f64.into()])),
        ("renew after a rollback", crate::jobs::statements::RENEW_AFTER_ROLLBACK, with(many(), vec![60.0f64.into()])),
        (
            "renew after a rollback within a limit",
            crate::jobs::statements::RENEW_AFTER_ROLLBACK_WITHIN_LIMIT,
            with(many(), vec![60.0f64.into()]),
        ),
        ("held", crate::jobs::statements::HELD_LEASES, many()),
        ("release", crate::jobs::statements::RELEASE_UNSTARTED, many()),
        ("complete batch", crate::jobs::statements::COMPLETE_BATCH, many()),
        ("complete batch skipping held", crate::jobs::statements::COMPLETE_BATCH_SKIPPING_HELD, many()),
        ("load", crate::worker::load::LOAD_JOBS, many()),
    ];
    for (name, statement, args) in statements {
        let plan = Spi::explain_with_args(statement, &args).unwrap().0.to_string();
        assert_finds_jobs_by_primary_key_only(name, &plan);
    }
}

/// Fails unless the JSON plan reads the job table by its primary key, looking up the batch's job
/// ids, and by nothing else: a primary key scan with no index condition reads the whole table.
fn assert_finds_jobs_by_primary_key_only(name: &str, plan: &str) {
    let other_scans = Spi::get_one_with_args::<String>(
        r#"SELECT string_agg(concat_ws(' ', n ->> 'Node Type', n ->> 'Index Name', n ->> 'Index Cond'), ', ')
           FROM jsonb_path_query($1::jsonb, '$.** ? ((@."Relation Name" == "durable_job" && @."Node Type" == "Seq Scan")
                                                     || @."Index Name" like_regex "^durable_job_([a-z_]+_idx|pkey)$")') AS n
           WHERE n ->> 'Index Name' IS DISTINCT FROM 'durable_job_pkey'
              OR COALESCE(n ->> 'Index Cond', '') NOT LIKE '%job_id = %'"#,
        &[plan.into()],
    )
    .unwrap();
    assert_eq!(other_scans, None, "{name}: {plan}");
    assert!(plan.contains("durable_job_pkey"), "{name}: {plan}");
}

/// The worker runs its statements over a batch's leases under their generic plan (whose
/// estimate is ten leases, whatever the batch): that plan finds the jobs by primary key too.
/// The test above explains custom plans only (one-shot SPI plans are always custom).
#[pg_test]
fn the_generic_plans_of_the_batch_statements_find_jobs_by_primary_key() {
    a_large_analyzed_queue();
    assert_generic_batch_plans_find_jobs_by_primary_key();
}

/// The same on a job table the planner has no statistics of and takes for small, as after
/// CREATE EXTENSION or a TRUNCATE until autovacuum analyzes it: a worker keeps the plans it makes
/// then until the table is analyzed, however much it grows. Failed before: each of them read
/// the whole table, once per batch.
#[pg_test]
fn the_generic_plans_of_the_batch_statements_find_jobs_by_primary_key_on_a_new_table() {
    Spi::run("TRUNCATE durable_jobs.durable_job").unwrap();
    enqueue("k", "{}");
    assert_generic_batch_plans_find_jobs_by_primary_key();
}

/// The same on small analyzed tables (none to twenty finished jobs, one page), as a worker meets
/// them soon after the table was created or truncated, or under a short retention: reading the
/// page whole looks as cheap as a lookup per job, and the worker keeps that plan until the next
/// ANALYZE, however much the table grows by then. Failed before (at twenty jobs): in a latency
/// run the load of a one-job batch read 30 buffers (the whole table of a thousand jobs), 0.11 ms
/// of a 1.2 ms path from enqueue to handler.
#[pg_test]
fn the_generic_plans_of_the_batch_statements_find_jobs_by_primary_key_on_a_small_table() {
    serialize_tests_that_analyze();
    for finished in [0, 1, 3, 5, 10, 20] {
        Spi::run("TRUNCATE durable_jobs.durable_job").unwrap();
        Spi::run(&format!(
            "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, job_state, payload, max_attempts,
                                                   attempt_count, enqueued_by, finished_at)
             SELECT 'q', 'k', 'succeeded', NULL, 1, 1, current_user, now() FROM generate_series(1, {finished});
             ANALYZE durable_jobs.durable_job"
        ))
        .unwrap();
        enqueue("k", "{}");
        assert_generic_batch_plans_find_jobs_by_primary_key();
    }
}

/// Claims a job and explains the generic plan of each statement over a batch's leases under
/// the planner settings the worker runs them with (plans::BATCH_PLANNER_SETTINGS).
fn assert_generic_batch_plans_find_jobs_by_primary_key() {
    let (job_id, token) = claim("w").unwrap();
    planner_settings(crate::pg::plans::BATCH_PLANNER_SETTINGS);
    let leases = "int8[], uuid[], text";
    let statements = [
        ("renew", crate::jobs::statements::RENEW_BATCH, ", float8", ", 60"),
        ("renew skipping held", crate::jobs::statements::RENEW_BATCH_SKIPPING_HELD, ", float8", ", 60"),
        ("renew after a rollback", crate::jobs::statements::RENEW_AFTER_ROLLBACK, ", float8", ", 60"),
        (
            "renew after a rollback within a limit",
            crate::jobs::statements::RENEW_AFTER_ROLLBACK_WITHIN_LIMIT,
            ", float8",
            ", 60",
        ),
        ("held", crate::jobs::statements::HELD_LEASES, "", ""),
        ("release", crate::jobs::statements::RELEASE_UNSTARTED, "", ""),
        ("complete batch", crate::jobs::statements::COMPLETE_BATCH, "", ""),
        ("complete batch skipping held", crate::jobs::statements::COMPLETE_BATCH_SKIPPING_HELD, "", ""),
        ("load", crate::worker::load::LOAD_JOBS, "", ""),
    ];
    for (name, statement, more_types, more_args) in statements {
        let plan = explain_prepared(
            &format!("{leases}{more_types}"),
            statement,
            &format!("'{{{job_id}}}', '{{{token}}}', 'w'{more_args}"),
            "",
        );
        // A generic plan: the batch's job ids stay a parameter (a custom plan shows them).
        assert!(plan.contains("job_id = ANY ($1)"), "{name}: a generic plan: {plan}");
        // Jobs and tokens paired in a hash, not each job against each token: at
        // claim_batch_size 1000 a nested loop cost the worker 12 % of its throughput.
        assert!(!plan.contains("Nested Loop"), "{name}: a nested loop: {plan}");
        assert_finds_jobs_by_primary_key_only(name, &plan);
    }
}

/// A claim's planner settings end with it: the caller's session plans as it did, its own
/// settings included (set without a nest level of their own, they would outlive the claim).
#[pg_test]
fn a_claim_leaves_the_sessions_planner_settings_as_they_were() {
    enqueue("k", "{}");
    Spi::run("SET LOCAL enable_bitmapscan = off").unwrap();
    assert!(claim("w").is_some());
    assert_eq!(one::<String>("SELECT current_setting('enable_sort')"), "on");
    assert_eq!(one::<String>("SELECT current_setting('plan_cache_mode')"), "auto");
    assert_eq!(one::<String>("SELECT current_setting('enable_bitmapscan')"), "off");
    Spi::run("RESET enable_bitmapscan").unwrap();
    assert!(claim("w").is_none());
    assert_eq!(one::<String>("SELECT current_setting('enable_bitmapscan')"), "on");
}

/// A claim is never compiled by JIT, however large the queue: its estimated cost passes
/// `jit_above_cost` on a large queue (a claim plan of a 20,000-job table was costed at 177,000
/// once), and compiling it took 19 ms per claim, against 1.4 ms to run it. The threshold at zero
/// stands in for a large queue here.
#[pg_test]
fn a_claim_is_not_compiled_by_jit() {
    enqueue("k", "{}");
    Spi::run("SET LOCAL jit_above_cost = 0").unwrap();
    planner_settings(crate::pg::plans::CLAIM_PLANNER_SETTINGS);
    let plan = explain_prepared(
        "text[], text, float8, bool, text[], uuid[]",
        &crate::jobs::lease::claim_text(crate::jobs::statements::CLAIM, 50, None),
        &format!("NULL, 'w', 60, false, NULL, '{{{}}}'", uuid_list(&lease_tokens(50))),
        "ANALYZE, ",
    );
    assert!(!plan.contains("\"JIT\""), "{plan}");
}

/// Nor is any statement over a batch's leases, whatever its cost: a path the batch settings
/// disable costs past `jit_above_cost` (zero here, for a large queue).
#[pg_test]
fn the_statements_over_a_batch_are_not_compiled_by_jit() {
    enqueue("k", "{}");
    let (job_id, token) = claim("w").unwrap();
    Spi::run("SET LOCAL jit_above_cost = 0").unwrap();
    planner_settings(crate::pg::plans::BATCH_PLANNER_SETTINGS);
    let leases = format!("'{{{job_id}}}', '{{{token}}}', 'w'");
    for (statement, more_types, more_args) in [
        (crate::worker::load::LOAD_JOBS, "", ""),
        (crate::jobs::statements::HELD_LEASES, "", ""),
        (crate::jobs::statements::RENEW_BATCH, ", float8", ", 60"),
        (crate::jobs::statements::COMPLETE_BATCH, "", ""),
    ] {
        let plan =
            explain_prepared(&format!("int8[], uuid[], text{more_types}"), statement, &format!("{leases}{more_args}"), "ANALYZE, ");
        assert!(!plan.contains("\"JIT\""), "{plan}");
    }
}

/// The load of a batch checks each handler against its enqueuer once, however many jobs and
/// kinds share them, in the library; its statement reads each job and its kind's registration by
/// primary key and no catalog. Failed before the first fix: the registration, the handler's
/// routine and both roles were read once per job, most of the load's time.
#[pg_test]
fn the_load_of_a_batch_checks_each_handler_once() {
    Spi::run(
        "CREATE FUNCTION public.dj_noop(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         SELECT durable_jobs.register_durable_job_handler('k', 'public.dj_noop(jsonb)');
         SELECT durable_jobs.register_durable_job_handler('also_k', 'public.dj_noop(jsonb)');
         SELECT durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[3]));
         SELECT durable_jobs.enqueue_durable_job('also_k', '{}');
         SELECT durable_jobs.enqueue_durable_job('unregistered', '{}');",
    )
    .unwrap();
    let leases: Vec<(i64, pgrx::Uuid)> = (0..5).map(|_| claim("w").unwrap()).collect();
    let (ids, tokens): (Vec<i64>, Vec<pgrx::Uuid>) = leases.iter().copied().unzip();
    // The settings the worker loads a batch under. Without them the plan depended on whether
    // another test had analyzed the job table first: run alone, on a job table never analyzed,
    // the five jobs were read by a sequential scan and the test failed.
    planner_settings(crate::pg::plans::BATCH_PLANNER_SETTINGS);
    let plan = Spi::get_one_with_args::<pgrx::Json>(
        &format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", crate::worker::load::LOAD_JOBS),
        &[ids.into(), tokens.into(), "w".into()],
    )
    .unwrap()
    .unwrap()
    .0
    .to_string();
    assert_finds_jobs_by_primary_key_only("load", &plan);
    let other_scans = Spi::get_one_with_args::<String>(
        r#"SELECT string_agg(DISTINCT concat_ws(' ', n ->> 'Node Type', n ->> 'Index Name'), ', ')
           FROM jsonb_path_query($1::jsonb, '$.** ? (exists (@."Relation Name"))') AS n
           WHERE n ->> 'Relation Name' <> 'durable_job'"#,
        &[plan.clone().into()],
    )
    .unwrap();
    assert_eq!(other_scans.as_deref(), Some("Index Scan durable_job_handler_pkey"), "{plan}");
    crate::jobs::trust::HANDLER_CHECKS.with(|checks| checks.set(0));
    let loaded = crate::worker::load::load_jobs(&leases, "w");
    assert_eq!(crate::jobs::trust::HANDLER_CHECKS.with(|checks| checks.get()), 1, "one handler, one enqueuer");
    let runnable: Vec<Option<bool>> =
        leases.iter().map(|(id, _)| loaded.get(id).map(|job| job.handler.is_some())).collect();
    assert_eq!(runnable, [Some(true), Some(true), Some(true), Some(true), Some(false)], "the unregistered kind last");
}

#[pg_test]
fn a_renewal_after_a_rollback_revives_no_lapsed_lease_past_its_queues_limit() {
    // Reviving a lapsed lease starts its job again: a queue limited to 2 that others filled
    // meanwhile gets none of them back, and one of them once a place is free. Failed before: both
    // came back, four jobs of the queue running.
    for _ in 0..4 {
        Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'limited_renewal')").unwrap();
    }
    Spi::run("SELECT durable_jobs.set_durable_job_queue_concurrency('limited_renewal', 2)").unwrap();
    let ours = [claim("w").unwrap(), claim("w").unwrap()];
    Spi::run(&format!(
        "UPDATE durable_jobs.durable_job SET lease_expires_at = now() - interval '1 minute' WHERE job_id IN ({}, {})",
        ours[0].0, ours[1].0
    ))
    .unwrap();
    // Ahead of ours in claim order: another worker takes them, not ours.
    Spi::run("UPDATE durable_jobs.durable_job SET priority = 10 WHERE job_state = 'available'").unwrap();
    let theirs = [claim("other").unwrap(), claim("other").unwrap()];
    assert!(ours.iter().all(|(ours, _)| theirs.iter().all(|(theirs, _)| ours != theirs)), "new jobs, not ours");
    assert_eq!(crate::jobs::lease::renew_leases_after_rollback(&ours, "w", 60), vec![], "the queue is full");
    assert_eq!(
        Spi::get_one_with_args::<&str>(
            "SELECT durable_jobs.complete_durable_job($1, 'other', $2)",
            &[theirs[0].0.into(), theirs[0].1.into()],
        )
        .unwrap(),
        Some("succeeded")
    );
    let renewed = crate::jobs::lease::renew_leases_after_rollback(&ours, "w", 60);
    assert_eq!(renewed.iter().map(|(job_id, _)| *job_id).collect::<Vec<_>>(), [ours[0].0], "one place was free");
    let running = Spi::get_one::<i64>("SELECT durable_jobs.durable_job_queue_running('limited_renewal')").unwrap();
    assert_eq!(running, Some(2));
}

/// After a failed run transaction the worker renews the leases it still holds, lapsed or not:
/// a lapsed lease under its owner and token (taken by no one) is renewed, for a whole lease; one
/// reclaimed by another worker (a new token), cancelled, completed or ended by the expiry of
/// exhausted leases is not.
#[pg_test]
fn a_renewal_after_a_rollback_renews_lapsed_leases_no_one_took() {
    for _ in 0..4 {
        enqueue("k", "{}");
    }
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', max_attempts => 1)").unwrap();
    let untouched = claim("w").unwrap();
    let reclaimed = claim("w").unwrap();
    let cancelled = claim("w").unwrap();
    let completed = claim("w").unwrap();
    let expired = claim("w").unwrap();
    let lapse = |job_id: i64| {
        Spi::run(&format!(
            "UPDATE durable_jobs.durable_job SET lease_expires_at = now() - interval '1 minute' WHERE job_id = {job_id}"
        ))
        .unwrap()
    };
    lapse(reclaimed.0);
    assert_eq!(claim("other").map(|(job_id, _)| job_id), Some(reclaimed.0), "another worker reclaims it");
    lapse(expired.0);
    assert_eq!(crate::jobs::lease::expire_exhausted_leases(), 1, "the expiry ends the exhausted lease");
    lapse(untouched.0);
    Spi::run(&format!("SELECT durable_jobs.cancel_durable_job({})", cancelled.0)).unwrap();
    assert_eq!(
        Spi::get_one_with_args::<&str>(
            "SELECT durable_jobs.complete_durable_job($1, 'w', $2)",
            &[completed.0.into(), completed.1.into()],
        )
        .unwrap(),
        Some("succeeded")
    );
    let leases = [untouched, reclaimed, cancelled, completed, expired];
    let renewed = crate::jobs::lease::renew_leases_after_rollback(&leases, "w", 60);
    assert_eq!(renewed.iter().map(|(job_id, _)| *job_id).collect::<Vec<_>>(), [untouched.0]);
    let lasts_a_lease = Spi::get_one_with_args::<bool>(
        "SELECT lease_expires_at > clock_timestamp() + interval '50 seconds' FROM durable_jobs.durable_job WHERE job_id = $1",
        &[untouched.0.into()],
    )
    .unwrap();
    assert_eq!(lasts_a_lease, Some(true));
}
