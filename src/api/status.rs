//! The status API: read one job, list jobs in keyset pages, wait for a job to change. A caller
//! sees the jobs of the roles whose privileges it has; superusers and roles with the extension
//! owner's privileges see all. Any other job is simply not there, to these reads as to every
//! other function (cancel and replay answer it as a missing job). No status row ever carries a
//! payload or a lease token. (A little over 400 lines: the three share their visibility rule and
//! their row.)

use crate::jobs::arguments;
use crate::jobs::wait_horizon;
use crate::jobs::waiters::WaiterSlot;
use crate::pg::plans;
use crate::pg::privilege::{as_extension_owner_of, caller, Caller};
use crate::pg::sql_types::{JobListingRow, JobStatusRow};
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// The columns of `durable_jobs.durable_job_status`, in its order, from job row `j`.
#[macro_export]
macro_rules! status_columns {
    () => {
        "j.job_id, j.queue_name, j.job_kind, j.job_state, j.state_version, j.attempt_count,
         j.max_attempts, j.last_failure_code, j.last_failure_sqlstate, j.priority, j.run_after,
         j.lease_owner, j.lease_expires_at, j.idempotency_key, j.enqueued_by, j.created_at,
         j.updated_at, j.finished_at, j.replay_count"
    };
}

/// $2: the caller sees every job; $3: the caller's role. (Also the rule of `api::attempts`.)
#[macro_export]
macro_rules! visible_to_caller {
    () => {
        "($2 OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                        WHERE r.rolname = j.enqueued_by AND pg_catalog.pg_has_role($3, r.oid, 'USAGE')))"
    };
}

const GET_WITH_VERSION: &str = concat!(
    "SELECT ROW(",
    status_columns!(),
    ")::durable_jobs.durable_job_status, j.job_state, j.state_version,
           j.xmin::pg_catalog.text::pg_catalog.int8
    FROM durable_jobs.durable_job j
    WHERE j.job_id = $1 AND ",
    visible_to_caller!()
);

/// The roles whose jobs a caller that does not see all may see.
const VISIBLE_ROLES: &str = "
    SELECT COALESCE(pg_catalog.array_agg(r.rolname::pg_catalog.text), '{}')
    FROM pg_catalog.pg_roles r WHERE pg_catalog.pg_has_role($1, r.oid, 'USAGE')";

/// The job states, in the order their index ranges are listed.
pub const JOB_STATES: [&str; 5] = ["available", "running", "succeeded", "failed", "cancelled"];

/// Whether `caller` sees every job: a superuser, or a role with the extension owner's privileges.
pub(crate) fn sees_all_jobs(caller: &Caller, owner: pg_sys::Oid) -> bool {
    caller.is_superuser || unsafe { pg_sys::has_privs_of_role(caller.role_oid, owner) }
}

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn get_durable_job(job_id: Option<i64>) -> SetOfIterator<'static, JobStatusRow> {
    let job_id = arguments::required(job_id, "job_id");
    SetOfIterator::new(read_job_with_version(job_id).map(|(row, ..)| row))
}

/// The job's status row, if the current role sees the job, with its state, state_version and
/// the xmin of its row version (see `changed_by_this_transaction`).
fn read_job_with_version(job_id: i64) -> Option<(JobStatusRow, String, i64, pg_sys::TransactionId)> {
    let caller = caller();
    as_extension_owner_of(|installed| {
        let sees_all = sees_all_jobs(&caller, installed.owner);
        Spi::connect_mut(|client| {
            let rows = plans::execute(
                client,
                GET_WITH_VERSION,
                &[job_id.into(), sees_all.into(), caller.role_oid.into()],
            );
            rows.into_iter().next().map(|row| {
                (
                    row.get::<JobStatusRow>(1).unwrap().expect("a status row"),
                    row.get::<String>(2).unwrap().expect("job_state"),
                    row.get::<i64>(3).unwrap().expect("state_version"),
                    pg_sys::TransactionId::from(row.get::<i64>(4).unwrap().expect("xmin") as u32),
                )
            })
        })
    })
}

/// Whether a row version with this xmin was written by this transaction or one of its
/// subtransactions, not committed yet. The raw xmin is read: a row left unchanged for some four
/// billion transactions (frozen) could take a current xid for its own, a wait then raising where
/// it would sleep.
fn changed_by_this_transaction(xmin: pg_sys::TransactionId) -> bool {
    unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xmin) }
}

/// The longest wait_for_durable_job may sleep, in seconds.
const WAIT_TIMEOUT_LIMIT: f64 = 300.0;

/// How often a waiter re-reads the job when no commit will wake it: no slot was free, the
/// library is not preloaded, or the server is a standby.
const FALLBACK_RECHECK: Duration = Duration::from_secs(1);

