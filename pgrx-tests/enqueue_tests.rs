// enqueue_durable_job: defaults, idempotency keys and bad input.

#[pg_test]
fn enqueue_fills_the_documented_defaults() {
    let job_id = enqueue("send_email", r#"{"to": 1}"#);
    let row = Spi::get_one_with_args::<bool>(
        "SELECT job_state = 'available' AND queue_name = 'default' AND priority = 0
                AND attempt_count = 0 AND max_attempts = 5 AND run_after = now()
                AND enqueued_by = current_user AND idempotency_key IS NULL
                AND lease_owner IS NULL AND finished_at IS NULL AND last_failure_code IS NULL
                AND payload = '{\"to\": 1}'
         FROM durable_jobs.durable_job WHERE job_id = $1",
        &[job_id.into()],
    );
    assert_eq!(row, Ok(Some(true)));
}

#[pg_test]
fn enqueue_takes_every_argument() {
    let job_id: i64 = one(
        "SELECT durable_jobs.enqueue_durable_job('etl.load', '[1, 2]', 'key-1', 'nightly',
                now() + interval '1 hour', 3, -7)",
    );
    let matches = Spi::get_one_with_args::<bool>(
        "SELECT queue_name = 'nightly' AND job_kind = 'etl.load' AND idempotency_key = 'key-1'
                AND max_attempts = 3 AND priority = -7 AND run_after = now() + interval '1 hour'
         FROM durable_jobs.durable_job WHERE job_id = $1",
        &[job_id.into()],
    );
    assert_eq!(matches, Ok(Some(true)));
}

#[pg_test]
fn max_attempts_default_follows_the_setting() {
    Spi::run("SET LOCAL durable_jobs.max_attempts = 9").unwrap();
    let job_id = enqueue("k", "{}");
    assert_eq!(job_field::<i32>(job_id, "max_attempts"), Some(9));
}

#[pg_test]
fn payload_is_kept_exactly() {
    // Numbers beyond f64 precision must survive: the payload is never parsed outside Postgres.
    let payload = r#"{"amount": 12345678901234567890.123456789, "nested": {"a": [true, null]}}"#;
    let job_id = enqueue("exact", payload);
    let same = Spi::get_one_with_args::<bool>(
        "SELECT payload = $2::jsonb FROM durable_jobs.durable_job WHERE job_id = $1",
        &[job_id.into(), payload.into()],
    );
    assert_eq!(same, Ok(Some(true)));
    // And the claim hands it out exactly (compared as jsonb, and as text: no number rounded).
    let (claimed_job, as_given, text) = Spi::get_three_with_args::<i64, bool, String>(
        "SELECT job_id, payload = $1::jsonb, payload::text FROM durable_jobs.claim_next_durable_job('w')",
        &[payload.into()],
    )
    .unwrap();
    assert_eq!((claimed_job, as_given), (Some(job_id), Some(true)));
    assert!(text.unwrap().contains("12345678901234567890.123456789"));
}

