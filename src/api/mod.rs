//! What a user calls: the SQL functions, one module per group.

pub mod attempts;
pub mod diagnosis;
pub mod enqueue;
pub mod handlers;
pub mod lease;
pub mod metrics;
pub mod queues;
pub mod replay;
pub mod retention;
pub mod status;
