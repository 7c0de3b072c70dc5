//! What the docs show is what runs: every ```` ```sql runnable ```` block of README.md (twice,
//! as a newcomer may try them again), then of docs/runbook.md, in order, through psql on a cluster set up like the one
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

    // README's blocks twice in a row, as a newcomer trying them again would (the second run
    // failed before: its table and function existed, and its keyed job was done, so the claim
    // found nothing to \gset).
    let blocks: Vec<(&str, String)> = runnable_blocks(README)
        .into_iter()
        .chain(runnable_blocks(README))
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
    let sample_manifest =
        "# [[test]]\n# path = \"a.rs\"\n[lib]\npath = \"b.rs\"\n[[test]]\nname = \"c\"\npath = \"c.rs\"\n";
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

/// The modules under src/, named as README does: `pg`, `pg::settings`, `worker::runner`, ...
/// (a folder's mod.rs is the folder's module; lib.rs is the crate).
fn source_modules(root: &std::path::Path) -> Vec<String> {
    let mut modules = Vec::new();
    for layer in std::fs::read_dir(root.join("src")).unwrap().map(|entry| entry.unwrap().path()) {
        if !layer.is_dir() {
            continue;
        }
        let layer_name = layer.file_name().unwrap().to_string_lossy().into_owned();
        for file in std::fs::read_dir(&layer).unwrap().map(|entry| entry.unwrap().path()) {
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            match (file.extension().and_then(|e| e.to_str()), stem.as_str()) {
                (Some("rs"), "mod") => modules.push(layer_name.clone()),
                (Some("rs"), _) => modules.push(format!("{layer_name}::{stem}")),
                _ => panic!("{}: src/ holds a layer's .rs files only", file.display()),
            }
        }
    }
    modules.sort();
    modules
}

/// The module names (`layer` or `layer::module`, backticked) a Markdown text names.
fn named_modules(markdown: &str) -> Vec<String> {
    let layers = ["pg", "jobs", "api", "worker"];
    let mut named: Vec<String> = markdown
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| {
            let mut parts = word.split("::");
            let (Some(first), second, None) = (parts.next(), parts.next(), parts.next()) else {
                return false;
            };
            layers.contains(&first)
                && second.is_none_or(|m| m.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        })
        .map(str::to_string)
        .collect();
    named.sort();
    named.dedup();
    named
}

/// README's Layout names every module under src/ and no module that is not there, and
/// docs/architecture.md names none that is not there. Broken on purpose: with `worker::claim`
/// left out of the Layout, and with a `jobs::queue` named in architecture.md, each check failed.
#[test]
fn readme_layout_and_architecture_name_the_modules_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let layout = README.split("\n## Layout\n").nth(1).expect("README has a Layout section");
    let layout = layout.split("\n## ").next().unwrap();
    let modules = source_modules(&root);
    assert_eq!(named_modules(layout), modules, "README's Layout against src/");
    let architecture = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let unknown: Vec<String> =
        named_modules(&architecture).into_iter().filter(|name| !modules.contains(name)).collect();
    assert_eq!(unknown, Vec::<String>::new(), "docs/architecture.md names modules that do not exist");
}

/// The modules each module of src/ imports (`crate::layer::module` and `super::module` paths in
/// its code, comments left out), as README names them.
fn imports(root: &std::path::Path, modules: &[String]) -> Vec<(String, String)> {
    let mut edges = Vec::new();
    for module in modules {
        let mut parts = module.split("::");
        let layer = parts.next().unwrap();
        let path = match parts.next() {
            Some(name) => root.join(format!("src/{layer}/{name}.rs")),
            None => root.join(format!("src/{layer}/mod.rs")),
        };
        let source = std::fs::read_to_string(&path).unwrap();
        let code = rust_code_lines(&source).join("\n");
        let mut add = |target: String| {
            let target = if modules.contains(&target) {
                target
            } else {
                target.split("::").next().unwrap().to_string()
            };
            if target != *module && !edges.contains(&(module.clone(), target.clone())) {
                edges.push((module.clone(), target));
            }
        };
        for (prefix, base) in [("crate::", None), ("super::", Some(layer)), ("use ", Some(layer))] {
            for found in code.split(prefix).skip(1) {
                let path: String =
                    found.chars().take_while(|c| c.is_ascii_lowercase() || *c == '_' || *c == ':').collect();
                let mut segments = path.split("::").filter(|s| !s.is_empty());
                let target = match base {
                    None => match (segments.next(), segments.next()) {
                        (Some(l), Some(m)) => format!("{l}::{m}"),
                        (Some(l), None) => l.to_string(),
                        _ => continue,
                    },
                    // `super::x` and, in a layer's mod.rs, `use x::...` of its own child module.
                    Some(layer) => match segments.next() {
                        Some(m) if modules.contains(&format!("{layer}::{m}")) => format!("{layer}::{m}"),
                        _ => continue,
                    },
                };
                if modules.contains(&target)
                    || modules.contains(&target.split("::").next().unwrap().to_string())
                {
                    add(target);
                }
            }
        }
    }
    edges
}

/// The layers hold: `pg` imports no other layer, `jobs` only `pg`, `api` and `worker` only `pg`
/// and `jobs` (never each other); and no modules import each other in a circle, a layer's
/// mod.rs and its own modules aside (it declares them). Broken on purpose: a `use
/// crate::worker::runner` in jobs::direct_lease (as before this layout) failed the first check,
/// a `use crate::jobs::direct_lease` in jobs::sleepers the second.
#[test]
fn the_layers_import_downward_and_no_modules_import_each_other_in_a_circle() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let modules = source_modules(&root);
    let edges = imports(&root, &modules);
    let layer = |module: &str| module.split("::").next().unwrap().to_string();
    let allowed = |from: &str, to: &str| match (from, to) {
        (a, b) if a == b => true,
        ("jobs", "pg") | ("api", "pg" | "jobs") | ("worker", "pg" | "jobs") => true,
        _ => false,
    };
    let upward: Vec<String> = edges
        .iter()
        .filter(|(from, to)| !allowed(&layer(from), &layer(to)))
        .map(|(from, to)| format!("{from} -> {to}"))
        .collect();
    assert_eq!(upward, Vec::<String>::new(), "imports against the layers");
    // A circle among modules: a depth-first search over the imports, a layer's mod.rs left out
    // as a target (it only declares its modules).
    let targets = |module: &str| -> Vec<String> {
        edges
            .iter()
            .filter(|(from, to)| from == module && to.contains("::"))
            .map(|(_, to)| to.clone())
            .collect()
    };
    fn visit(
        module: &str,
        targets: &dyn Fn(&str) -> Vec<String>,
        path: &mut Vec<String>,
        done: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == module) {
            return Some(path[start..].iter().cloned().chain([module.to_string()]).collect());
        }
        if done.iter().any(|m| m == module) {
            return None;
        }
        path.push(module.to_string());
        for target in targets(module) {
            if let Some(circle) = visit(&target, targets, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.push(module.to_string());
        None
    }
    let mut done = Vec::new();
    for module in &modules {
        if let Some(circle) = visit(module, &targets, &mut Vec::new(), &mut done) {
            panic!("modules import each other in a circle: {}", circle.join(" -> "));
        }
    }
    assert!(edges.len() > 50, "the imports were read: {}", edges.len());
}
