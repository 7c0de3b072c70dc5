// Queue controls and the operators' views.

#[pg_test]
fn a_paused_queue_is_not_claimed_from_but_accepts_jobs() {
    let held: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'held')");
    let open: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'open')");
    assert!(one::<bool>("SELECT durable_jobs.pause_durable_job_queue('held')"));
    assert!(!one::<bool>("SELECT durable_jobs.pause_durable_job_queue('held')"), "already paused");
    let later: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'held')");
    assert_eq!(claim("w").map(|(job, _)| job), Some(open));
    assert!(claim("w").is_none(), "nothing is claimed from the paused queue");
    assert_eq!(
        one::<i64>("SELECT count(*) FROM durable_jobs.claim_next_durable_job('w', ARRAY['held'])"),
        0
    );
    assert!(one::<bool>("SELECT durable_jobs.resume_durable_job_queue('held')"));
    assert!(!one::<bool>("SELECT durable_jobs.resume_durable_job_queue('held')"), "already open");
    assert!(!one::<bool>("SELECT durable_jobs.resume_durable_job_queue('never-paused')"));
    let order: Vec<i64> = (0..2).map(|_| claim("w").unwrap().0).collect();
    assert_eq!(order, vec![held, later]);
    assert_rejected("SELECT durable_jobs.pause_durable_job_queue(NULL)", "22004");
    assert_rejected("SELECT durable_jobs.pause_durable_job_queue('no spaces')", "22023");
}

#[pg_test]
fn a_paused_queue_keeps_its_lapsed_leases_too() {
    let job_id: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'q')");
    claim("w1").unwrap();
    Spi::run("SELECT durable_jobs.pause_durable_job_queue('q')").unwrap();
    expire_lease(job_id);
    assert!(claim("w2").is_none());
    Spi::run("SELECT durable_jobs.resume_durable_job_queue('q')").unwrap();
    assert_eq!(claim("w2").map(|(job, _)| job), Some(job_id));
}

#[pg_test]
fn the_summary_view_counts_per_queue_and_state() {
    for queue in ["a", "a", "b"] {
        Spi::run_with_args(
            "SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, $1, now() - interval '10 minutes')",
            &[queue.into()],
        )
        .unwrap();
    }
    let (running, _) = claim("w").unwrap();
    expire_lease(running);
    let failing: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'b', now(), 1, 10)");
    let (_, token) = claim("w").unwrap();
    assert_eq!(fail(failing, "w", token, "target_rejected"), "failed");
    Spi::run("SELECT durable_jobs.pause_durable_job_queue('b')").unwrap();

    let summary: Vec<(String, String, i64, bool, i64, bool)> = Spi::connect(|client| {
        client
            .select(
                "SELECT queue_name, job_state, job_count, oldest_ready_age >= interval '10 minutes',
                        expired_leases, queue_paused
                 FROM durable_jobs.durable_job_queue_summary ORDER BY 1, 2",
                None,
                &[],
            )
            .unwrap()
            .map(|r| {
                (
                    r.get(1).unwrap().unwrap(),
                    r.get(2).unwrap().unwrap(),
                    r.get(3).unwrap().unwrap(),
                    r.get::<bool>(4).unwrap().unwrap_or(false),
                    r.get(5).unwrap().unwrap(),
                    r.get(6).unwrap().unwrap(),
                )
            })
            .collect()
    });
    let row = |q: &str, s: &str, n: i64, old: bool, expired: i64, paused: bool| {
        (q.to_string(), s.to_string(), n, old, expired, paused)
    };
    assert_eq!(
        summary,
        vec![
            row("a", "available", 1, true, 0, false),
            row("a", "running", 1, false, 1, false),
            row("b", "available", 1, true, 0, true),
            row("b", "failed", 1, false, 0, true),
        ]
    );
    let failures = Spi::get_two::<String, i64>(
        "SELECT failure_code, failed_last_hour FROM durable_jobs.durable_job_recent_failures WHERE queue_name = 'b'",
    );
    assert_eq!(failures, Ok((Some("target_rejected".into()), Some(1))));
}

