//! What a user calls: the SQL functions, one module per group.

pub mod enqueue;
pub mod handlers;
pub mod lease;
pub mod queues;
pub mod replay;
pub mod status;
