-- durable_jobs 0.4.0 to 0.5.0: no change to the schema yet (the version moved on at the 0.4.0
-- release, so that the released schema is never edited in place). Run by ALTER EXTENSION
-- durable_jobs UPDATE; tests/upgrade.rs checks that the result equals a fresh 0.5.0 install.
\echo Use "ALTER EXTENSION durable_jobs UPDATE" to load this file. \quit