#[pg_test]
fn a_concurrency_limit_caps_running_jobs_per_queue() {
    for _ in 0..4 {
        Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'limited_caps')").unwrap();
    }
    let other: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'other')");
    Spi::run("SELECT durable_jobs.set_durable_job_queue_concurrency('limited_caps', 2)").unwrap();
    let in_limited = || claim_from("limited_caps");
    let (first, first_token) = in_limited().unwrap();
    let (second, _) = in_limited().unwrap();
    assert!(in_limited().is_none(), "two are running: the limit is reached");
    assert_eq!(claim("w").map(|(job, _)| job), Some(other), "other queues are not limited");
    // A finished job frees its place; so does a job whose lease expired.
    assert_eq!(complete(first, "w", first_token), "succeeded");
    let (third, _) = in_limited().unwrap();
    assert!(in_limited().is_none());
    expire_lease(second);
    let (reclaimed, _) = in_limited().unwrap();
    assert_eq!(reclaimed, second, "the lapsed job is taken again, within the limit");
    assert!(in_limited().is_none());
    // NULL removes the limit.
    Spi::run("SELECT durable_jobs.set_durable_job_queue_concurrency('limited_caps', NULL)").unwrap();
    assert!(in_limited().is_some());
    assert_ne!(third, reclaimed);
    for (arguments, sqlstate) in [
        ("'limited_caps', 0", "22023"),
        ("'limited_caps', 100001", "22023"),
        ("NULL, 3", "22004"),
        ("'bad queue', 3", "22023"),
    ] {
        assert_rejected(&format!("SELECT durable_jobs.set_durable_job_queue_concurrency({arguments})"), sqlstate);
    }
}

#[pg_test]
fn the_running_count_reads_the_clock_so_it_is_volatile() {
    let volatility: String = one(
        "SELECT provolatile::text FROM pg_proc
         WHERE oid = 'durable_jobs.durable_job_queue_running(text)'::regprocedure",
    );
    assert_eq!(volatility, "v");
}

#[pg_test]
fn an_admin_reads_handlers_and_queue_controls_it_may_not_write() {
    Spi::run(
        "CREATE FUNCTION public.greet(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         SELECT durable_jobs.register_durable_job_handler('greet', 'public.greet(jsonb)');
         SELECT durable_jobs.pause_durable_job_queue('emails');
         SELECT durable_jobs.set_durable_job_queue_concurrency('reports', 4);
         CREATE ROLE dj_test_admin;
         GRANT USAGE ON SCHEMA durable_jobs TO dj_test_admin;
         GRANT SELECT ON durable_jobs.durable_job_handlers, durable_jobs.durable_job_queue_controls,
                         durable_jobs.durable_job_queue_summary TO dj_test_admin;
         GRANT USAGE ON SCHEMA tests TO dj_test_admin;
         SET LOCAL ROLE dj_test_admin",
    )
    .unwrap();
    assert_eq!(
        one::<String>("SELECT job_kind || ' ' || handler || ' ' || registered_by FROM durable_jobs.durable_job_handlers"),
        "greet public.greet(jsonb) postgres"
    );
    assert_eq!(
        one::<String>(
            "SELECT string_agg(queue_name || ' ' || paused || ' ' || coalesce(concurrency_limit::text, '-'), ', '
                               ORDER BY queue_name)
             FROM durable_jobs.durable_job_queue_controls"
        ),
        "emails true -, reports false 4"
    );
    // A paused queue with no job still shows in the summary (0.3.0 left it out).
    assert_eq!(
        one::<String>(
            "SELECT string_agg(queue_name || ' ' || coalesce(job_state, '-') || ' ' || job_count || ' ' || queue_paused, ', '
                               ORDER BY queue_name)
             FROM durable_jobs.durable_job_queue_summary"
        ),
        "emails - 0 true, reports - 0 false"
    );
    // Reading grants no write: the tables stay closed.
    assert_eq!(sqlstate_of("SELECT * FROM durable_jobs.durable_job_handler").as_deref(), Some("42501"));
    assert_eq!(sqlstate_of("UPDATE durable_jobs.durable_job_queue SET paused = false").as_deref(), Some("42501"));
    Spi::run("RESET ROLE").unwrap();
    // Read-only whatever is granted on them: no write through the views, even for their owner.
    for write in [
        "UPDATE durable_jobs.durable_job_handlers SET registered_by = 'someone'",
        "DELETE FROM durable_jobs.durable_job_queue_controls",
    ] {
        assert_eq!(sqlstate_of(write).as_deref(), Some("55000"), "{write}");
    }
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'emails')").unwrap();
    assert_eq!(
        one::<String>("SELECT string_agg(coalesce(job_state, '-'), ',') FROM durable_jobs.durable_job_queue_summary WHERE queue_name = 'emails'"),
        "available",
        "a queue with jobs has its per-state rows only"
    );
}

