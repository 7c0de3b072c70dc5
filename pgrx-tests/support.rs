// Helpers shared by the suites (included into the `tests` schema module by src/lib.rs).


extension_sql!(
    r#"
    -- The SQLSTATE a statement raises, or NULL when it succeeds; its effects are rolled back.
    CREATE FUNCTION tests.sqlstate_of(statement text) RETURNS text
        LANGUAGE plpgsql AS $$
    BEGIN
        EXECUTE statement;
        RETURN NULL;
    EXCEPTION WHEN OTHERS THEN
        RETURN SQLSTATE;
    END
    $$;
    "#,
    name = "test_support"
);

pub fn sqlstate_of(statement: &str) -> Option<String> {
    Spi::get_one_with_args::<String>("SELECT tests.sqlstate_of($1)", &[statement.into()])
        .expect("sqlstate_of")
}

/// Asserts that `statement` fails with `sqlstate` and leaves every job as it was.
pub fn assert_rejected(statement: &str, sqlstate: &str) {
    let before = jobs_fingerprint();
    assert_eq!(sqlstate_of(statement).as_deref(), Some(sqlstate), "{statement}");
    assert_eq!(jobs_fingerprint(), before, "{statement} changed jobs");
}

/// A digest of every job row, to show that a rejected call changed nothing.
pub fn jobs_fingerprint() -> String {
    Spi::get_one::<String>(
        "SELECT md5(coalesce(string_agg(j::text, '|' ORDER BY job_id), ''))
         FROM durable_jobs.durable_job j",
    )
    .expect("fingerprint")
    .expect("fingerprint is not null")
}

pub fn one<T: pgrx::FromDatum + pgrx::IntoDatum>(query: &str) -> T {
    Spi::get_one::<T>(query).expect(query).expect("value is not NULL")
}
