// Status API: get_durable_job, list_durable_jobs, state_version, last_failure_sqlstate, audit.

/// state_version of a job as get_durable_job shows it.
fn state_version(job_id: i64) -> i64 {
    Spi::get_one_with_args::<i64>("SELECT state_version FROM durable_jobs.get_durable_job($1)", &[job_id.into()])
        .expect("get_durable_job")
        .expect("a visible job")
}

/// The job ids of one page, and the cursor of its last row.
fn list_page(arguments: &str, cursor: Option<&str>) -> (Vec<i64>, Option<String>) {
    let rows: Vec<(i64, String)> = Spi::connect(|client| {
        client
            .select(
                &format!("SELECT job_id, page_cursor FROM durable_jobs.list_durable_jobs({arguments}, page_cursor => $1)"),
                None,
                &[cursor.into()],
            )
            .expect("list_durable_jobs")
            .map(|row| (row.get::<i64>(1).unwrap().unwrap(), row.get::<String>(2).unwrap().unwrap()))
            .collect()
    });
    let last_cursor = rows.last().map(|(_, cursor)| cursor.clone());
    (rows.into_iter().map(|(job_id, _)| job_id).collect(), last_cursor)
}

/// Every job id a listing returns, walking its pages.
fn walk_pages(arguments: &str) -> Vec<i64> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let (page, next) = list_page(arguments, cursor.as_deref());
        if page.is_empty() {
            return all;
        }
        all.extend(page);
        cursor = next;
    }
}

#[pg_test]
fn get_durable_job_returns_the_documented_columns_and_never_the_payload_or_token() {
    let columns: Vec<String> = Spi::connect(|client| {
        client
            .select(
                "SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'durable_jobs.durable_job_status'::regclass AND attnum > 0 ORDER BY attnum",
                None,
                &[],
            )
            .unwrap()
            .map(|row| row.get::<String>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(
        columns.join(","),
        "job_id,queue_name,job_kind,job_state,state_version,attempt_count,max_attempts,last_failure_code,\
         last_failure_sqlstate,priority,run_after,lease_owner,lease_expires_at,idempotency_key,enqueued_by,\
         created_at,updated_at,finished_at,replay_count"
    );
    let listing = one::<String>(
        "SELECT string_agg(attname::text, ',' ORDER BY attnum) FROM pg_attribute
         WHERE attrelid = 'durable_jobs.durable_job_listing'::regclass AND attnum > 0",
    );
    assert_eq!(listing, format!("{},page_cursor", columns.join(",")));

    let job_id = Spi::get_one::<i64>(
        "SELECT durable_jobs.enqueue_durable_job('k', '{\"secret\": 1}', 'key-1', queue_name => 'q', priority => 5)",
    )
    .unwrap()
    .unwrap();
    claim("w").unwrap();
    let row = one::<String>(&format!(
        "SELECT concat_ws('|', job_id, queue_name, job_kind, job_state, state_version, attempt_count,
                          last_failure_code IS NULL, priority, lease_owner, lease_expires_at IS NOT NULL,
                          idempotency_key, enqueued_by, finished_at IS NULL, replay_count)
         FROM durable_jobs.get_durable_job({job_id})"
    ));
    assert_eq!(row, format!("{job_id}|q|k|running|2|1|t|5|w|t|key-1|postgres|t|0"));
    assert_eq!(one::<i64>(&format!("SELECT count(*) FROM durable_jobs.get_durable_job({})", i64::MAX)), 0);
    assert_rejected("SELECT * FROM durable_jobs.get_durable_job(NULL)", "22004");
}

#[pg_test]
fn state_version_moves_on_every_change_of_state_or_lease_and_only_then() {
    let job_id = Spi::get_one::<i64>("SELECT durable_jobs.enqueue_durable_job('k', '{}', 'again')")
        .unwrap()
        .unwrap();
    assert_eq!(state_version(job_id), 1, "1 at enqueue");
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{}', 'again')").unwrap();
    assert_eq!(state_version(job_id), 1, "an idempotent re-enqueue changes nothing");
    let (_, token) = claim("w").unwrap();
    assert_eq!(state_version(job_id), 2, "claim");
    Spi::run_with_args(
        "SELECT durable_jobs.extend_durable_job_lease($1, 'w', $2, 60)",
        &[job_id.into(), token.into()],
    )
    .unwrap();
    assert_eq!(state_version(job_id), 2, "a lease extension is no change of state or lease");
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "retried");
    assert_eq!(state_version(job_id), 3, "retry");
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "stale");
    assert_eq!(complete(job_id, "w", token), "stale");
    assert_eq!(state_version(job_id), 3, "stale calls change nothing");
    Spi::run_with_args("UPDATE durable_jobs.durable_job SET run_after = now() WHERE job_id = $1", &[job_id.into()])
        .unwrap();
    let (_, token) = claim("w").unwrap();
    assert_eq!(state_version(job_id), 4, "second claim");
    expire_lease(job_id);
    let (_, reclaimed) = claim("w2").unwrap();
    assert_eq!(state_version(job_id), 5, "reclaim after expiry");
    assert_eq!(complete(job_id, "w", token), "stale");
    assert_eq!(complete(job_id, "w2", reclaimed), "succeeded");
    assert_eq!(state_version(job_id), 6, "completion");

    let cancelled = enqueue("k", "{}");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[cancelled.into()]).unwrap();
    assert_eq!(state_version(cancelled), 2, "cancel");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[cancelled.into()]).unwrap();
    assert_eq!(state_version(cancelled), 2, "a second cancel changes nothing");

    let failing = Spi::get_one::<i64>("SELECT durable_jobs.enqueue_durable_job('k', '{}', max_attempts => 1)")
        .unwrap()
        .unwrap();
    let (_, token) = claim("w").unwrap();
    assert_eq!(fail(failing, "w", token, "invalid_request"), "failed");
    assert_eq!(state_version(failing), 3, "terminal failure");

    let expiring = Spi::get_one::<i64>("SELECT durable_jobs.enqueue_durable_job('k', '{}', max_attempts => 1)")
        .unwrap()
        .unwrap();
    claim("w").unwrap();
    expire_lease(expiring);
    assert!(claim("w").is_none());
    assert_eq!(job_field::<String>(expiring, "last_failure_code").as_deref(), Some("lease_expired"));
    assert_eq!(state_version(expiring), 3, "lease_expired");
}