#[pg_test]
fn one_claim_statement_takes_no_more_of_a_limited_queue_than_its_free_places() {
    // A batch claimed in one statement takes a place for each job of a limited queue: 3 of its
    // 10 jobs, in places 1 to 3, and every job of an unlimited queue besides, in claim order.
    // Broken on purpose (the claim not recording the place on its job), it took two: the second
    // saw the first running outside the places.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_concurrency('limited_batch', 3);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'limited_batch') FROM generate_series(1, 10);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'open_batch') FROM generate_series(1, 4);",
    )
    .unwrap();
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    let claimed = crate::jobs::lease::claim_jobs(installed, "w", None, None, 60, false, 20);
    assert_eq!(claimed.len(), 7);
    let places: Vec<Option<i32>> = one(
        "SELECT array_agg(queue_slot ORDER BY queue_slot) FROM durable_jobs.durable_job
         WHERE job_state = 'running' AND queue_name = 'limited_batch'",
    );
    assert_eq!(places, [Some(1), Some(2), Some(3)]);
    let first_limited: i64 =
        one("SELECT min(job_id) FROM durable_jobs.durable_job WHERE queue_name = 'limited_batch'");
    let taken: Vec<i64> = one(
        "SELECT array_agg(job_id ORDER BY job_id) FROM durable_jobs.durable_job
         WHERE job_state = 'running' AND queue_name = 'limited_batch'",
    );
    assert_eq!(taken, [first_limited, first_limited + 1, first_limited + 2], "the first three, in claim order");
    // The next statement sees them run: nothing more of that queue.
    assert!(claim_from("limited_batch").is_none());
}

#[pg_test]
fn jobs_running_outside_the_places_keep_a_limited_queue_full_until_they_end() {
    // Jobs that started before the queue had a limit hold no place: the queue counts as full
    // while they run, whatever its limit. Broken on purpose (PLACE_STILL_FREE checking only the
    // place itself), the claim took a third job beside the two running.
    let jobs: Vec<i64> = (0..3).map(|_| one("SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'late_limit')")).collect();
    let first = claim_from("late_limit").unwrap();
    let second = claim_from("late_limit").unwrap();
    Spi::run("SELECT durable_jobs.set_durable_job_queue_concurrency('late_limit', 2)").unwrap();
    assert!(claim_from("late_limit").is_none(), "two run without a place: the queue is full");
    assert_eq!(complete(first.0, "w", first.1), "succeeded");
    assert!(claim_from("late_limit").is_none(), "one still runs outside the places");
    assert_eq!(complete(second.0, "w", second.1), "succeeded");
    let (third, _) = claim_from("late_limit").unwrap();
    assert_eq!(third, jobs[2]);
    assert_eq!(job_field::<i32>(third, "queue_slot"), Some(1));
}

