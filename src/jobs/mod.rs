//! The job model the SQL API and the background share: caller input and failure codes, the
//! lease statements and fenced transitions, the trust rule, wake-ups and direct leases at
//! commit, the status waiters, queue limits' places and rate tokens, the counters and pruning.

pub mod arguments;
pub mod attempts;
pub mod counters;
pub mod direct_lease;
pub mod failure;
pub mod held_rows;
pub mod histograms;
pub mod hooks;
pub mod lease;
pub mod rates;
pub mod retention;
pub mod sleepers;
pub mod slots;
pub mod statements;
pub mod trust;
pub mod wait_horizon;
pub mod waiters;
pub mod wakeup;