#[pg_test]
fn failures_reported_by_external_workers_or_lease_expiry_carry_no_sqlstate() {
    let job_id = Spi::get_one::<i64>("SELECT durable_jobs.enqueue_durable_job('k', '{}', max_attempts => 2)")
        .unwrap()
        .unwrap();
    // As if the background worker had recorded a handler's serialization failure before.
    Spi::run_with_args(
        "UPDATE durable_jobs.durable_job SET last_failure_code = 'target_unavailable',
                last_failure_sqlstate = '40001' WHERE job_id = $1",
        &[job_id.into()],
    )
    .unwrap();
    let (_, token) = claim("w").unwrap();
    assert_eq!(fail(job_id, "w", token, "target_unavailable"), "retried");
    assert_eq!(job_field::<String>(job_id, "last_failure_sqlstate"), None);
    Spi::run_with_args(
        "UPDATE durable_jobs.durable_job SET run_after = now(), last_failure_sqlstate = '57014' WHERE job_id = $1",
        &[job_id.into()],
    )
    .unwrap();
    claim("w").unwrap();
    expire_lease(job_id);
    assert!(claim("w").is_none());
    assert_eq!(job_field::<String>(job_id, "last_failure_code").as_deref(), Some("lease_expired"));
    assert_eq!(job_field::<String>(job_id, "last_failure_sqlstate"), None);
    assert_rejected(
        &format!("UPDATE durable_jobs.durable_job SET last_failure_sqlstate = '4000' WHERE job_id = {job_id}"),
        "23514",
    );
}

