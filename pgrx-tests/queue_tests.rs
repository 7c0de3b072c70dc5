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