/// How often a waiter that commits wake re-reads the job anyway, for changes made outside our
/// functions (a manual UPDATE, a session still running the previous library). Once a second,
/// 200 sleeping waiters cost the worker 8 % of its throughput (docs/benchmarks.md).
const WOKEN_RECHECK: Duration = Duration::from_secs(10);

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn wait_for_durable_job(
    job_id: Option<i64>,
    known_version: default!(Option<i64>, "NULL"),
    timeout_seconds: default!(Option<f64>, "30"),
    fcinfo: pg_sys::FunctionCallInfo,
) -> SetOfIterator<'static, JobStatusRow> {
    let job_id = arguments::required(job_id, "job_id");
    let timeout_seconds = arguments::required(timeout_seconds, "timeout_seconds");
    if !(0.0..=WAIT_TIMEOUT_LIMIT).contains(&timeout_seconds) {
        arguments::invalid(&format!("timeout_seconds must be between 0 and {WAIT_TIMEOUT_LIMIT}"));
    }
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        // Its snapshot would never show the change it waits for.
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_INVALID_TRANSACTION_STATE,
            "wait_for_durable_job needs a READ COMMITTED transaction",
            "Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot never shows the change it waits for."
        );
    }
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_seconds);
    let statement_snapshot = wait_horizon::call_is_whole_statement(fcinfo);
    // Published before the first read: a commit after that read sets the latch, so the sleep
    // below returns at once, and no wake-up is missed between the read and the sleep.
    let slot = WaiterSlot::take(job_id, known_version.is_none());
    let row = loop {
        let Some((row, state, version, xmin)) = without_keeping_locks(|| read_job_with_version(job_id))
        else {
            break None;
        };
        let changed = match known_version {
            Some(known) => version != known,
            None => matches!(state.as_str(), "succeeded" | "failed" | "cancelled"),
        };
        let now = Instant::now();
        if changed || now >= deadline {
            break Some(row);
        }
        if changed_by_this_transaction(xmin) {
            // Nothing can change the job before this transaction commits (its row is this
            // transaction's): the wait would only sleep out its timeout.
            ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_INVALID_TRANSACTION_STATE,
                "wait_for_durable_job cannot wait for a job whose last change is this transaction's own, not committed yet",
                "Nothing can change the job before this transaction commits: commit first, then wait."
            );
        }
        // On a standby, changes arrive by WAL replay, which runs no commit of ours to wake anyone.
        let woken = slot.is_woken_at_commit() && !unsafe { pg_sys::RecoveryInProgress() };
        let recheck = if woken { WOKEN_RECHECK } else { FALLBACK_RECHECK };
        let sleep = (deadline - now).min(recheck);
        wait_horizon::release_for_sleep(statement_snapshot);
        // A query cancel or a terminate ends the wait here (57014, 57P01).
        crate::pg::latch::sleep_on_latch(sleep);
    };
    drop(slot);
    SetOfIterator::new(row)
}

/// Runs `read` in a subtransaction that is then rolled back, so that the locks its statements
/// took (the job table, its indexes, catalogs) go with it: a waiter holds none while it sleeps,
/// and DDL on the table (ALTER EXTENSION UPDATE, say) does not wait for it, with every enqueue
/// and claim queued behind that DDL. SPI copies what `read` returns into the caller's context.
fn without_keeping_locks<R>(read: impl FnOnce() -> R) -> R {
    unsafe {
        let memory_context = pg_sys::CurrentMemoryContext;
        let resource_owner = pg_sys::CurrentResourceOwner;
        let leave = || {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            pg_sys::MemoryContextSwitchTo(memory_context);
            pg_sys::CurrentResourceOwner = resource_owner;
        };
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(memory_context);
        let result = PgTryBuilder::new(std::panic::AssertUnwindSafe(read))
            .catch_others(|error| {
                leave();
                error.rethrow()
            })
            .execute();
        leave();
        result
    }
}

/// The filters of one listing, validated; a page cursor is bound to them.
pub struct ListFilters {
    pub queue_name: Option<String>,
    /// Sorted, without repeats; empty means every state.
    pub job_states: Vec<&'static str>,
    pub job_kind: Option<String>,
}