#[pg_test]
fn every_payload_keeps_its_fingerprint() {
    let job_id = enqueue("k", r#"{"b": 2, "a": 1}"#);
    let batch: Vec<i64> = Spi::connect(|client| {
        client
            .select(
                "SELECT * FROM durable_jobs.enqueue_durable_jobs('k', ARRAY['{\"n\": 1}', '{\"n\": 2}']::jsonb[])",
                None,
                &[],
            )
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    for (id, payload) in [(job_id, r#"{"a": 1, "b": 2}"#), (batch[0], r#"{"n": 1}"#), (batch[1], r#"{"n": 2}"#)] {
        let matches = Spi::get_one_with_args::<bool>(
            "SELECT payload_sha256 = sha256(convert_to($2::jsonb::text, 'UTF8'))
             FROM durable_jobs.durable_job WHERE job_id = $1",
            &[id.into(), payload.into()],
        );
        assert_eq!(matches, Ok(Some(true)), "job {id}");
    }
}

#[pg_test]
fn a_caller_sees_only_the_jobs_of_roles_whose_privileges_it_has() {
    Spi::run(
        "CREATE ROLE dj_status_owner; CREATE ROLE dj_status_stranger; CREATE ROLE dj_status_team;
         GRANT dj_status_owner TO dj_status_team;
         GRANT USAGE ON SCHEMA durable_jobs, tests TO dj_status_owner, dj_status_stranger, dj_status_team;
         GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                                   durable_jobs.get_durable_job(bigint),
                                   durable_jobs.list_durable_jobs(text, text[], text, integer, text)
             TO dj_status_owner, dj_status_stranger, dj_status_team;
         SET LOCAL ROLE dj_status_owner",
    )
    .unwrap();
    let job_id = enqueue("k", "{}");
    let visible = |role: &str| -> (i64, i64) {
        Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
        let got = one::<i64>(&format!("SELECT count(*) FROM durable_jobs.get_durable_job({job_id})"));
        let listed = one::<i64>("SELECT count(*) FROM durable_jobs.list_durable_jobs()");
        let listed_by_state =
            one::<i64>("SELECT count(*) FROM durable_jobs.list_durable_jobs(job_states => ARRAY['available'])");
        assert_eq!(listed, listed_by_state, "{role}");
        (got, listed)
    };
    assert_eq!(visible("dj_status_owner"), (1, 1));
    assert_eq!(visible("dj_status_team"), (1, 1), "a member of the enqueuer");
    assert_eq!(visible("dj_status_stranger"), (0, 0), "another role's job is simply not there");
    Spi::run("RESET ROLE").unwrap();
    let superuser_sees = one::<i64>(&format!("SELECT count(*) FROM durable_jobs.get_durable_job({job_id})"));
    assert_eq!(superuser_sees, 1);
}

#[pg_test]
fn list_durable_jobs_walks_every_matching_job_once_newest_first() {
    let mut ids: Vec<i64> = Vec::new();
    for n in 0..25 {
        let queue = if n % 2 == 0 { "even" } else { "odd" };
        let kind = if n % 3 == 0 { "third" } else { "other" };
        ids.push(
            Spi::get_one_with_args::<i64>(
                "SELECT durable_jobs.enqueue_durable_job($1, '{}', queue_name => $2)",
                &[kind.into(), queue.into()],
            )
            .unwrap()
            .unwrap(),
        );
    }
    // Some jobs of each queue move on to other states.
    for _ in 0..4 {
        let (job_id, token) = claim("w").unwrap();
        if job_id % 2 == 0 {
            complete(job_id, "w", token);
        }
    }
    let newest_first = |filter: &dyn Fn(i64) -> bool| -> Vec<i64> {
        let mut expected: Vec<i64> = ids.iter().copied().filter(|id| filter(*id)).collect();
        expected.sort_unstable_by(|a, b| b.cmp(a));
        expected
    };
    let state_of = |id: i64| job_state(id);
    let queue_of = |id: i64| job_field::<String>(id, "queue_name").unwrap();
    let kind_of = |id: i64| job_field::<String>(id, "job_kind").unwrap();

    assert_eq!(walk_pages("page_size => 4"), newest_first(&|_| true));
    assert_eq!(walk_pages("queue_name => 'odd', page_size => 3"), newest_first(&|id| queue_of(id) == "odd"));
    assert_eq!(
        walk_pages("job_states => ARRAY['running', 'succeeded'], page_size => 1"),
        newest_first(&|id| matches!(state_of(id).as_str(), "running" | "succeeded"))
    );
    assert_eq!(
        walk_pages("queue_name => 'even', job_states => ARRAY['available'], job_kind => 'third', page_size => 2"),
        newest_first(&|id| queue_of(id) == "even" && state_of(id) == "available" && kind_of(id) == "third")
    );

    // A page keeps its place while jobs are enqueued meanwhile.
    let (first_page, cursor) = list_page("page_size => 10", None);
    enqueue("k", "{}");
    let (second_page, _) = list_page("page_size => 10", cursor.as_deref());
    let expected = newest_first(&|_| true);
    assert_eq!(first_page, expected[..10]);
    assert_eq!(second_page, expected[10..20]);
}

#[pg_test]
fn list_durable_jobs_refuses_bad_arguments_and_foreign_cursors() {
    enqueue("k", "{}");
    enqueue("k", "{}");
    let (_, cursor) = list_page("page_size => 1", None);
    let cursor = cursor.unwrap();
    let (_, queue_cursor) = list_page("queue_name => 'default', page_size => 1", None);
    let queue_cursor = queue_cursor.unwrap();
    let call = |arguments: &str| format!("SELECT * FROM durable_jobs.list_durable_jobs({arguments})");
    for arguments in [
        "page_size => 0".to_string(),
        "page_size => 1001".to_string(),
        "job_states => ARRAY['done']".to_string(),
        "job_states => ARRAY[]::text[]".to_string(),
        "job_states => ARRAY[NULL]::text[]".to_string(),
        "queue_name => ''".to_string(),
        "job_kind => ''".to_string(),
        "page_cursor => 'not-a-cursor'".to_string(),
        "page_cursor => ''".to_string(),
        format!("queue_name => 'default', page_cursor => '{cursor}'"),
        format!("page_cursor => '{queue_cursor}'"),
        format!("job_kind => 'k', page_cursor => '{cursor}'"),
    ] {
        assert_rejected(&call(&arguments), "22023");
    }
    assert_rejected(&call("page_size => NULL"), "22004");
    // The same filters continue; states are a set.
    assert_eq!(list_page("page_size => 1", Some(&cursor)).0.len(), 1);
    let (_, states_cursor) = list_page("job_states => ARRAY['available', 'failed'], page_size => 1", None);
    let (page, _) = list_page("job_states => ARRAY['failed', 'available', 'failed'], page_size => 1", states_cursor.as_deref());
    assert_eq!(page.len(), 1);
}

#[pg_test]
fn cancel_is_recorded_in_the_audit_table() {
    let job_id = enqueue("k", "{}");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[job_id.into()]).unwrap();
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[job_id.into()]).unwrap();
    let audit = one::<String>(&format!(
        "SELECT string_agg(concat_ws('|', job_id, action, acted_by, previous_state, previous_failure_code IS NULL,
                                     acted_at <= clock_timestamp()), ';')
         FROM durable_jobs.durable_job_audit WHERE job_id = {job_id}"
    ));
    assert_eq!(audit, format!("{job_id}|cancel|postgres|available|t|t"), "one row: the second cancel changed nothing");
}