#[pg_test]
fn a_key_at_its_limit_is_skipped_and_the_next_jobs_are_claimed_in_order() {
    // A per-key limit of 1: a batch claim takes the first job of each key and every job without
    // a key, in claim order, and skips the second job of each key; a key's next job runs once
    // its running one ends. Broken on purpose (the claim's filter without the key's place), it
    // took both jobs of keys a and b.
    Spi::run("SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_order', 1)").unwrap();
    let jobs: Vec<i64> = ["a", "a", "b", "", "b", "c"]
        .iter()
        .map(|key| {
            let key = if key.is_empty() { "NULL".to_string() } else { format!("'{key}'") };
            one(&format!(
                "SELECT durable_jobs.enqueue_durable_job('k', '{{}}', queue_name => 'tenants_order', concurrency_key => {key})"
            ))
        })
        .collect();
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    let claimed = crate::jobs::lease::claim_jobs(installed, "w", None, None, 60, false, 20);
    let claimed: Vec<i64> = claimed.iter().map(|job| job.job_id).collect();
    assert_eq!(claimed, [jobs[0], jobs[2], jobs[3], jobs[5]], "one per key, and the job without a key");
    let places: Vec<Option<i32>> = one(&format!(
        "SELECT array_agg(key_slot ORDER BY job_id) FROM durable_jobs.durable_job WHERE job_id IN ({}, {}, {})",
        jobs[0], jobs[2], jobs[5]
    ));
    assert_eq!(places, [Some(1), Some(1), Some(1)]);
    assert!(claim_from("tenants_order").is_none(), "a and b run, c has no other job");
    let token: pgrx::Uuid = job_field(jobs[0], "lease_token").unwrap();
    assert_eq!(complete(jobs[0], "w", token), "succeeded");
    assert_eq!(claim_from("tenants_order").map(|(job, _)| job), Some(jobs[1]), "a's next job");
    assert!(claim_from("tenants_order").is_none());
    // A key's places are made when they are missing (its jobs enqueued while the limit was being
    // set, say): the claim makes them.
    Spi::run("DELETE FROM durable_jobs.durable_job_key_slot WHERE concurrency_key = 'b'").unwrap();
    let token: pgrx::Uuid = job_field(jobs[2], "lease_token").unwrap();
    assert_eq!(complete(jobs[2], "w", token), "succeeded");
    assert_eq!(claim_from("tenants_order").map(|(job, _)| job), Some(jobs[4]), "b's next job");
    // NULL lifts the limit; bad arguments are refused.
    Spi::run("SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_order', NULL)").unwrap();
    for (statement, sqlstate) in [
        ("SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_order', 0)", "22023"),
        ("SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_order', 1001)", "22023"),
        ("SELECT durable_jobs.set_durable_job_queue_key_concurrency(NULL, 1)", "22004"),
        ("SELECT durable_jobs.enqueue_durable_job('k', '{}', concurrency_key => 'bad key')", "22023"),
        ("SELECT durable_jobs.enqueue_durable_job('k', '{}', concurrency_key => '')", "22023"),
    ] {
        assert_rejected(statement, sqlstate);
    }
}

#[pg_test]
fn a_key_limit_counts_the_keys_jobs_across_enqueuers_and_batch_enqueues() {
    // Jobs of one key enqueued by enqueue_durable_jobs and by enqueue_or_get_durable_job share
    // the key's places: with a limit of 2, two run. Broken on purpose (the batch enqueue not
    // writing the key), three ran.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_batch', 2);
         SELECT durable_jobs.enqueue_durable_jobs('k', ARRAY['{}', '{}']::jsonb[], queue_name => 'tenants_batch',
                                                  concurrency_key => 'acme');
         SELECT durable_jobs.enqueue_or_get_durable_job('k', '{}', queue_name => 'tenants_batch', concurrency_key => 'acme');",
    )
    .unwrap();
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    assert_eq!(crate::jobs::lease::claim_jobs(installed, "w", None, None, 60, false, 10).len(), 2);
    let keyed: i64 = one("SELECT count(*) FROM durable_jobs.durable_job WHERE concurrency_key = 'acme'");
    assert_eq!(keyed, 3);
}

#[pg_test]
fn a_rate_limit_starts_no_more_than_its_burst_until_a_token_comes_back() {
    // A rate of one start every thousand seconds with a burst of 2: two claims start jobs, the
    // third takes nothing from that queue (another queue's job instead) and the next start is a
    // period away; each start is the time its token was taken. Broken on purpose (the claim's
    // filter without the token), the third claim took a third job.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_rate('api_burst', 0.002, 2);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'api_burst') FROM generate_series(1, 3);",
    )
    .unwrap();
    let other: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'other', priority => -1)");
    assert!(claim_from("api_burst").is_some());
    assert!(claim_from("api_burst").is_some());
    assert!(claim_from("api_burst").is_none(), "no token left");
    assert_eq!(claim("w").map(|(job, _)| job), Some(other), "other queues are not limited");
    let next_in: f64 = one(
        "SELECT extract(epoch FROM durable_jobs.get_durable_job_queue_next_start('api_burst') - clock_timestamp())::float8",
    );
    assert!(next_in > 900.0 && next_in <= 1000.0, "the next start is a period (1000 s) away: {next_in}");
    let starts_at_tokens: bool = one(
        "SELECT bool_and(j.attempt_started_at + interval '1000 seconds' = t.next_at)
         FROM durable_jobs.durable_job j
         JOIN durable_jobs.durable_job_rate_token t ON t.queue_name = j.queue_name
          AND t.next_at = j.attempt_started_at + interval '1000 seconds'
         WHERE j.queue_name = 'api_burst' AND j.job_state = 'running'",
    );
    assert!(starts_at_tokens, "each start is its token's time");
    assert!(one::<bool>("SELECT durable_jobs.get_durable_job_queue_next_start('other') IS NULL"));
    // NULL lifts it.
    Spi::run("SELECT durable_jobs.set_durable_job_queue_rate('api_burst', NULL)").unwrap();
    assert!(claim_from("api_burst").is_some());
    for (arguments, sqlstate) in [
        ("'api_burst', 0", "22023"),
        ("'api_burst', -1", "22023"),
        ("'api_burst', 'NaN'", "22023"),
        ("'api_burst', 'Infinity'", "22023"),
        ("'api_burst', 1e7", "22023"),
        ("'api_burst', 10, 0", "22023"),
        ("'api_burst', 10, 10001", "22023"),
        ("'api_burst', 10, NULL", "22004"),
        ("NULL, 10", "22004"),
        // A period (burst / rate) past a year: its token's next time would overflow a timestamp.
        ("'api_burst', 1e-300", "22023"),
        ("'api_burst', 1e-10, 10000", "22023"),
    ] {
        assert_rejected(&format!("SELECT durable_jobs.set_durable_job_queue_rate({arguments})"), sqlstate);
    }
}

