//! The job table's CHECK constraints and the payload trigger's WHEN condition, as C functions.
//!
//! PostgreSQL reads a table's CHECK expressions (and a trigger's WHEN) back from their stored
//! text and prepares them once per statement: written out in SQL, ours were 12 KB of node text,
//! half the time of the enqueue function for one job and a sixth of a one-job claim (perf). A
//! call of one of these functions is a few hundred bytes. Each constraint keeps its name and its
//! meaning (`pgrx-tests/schema_tests.rs` compares every function with the SQL it replaces): a
//! function returns false exactly where that SQL was false, and true where it was true or NULL
//! (a CHECK passes both).
//!
//! Plain V1 functions, with no pgrx argument conversion: they run once per written row each.
//! They run no SQL and look up no name, so they pin no search_path (a `SET` clause would cost a
//! GUC save and restore per call).

use pgrx::pg_sys;
use pgrx::prelude::*;

// The lists are the 0.4.0 schema's rules, frozen here: every later library serves an installed
// 0.4.0 schema through these symbols, so a new state or failure code needs new functions and an
// update script, never an edit of these lists.

/// The job states, in the order of their life.
pub const JOB_STATES: [&str; 5] = ["available", "running", "succeeded", "failed", "cancelled"];
/// The failure codes the table accepts.
pub const FAILURE_CODES: [&str; 6] = [
    "invalid_request",
    "integrity_violation",
    "target_rejected",
    "target_unavailable",
    "unexpected_failure",
    "lease_expired",
];
const PENDING_STATES: [&str; 2] = ["available", "running"];
const TERMINAL_STATES: [&str; 3] = ["succeeded", "failed", "cancelled"];

/// The functions defined here, by SQL name.
#[cfg_attr(not(any(test, feature = "pg_test")), allow(dead_code))]
pub const C_FUNCTIONS: [&str; 10] = [
    "durable_job_state_known",
    "durable_job_names_not_empty",
    "durable_job_priority_range",
    "durable_job_attempts_within_max",
    "durable_job_payload_only_while_pending",
    "durable_job_lease_only_while_running",
    "durable_job_finished_only_when_terminal",
    "durable_job_failure_code_known",
    "durable_job_status_fields_valid",
    "durable_job_terminal_row_uncleared",
];

/// Argument `n` of the call, None when NULL.
unsafe fn argument(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<pg_sys::Datum> {
    unsafe {
        let argument = (*fcinfo).args.as_slice(n + 1)[n];
        (!argument.isnull).then_some(argument.value)
    }
}

/// Text argument `n` as bytes (detoasted: a value the row kept may be stored apart).
unsafe fn text_argument<'a>(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<&'a [u8]> {
    unsafe {
        argument(fcinfo, n).map(|datum| {
            let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
            pgrx::varlena::varlena_to_byte_slice(text)
        })
    }
}

/// Length in bytes of text argument `n`, as `octet_length` reads it (without detoasting).
unsafe fn text_length(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<usize> {
    unsafe { argument(fcinfo, n).map(|datum| pg_sys::toast_raw_datum_size(datum) - pg_sys::VARHDRSZ) }
}

unsafe fn int_argument(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<i64> {
    unsafe { argument(fcinfo, n).map(|datum| datum.value() as i64) }
}

unsafe fn int4_argument(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<i64> {
    unsafe { argument(fcinfo, n).map(|datum| i64::from(datum.value() as i32)) }
}

fn is_one_of(value: &[u8], allowed: &[&str]) -> bool {
    allowed.iter().any(|a| a.as_bytes() == value)
}

/// SQL's `x IN (list)` under CHECK: NULL passes.
fn in_list_or_null(value: Option<&[u8]>, allowed: &[&str]) -> bool {
    value.is_none_or(|v| is_one_of(v, allowed))
}

/// SQL's `x BETWEEN low AND high` under CHECK: a NULL bound or value passes.
fn between_or_null(value: Option<i64>, low: Option<i64>, high: Option<i64>) -> bool {
    let above = match (value, low) {
        (Some(v), Some(l)) => v >= l,
        _ => true,
    };
    let below = match (value, high) {
        (Some(v), Some(h)) => v <= h,
        _ => true,
    };
    above && below
}

/// The V1 call-convention records (`pg_finfo_<name>`) of the library's hand-written C
/// functions, which PostgreSQL looks up beside each symbol.
#[macro_export]
macro_rules! v1_function_info {
    ($($info:ident),* $(,)?) => {
        $(
            #[unsafe(no_mangle)]
            #[doc(hidden)]
            pub extern "C" fn $info() -> &'static ::pgrx::pg_sys::Pg_finfo_record {
                const V1_API: ::pgrx::pg_sys::Pg_finfo_record = ::pgrx::pg_sys::Pg_finfo_record { api_version: 1 };
                &V1_API
            }
        )*
    };
}

/// Exports `check(fcinfo) -> bool` as the V1 function `name` of the library.
macro_rules! row_rule {
    ($name:ident, $finfo:ident, $check:ident) => {
        $crate::v1_function_info!($finfo);

        #[pg_guard]
        #[unsafe(no_mangle)]
        pub unsafe extern "C-unwind" fn $name(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
            pg_sys::Datum::from(unsafe { $check(fcinfo) })
        }
    };
}

// job_state IN ('available', 'running', 'succeeded', 'failed', 'cancelled')
unsafe fn state_known(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe { in_list_or_null(text_argument(fcinfo, 0), &JOB_STATES) }
}
row_rule!(durable_job_state_known, pg_finfo_durable_job_state_known, state_known);

// queue_name <> '' AND job_kind <> ''
unsafe fn names_not_empty(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        text_length(fcinfo, 0).is_none_or(|length| length > 0)
            && text_length(fcinfo, 1).is_none_or(|length| length > 0)
    }
}
row_rule!(durable_job_names_not_empty, pg_finfo_durable_job_names_not_empty, names_not_empty);

// priority BETWEEN -1000 AND 1000
unsafe fn priority_range(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe { between_or_null(int4_argument(fcinfo, 0), Some(-1000), Some(1000)) }
}
row_rule!(durable_job_priority_range, pg_finfo_durable_job_priority_range, priority_range);

// max_attempts BETWEEN 1 AND 1000 AND attempt_count BETWEEN 0 AND max_attempts
unsafe fn attempts_within_max(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        let max_attempts = int4_argument(fcinfo, 0);
        between_or_null(max_attempts, Some(1), Some(1000))
            && between_or_null(int4_argument(fcinfo, 1), Some(0), max_attempts)
    }
}
row_rule!(durable_job_attempts_within_max, pg_finfo_durable_job_attempts_within_max, attempts_within_max);

// (job_state IN ('available', 'running')) = (payload IS NOT NULL)
unsafe fn payload_only_while_pending(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        text_argument(fcinfo, 0)
            .is_none_or(|state| is_one_of(state, &PENDING_STATES) == argument(fcinfo, 1).is_some())
    }
}
row_rule!(
    durable_job_payload_only_while_pending,
    pg_finfo_durable_job_payload_only_while_pending,
    payload_only_while_pending
);

