//! Latches: this process's number as shared slots keep it, setting another process's latch,
//! sleeping on this one's, holding query cancels off around a wait, and running a function at
//! the current transaction's commit.

use pgrx::pg_sys;
use pgrx::PgXactCallbackEvent;

/// At the end of the current transaction: `on_commit` if it committed (once the change is
/// visible), then `forget` in any case. A prepared transaction only forgets: it commits later,
/// maybe from another session.
pub fn at_commit_or_forget(on_commit: fn(), forget: fn()) {
    pgrx::register_xact_callback(PgXactCallbackEvent::Commit, move || {
        on_commit();
        forget();
    });
    for event in [PgXactCallbackEvent::Abort, PgXactCallbackEvent::Prepare] {
        pgrx::register_xact_callback(event, forget);
    }
}

/// This process, named as shared slots keep it: `pgprocno + 1`, so that 0 can mean none.
pub fn my_procno_plus_one() -> i32 {
    unsafe { (*pg_sys::MyProc).pgprocno + 1 }
}

/// Sets the latch of the process `procno_plus_one` names (as `my_procno_plus_one`); 0 is none.
pub fn set_latch_of(procno_plus_one: i32) {
    if procno_plus_one > 0 {
        unsafe {
            let process = (*pg_sys::ProcGlobal).allProcs.add((procno_plus_one - 1) as usize);
            pg_sys::SetLatch(&raw mut (*process).procLatch);
        }
    }
}

/// Sleeps on this process's latch for at most `timeout` (wait event `Extension`), resets it,
/// then checks for interrupts (a query cancel or a terminate ends the sleep with its error).
/// A latch set before the sleep ends it at once, so a caller that reads shared state, then
/// sleeps, misses no change whose setter set the latch after making it visible. Returns
/// whether the latch was set (false: the time ran out).
pub fn sleep_on_latch(timeout: std::time::Duration) -> bool {
    // Interrupts first, as PostgreSQL's own wait loops do: a cancel that came while interrupts
    // were held, and whose latch a lock wait since reset, would otherwise wait out the timeout.
    pg_sys::check_for_interrupts!();
    let events = unsafe {
        let events = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout.as_millis().max(1) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        events
    };
    pg_sys::check_for_interrupts!();
    events & pg_sys::WL_LATCH_SET as i32 != 0
}

/// Runs `wait` with query cancels held off (a terminate still ends it), then drops any cancel
/// that came meanwhile: for a worker waiting on its role runner, to which a cancel means nothing
/// (it would abort the poll and strand the claim's later batches until their leases lapse).
/// Only around waits that arm no timeout: `lock_timeout` and `statement_timeout` raise through
/// the same flag, and a held one would never fire.
pub fn past_cancels<R>(wait: impl FnOnce() -> R) -> R {
    unsafe {
        let held = pg_sys::QueryCancelHoldoffCount;
        pg_sys::QueryCancelHoldoffCount = held + 1;
        let result = wait();
        (&raw mut pg_sys::QueryCancelPending).write_volatile(0);
        pg_sys::QueryCancelHoldoffCount = held;
        result
    }
}