/// Rows of the job table this transaction has read so far, through indexes or scans.
fn job_rows_read() -> i64 {
    one("SELECT (COALESCE(idx_tup_fetch, 0) + COALESCE(seq_tup_read, 0))::bigint FROM pg_stat_xact_user_tables
         WHERE relid = 'durable_jobs.durable_job'::regclass")
}

#[pg_test]
fn a_claim_of_some_kinds_reads_no_backlog_of_other_kinds() {
    // 5,000 ready jobs of a kind nobody claims here, ahead in claim order: a job_kinds claim of
    // one kind and the background worker's claim (one registered kind) take the later job of
    // their kind reading a few rows, not the backlog. Broken on purpose (claims reading every kind in claim
    // order, as before), each read over 5,000.
    Spi::run(
        "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('backlog', array_fill('{}'::jsonb, ARRAY[5000]),
                                                                run_after => now() - interval '1 hour');
         CREATE FUNCTION public.wanted(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         SELECT durable_jobs.register_durable_job_handler('wanted', 'public.wanted(jsonb)');",
    )
    .unwrap();
    let first: i64 = one("SELECT durable_jobs.enqueue_durable_job('wanted', '{}')");
    let second: i64 = one("SELECT durable_jobs.enqueue_durable_job('wanted', '{}')");
    let before = job_rows_read();
    let claimed: i64 = one("SELECT job_id FROM durable_jobs.claim_next_durable_job('w', job_kinds => ARRAY['wanted'])");
    assert_eq!(claimed, first);
    let read = job_rows_read() - before;
    assert!(read < 100, "a job_kinds claim read {read} rows");
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    let before = job_rows_read();
    let claimed = crate::jobs::lease::claim_jobs(installed, "worker", None, None, 60, true, 10);
    assert_eq!(claimed.iter().map(|job| job.job_id).collect::<Vec<_>>(), [second]);
    let read = job_rows_read() - before;
    assert!(read < 100, "the worker's claim read {read} rows");
    // And with none of its kinds left, the worker's poll, under the plan PostgreSQL keeps (the
    // generic one, here from the first call) on analyzed statistics. (It read the backlog
    // through a plan of `job_kind = ANY (...)` that scanned the table: milliseconds per idle
    // poll; broken that way on purpose, it read 5,002 rows.)
    serialize_tests_that_analyze();
    Spi::run("ANALYZE durable_jobs.durable_job; SET LOCAL plan_cache_mode = force_generic_plan").unwrap();
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    let before = job_rows_read();
    assert!(crate::jobs::lease::claim_jobs(installed, "worker", None, None, 60, true, 10).is_empty());
    let read = job_rows_read() - before;
    assert!(read < 100, "an empty claim of the worker read {read} rows");
}

#[pg_test]
fn a_claim_of_closed_queues_reads_none_of_their_jobs() {
    // 5,000 jobs in a paused queue and in a queue out of rate tokens: a claim naming only those
    // queues takes nothing and reads none of them. Broken on purpose (no look at the queues
    // first), it read the 5,000.
    Spi::run(
        "SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[5000]), queue_name => 'held_closed');
         SELECT durable_jobs.pause_durable_job_queue('held_closed');
         SELECT durable_jobs.set_durable_job_queue_rate('slow_closed', 0.001);
         SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[5000]), queue_name => 'slow_closed');",
    )
    .unwrap();
    assert!(claim_from("slow_closed").is_some(), "the token");
    let before = job_rows_read();
    assert!(claim_from("slow_closed").is_none());
    assert!(Spi::get_one::<i64>(
        "SELECT job_id FROM durable_jobs.claim_next_durable_job('w', ARRAY['held_closed', 'slow_closed'])"
    )
    .is_err_and(|error| matches!(error, pgrx::spi::SpiError::InvalidPosition)));
    let read = job_rows_read() - before;
    assert!(read < 100, "claims of closed queues read {read} rows");
}