#[pg_test]
fn same_idempotency_key_and_payload_returns_the_existing_job() {
    let enqueue_keyed = |payload: &str| -> i64 {
        Spi::get_one_with_args::<i64>(
            "SELECT durable_jobs.enqueue_durable_job('charge', $1::jsonb, 'order-42')",
            &[payload.into()],
        )
        .unwrap()
        .unwrap()
    };
    let first = enqueue_keyed(r#"{"a": 1, "b": 2}"#);
    // Key order and spacing do not matter: jsonb compares values.
    let again = enqueue_keyed(r#"{ "b": 2,   "a": 1 }"#);
    assert_eq!(first, again);
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job"), 1);

    // Still recognised after the job finished and its payload was cleared.
    let (job_id, token) = claim("w").unwrap();
    assert_eq!(complete(job_id, "w", token), "succeeded");
    assert_eq!(job_field::<String>(first, "payload::text"), None);
    assert_eq!(enqueue_keyed(r#"{"a": 1, "b": 2}"#), first);
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job"), 1);
}

#[pg_test]
fn same_idempotency_key_with_other_kind_or_payload_is_rejected() {
    let first: i64 =
        one("SELECT durable_jobs.enqueue_durable_job('charge', '{\"a\": 1}', 'order-7')");
    assert_rejected(
        "SELECT durable_jobs.enqueue_durable_job('charge', '{\"a\": 2}', 'order-7')",
        "23505",
    );
    assert_rejected(
        "SELECT durable_jobs.enqueue_durable_job('refund', '{\"a\": 1}', 'order-7')",
        "23505",
    );
    // Also after the payload was cleared: the fingerprint remains.
    Spi::run_with_args("SELECT durable_jobs.cancel_durable_job($1)", &[first.into()]).unwrap();
    assert_rejected(
        "SELECT durable_jobs.enqueue_durable_job('charge', '{\"a\": 2}', 'order-7')",
        "23505",
    );
}

#[pg_test]
fn idempotency_keys_are_per_queue() {
    let a: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', 'same', 'queue-a')");
    let b: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{}', 'same', 'queue-b')");
    assert_ne!(a, b);
}

#[pg_test]
fn enqueue_rejects_bad_input() {
    let cases = [
        ("NULL, '{}'", "22004"),
        ("'', '{}'", "22023"),
        ("'has space', '{}'", "22023"),
        ("'k''; DROP TABLE durable_jobs.durable_job; --', '{}'", "22023"),
        ("repeat('k', 129), '{}'", "22023"),
        ("'k', NULL", "22004"),
        ("'k', '{}', ''", "22023"),
        ("'k', '{}', repeat('x', 256)", "22023"),
        ("'k', '{}', NULL, NULL", "22004"),
        ("'k', '{}', NULL, ''", "22023"),
        ("'k', '{}', NULL, 'default', NULL", "22004"),
        ("'k', '{}', NULL, 'default', 'infinity'", "22023"),
        ("'k', '{}', NULL, 'default', '-infinity'", "22023"),
        ("'k', '{}', NULL, 'default', now(), 0", "22023"),
        ("'k', '{}', NULL, 'default', now(), -1", "22023"),
        ("'k', '{}', NULL, 'default', now(), 1001", "22023"),
        ("'k', '{}', NULL, 'default', now(), 3, NULL", "22004"),
        ("'k', '{}', NULL, 'default', now(), 3, 1001", "22023"),
        ("'k', '{}', NULL, 'default', now(), 3, -1001", "22023"),
    ];
    enqueue("existing", "{}");
    for (arguments, sqlstate) in cases {
        assert_rejected(&format!("SELECT durable_jobs.enqueue_durable_job({arguments})"), sqlstate);
    }
    // Malformed JSON never reaches us: jsonb input rejects it.
    assert_rejected("SELECT durable_jobs.enqueue_durable_job('k', '{oops')", "22P02");
}

#[pg_test]
fn enqueue_rejects_a_payload_over_the_size_limit() {
    Spi::run("SET LOCAL durable_jobs.max_payload_size = '1kB'").unwrap();
    assert_rejected(
        "SELECT durable_jobs.enqueue_durable_job('k', jsonb_build_object('blob', repeat('x', 2000)))",
        "54000",
    );
    enqueue("k", r#"{"small": true}"#);
}

#[pg_test]
fn batch_enqueue_returns_ids_in_payload_order() {
    let ids: Vec<i64> = Spi::connect(|client| {
        client
            .select(
                "SELECT * FROM durable_jobs.enqueue_durable_jobs('etl.step',
                     ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}']::jsonb[], NULL, 'batch',
                     now(), 4, 7)",
                None,
                &[],
            )
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    assert_eq!(ids.len(), 3);
    for (position, job_id) in ids.iter().enumerate() {
        assert_eq!(job_field::<i64>(*job_id, "(payload->>'n')::int8"), Some(position as i64 + 1));
        assert_eq!(
            job_field::<bool>(*job_id, "queue_name = 'batch' AND job_kind = 'etl.step' AND max_attempts = 4
                                        AND priority = 7 AND enqueued_by = current_user AND job_state = 'available'"),
            Some(true)
        );
    }
}

#[pg_test]
fn batch_enqueue_with_keys_is_idempotent_per_element() {
    let first: Vec<i64> = Spi::connect(|client| {
        client
            .select(
                "SELECT * FROM durable_jobs.enqueue_durable_jobs('k', ARRAY['{\"a\": 1}', '{\"a\": 2}']::jsonb[],
                                                                 ARRAY['key-1', NULL])",
                None,
                &[],
            )
            .unwrap()
            .map(|row| row.get::<i64>(1).unwrap().unwrap())
            .collect()
    });
    let again: i64 = one("SELECT durable_jobs.enqueue_durable_job('k', '{\"a\": 1}', 'key-1')");
    assert_eq!(again, first[0]);
    assert_rejected(
        "SELECT * FROM durable_jobs.enqueue_durable_jobs('k', ARRAY['{\"a\": 9}']::jsonb[], ARRAY['key-1'])",
        "23505",
    );
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job"), 2);
}

#[pg_test]
fn batch_enqueue_rejects_bad_input() {
    enqueue("existing", "{}");
    for (arguments, sqlstate) in [
        ("NULL, ARRAY['{}']::jsonb[]", "22004"),
        ("'k', NULL", "22004"),
        ("'k', ARRAY['{}', NULL]::jsonb[]", "22004"),
        ("'k', ARRAY['{}', '{}']::jsonb[], ARRAY['only-one']", "22023"),
        ("'k', ARRAY['{}']::jsonb[], ARRAY['']", "22023"),
        ("'bad kind', ARRAY['{}']::jsonb[]", "22023"),
        ("'k', ARRAY['{}']::jsonb[], NULL, 'default', now(), 0", "22023"),
    ] {
        assert_rejected(&format!("SELECT * FROM durable_jobs.enqueue_durable_jobs({arguments})"), sqlstate);
    }
    Spi::run("SET LOCAL durable_jobs.max_payload_size = '1kB'").unwrap();
    assert_rejected(
        "SELECT * FROM durable_jobs.enqueue_durable_jobs('k', ARRAY['{}'::jsonb, jsonb_build_object('b', repeat('x', 2000))])",
        "54000",
    );
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.enqueue_durable_jobs('k', ARRAY[]::jsonb[])"), 0);
}

/// The WAL records of one statement and what it ran (EXPLAIN's WAL counters are this backend's).
fn wal_records_of(statement: &str) -> i64 {
    let plan = one::<pgrx::Json>(&format!("EXPLAIN (ANALYZE, WAL, FORMAT JSON) {statement}")).0;
    plan[0]["Plan"]["WAL Records"].as_i64().unwrap()
}

/// A job without an idempotency key can conflict with no other, so its insert is a plain one:
/// it writes what one job of `enqueue_durable_jobs` writes. Failed before: ON CONFLICT's
/// speculative insertion added a record to every enqueue (688 against 639 WAL bytes).
#[pg_test]
fn an_enqueue_without_a_key_writes_no_more_than_a_plain_insert() {
    let single = "SELECT durable_jobs.enqueue_durable_job('k', '{}')";
    let batch = "SELECT durable_jobs.enqueue_durable_jobs('k', ARRAY['{}'::jsonb])";
    // The fewest of a few: a page split or a new page adds records now and then.
    let fewest = |statement: &str| (0..5).map(|_| wal_records_of(statement)).min().unwrap();
    fewest(single);
    fewest(batch);
    assert_eq!(fewest(single), fewest(batch));
}