impl ListFilters {
    fn new(
        queue_name: Option<String>,
        job_states: Option<Vec<Option<String>>>,
        job_kind: Option<String>,
    ) -> Self {
        let queue_name = queue_name.map(|name| arguments::name(Some(name), "queue_name"));
        let job_kind = job_kind.map(|kind| arguments::name(Some(kind), "job_kind"));
        let job_states = match job_states {
            None => Vec::new(),
            Some(states) if states.is_empty() => {
                arguments::invalid("job_states must be NULL (every state) or a non-empty array")
            }
            Some(states) => {
                let mut known: Vec<&'static str> = states
                    .iter()
                    .map(|state| {
                        JOB_STATES
                            .iter()
                            .copied()
                            .find(|known| Some(*known) == state.as_deref())
                            .unwrap_or_else(|| {
                                arguments::invalid(&format!(
                                    "job_states elements must be one of {}",
                                    JOB_STATES.join(", ")
                                ))
                            })
                    })
                    .collect();
                known.sort_by_key(|state| JOB_STATES.iter().position(|s| s == state));
                known.dedup();
                known
            }
        };
        ListFilters { queue_name, job_states, job_kind }
    }

    /// A 64-bit FNV-1a digest of the filters; a cursor carries it, so that it continues only the
    /// listing it was made for. Stable across builds and servers (unlike std's hasher).
    fn digest(&self) -> u64 {
        let mut text = String::from("durable_jobs list v1");
        for part in [self.queue_name.as_deref(), Some(&self.job_states.join(",")), self.job_kind.as_deref()] {
            text.push('\u{0}');
            match part {
                Some(value) => {
                    text.push('=');
                    text.push_str(value);
                }
                None => text.push('-'),
            }
        }
        text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// The text that follows the job id in each of this listing's cursors.
    fn cursor_tag(&self) -> String {
        format!("{:016x}", self.digest())
    }

    /// The job id a cursor continues after; 22023 for anything but a cursor of this listing.
    fn continue_after(&self, page_cursor: &str) -> i64 {
        let parsed = page_cursor
            .split_once('-')
            .filter(|(_, tag)| *tag == self.cursor_tag())
            .and_then(|(job_id, _)| i64::from_str_radix(job_id, 16).ok())
            .filter(|job_id| *job_id > 0);
        parsed.unwrap_or_else(|| {
            arguments::invalid("page_cursor is not a cursor of list_durable_jobs with these filters")
        })
    }

    /// The states whose index ranges a listing reads: those asked for, or all of them.
    fn range_states(&self) -> &[&'static str] {
        if self.job_states.is_empty() {
            &JOB_STATES
        } else {
            &self.job_states
        }
    }

    /// Whether the listing reads the primary key from the cursor down: a caller that sees
    /// every job, with neither states nor a queue to narrow it.
    pub fn reads_primary_key(&self, sees_all: bool) -> bool {
        sees_all && self.job_states.is_empty() && self.queue_name.is_none()
    }

    /// The listing statement. $1: list jobs below this id; $2: page size; $3: queue; $4: kind;
    /// $5: the enqueuing roles whose ranges are read (`roles` of them); $6: the cursor tag.
    /// It merges one index range per role and state (newest first), so that a page reads
    /// about a page of index entries however rare the states, and never an entry of a role
    /// the caller may not see (whose count its timing would betray). Past
    /// `MERGED_RANGES_LIMIT` ranges it reads each range by a lateral join instead: up to a
    /// page from each, but the statement stays small.
    pub fn statement(&self, sees_all: bool, roles: usize) -> String {
        let kind = "AND ($4::pg_catalog.text IS NULL OR j.job_kind = $4)";
        let queue = if self.queue_name.is_some() { "AND j.queue_name = $3" } else { "" };
        let page = |from: String| {
            format!(
                "SELECT ROW(page.*, pg_catalog.to_hex(page.job_id) || '-' || $6)::durable_jobs.durable_job_listing
                 FROM ({from}) AS page
                 ORDER BY page.job_id DESC
                 LIMIT $2"
            )
        };
        let columns = status_columns!();
        if self.reads_primary_key(sees_all) {
            return page(format!(
                "SELECT {columns} FROM durable_jobs.durable_job j WHERE j.job_id < $1 {kind}
                 ORDER BY j.job_id DESC LIMIT $2"
            ));
        }
        let states = self.range_states();
        let range = |role: &str, state: &str| {
            format!(
                "(SELECT {columns} FROM durable_jobs.durable_job j
                  WHERE (j.enqueued_by)::pg_catalog.text = {role} AND j.job_state = {state} {queue}
                    AND j.job_id < $1 {kind}
                  ORDER BY j.job_id DESC LIMIT $2)"
            )
        };
        if roles * states.len() <= MERGED_RANGES_LIMIT {
            let ranges: Vec<String> = (1..=roles)
                .flat_map(|role| states.iter().map(move |state| (role, *state)))
                .map(|(role, state)| range(&format!("$5[{role}]"), &format!("'{state}'")))
                .collect();
            if ranges.is_empty() {
                return page(format!("SELECT {columns} FROM durable_jobs.durable_job j WHERE false"));
            }
            return page(ranges.join(" UNION ALL "));
        }
        // One lateral join per state, the state written out: the listing indexes are partial
        // (running jobs apart), and only a constant state proves which one a range may read.
        let per_state: Vec<String> = states
            .iter()
            .map(|state| {
                format!(
                    "SELECT j.* FROM pg_catalog.unnest($5::pg_catalog.text[]) AS r(role), LATERAL {} AS j",
                    range("r.role", &format!("'{state}'"))
                )
            })
            .collect();
        page(per_state.join(" UNION ALL "))
    }
}