#[pg_test]
fn a_claim_by_kind_reaches_the_jobs_behind_those_it_may_not_take() {
    // A registration by a role serves that role's jobs only: thirty jobs of its kind enqueued by
    // the superuser, ahead in claim order, are left to external workers, and the worker's claim,
    // which reads each kind's first jobs only, still reaches the role's job behind them. Broken on
    // purpose (no claim reading on past a short claim by kind), it claimed nothing.
    Spi::run(
        "CREATE ROLE dj_kind_owner;
         CREATE FUNCTION public.dj_kind_work(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         INSERT INTO durable_jobs.durable_job_handler (job_kind, handler, registered_by)
         VALUES ('dj_kind', 'public.dj_kind_work(jsonb)', 'dj_kind_owner');
         SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('dj_kind', array_fill('{}'::jsonb, ARRAY[30]));
         GRANT USAGE ON SCHEMA durable_jobs TO dj_kind_owner;
         GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job TO dj_kind_owner;
         SET LOCAL ROLE dj_kind_owner;
         SELECT durable_jobs.enqueue_durable_job('dj_kind', '{}');
         RESET ROLE;",
    )
    .unwrap();
    let owners: i64 =
        one("SELECT job_id FROM durable_jobs.durable_job WHERE enqueued_by = 'dj_kind_owner'");
    let installed = crate::pg::privilege::Installed::from(&crate::pg::privilege::installed_row().unwrap());
    let claimed = crate::jobs::lease::claim_jobs(installed, "worker", None, None, 60, true, 1);
    assert_eq!(claimed.iter().map(|job| job.job_id).collect::<Vec<_>>(), [owners]);
}

#[pg_test]
fn a_new_rate_applies_to_tokens_spent_under_the_old_one() {
    // A token spent under a rate of one start every thousand seconds comes back within a period
    // of the new rate of 100 a second; removing the rate drops the tokens. Failed before: the
    // next start stayed a thousand seconds away.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_rate('api_reset', 0.001);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'api_reset') FROM generate_series(1, 2);",
    )
    .unwrap();
    assert!(claim_from("api_reset").is_some());
    assert!(claim_from("api_reset").is_none());
    Spi::run("SELECT durable_jobs.set_durable_job_queue_rate('api_reset', 100)").unwrap();
    assert!(one::<bool>(
        "SELECT durable_jobs.get_durable_job_queue_next_start('api_reset') <= clock_timestamp() + interval '10 ms'"
    ));
    Spi::run("SELECT durable_jobs.set_durable_job_queue_rate('api_reset', NULL)").unwrap();
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job_rate_token"), 0);
}

#[pg_test]
fn the_places_of_keys_without_pending_jobs_are_pruned() {
    // Every new key value gets its places: pruning deletes those of keys with no pending job,
    // and lifting the limit deletes them all. Failed before: the 3,000 places stayed.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_pruned', 1000);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'tenants_pruned', concurrency_key => 'key-' || n)
         FROM generate_series(1, 3) n;",
    )
    .unwrap();
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job_key_slot"), 3000);
    Spi::run(
        "SELECT durable_jobs.cancel_durable_job(job_id) FROM durable_jobs.durable_job WHERE concurrency_key <> 'key-3'",
    )
    .unwrap();
    Spi::run("SELECT durable_jobs.prune_durable_jobs(interval '1 day')").unwrap();
    let kept: Vec<String> = one(
        "SELECT array_agg(DISTINCT concurrency_key) FROM durable_jobs.durable_job_key_slot",
    );
    assert_eq!(kept, ["key-3"], "the key with a pending job keeps its places");
    Spi::run("SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_pruned', NULL)").unwrap();
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job_key_slot"), 0);
}

