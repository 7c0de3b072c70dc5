-- durable_jobs 0.5.0 back to 0.4.0: nothing to undo yet. Run by ALTER EXTENSION durable_jobs
-- UPDATE TO '0.4.0'; tests/upgrade.rs checks that the result equals a fresh 0.4.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE TO '0.4.0'" to load this file. \quit