/// Index entries a listing statement reads, and whether its plan reads the table by index only,
/// from EXPLAIN (ANALYZE, BUFFERS) of the statement list_durable_jobs runs for a caller that sees
/// every job (`roles` None: the enqueuing roles of the table) or only `roles`.
fn listing_cost(
    queue_name: Option<&str>,
    job_states: &[&'static str],
    below: i64,
    page_size: i64,
    roles: Option<Vec<String>>,
) -> (i64, bool) {
    let filters = crate::api::status::ListFilters {
        queue_name: queue_name.map(str::to_owned),
        job_states: job_states.to_vec(),
        job_kind: None,
    };
    let sees_all = roles.is_none();
    let roles = roles.unwrap_or_else(|| {
        Spi::get_one::<Vec<String>>("SELECT array_agg(DISTINCT enqueued_by::text) FROM durable_jobs.durable_job")
            .unwrap()
            .unwrap()
    });
    let plan = Spi::connect_mut(|client| {
        client
            .update(
                &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", filters.statement(sees_all, roles.len())),
                None,
                &[
                    below.into(),
                    page_size.into(),
                    queue_name.into(),
                    Option::<&str>::None.into(),
                    roles.clone().into(),
                    "tag".into(),
                ],
            )
            .unwrap()
            .first()
            .get_one::<pgrx::Json>()
            .unwrap()
            .unwrap()
            .0
            .to_string()
    });
    index_entries_read(plan)
}

/// From a JSON plan of EXPLAIN ANALYZE: the live index entries read (rows the index scans
/// returned plus rows their filters removed, and the entries a bitmap index scan, the planner's
/// pick for a range it knows to be tiny, found; dead entries left by other tests' rolled-back
/// jobs are vacuum's business, not the plan's), and whether no sequential scan ran.
fn index_entries_read(plan: String) -> (i64, bool) {
    Spi::get_two_with_args::<i64, bool>(
        r#"SELECT (SELECT COALESCE(sum((n ->> 'Actual Rows')::bigint + COALESCE((n ->> 'Rows Removed by Filter')::bigint, 0)), 0)
                   FROM jsonb_path_query(p, 'strict $.** ? (@."Node Type" == "Index Scan" || @."Node Type" == "Index Only Scan"
                                                            || @."Node Type" == "Bitmap Index Scan")') AS n)::bigint,
                  NOT jsonb_path_exists(p, '$.** ? (@."Node Type" == "Seq Scan")')
           FROM (SELECT $1::jsonb AS p) plan"#,
        &[plan.into()],
    )
    .map(|(entries, index_only)| (entries.unwrap(), index_only.unwrap()))
    .unwrap()
}

#[pg_test]
fn a_page_reads_about_one_page_of_index_entries_at_any_depth_and_for_rare_states() {
    serialize_tests_that_analyze();
    // 200,000 succeeded jobs of two roles in two queues, a few failed ones among them, some
    // waiting, 40 running, and three jobs of a third role (one running). ANALYZE reads every row, so that the plans do
    // not vary from run to run (from a sample, "several states" took a bitmap scan of its tiny
    // ranges now and then; with every row, always). Broken on purpose with the role's condition
    // made unindexable: "first page of a queue: 1160814 index entries for a page of 100".
    Spi::run(
        "INSERT INTO durable_jobs.durable_job
             (queue_name, job_kind, job_state, payload, max_attempts, attempt_count, enqueued_by, finished_at,
              last_failure_code)
         SELECT CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END, 'k',
                CASE WHEN g % 40000 = 7 THEN 'failed' ELSE 'succeeded' END, NULL, 1, 1,
                CASE WHEN g % 3 = 0 THEN 'dj_test_busy' ELSE 'postgres' END, now(),
                CASE WHEN g % 40000 = 7 THEN 'target_rejected' END
         FROM generate_series(1, 200000) g;
         INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, max_attempts, enqueued_by)
         SELECT 'odd', 'k', '{}', 1, 'postgres' FROM generate_series(1, 50);
         INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, max_attempts, enqueued_by)
         SELECT 'odd', 'k', '{}', 1, 'dj_test_few' FROM generate_series(1, 2);
         INSERT INTO durable_jobs.durable_job
             (queue_name, job_kind, job_state, payload, max_attempts, attempt_count, enqueued_by,
              lease_owner, lease_token, lease_expires_at)
         SELECT 'odd', 'k', 'running', '{}', 2, 1, CASE WHEN g = 1 THEN 'dj_test_few' ELSE 'postgres' END,
                'w', gen_random_uuid(), now() + interval '1 hour'
         FROM generate_series(1, 41) g;
         SET LOCAL default_statistics_target = 10000;
         ANALYZE durable_jobs.durable_job",
    )
    .unwrap();
    let deep = one::<i64>("SELECT max(job_id) - 100000 FROM durable_jobs.durable_job");
    let few = || Some(vec!["dj_test_few".to_string()]);
    // Past MERGED_RANGES_LIMIT ranges the listing reads each range by a lateral join.
    let few_among_many = || {
        Some(std::iter::once("dj_test_few".to_string()).chain((1..=12).map(|n| format!("dj_test_none_{n}"))).collect())
    };
    assert!(13 * crate::api::status::JOB_STATES.len() > crate::api::status::MERGED_RANGES_LIMIT);
    for (what, queue, states, below, roles) in [
        ("first page", None, &[][..], i64::MAX, None),
        ("page at depth 100,000", None, &[][..], deep, None),
        ("first page of a queue", Some("odd"), &[][..], i64::MAX, None),
        ("page of a queue at depth 100,000", Some("odd"), &[][..], deep, None),
        ("rare state", None, &["failed"][..], i64::MAX, None),
        ("rare state in a queue", Some("odd"), &["failed"][..], i64::MAX, None),
        ("several states", None, &["available", "failed", "cancelled"][..], deep, None),
        // Running jobs have an index of their own (a claim writes one listing entry).
        ("running jobs", None, &["running"][..], i64::MAX, None),
        ("running jobs in a queue", Some("odd"), &["running"][..], i64::MAX, None),
        ("running and rare states", Some("odd"), &["running", "failed"][..], i64::MAX, None),
        // A role that sees only its own three jobs reads only their entries, whatever the
        // other roles have: its timing says nothing about their jobs.
        ("a role's own jobs", None, &[][..], i64::MAX, few()),
        ("a role's own jobs in a queue", Some("odd"), &["available"][..], i64::MAX, few()),
        ("a role's own rare state", None, &["failed"][..], i64::MAX, few()),
        ("a role's own running job", None, &["running"][..], i64::MAX, few()),
        ("a role's own running job in a queue", Some("odd"), &["running"][..], i64::MAX, few()),
        ("a role's own jobs, by lateral joins", None, &[][..], i64::MAX, few_among_many()),
        ("a role's own jobs in a queue, by lateral joins", Some("odd"), &[][..], i64::MAX, few_among_many()),
    ] {
        let own = roles.is_some();
        let (entries, index_only) = listing_cost(queue, states, below, 100, roles);
        assert!(index_only, "{what}: the table is read by index only");
        if own {
            assert!(entries <= 3, "{what}: {entries} index entries for a role with 3 jobs");
            continue;
        }
        // At most a page per merged index range (one per role and state; the primary key
        // without states or queue); filtering through the table would read up to 200,000.
        let roles = 3;
        let ranges = match (states.len(), queue) {
            (0, None) => 1,
            (0, Some(_)) => roles * crate::api::status::JOB_STATES.len(),
            (n, _) => roles * n,
        } as i64;
        assert!(entries <= 100 * ranges + ranges, "{what}: {entries} index entries for a page of 100");
    }
    // A page of running jobs reads about a page of each role's running entries, in order (40
    // running jobs here), with or without a queue.
    for queue in [None, Some("odd")] {
        let (entries, index_only) = listing_cost(queue, &["running"], i64::MAX, 10, None);
        assert!(index_only && entries <= 10 * 3 + 3, "running jobs, queue {queue:?}: {entries} entries for a page of 10");
    }
    // The roles that enqueued jobs (a caller that sees all): a few entries per role, never the table.
    let plan = one::<pgrx::Json>(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", crate::api::status::ENQUEUING_ROLES)).0;
    let (entries, index_only) = index_entries_read(plan.to_string());
    assert!(index_only && entries <= 4 * 3 + 4, "enqueuing roles: {entries} index entries for 3 roles");
}

