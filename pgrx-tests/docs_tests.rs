// docs/sql-reference.md and the installed catalog tell the same story: every routine (with its
// signature), setting, state, failure code and metric that exists is documented, and everything
// documented exists.

const SQL_REFERENCE: &str = include_str!("../docs/sql-reference.md");

/// The lines of the section that starts with `heading` (up to the next heading of its level).
fn doc_section(heading: &str) -> Vec<&'static str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = SQL_REFERENCE.lines().skip_while(|l| l.trim() != heading);
    lines.next().unwrap_or_else(|| panic!("docs/sql-reference.md has no section {heading}"));
    lines
        .take_while(|l| {
            let hashes = l.chars().take_while(|c| *c == '#').count();
            hashes == 0 || hashes > level
        })
        .collect()
}

/// The backticked first column of every table row in a section.
fn doc_table_keys(heading: &str) -> Vec<String> {
    doc_section(heading)
        .into_iter()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

fn sorted(mut items: Vec<String>) -> Vec<String> {
    items.sort();
    items
}

fn catalog_list(query: &str) -> Vec<String> {
    Spi::connect(|client| {
        client.select(query, None, &[]).unwrap().map(|r| r.get::<String>(1).unwrap().unwrap()).collect()
    })
}

#[pg_test]
fn documented_signatures_match_the_catalog() {
    let documented: Vec<String> = doc_section("## Signatures")
        .into_iter()
        .filter_map(|l| l.strip_prefix("- `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    let installed = catalog_list(
        "SELECT p.oid::regprocedure::text FROM pg_proc p
         WHERE p.pronamespace = 'durable_jobs'::regnamespace",
    );
    assert_eq!(sorted(documented), sorted(installed));
    // Each SQL-callable routine has its own section.
    for name in catalog_list(
        "SELECT proname::text FROM pg_proc WHERE pronamespace = 'durable_jobs'::regnamespace
           AND prorettype <> 'trigger'::regtype",
    ) {
        assert!(
            SQL_REFERENCE.lines().any(|l| l.starts_with("### ") && l.split([' ', ',']).any(|w| w == name)),
            "no section for {name}"
        );
    }
}

#[pg_test]
fn documented_views_match_the_catalog() {
    let documented: Vec<String> = doc_section("## Views")
        .into_iter()
        .filter_map(|l| l.strip_prefix("`durable_jobs."))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    let installed = catalog_list(
        "SELECT relname::text FROM pg_class WHERE relnamespace = 'durable_jobs'::regnamespace AND relkind = 'v'",
    );
    assert_eq!(sorted(documented), sorted(installed));
}

#[pg_test]
fn documented_settings_match_the_catalog() {
    // The test cluster preloads durable_jobs, so the restart-only settings exist too.
    let installed = catalog_list("SELECT name FROM pg_settings WHERE name LIKE 'durable_jobs.%'");
    assert_eq!(sorted(doc_table_keys("## Settings")), sorted(installed));
}

#[pg_test]
fn documented_states_and_failure_codes_match_the_code() {
    // The states and codes the table's constraints accept (src/pg/constraints.rs).
    let states: Vec<String> = crate::pg::constraints::JOB_STATES.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(doc_table_keys("## Job states"), states, "same states, same order");
    let codes: Vec<String> =
        crate::jobs::failure::FailureCode::ALL.iter().map(|c| c.as_str().to_owned()).collect();
    assert_eq!(sorted(doc_table_keys("## Failure codes")), sorted(codes.clone()));
    let accepted: Vec<String> = crate::pg::constraints::FAILURE_CODES.iter().map(|c| (*c).to_owned()).collect();
    assert_eq!(sorted(accepted), sorted(codes), "the table accepts every code the code has");
}

#[pg_test]
fn documented_metrics_match_the_function() {
    let installed = catalog_list("SELECT metric_name FROM durable_jobs.durable_job_metrics()");
    assert_eq!(doc_table_keys("### durable_job_metrics"), installed, "same names, same order");
}

#[pg_test]
fn documented_types_match_the_catalog() {
    let columns = |type_name: &str| {
        catalog_list(&format!(
            "SELECT a.attname || ' ' || format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
             WHERE a.attrelid = 'durable_jobs.{type_name}'::regclass AND a.attnum > 0 ORDER BY a.attnum"
        ))
    };
    let documented = |heading: &str| -> Vec<String> {
        doc_section(heading)
            .into_iter()
            .filter_map(|l| l.strip_prefix("| `"))
            .map(|l| {
                let mut cells = l.split('|');
                let name = cells.next().unwrap().trim().trim_end_matches('`');
                format!("{name} {}", cells.next().unwrap().trim())
            })
            .collect()
    };
    let status = documented("### durable_job_status");
    assert_eq!(status, columns("durable_job_status"), "same columns, same order");
    let mut listing = status;
    listing.extend(documented("### durable_job_listing"));
    assert_eq!(listing, columns("durable_job_listing"));
    let types = catalog_list(
        "SELECT t.typname::text FROM pg_type t JOIN pg_class c ON c.oid = t.typrelid
         WHERE t.typnamespace = 'durable_jobs'::regnamespace AND c.relkind = 'c' ORDER BY 1",
    );
    assert_eq!(types, vec!["durable_job_listing", "durable_job_status"], "every composite type is documented");
}