// CASE WHEN job_state = 'running'
//      THEN lease_owner IS NOT NULL AND lease_token IS NOT NULL AND lease_expires_at IS NOT NULL
//      ELSE lease_owner IS NULL AND lease_token IS NULL AND lease_expires_at IS NULL END
unsafe fn lease_only_while_running(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        let running = text_argument(fcinfo, 0) == Some(b"running".as_slice());
        (1..=3).all(|n| argument(fcinfo, n).is_some() == running)
    }
}
row_rule!(
    durable_job_lease_only_while_running,
    pg_finfo_durable_job_lease_only_while_running,
    lease_only_while_running
);

// (job_state IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)
unsafe fn finished_only_when_terminal(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        text_argument(fcinfo, 0)
            .is_none_or(|state| is_one_of(state, &TERMINAL_STATES) == argument(fcinfo, 1).is_some())
    }
}
row_rule!(
    durable_job_finished_only_when_terminal,
    pg_finfo_durable_job_finished_only_when_terminal,
    finished_only_when_terminal
);

// last_failure_code IS NULL OR last_failure_code IN (<the failure codes>)
unsafe fn failure_code_known(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe { text_argument(fcinfo, 0).is_none_or(|code| is_one_of(code, &FAILURE_CODES)) }
}
row_rule!(durable_job_failure_code_known, pg_finfo_durable_job_failure_code_known, failure_code_known);

// state_version >= 1 AND replay_count >= 0
// AND (last_failure_sqlstate IS NULL OR octet_length(last_failure_sqlstate) = 5)
unsafe fn status_fields_valid(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        between_or_null(int_argument(fcinfo, 0), Some(1), None)
            && between_or_null(int4_argument(fcinfo, 1), Some(0), None)
            && text_length(fcinfo, 2).is_none_or(|length| length == 5)
    }
}
row_rule!(durable_job_status_fields_valid, pg_finfo_durable_job_status_fields_valid, status_fields_valid);

// The trigger's WHEN (NULL does not fire it):
// job_state IN ('succeeded', 'failed', 'cancelled') AND (payload IS NOT NULL OR finished_at IS NULL)
unsafe fn terminal_row_uncleared(fcinfo: pg_sys::FunctionCallInfo) -> bool {
    unsafe {
        text_argument(fcinfo, 0).is_some_and(|state| is_one_of(state, &TERMINAL_STATES))
            && (argument(fcinfo, 1).is_some() || argument(fcinfo, 2).is_none())
    }
}
row_rule!(
    durable_job_terminal_row_uncleared,
    pg_finfo_durable_job_terminal_row_uncleared,
    terminal_row_uncleared
);