/// A job that failed for good after one attempt, as an external worker would fail it.
fn failed_job(payload: &str) -> i64 {
    let job_id = Spi::get_one_with_args::<i64>(
        "SELECT durable_jobs.enqueue_durable_job('k', $1::jsonb, queue_name => 'to_fail', max_attempts => 1)",
        &[payload.into()],
    )
    .unwrap()
    .unwrap();
    let (claimed, token) = claim_from("to_fail").unwrap();
    assert_eq!(claimed, job_id);
    assert_eq!(fail(job_id, "w", token, "invalid_request"), "failed");
    job_id
}

#[pg_test]
fn replay_runs_a_failed_job_again_under_its_id_with_its_payload() {
    let job_id = failed_job(r#"{"to": "a@example.com", "n": 1}"#);
    let version_before = state_version(job_id);
    let replayed = one::<String>(&format!(
        r#"SELECT concat_ws('|', job_id, job_state, attempt_count, max_attempts, replay_count, state_version,
                           finished_at IS NULL, last_failure_code, run_after <= now())
           FROM durable_jobs.replay_durable_job({job_id}, '{{"n": 1, "to": "a@example.com"}}', 3)"#
    ));
    assert_eq!(replayed, format!("{job_id}|available|1|4|1|{}|t|invalid_request|t", version_before + 1));
    assert_eq!(
        job_field::<String>(job_id, "payload::text").as_deref(),
        Some(r#"{"n": 1, "to": "a@example.com"}"#),
        "the payload is back"
    );
    let (claimed, token) = claim("w").unwrap();
    assert_eq!(claimed, job_id, "the replayed job is claimed again");
    assert_eq!(job_field::<i32>(job_id, "attempt_count"), Some(2));
    assert_eq!(complete(job_id, "w", token), "succeeded");
    let audit = one::<String>(&format!(
        "SELECT string_agg(concat_ws('|', action, acted_by, previous_state, previous_failure_code), ';')
         FROM durable_jobs.durable_job_audit WHERE job_id = {job_id}"
    ));
    assert_eq!(audit, "replay|postgres|failed|invalid_request");

    let cancelled = enqueue("k", "{}");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[cancelled.into()]).unwrap();
    let state = one::<String>(&format!(
        "SELECT job_state || '|' || replay_count FROM durable_jobs.replay_durable_job({cancelled}, '{{}}')"
    ));
    assert_eq!(state, "available|1", "a cancelled job too, with one extra attempt by default");
    assert_eq!(job_field::<i32>(cancelled, "max_attempts"), Some(1));
}

