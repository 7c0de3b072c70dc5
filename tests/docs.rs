//! What the docs show is what runs: every ```` ```sql runnable ```` block of README.md, then of
//! docs/runbook.md, in order, through psql on a cluster set up like the one
//! scripts/install-and-start.sh starts (worker on in database `postgres`, passwords over TCP);
//! then every connection string the runbook shows connects, as the role it names.

use harness::{Cluster, WORKER_CONF};
use postgres::{Client, NoTls};

const README: &str = include_str!("../README.md");
const RUNBOOK: &str = include_str!("../docs/runbook.md");

/// The runnable SQL blocks of a Markdown text, in order.
fn runnable_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sql runnable") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), text) => {
                block.push_str(text);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(current.is_none(), "an unclosed runnable block");
    blocks
}

/// The libpq connection strings the runbook shows for port 5433 and database `postgres`.
fn shown_connection_strings() -> Vec<String> {
    const PREFIX: &str = "host=localhost port=5433 dbname=postgres user=";
    let mut found: Vec<String> = RUNBOOK
        .match_indices(PREFIX)
        .map(|(at, _)| RUNBOOK[at..].split(['`', '"', '\n']).next().unwrap().to_string())
        .collect();
    found.dedup();
    found
}

#[test]
fn the_runnable_sql_of_readme_and_runbook_runs_as_written() {
    let cluster = Cluster::start(&format!(
        "{WORKER_CONF}durable_jobs.database = 'postgres'\nmax_worker_processes = 16\npassword_encryption = 'scram-sha-256'\n"
    ));
    // As install-and-start.sh: passwords over TCP (the harness itself connects as postgres).
    std::fs::write(
        cluster.data_dir.join("pg_hba.conf"),
        "local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    cluster.connect().batch_execute("SELECT pg_reload_conf()").unwrap();

    let blocks: Vec<(&str, String)> = runnable_blocks(README)
        .into_iter()
        .map(|block| ("README.md", block))
        .chain(runnable_blocks(RUNBOOK).into_iter().map(|block| ("docs/runbook.md", block)))
        .collect();
    assert!(blocks.len() >= 10, "the docs lost their runnable blocks: {}", blocks.len());
    for (number, (file, block)) in blocks.iter().enumerate() {
        let path =
            std::env::temp_dir().join(format!("durable_jobs_docs_{}_{number}.sql", std::process::id()));
        std::fs::write(&path, block).unwrap();
        let output = std::process::Command::new(cluster.program("psql"))
            .args([
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-p",
            ])
            .arg(cluster.port.to_string())
            .arg("-f")
            .arg(&path)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(
            output.status.success(),
            "runnable block {number} of {file} failed:\n{block}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    let shown = shown_connection_strings();
    assert!(shown.len() >= 4, "the runbook shows no connection strings: {shown:?}");
    for dsn in shown {
        let user = dsn.split("user=").nth(1).unwrap().split(' ').next().unwrap().to_string();
        let local = dsn.replace("host=localhost port=5433", &format!("host=127.0.0.1 port={}", cluster.port));
        let mut client = Client::connect(&local, NoTls).unwrap_or_else(|e| panic!("{dsn}: {e}"));
        let current: String = client.query_one("SELECT current_user::text", &[]).unwrap().get(0);
        assert_eq!(current, user, "{dsn}");
    }
}

/// The lines of a Rust source that are code: neither `//` comments nor inside `/* */` blocks.
fn rust_code_lines(source: &str) -> Vec<&str> {
    let mut in_block = false;
    let mut code = Vec::new();
    for line in source.lines().map(str::trim) {
        if in_block {
            in_block = !line.contains("*/");
        } else if line.starts_with("/*") {
            in_block = !line.contains("*/");
        } else if !line.starts_with("//") {
            code.push(line);
        }
    }
    code
}

/// The suite files src/lib.rs includes: its uncommented `include!("../pgrx-tests/NAME");` lines.
fn included_suites(library: &str) -> Vec<String> {
    rust_code_lines(library)
        .into_iter()
        .filter_map(|line| line.strip_prefix("include!(\"../pgrx-tests/")?.strip_suffix("\");"))
        .map(str::to_string)
        .collect()
}

/// The paths of the `[[test]]` targets of a Cargo manifest (uncommented lines only).
fn test_targets(manifest: &str) -> Vec<String> {
    let mut section = "";
    let mut paths = Vec::new();
    for line in manifest.lines().map(|line| line.split('#').next().unwrap().trim()) {
        if line.starts_with('[') {
            section = line;
        } else if let (Some(path), "[[test]]") = (line.strip_prefix("path = \""), section) {
            paths.push(path.trim_end_matches('"').to_string());
        }
    }
    paths
}

/// Every suite file is registered where it runs: tests/*.rs as a `[[test]]` of tests/Cargo.toml
/// (autotests is off), pgrx-tests/*.rs in an `include!` of src/lib.rs. A new file left out would
/// otherwise never run and never fail. Broken on purpose: a pgrx-tests file not included failed;
/// and a commented-out `include!` or `[[test]]` counts as missing (it passed before: the check
/// looked for the text anywhere), as the first assertions show on samples.
#[test]
fn every_test_file_is_registered() {
    let sample_library = "// include!(\"../pgrx-tests/a.rs\");\n/*\ninclude!(\"../pgrx-tests/b.rs\");\n*/\n    include!(\"../pgrx-tests/c.rs\");\n";
    assert_eq!(included_suites(sample_library), ["c.rs"]);
    let sample_manifest = "# [[test]]\n# path = \"a.rs\"\n[lib]\npath = \"b.rs\"\n[[test]]\nname = \"c\"\npath = \"c.rs\"\n";
    assert_eq!(test_targets(sample_manifest), ["c.rs"]);

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rust_files = |dir: &str| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".rs"))
            .collect();
        names.sort();
        names
    };
    let targets = test_targets(&std::fs::read_to_string(root.join("tests/Cargo.toml")).unwrap());
    let included = included_suites(&std::fs::read_to_string(root.join("src/lib.rs")).unwrap());
    let mut unregistered: Vec<String> = rust_files("tests")
        .into_iter()
        .filter(|name| name != "harness.rs" && !targets.contains(name))
        .map(|name| format!("tests/{name}"))
        .collect();
    unregistered.extend(
        rust_files("pgrx-tests")
            .into_iter()
            .filter(|name| !included.contains(name))
            .map(|name| format!("pgrx-tests/{name}")),
    );
    assert_eq!(unregistered, Vec::<String>::new(), "test files that never run");
}
