//! PostgreSQL plumbing: settings, roles and security contexts, kept SPI plans, randomness, SQL
//! types and the job table's constraints as C functions. Nothing here knows a job's life.

pub mod constraints;
pub mod latch;
pub mod plans;
pub mod privilege;
pub mod randomness;
pub mod settings;
pub mod shared_words;
pub mod sql_types;
