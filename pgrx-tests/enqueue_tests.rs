
#[pg_test]
fn enqueue_returns_a_new_available_job() {
    let job_id: i64 = one("SELECT durable_jobs.enqueue_durable_job('send_email', '{\"to\": 1}')");
    let (state, queue) = Spi::get_two_with_args::<String, String>(
        "SELECT job_state, queue_name FROM durable_jobs.durable_job WHERE job_id = $1",
        &[job_id.into()],
    )
    .unwrap();
    assert_eq!(state.as_deref(), Some("available"));
    assert_eq!(queue.as_deref(), Some("default"));
}

#[pg_test]
fn enqueue_rejects_null_kind() {
    assert_rejected("SELECT durable_jobs.enqueue_durable_job(NULL, '{}')", "22004");
}