#[pg_test]
fn a_job_kinds_claim_reaches_jobs_behind_a_full_queues_backlog_of_its_kind() {
    // Forty jobs of kind ext in a queue at its limit, ahead in claim order, then five in an open
    // queue: a job_kinds claim takes one of those five, with or without naming their queue.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_concurrency('lim_kinds', 1);
         SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('ext', array_fill('{}'::jsonb, ARRAY[41]),
                                                                queue_name => 'lim_kinds', run_after => now() - interval '1 hour');
         SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('ext', array_fill('{}'::jsonb, ARRAY[5]), queue_name => 'open_kinds');",
    )
    .unwrap();
    assert!(claim_from("lim_kinds").is_some(), "the queue lim is full from here");
    let open_queue = |claimed: Option<i64>| -> bool {
        claimed.is_some_and(|job| job_field::<String>(job, "queue_name").as_deref() == Some("open_kinds"))
    };
    let claim_kinds = |queues: &str| -> Option<i64> {
        Spi::get_one::<i64>(&format!(
            "SELECT job_id FROM durable_jobs.claim_next_durable_job('w', {queues}, job_kinds => ARRAY['ext'])"
        ))
        .ok()
        .flatten()
    };
    assert!(open_queue(claim_kinds("ARRAY['open_kinds']")), "naming the open queue");
    assert!(open_queue(claim_kinds("NULL")), "any queue");
}

#[pg_test]
fn claims_by_kind_keep_the_claim_order_behind_jobs_they_may_not_take() {
    // Eleven jobs of kind a of priority 10 whose key is at its limit, then one of kind a of
    // priority 5 without a key, then one of kind b of priority 0: a claim of kind a, and a claim
    // of kinds a and b, take the job of priority 5. (A claim by kind that read each kind's first
    // jobs only took b's job, and left a's for as long as other kinds had jobs.)
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_key_concurrency('q_order', 1);
         SELECT count(*) FROM (
             SELECT durable_jobs.enqueue_durable_job('a_order', '{}', queue_name => 'q_order', priority => 10,
                                                     concurrency_key => 'k')
             FROM generate_series(1, 11)) enqueued;",
    )
    .unwrap();
    assert!(claim_from("q_order").is_some(), "the key is at its limit from here");
    let behind: i64 =
        one("SELECT durable_jobs.enqueue_durable_job('a_order', '{}', queue_name => 'q_order', priority => 5)");
    Spi::run("SELECT durable_jobs.enqueue_durable_job('b_order', '{}', queue_name => 'q_order')").unwrap();
    for kinds in ["ARRAY['a_order']", "ARRAY['a_order', 'b_order']"] {
        let claimed: i64 = one(&format!(
            "SELECT job_id FROM durable_jobs.claim_next_durable_job('w', ARRAY['q_order'], job_kinds => {kinds})"
        ));
        assert_eq!(claimed, behind, "{kinds}");
        Spi::run(&format!(
            "UPDATE durable_jobs.durable_job SET job_state = 'available', lease_owner = NULL, lease_token = NULL,
                    lease_expires_at = NULL, attempt_count = 0 WHERE job_id = {behind}"
        ))
        .unwrap();
    }
}

#[pg_test]
fn a_claim_of_closed_queues_still_ends_their_exhausted_leases() {
    // A job on its last attempt whose lease lapsed, in a queue now paused: a claim naming only
    // that queue takes nothing, and ends the job lease_expired, as a claim did before it looked
    // at its queues first. Failed with that look returning at once (the job stayed running).
    let job: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'q_exhausted', max_attempts => 1)");
    assert!(claim_from("q_exhausted").is_some());
    expire_lease(job);
    Spi::run("SELECT durable_jobs.pause_durable_job_queue('q_exhausted')").unwrap();
    assert!(claim_from("q_exhausted").is_none());
    assert_eq!(job_state(job), "failed");
    assert_eq!(job_field::<String>(job, "last_failure_code").as_deref(), Some("lease_expired"));
}
