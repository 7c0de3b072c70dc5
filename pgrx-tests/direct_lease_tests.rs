// Direct leases (src/jobs/sleepers.rs): the worker's side of the word, which the end-to-end tests
// in tests/worker.rs cannot hold still.

/// A worker that waits for an enqueue's commit longer than its wait stops waiting: it takes the
/// job's lease and the enqueuing transaction from the word, and leaves the word awake (free for
/// the next enqueue to find the worker awake). The job goes back to the queue once that
/// transaction ended committed (`transaction_ended`; still running here: the test's own).
/// Failed before: the worker waited for the commit however long, and ran
/// no other job meanwhile.
#[pg_test]
fn a_worker_stops_waiting_for_an_enqueues_commit_that_outlasts_its_wait() {
    use crate::jobs::sleepers::{transaction_ended, wake_up, Handed};
    let job = (42_i64, pgrx::Uuid::from_bytes([7; 16]));
    let enqueuing = unsafe { pg_sys::GetTopTransactionId() };
    // Worker 1 of the test cluster stays switched off: its word is this test's to set.
    crate::jobs::sleepers::committing_for_test(1, job, enqueuing);
    let started = std::time::Instant::now();
    match wake_up(1) {
        Handed::Late(late, transaction) => assert_eq!((late, transaction), (job, enqueuing)),
        _ => panic!("the worker did not stop waiting"),
    }
    assert!(started.elapsed() >= std::time::Duration::from_secs(1));
    assert!(matches!(wake_up(1), Handed::Nothing), "the word was left committing");
    assert_eq!(transaction_ended(enqueuing), None);
    let created: u32 = Spi::get_one::<pg_sys::TransactionId>(
        "SELECT xmin FROM pg_catalog.pg_class WHERE oid = 'durable_jobs.durable_job'::pg_catalog.regclass",
    )
    .unwrap()
    .unwrap()
    .into();
    assert_eq!(transaction_ended(created.into()), Some(true));
}
