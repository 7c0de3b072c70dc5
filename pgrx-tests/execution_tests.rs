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

fn write_a_row_in_a_job_subtransaction() -> Result<bool, crate::worker::sandbox::CaughtFailure> {
    Spi::run("CREATE TEMP TABLE written (n int)").unwrap();
    crate::worker::sandbox::in_subtransaction(|| {
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

/// The worker's waits for rows other sessions hold, in one step of a batch (`RowWaits`): each
/// at most a quarter of what the leases at stake have left beyond a reserve of a quarter of the
/// margin, and together, waited one after another in full, at most half the margin, so that
/// those leases are still live when the step ends. The arithmetic the end-to-end tests of held
/// rows at renewal depend on, pinned here whatever the machine's speed. Broken on purpose (each
/// wait a fixed quarter of the margin): the first assertion failed, 500 against 150 ms.
#[pg_test]
fn waits_for_held_rows_leave_every_lease_of_the_step_live() {
    let second = 1_000_000i64;
    let start = 1_000 * second;
    // A 20 s lease's margin (2 s), 1.1 s left: a handler that used its whole timeout.
    let waits = crate::worker::execution::RowWaits::starting_at(start, start + 1_100_000, 2_000);
    assert_eq!(waits.wait_ms_at(start), 150, "(1,100 - 500) / 4 ms");
    for (left_ms, margin_ms) in [(1_100i64, 2_000i64), (9_500, 1_000), (3_000, 300), (60_000, 2_000), (400, 100)] {
        let waits = crate::worker::execution::RowWaits::starting_at(start, start + left_ms * 1000, margin_ms);
        // One wait after another, each used in full, as long as the step allows one.
        let (mut now, mut waited_ms) = (start, 0i64);
        loop {
            let wait_ms = waits.wait_ms_at(now);
            if wait_ms < 1 {
                break;
            }
            let left_now_ms = (start + left_ms * 1000 - now) / 1000;
            assert!(wait_ms <= (left_now_ms - margin_ms / 4) / 4, "{left_ms} ms left, margin {margin_ms}: one wait of {wait_ms}");
            now += wait_ms * 1000;
            waited_ms += wait_ms;
        }
        assert!(waited_ms <= margin_ms / 2, "{left_ms} ms left, margin {margin_ms}: {waited_ms} ms of waits in one step");
        assert!(start + left_ms * 1000 > now, "the leases outlive the step's waits");
    }
}