#[pg_test]
fn replay_refuses_other_payloads_states_and_bad_arguments_and_changes_nothing() {
    let job_id = failed_job(r#"{"n": 1}"#);
    let call = |payload: &str, extra: &str| {
        format!("SELECT * FROM durable_jobs.replay_durable_job({job_id}, '{payload}', {extra})")
    };
    // Another payload: 23514 since 0.6.0 (22023 before, which a gateway could not tell from a
    // bad argument).
    assert_rejected(&call(r#"{"n": 2}"#, "1"), "23514");
    assert_rejected(&call(r#"{"n": 1}"#, "0"), "22023");
    assert_rejected(&call(r#"{"n": 1}"#, "1001"), "22023");
    assert_rejected(&call(r#"{"n": 1}"#, "1000"), "22023"); // one attempt made: 1001 in all
    assert_rejected(&call(r#"{"n": 1}"#, "NULL"), "22004");
    assert_rejected(&format!("SELECT * FROM durable_jobs.replay_durable_job({job_id}, NULL)"), "22004");
    assert_rejected("SELECT * FROM durable_jobs.replay_durable_job(NULL, '{}')", "22004");

    // In a queue of their own, so that no other job is claimed instead.
    let enqueue_here = || {
        Spi::get_one::<i64>("SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'replay_states')")
            .unwrap()
            .unwrap()
    };
    let succeeded = enqueue_here();
    let (claimed, token) = claim_from("replay_states").unwrap();
    assert_eq!(claimed, succeeded);
    assert_eq!(complete(succeeded, "w", token), "succeeded");
    let running = enqueue_here();
    let (claimed, token) = claim_from("replay_states").unwrap();
    assert_eq!(claimed, running);
    let waiting = enqueue_here();
    for id in [waiting, running, succeeded] {
        assert_rejected(&format!("SELECT * FROM durable_jobs.replay_durable_job({id}, '{{}}')"), "55000");
    }
    assert_eq!(complete(running, "w", token), "succeeded");
    assert_eq!(
        // Not job_id + 1000: the database may hold a job of that id (failed once with 55000).
        one::<i64>(&format!("SELECT count(*) FROM durable_jobs.replay_durable_job({}, '{{}}')", i64::MAX)),
        0,
        "an unknown job: no row"
    );
    // A job from before 0.4.0 without a key kept no fingerprint.
    let old = failed_job("{}");
    Spi::run_with_args("UPDATE durable_jobs.durable_job SET payload_sha256 = NULL WHERE job_id = $1", &[old.into()])
        .unwrap();
    assert_rejected(&format!("SELECT * FROM durable_jobs.replay_durable_job({old}, '{{}}')"), "55000");
}

#[pg_test]
fn replay_of_another_roles_job_is_answered_as_a_missing_one() {
    Spi::run(
        "CREATE ROLE dj_replay_owner; CREATE ROLE dj_replay_stranger;
         GRANT USAGE ON SCHEMA durable_jobs, tests TO dj_replay_owner, dj_replay_stranger;
         GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer, text),
                                   durable_jobs.cancel_durable_job(bigint),
                                   durable_jobs.replay_durable_job(bigint, jsonb, integer)
             TO dj_replay_owner, dj_replay_stranger;
         SET LOCAL ROLE dj_replay_owner",
    )
    .unwrap();
    let job_id = enqueue("k", "{}");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[job_id.into()]).unwrap();
    // No row, as for a missing job (42501 before 0.6.0, which told the stranger it existed).
    Spi::run("SET LOCAL ROLE dj_replay_stranger").unwrap();
    let replayed = one::<i64>(&format!("SELECT count(*) FROM durable_jobs.replay_durable_job({job_id}, '{{}}')"));
    assert_eq!(replayed, 0);
    Spi::run("RESET ROLE").unwrap();
    assert_eq!(job_state(job_id), "cancelled", "the refused replay changed nothing");
    Spi::run("SET LOCAL ROLE dj_replay_owner").unwrap();
    assert_eq!(
        one::<String>(&format!("SELECT job_state FROM durable_jobs.replay_durable_job({job_id}, '{{}}')")),
        "available"
    );
}

#[pg_test]
fn wait_returns_at_once_when_the_job_already_differs_and_at_the_timeout_otherwise() {
    let job_id = enqueue("k", "{}");
    let started = std::time::Instant::now();
    assert_eq!(
        one::<i64>(&format!("SELECT state_version FROM durable_jobs.wait_for_durable_job({job_id}, 0, 5)")),
        1,
        "a known version that differs: at once"
    );
    // At once: far below the 5 s a wait to its timeout takes (a bound a loaded machine cannot
    // reach; it was 2 s).
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    // The job is this test transaction's own, uncommitted: a wait that would sleep raises at once
    // (the waits to the timeout, of a committed job, are in tests/status.rs).
    assert_rejected(&format!("SELECT * FROM durable_jobs.wait_for_durable_job({job_id}, 1, 3)"), "25000");
    assert_rejected(&format!("SELECT * FROM durable_jobs.wait_for_durable_job({job_id}, NULL, 3)"), "25000");
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[job_id.into()]).unwrap();
    assert_eq!(
        one::<String>(&format!("SELECT job_state FROM durable_jobs.wait_for_durable_job({job_id})")),
        "cancelled",
        "a terminal job: at once"
    );
    assert_eq!(
        one::<i64>(&format!("SELECT count(*) FROM durable_jobs.wait_for_durable_job({}, NULL, 0)", i64::MAX)),
        0,
        "an unknown job: no row"
    );
    for arguments in ["1, -1", "1, 300.5", "1, 'NaN'"] {
        assert_rejected(&format!("SELECT * FROM durable_jobs.wait_for_durable_job({job_id}, {arguments})"), "22023");
    }
    assert_rejected("SELECT * FROM durable_jobs.wait_for_durable_job(NULL)", "22004");
    assert_rejected(&format!("SELECT * FROM durable_jobs.wait_for_durable_job({job_id}, 1, NULL)"), "22004");
}

#[pg_test]
fn a_listing_over_many_enqueuing_roles_still_walks_every_job_once() {
    // 13 roles x 5 states is past the ranges merged in one statement: the lateral form runs.
    Spi::run(
        "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, payload, max_attempts, enqueued_by)
         SELECT 'many', 'k', '{}', 1, 'role_' || (g % 13) FROM generate_series(1, 130) g",
    )
    .unwrap();
    assert!(13 * crate::api::status::JOB_STATES.len() > crate::api::status::MERGED_RANGES_LIMIT);
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page: Vec<(i64, String)> = Spi::connect(|client| {
            client
                .select(
                    "SELECT job_id, page_cursor FROM durable_jobs.list_durable_jobs('many', page_size => 40, page_cursor => $1)",
                    None,
                    &[cursor.clone().into()],
                )
                .unwrap()
                .map(|row| (row.get::<i64>(1).unwrap().unwrap(), row.get::<String>(2).unwrap().unwrap()))
                .collect()
        });
        let Some((_, last)) = page.last() else { break };
        cursor = Some(last.clone());
        seen.extend(page.iter().map(|(job_id, _)| *job_id));
    }
    let expected: Vec<i64> = Spi::connect(|client| {
        client
            .select("SELECT job_id FROM durable_jobs.durable_job WHERE queue_name = 'many' ORDER BY job_id DESC", None, &[])
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(seen, expected);
}