/// Up to this many index ranges (roles x states) are merged in one statement.
pub const MERGED_RANGES_LIMIT: usize = 60;

/// The enqueuing roles of the job table, by skip scans of the two listing indexes (running jobs
/// and the others; each partial, so each scan names its states): two descents per role.
pub const ENQUEUING_ROLES: &str = "
    WITH RECURSIVE roles(role) AS (
        SELECT pg_catalog.min(next.role) FROM (
            SELECT pg_catalog.min((j.enqueued_by)::pg_catalog.text) FROM durable_jobs.durable_job j
            WHERE j.job_state <> 'running'
            UNION ALL
            SELECT pg_catalog.min((j.enqueued_by)::pg_catalog.text) FROM durable_jobs.durable_job j
            WHERE j.job_state = 'running') AS next(role)
        UNION ALL
        SELECT (SELECT pg_catalog.min(next.role) FROM (
                    SELECT pg_catalog.min((j.enqueued_by)::pg_catalog.text) FROM durable_jobs.durable_job j
                    WHERE j.job_state <> 'running' AND (j.enqueued_by)::pg_catalog.text > roles.role
                    UNION ALL
                    SELECT pg_catalog.min((j.enqueued_by)::pg_catalog.text) FROM durable_jobs.durable_job j
                    WHERE j.job_state = 'running' AND (j.enqueued_by)::pg_catalog.text > roles.role) AS next(role))
        FROM roles WHERE roles.role IS NOT NULL)
    SELECT COALESCE(pg_catalog.array_agg(role), '{}') FROM roles WHERE role IS NOT NULL";

#[pg_extern(volatile, parallel_unsafe, requires = ["status"])]
#[search_path(pg_catalog, pg_temp)]
fn list_durable_jobs(
    queue_name: default!(Option<String>, "NULL"),
    job_states: default!(Option<Vec<Option<String>>>, "NULL"),
    job_kind: default!(Option<String>, "NULL"),
    page_size: default!(Option<i32>, "100"),
    page_cursor: default!(Option<String>, "NULL"),
) -> SetOfIterator<'static, JobListingRow> {
    let filters = ListFilters::new(queue_name, job_states, job_kind);
    let page_size = arguments::required(page_size, "page_size");
    if !(1..=1000).contains(&page_size) {
        arguments::invalid("page_size must be between 1 and 1000");
    }
    let below = page_cursor.map_or(i64::MAX, |cursor| filters.continue_after(&cursor));
    let caller = caller();
    let rows = as_extension_owner_of(|installed| {
        let sees_all = sees_all_jobs(&caller, installed.owner);
        Spi::connect_mut(|client| {
            // A caller that does not see every job reads the ranges of the roles it may see,
            // whether they have jobs or not, so that nothing depends on other roles' jobs.
            let roles: Vec<String> = if filters.reads_primary_key(sees_all) {
                Vec::new()
            } else {
                let (statement, args): (&str, Vec<pgrx::datum::DatumWithOid>) = match sees_all {
                    true => (ENQUEUING_ROLES, vec![]),
                    false => (VISIBLE_ROLES, vec![caller.role_oid.into()]),
                };
                plans::execute(client, statement, &args)
                    .first()
                    .get_one::<Vec<String>>()
                    .expect("roles")
                    .unwrap_or_default()
            };
            let args = [
                below.into(),
                i64::from(page_size).into(),
                filters.queue_name.as_deref().into(),
                filters.job_kind.as_deref().into(),
                roles.clone().into(),
                filters.cursor_tag().into(),
            ];
            // Planned for these values on every call (a listing is not a hot path), so that the
            // plan always fits the page and the ranges it merges.
            plans::with_fresh_snapshot(|| {
                client.select(&filters.statement(sees_all, roles.len()), None, &args)
            })
            .expect("list_durable_jobs")
            .map(|row| row.get::<JobListingRow>(1).unwrap().expect("a listing row"))
            .collect::<Vec<_>>()
        })
    });
    SetOfIterator::new(rows)
}
