// A job's subtransaction (`execution::in_subtransaction`) when releasing it raises an error: another
// extension's subtransaction callback (postgres_fdw at PRE_COMMIT_SUB, Citus at COMMIT_SUB).

/// The subtransaction event at which `fail_once_at_release` raises its error next; none when
/// u32::MAX.
static FAIL_AT_EVENT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);

#[pg_guard]
unsafe extern "C-unwind" fn fail_once_at_release(
    event: pg_sys::SubXactEvent::Type,
    _subtransaction: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use std::sync::atomic::Ordering;
    if FAIL_AT_EVENT.compare_exchange(event, u32::MAX, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
        error!("release failed on purpose");
    }
}

/// Arms `fail_once_at_release` for the next `event` of this session.
fn fail_at_next_release(event: pg_sys::SubXactEvent::Type) {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| unsafe { pg_sys::RegisterSubXactCallback(Some(fail_once_at_release), std::ptr::null_mut()) });
    FAIL_AT_EVENT.store(event, std::sync::atomic::Ordering::Relaxed);
}

fn write_a_row_in_a_job_subtransaction() -> Result<bool, crate::execution::CaughtFailure> {
    Spi::run("CREATE TEMP TABLE written (n int)").unwrap();
    crate::execution::in_subtransaction(|| {
        Spi::run("INSERT INTO written VALUES (1)").unwrap();
        true
    })
}

#[pg_test]
fn an_error_while_a_job_subtransaction_is_released_fails_that_job_alone() {
    // Before: the error left in_subtransaction and failed the batch's whole transaction.
    fail_at_next_release(pg_sys::SubXactEvent::SUBXACT_EVENT_PRE_COMMIT_SUB);
    let outcome = write_a_row_in_a_job_subtransaction();
    assert!(
        matches!(&outcome, Err(failure) if failure.message == "release failed on purpose"),
        "{:?}",
        outcome.map_err(|failure| failure.message)
    );
    assert_eq!(one::<i64>("SELECT count(*) FROM written"), 0, "the job's write was rolled back");
}

#[pg_test(error = "release failed on purpose")]
fn an_error_after_a_job_subtransaction_joined_its_parent_fails_the_transaction() {
    // Past PRE_COMMIT_SUB the subtransaction is among its parent's children: rolling back only
    // it would let the transaction's commit keep its write beside the job's failure.
    fail_at_next_release(pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB);
    let outcome = write_a_row_in_a_job_subtransaction();
    panic!("in_subtransaction returned instead: {:?}", outcome.map_err(|failure| failure.message));
}
