//! Upgrades: a database on the oldest supported version (0.1.0) with jobs in every state is
//! upgraded with ALTER EXTENSION durable_jobs UPDATE while the background worker runs; its
//! catalog must then equal a fresh install of the current version, its jobs must be untouched,
//! and work must go on. The rollback script must bring it back to a fresh 0.1.0 install.

use harness::{
    claim_from, complete, count, extension_data, job_outcome, wait_until, Cluster, RECORD_HANDLER,
    WORKER_CONF,
};
use postgres::{Client, GenericClient};
use std::collections::BTreeSet;
use std::str::FromStr;
use std::time::Duration;

const OLDEST_SUPPORTED_VERSION: &str = "0.1.0";
/// Every released version, oldest first; each must update to the current one and back.
const RELEASED_VERSIONS: [&str; 5] = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"];

/// One line per catalog fact of the extension: its member objects, and for those in schema
/// durable_jobs their definitions, owners and grants. Names only, never OIDs, so that two
/// databases compare line by line.
const CATALOG_FACTS: &str = r#"
    WITH schema AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = 'durable_jobs'),
    extension AS (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'durable_jobs')
    SELECT 'member: ' || pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid)
    FROM pg_catalog.pg_depend d, extension e
    WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.refobjid = e.oid
      AND d.deptype = 'e'
    UNION ALL
    SELECT 'extension: relocatable=' || x.extrelocatable || ' owner=' || x.extowner::pg_catalog.regrole
    FROM pg_catalog.pg_extension x WHERE x.extname = 'durable_jobs'
    UNION ALL
    -- What pg_dump dumps; the array's order follows the install script's and means nothing.
    SELECT 'dumped: ' || config.relid::pg_catalog.regclass || ' where ' || config.condition
    FROM pg_catalog.pg_extension x,
         ROWS FROM (pg_catalog.unnest(x.extconfig), pg_catalog.unnest(x.extcondition)) AS config(relid, condition)
    WHERE x.extname = 'durable_jobs'
    UNION ALL
    SELECT 'schema: owner=' || n.nspowner::pg_catalog.regrole || ' acl=' || coalesce(n.nspacl::text, '-')
    FROM pg_catalog.pg_namespace n WHERE n.nspname = 'durable_jobs'
    UNION ALL
    SELECT 'function: ' || p.oid::pg_catalog.regprocedure || ' owner=' || p.proowner::pg_catalog.regrole
           || ' acl=' || coalesce(p.proacl::text, '-') || ' leakproof=' || p.proleakproof
           || ' cost=' || p.procost || ' rows=' || p.prorows
           || E'\n' || pg_catalog.pg_get_functiondef(p.oid)
    FROM pg_catalog.pg_proc p, schema s WHERE p.pronamespace = s.oid
    UNION ALL
    SELECT 'relation: ' || c.oid::pg_catalog.regclass || ' kind=' || c.relkind::text
           || ' persistence=' || c.relpersistence::text || ' owner=' || c.relowner::pg_catalog.regrole
           || ' acl=' || coalesce(c.relacl::text, '-') || ' options=' || coalesce(c.reloptions::text, '-')
           || ' rls=' || c.relrowsecurity
    FROM pg_catalog.pg_class c, schema s WHERE c.relnamespace = s.oid
    UNION ALL
    -- Columns by position among the live ones: an added column would come last.
    SELECT 'column: ' || c.oid::pg_catalog.regclass || ' #'
           || pg_catalog.row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) || ' ' || a.attname
           || ' ' || pg_catalog.format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull
           || ' identity=' || a.attidentity::text || ' generated=' || a.attgenerated::text
           || ' default=' || coalesce(pg_catalog.pg_get_expr(ad.adbin, ad.adrelid), '-')
           || ' collation=' || coalesce(co.collname::text, '-') || ' acl=' || coalesce(a.attacl::text, '-')
    FROM pg_catalog.pg_class c
    JOIN schema s ON c.relnamespace = s.oid
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_catalog.pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum
    LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
    UNION ALL
    SELECT 'constraint: ' || co.conrelid::pg_catalog.regclass || ' ' || co.conname || ' '
           || pg_catalog.pg_get_constraintdef(co.oid) || ' deferrable=' || co.condeferrable
    FROM pg_catalog.pg_constraint co, schema s WHERE co.connamespace = s.oid
    UNION ALL
    SELECT 'index: ' || pg_catalog.pg_get_indexdef(i.indexrelid)
    FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indrelid, schema s
    WHERE c.relnamespace = s.oid
    UNION ALL
    SELECT 'trigger: ' || pg_catalog.pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text
    FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid, schema s
    WHERE c.relnamespace = s.oid AND NOT t.tgisinternal
    UNION ALL
    SELECT 'view: ' || c.oid::pg_catalog.regclass || E'\n' || pg_catalog.pg_get_viewdef(c.oid)
    FROM pg_catalog.pg_class c, schema s WHERE c.relnamespace = s.oid AND c.relkind IN ('v', 'm')
    UNION ALL
    SELECT 'sequence: ' || q.seqrelid::pg_catalog.regclass || ' ' || q.seqtypid::pg_catalog.regtype
           || ' start=' || q.seqstart || ' increment=' || q.seqincrement || ' min=' || q.seqmin
           || ' max=' || q.seqmax || ' cache=' || q.seqcache || ' cycle=' || q.seqcycle
    FROM pg_catalog.pg_sequence q JOIN pg_catalog.pg_class c ON c.oid = q.seqrelid, schema s
    WHERE c.relnamespace = s.oid
    UNION ALL
    SELECT 'rule: ' || r.tablename || ' ' || r.rulename || ' ' || r.definition
    FROM pg_catalog.pg_rules r WHERE r.schemaname = 'durable_jobs'
    UNION ALL
    SELECT 'policy: ' || p.tablename || ' ' || p.policyname
    FROM pg_catalog.pg_policies p WHERE p.schemaname = 'durable_jobs'
    UNION ALL
    SELECT 'type: ' || t.oid::pg_catalog.regtype || ' kind=' || t.typtype::text
           || ' owner=' || t.typowner::pg_catalog.regrole || ' acl=' || coalesce(t.typacl::text, '-')
    FROM pg_catalog.pg_type t, schema s WHERE t.typnamespace = s.oid
    UNION ALL
    SELECT 'comment: ' || pg_catalog.pg_describe_object(d.classoid, d.objoid, d.objsubid) || ' '
           || d.description
    FROM pg_catalog.pg_description d, pg_catalog.pg_depend m, extension e
    WHERE m.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND m.refobjid = e.oid
      AND m.deptype = 'e' AND d.classoid = m.classid AND d.objoid = m.objid
    UNION ALL
    -- The privileges pg_dump takes as the extension's own (it dumps only what differs).
    SELECT 'initial privileges: ' || pg_catalog.pg_describe_object(i.classoid, i.objoid, i.objsubid) || ' '
           || i.privtype::text || ' ' || i.initprivs::text
    FROM pg_catalog.pg_init_privs i, pg_catalog.pg_depend m, extension e
    WHERE m.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND m.refobjid = e.oid
      AND m.deptype = 'e' AND i.classoid = m.classid AND i.objoid = m.objid
"#;

fn catalog_facts(client: &mut Client) -> BTreeSet<String> {
    let rows = client.query(CATALOG_FACTS, &[]).expect("read the catalog");
    let facts: Vec<String> = rows.iter().map(|row| row.get(0)).collect();
    let unique: BTreeSet<String> = facts.iter().cloned().collect();
    assert_eq!(unique.len(), facts.len(), "every catalog fact is one distinct line");
    for kind in
        ["member", "function", "relation", "column", "constraint", "index", "trigger", "view", "comment"]
    {
        let prefix = format!("{kind}: ");
        assert!(unique.iter().any(|f| f.starts_with(&prefix)), "the catalog query finds no {kind}");
    }
    unique
}

/// Panics with the facts that differ, each side's own lines, when `actual` is not `expected`.
fn assert_same_catalog(actual: &BTreeSet<String>, expected: &BTreeSet<String>, what: &str) {
    let missing: Vec<_> = expected.difference(actual).collect();
    let extra: Vec<_> = actual.difference(expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: the catalog differs.\nonly in the expected install:\n{missing:#?}\nonly after the update:\n{extra:#?}"
    );
}

/// The version CREATE EXTENSION installs: the one of the build under test.
fn default_version(client: &mut Client) -> String {
    client
        .query_one(
            "SELECT default_version FROM pg_catalog.pg_available_extensions WHERE name = 'durable_jobs'",
            &[],
        )
        .expect("available version")
        .get(0)
}

fn extension_version(client: &mut Client) -> String {
    client
        .query_one("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'durable_jobs'", &[])
        .expect("extension version")
        .get(0)
}

/// Every column of every job, as text, in job_id order.
/// Every job, by the columns every version has (later versions add columns, never change these).
fn all_jobs(client: &mut impl GenericClient) -> Vec<String> {
    client
        .query(
            "SELECT (job_id, queue_name, job_kind, payload, idempotency_key, payload_sha256, job_state, priority,
                     run_after, attempt_count, max_attempts, lease_owner, lease_token, lease_expires_at,
                     last_failure_code, enqueued_by, created_at, updated_at, finished_at)::text
             FROM durable_jobs.durable_job ORDER BY job_id",
            &[],
        )
        .expect("read jobs")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The operator's own setup: roles and grants, which an update must keep.
// The claim's signature changes in 0.4.0, the enqueue's in 0.6.0: an update keeps the grants given
// on them, here by name alone, as in either version (the catalog
// comparison sees its ACL and what pg_dump takes as the extension's own privileges).
const OPERATOR_GRANTS: &str = "
    GRANT USAGE ON SCHEMA durable_jobs TO upgrade_producer;
    GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job TO upgrade_producer;
    GRANT EXECUTE ON FUNCTION durable_jobs.claim_next_durable_job TO upgrade_producer WITH GRANT OPTION;";

fn create_database(cluster: &Cluster, name: &str) -> Client {
    cluster.connect().batch_execute(&format!("CREATE DATABASE {name}")).expect("create database");
    cluster.connect_to(name)
}

#[test]
fn an_update_from_the_oldest_version_equals_a_fresh_install_and_keeps_every_job() {
    // The worker's database is `postgres`, the one we upgrade.
    let cluster = Cluster::start_without_extension(WORKER_CONF);
    let mut client = cluster.connect();
    client.batch_execute("CREATE ROLE upgrade_producer").unwrap();
    client
        .batch_execute(&format!("CREATE EXTENSION durable_jobs VERSION '{OLDEST_SUPPORTED_VERSION}'"))
        .expect("install the oldest supported version");
    assert_eq!(extension_version(&mut client), OLDEST_SUPPORTED_VERSION);
    let current_version = default_version(&mut client);
    assert_ne!(current_version, OLDEST_SUPPORTED_VERSION, "there is something to upgrade to");

    // Jobs in every state, through the old version's functions.
    client
        .batch_execute(&format!(
            "{OPERATOR_GRANTS}
             {RECORD_HANDLER}
             SELECT durable_jobs.enqueue_durable_job('record', jsonb_build_object('n', g))
             FROM generate_series(1, 5) g;
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 1}}', 'key-held',
                                                     queue_name => 'held');
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 2}}', queue_name => 'done');
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 3}}', queue_name => 'cancelled');
             SELECT durable_jobs.enqueue_durable_job('external', '{{\"step\": 4}}', queue_name => 'later',
                                                     run_after => now() + interval '1 day');
             SELECT durable_jobs.pause_durable_job_queue('paused');
             SELECT durable_jobs.enqueue_durable_job('record', '{{\"n\": 99}}', queue_name => 'paused');
             SELECT durable_jobs.set_durable_job_queue_concurrency('limited', 2);"
        ))
        .expect("work on the old version");
    let held = claim_from(&mut client, "ext-1", "held", 600).expect("claim on the old version");
    let done = claim_from(&mut client, "ext-1", "done", 60).expect("claim on the old version");
    assert_eq!(complete(&mut client, &done, "ext-1"), "succeeded", "complete on the old version");
    client
        .batch_execute(
            "SELECT durable_jobs.cancel_durable_job(job_id) FROM durable_jobs.durable_job
             WHERE queue_name = 'cancelled'",
        )
        .unwrap();

    // The 0.2.0 library's worker leaves a 0.1.0 schema alone (a window in which no job may run).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(count(&mut client, "SELECT count(*) FROM public.effects"), 0, "no job runs before the update");
    let jobs_before = all_jobs(&mut client);

    // The update and the check of its result in one transaction, before the worker sees it.
    let mut update = client.transaction().unwrap();
    update.batch_execute("ALTER EXTENSION durable_jobs UPDATE").expect("ALTER EXTENSION UPDATE");
    let jobs_during = all_jobs(&mut update);
    // Checked before the commit: from then on the worker may claim a job, which moves its version.
    let moved: i64 = update
        .query_one(
            "SELECT count(*) FROM durable_jobs.durable_job WHERE state_version <> 1 OR replay_count <> 0",
            &[],
        )
        .unwrap()
        .get(0);
    update.commit().unwrap();
    assert_eq!(jobs_during, jobs_before, "the update rewrites no job");
    assert_eq!(moved, 0, "existing jobs start at state_version 1 and replay_count 0");
    assert_eq!(extension_version(&mut client), current_version);

    let mut fresh = create_database(&cluster, "fresh_install");
    fresh.batch_execute(&format!("CREATE EXTENSION durable_jobs; {OPERATOR_GRANTS}")).unwrap();
    assert_eq!(extension_version(&mut fresh), current_version);
    assert_same_catalog(&catalog_facts(&mut client), &catalog_facts(&mut fresh), "0.1.0 updated");

    // Work goes on: the lease taken before the update still fences, the worker runs the backlog,
    // keys and queue controls still hold.
    assert_eq!(
        complete(&mut client, &held, "ext-2"),
        "stale",
        "another worker id cannot complete the held job"
    );
    assert_eq!(complete(&mut client, &held, "ext-1"), "succeeded");
    wait_until(Duration::from_secs(30), "the worker to run the jobs enqueued before the update", || {
        count(&mut client, "SELECT count(*) FROM public.effects") == 5
    });
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM public.effects WHERE n = 99"),
        0,
        "the queue paused before the update stays paused"
    );
    let again = count(
        &mut client,
        "SELECT durable_jobs.enqueue_durable_job('external', '{\"step\": 1}', 'key-held', queue_name => 'held')",
    );
    assert_eq!(again, held.job_id, "an idempotency key from before the update still finds its job");
    assert_eq!(job_outcome(&mut client, "queue_name = 'later'").0, "available");
    assert_eq!(
        count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job_queue WHERE concurrency_limit = 2"),
        1
    );
    // What 0.2.0 adds works on an updated database: 5 handler jobs, held, done and cancelled.
    assert_eq!(count(&mut client, "SELECT durable_jobs.prune_durable_jobs(interval '0')"), 8);
    assert_eq!(count(&mut client, "SELECT count(*) FROM durable_jobs.durable_job"), 2);

    // Rollback: back to 0.1.0 while this library is installed, then compare with a fresh 0.1.0.
    client
        .batch_execute(&format!("ALTER EXTENSION durable_jobs UPDATE TO '{OLDEST_SUPPORTED_VERSION}'"))
        .expect("roll back with the downgrade script");
    assert_eq!(extension_version(&mut client), OLDEST_SUPPORTED_VERSION);
    let mut fresh_old = create_database(&cluster, "fresh_old_install");
    fresh_old
        .batch_execute(&format!(
            "CREATE EXTENSION durable_jobs VERSION '{OLDEST_SUPPORTED_VERSION}'; {OPERATOR_GRANTS}"
        ))
        .unwrap();
    assert_same_catalog(&catalog_facts(&mut client), &catalog_facts(&mut fresh_old), "rolled back to 0.1.0");
    assert_eq!(
        count(
            &mut client,
            "SELECT count(*) FROM durable_jobs.durable_job WHERE queue_name IN ('paused', 'later')"
        ),
        2,
        "the rollback keeps the jobs"
    );
}

#[test]
fn every_release_updates_to_a_fresh_install_of_the_current_version_and_back() {
    let cluster = Cluster::start_without_extension("shared_preload_libraries = 'durable_jobs'");
    cluster.connect().batch_execute("CREATE ROLE upgrade_producer").unwrap();
    let mut fresh = create_database(&cluster, "fresh_current");
    fresh.batch_execute(&format!("CREATE EXTENSION durable_jobs; {OPERATOR_GRANTS}")).unwrap();
    let current_version = extension_version(&mut fresh);
    let current = catalog_facts(&mut fresh);
    for version in RELEASED_VERSIONS {
        let database = format!("from_{}", version.replace('.', "_"));
        let mut client = create_database(&cluster, &database);
        client
            .batch_execute(&format!(
                "CREATE EXTENSION durable_jobs VERSION '{version}'; {OPERATOR_GRANTS}
                 SELECT durable_jobs.enqueue_durable_job('external', jsonb_build_object('n', g), 'key-' || g)
                 FROM generate_series(1, 3) g;
                 SELECT durable_jobs.set_durable_job_queue_concurrency('limited', 2);"
            ))
            .unwrap_or_else(|e| panic!("install {version}: {e}"));
        let released = catalog_facts(&mut client);
        let jobs_before = all_jobs(&mut client);

        client.batch_execute("ALTER EXTENSION durable_jobs UPDATE").expect("update");
        assert_eq!(extension_version(&mut client), current_version);
        assert_same_catalog(&catalog_facts(&mut client), &current, &format!("{version} updated"));
        assert_eq!(all_jobs(&mut client), jobs_before, "{version}: the update rewrites no job");

        client
            .batch_execute(&format!("ALTER EXTENSION durable_jobs UPDATE TO '{version}'"))
            .expect("roll back");
        assert_same_catalog(&catalog_facts(&mut client), &released, &format!("rolled back to {version}"));
        assert_eq!(all_jobs(&mut client), jobs_before, "{version}: the rollback rewrites no job");
    }
}

/// The update to 0.6.0 warns of each registration whose jobs the trust rule of 0.5.0 ran for a role
/// and the new rule does not (a group's registration for its members; a superuser's registration
/// of a routine a group owns), and of each that now claims the jobs of roles it did not (an
/// administrator granted a producer's role), to run them or, when the routine's owner holds none
/// of their rights, to fail them, naming the roles and counting their pending jobs;
/// the way back keeps the grants made on durable_job_handlers, which it makes again, and the
/// initial privileges pg_dump compares them with.
#[test]
fn the_update_to_0_6_0_names_the_roles_a_registration_no_longer_serves() {
    // The database the background workers work in: the update reports nowhere else.
    let cluster = Cluster::start_without_extension(
        "shared_preload_libraries = 'durable_jobs'\ndurable_jobs.database = 'trust'",
    );
    cluster.connect().batch_execute("CREATE DATABASE trust").unwrap();
    let warnings = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let collected = warnings.clone();
    let mut client = postgres::Config::from_str(&cluster.dsn("postgres", "trust"))
        .unwrap()
        .notice_callback(move |notice| {
            if notice.severity() == "WARNING" {
                collected.lock().unwrap().push(notice.message().to_string());
            }
        })
        .connect(postgres::NoTls)
        .unwrap();
    client
        .batch_execute(
            "CREATE EXTENSION durable_jobs VERSION '0.5.0';
             CREATE ROLE up_team; CREATE ROLE up_alice IN ROLE up_team; CREATE ROLE up_bob IN ROLE up_team;
             CREATE ROLE up_admin; CREATE ROLE up_producer; GRANT up_producer TO up_admin; CREATE ROLE up_monitor;
             GRANT USAGE ON SCHEMA durable_jobs TO up_alice;
             GRANT EXECUTE ON FUNCTION
                 durable_jobs.enqueue_durable_job(text, jsonb, text, text, timestamptz, integer, integer) TO up_alice;
             CREATE FUNCTION public.up_superusers(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
             CREATE FUNCTION public.up_teams(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
             ALTER FUNCTION public.up_teams(jsonb) OWNER TO up_team;
             CREATE FUNCTION public.up_monitors(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
             ALTER FUNCTION public.up_monitors(jsonb) OWNER TO up_monitor;
             INSERT INTO durable_jobs.durable_job_handler (job_kind, handler, registered_by) VALUES
                 ('by_team', 'public.up_superusers(jsonb)', 'up_team'),
                 ('teams_routine', 'public.up_teams(jsonb)', current_user),
                 ('by_admin', 'public.up_superusers(jsonb)', 'up_admin'),
                 ('admin_owner_bad', 'public.up_monitors(jsonb)', 'up_admin'),
                 ('alices_own', 'public.up_teams(jsonb)', 'up_alice'),
                 ('by_superuser', 'public.up_superusers(jsonb)', current_user);
             SET ROLE up_alice;
             SELECT durable_jobs.enqueue_durable_job('by_team', '{}') FROM generate_series(1, 2);
             RESET ROLE;
             GRANT SELECT ON durable_jobs.durable_job_handlers TO up_monitor;
             GRANT SELECT ON durable_jobs.durable_job_handlers TO up_admin WITH GRANT OPTION;
             GRANT SELECT (job_kind, handler) ON durable_jobs.durable_job_handlers TO up_alice;",
        )
        .unwrap();
    let privileges = "SELECT c.relacl::text || ' ' || i.initprivs::text || ' '
                             || (SELECT string_agg(a.attname || '=' || a.attacl::text, ' ' ORDER BY a.attnum)
                                 FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attacl IS NOT NULL)
                      FROM pg_class c
                      JOIN pg_init_privs i ON i.objoid = c.oid AND i.classoid = 'pg_class'::regclass AND i.objsubid = 0
                      WHERE c.oid = 'durable_jobs.durable_job_handlers'::regclass";
    let privileges_of = |client: &mut Client| -> String { client.query_one(privileges, &[]).unwrap().get(0) };
    let granted = privileges_of(&mut client);
    assert!(
        granted.contains("up_monitor=r/")
            && granted.contains("up_admin=r*/")
            && granted.contains("handler={up_alice=r/"),
        "{granted}"
    );

    client.batch_execute("ALTER EXTENSION durable_jobs UPDATE").unwrap();
    assert_eq!(
        std::mem::take(&mut *warnings.lock().unwrap()),
        [
            "durable_jobs: the handler public.up_monitors(jsonb) registered for job kind 'admin_owner_bad' by up_admin \
             now fails with target_rejected the jobs of up_producer (the handler's owner holds none of their \
             rights, or they may not execute it) (0 of them pending)",
            "durable_jobs: the handler public.up_teams(jsonb) registered for job kind 'alices_own' by up_alice \
             now fails with target_rejected the jobs of up_alice (the handler's owner holds none of their rights, \
             or they may not execute it) (0 of them pending)",
            "durable_jobs: the handler public.up_teams(jsonb) registered for job kind 'alices_own' by up_alice \
             now runs the jobs of up_team (the registering role and the handler's owner hold their rights) \
             (0 of them pending)",
            "durable_jobs: the handler public.up_superusers(jsonb) registered for job kind 'by_admin' by up_admin \
             now runs the jobs of up_producer (the registering role and the handler's owner hold their rights) \
             (0 of them pending)",
            "durable_jobs: the handler public.up_superusers(jsonb) registered for job kind 'by_team' by up_team \
             now leaves to external workers the jobs of up_alice, up_bob (the registering role holds none of \
             their rights) (2 of them pending)",
            "durable_jobs: the handler public.up_teams(jsonb) registered for job kind 'teams_routine' by postgres \
             now fails with target_rejected the jobs of up_alice, up_bob (the handler's owner holds none of their \
             rights, or they may not execute it) (0 of them pending)",
        ]
    );
    let serves: Vec<(String, bool, Option<Vec<String>>)> = client
        .query("SELECT job_kind, serves_every_role, serves_roles::text[] FROM durable_jobs.durable_job_handlers ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    let roles = |names: &[&str]| Some(names.iter().map(|name| name.to_string()).collect::<Vec<_>>());
    assert_eq!(
        serves,
        [
            ("admin_owner_bad".to_string(), false, roles(&["up_admin", "up_producer"])),
            ("alices_own".to_string(), false, roles(&["up_alice", "up_team"])),
            ("by_admin".to_string(), false, roles(&["up_admin", "up_producer"])),
            ("by_superuser".to_string(), true, None),
            ("by_team".to_string(), false, roles(&["up_team"])),
            ("teams_routine".to_string(), true, None),
        ]
    );
    assert_eq!(privileges_of(&mut client), granted, "the update keeps the view's grants");

    client.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.5.0'").unwrap();
    assert_eq!(
        privileges_of(&mut client),
        granted,
        "the way back keeps the view's grants and initial privileges"
    );
    assert!(warnings.lock().unwrap().is_empty());
}

/// Members of the extension (routines, relations, types) that its owner does not own.
fn members_not_of_the_owner(client: &mut Client) -> Vec<String> {
    let query = "
    SELECT pg_catalog.pg_describe_object(d.classid, d.objid, 0)
    FROM pg_catalog.pg_depend d
    JOIN pg_catalog.pg_extension x ON x.oid = d.refobjid AND x.extname = 'durable_jobs'
    LEFT JOIN pg_catalog.pg_proc p ON d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND p.oid = d.objid
    LEFT JOIN pg_catalog.pg_class c ON d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND c.oid = d.objid
    LEFT JOIN pg_catalog.pg_type t ON d.classid = 'pg_catalog.pg_type'::pg_catalog.regclass AND t.oid = d.objid
    WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.deptype = 'e'
      AND coalesce(p.proowner, c.relowner, t.typowner) <> x.extowner
    ORDER BY 1";
    client.query(query, &[]).unwrap().iter().map(|row| row.get(0)).collect()
}

/// The objects of the schema whose privileges differ from those pg_dump takes as the
/// extension's own (it would dump a GRANT or REVOKE for each); compared, as pg_dump does, as
/// sets of items.
fn privileges_dumped_as_changed(client: &mut Client) -> BTreeSet<String> {
    client
        .query(
            "SELECT pg_describe_object(i.classoid, i.objoid, 0)
             FROM pg_init_privs i
             LEFT JOIN pg_proc p ON i.classoid = 'pg_proc'::regclass AND p.oid = i.objoid
             LEFT JOIN pg_class c ON i.classoid = 'pg_class'::regclass AND c.oid = i.objoid
             LEFT JOIN pg_type t ON i.classoid = 'pg_type'::regclass AND t.oid = i.objoid
             WHERE i.objsubid = 0
               AND (SELECT array_agg(x::text ORDER BY x::text) FROM unnest(i.initprivs) x)
                   IS DISTINCT FROM (SELECT array_agg(x::text ORDER BY x::text)
                                     FROM unnest(coalesce(p.proacl, c.relacl, t.typacl)) x)
               AND coalesce(p.pronamespace, c.relnamespace, t.typnamespace) = 'durable_jobs'::regnamespace",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[test]
fn an_update_by_a_superuser_hands_what_it_creates_to_the_extensions_owner() {
    // After REASSIGN OWNED the extension belongs to an ordinary role, which the library's
    // functions act as; a superuser runs the update. Before the fix, everything the update
    // created stayed the superuser's, and the owner could not even write its own table (the
    // CHECK constraints' functions: 42501).
    let cluster = Cluster::start_without_extension("");
    let mut admin = cluster.connect();
    admin.batch_execute("CREATE ROLE first_owner SUPERUSER LOGIN; CREATE ROLE queue_owner").unwrap();
    cluster
        .connect_as("first_owner")
        .batch_execute(&format!("CREATE EXTENSION durable_jobs VERSION '{OLDEST_SUPPORTED_VERSION}'"))
        .unwrap();
    admin.batch_execute("REASSIGN OWNED BY first_owner TO queue_owner; DROP ROLE first_owner").unwrap();
    // An operator's grant on the claim, which the update carries to the claim it replaces it with.
    admin
        .batch_execute(
            "CREATE ROLE queue_worker;
             GRANT EXECUTE ON FUNCTION durable_jobs.claim_next_durable_job(text, text[], integer)
               TO queue_worker",
        )
        .unwrap();
    admin
        .batch_execute("SELECT durable_jobs.enqueue_durable_job('external', '{\"n\": 1}', queue_name => 'q')")
        .expect("the old version works under its new owner");

    let drifted_before = privileges_dumped_as_changed(&mut admin);
    admin.batch_execute("ALTER EXTENSION durable_jobs UPDATE").expect("update");
    let foreign = members_not_of_the_owner(&mut admin);
    assert!(foreign.is_empty(), "left to the superuser who ran the update: {foreign:?}");
    let owner: String = admin
        .query_one("SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'durable_jobs'", &[])
        .unwrap()
        .get(0);
    assert_eq!(owner, "queue_owner");
    // PostgreSQL 15's REASSIGN OWNED leaves pg_init_privs naming the old owner (so pg_dump
    // dumps those privileges as changed); the update must add no such privilege of its own.
    let mut drifted_after = privileges_dumped_as_changed(&mut admin);
    assert!(
        drifted_after.remove("function durable_jobs.claim_next_durable_job(text,text[],integer,text[])"),
        "the operator's grant on the claim must be dumped as theirs: {drifted_after:?}"
    );
    let claim_privileges: Vec<bool> = admin
        .query_one(
            "SELECT array_agg(
                        (SELECT bool_or(a.grantee = 'queue_worker'::regrole) FROM aclexplode(acl) a)
                        ORDER BY n)
             FROM pg_proc p, pg_init_privs i,
                  LATERAL (VALUES (1, p.proacl), (2, i.initprivs)) v(n, acl)
             WHERE p.oid = 'durable_jobs.claim_next_durable_job(text, text[], integer, text[])'::regprocedure
               AND i.objoid = p.oid AND i.classoid = 'pg_proc'::regclass AND i.objsubid = 0",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        claim_privileges,
        [true, false],
        "queue_worker in the claim's ACL, not in its initial privileges"
    );
    let dump = std::process::Command::new(cluster.program("pg_dump"))
        .args(["--schema-only", &format!("--dbname={}", cluster.connection_string())])
        .output()
        .expect("pg_dump");
    assert!(dump.status.success(), "{}", String::from_utf8_lossy(&dump.stderr));
    let grants: Vec<String> = String::from_utf8_lossy(&dump.stdout)
        .lines()
        .filter(|line| line.starts_with("GRANT") && line.contains("claim_next_durable_job"))
        .map(String::from)
        .collect();
    assert!(
        grants.iter().any(|grant| grant.ends_with("TO queue_worker;")),
        "pg_dump must dump the operator's grant on the claim: {grants:?}"
    );
    assert!(
        drifted_after.is_subset(&drifted_before),
        "the update left privileges for pg_dump to dump as changed: {:?}",
        drifted_after.difference(&drifted_before).collect::<Vec<_>>()
    );

    // The library acts as queue_owner: every write and the status API work.
    admin
        .batch_execute("SELECT durable_jobs.enqueue_durable_job('external', '{\"n\": 2}', queue_name => 'q')")
        .expect("enqueue after the update");
    for _ in 0..2 {
        let job = claim_from(&mut admin, "ext-1", "q", 60).expect("claim after the update");
        assert_eq!(complete(&mut admin, &job, "ext-1"), "succeeded");
        let state: String = admin
            .query_one("SELECT job_state FROM durable_jobs.get_durable_job($1)", &[&job.job_id])
            .unwrap()
            .get(0);
        assert_eq!(state, "succeeded");
    }
    let job_id: i64 = admin
        .query_one(
            "SELECT durable_jobs.enqueue_durable_job('external', '{\"n\": 3}', queue_name => 'q')",
            &[],
        )
        .unwrap()
        .get(0);
    admin.execute("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id]).expect("cancel after the update");
    let state: String = admin
        .query_one("SELECT job_state FROM durable_jobs.replay_durable_job($1, '{\"n\": 3}')", &[&job_id])
        .expect("replay (it writes the audit table the update created) after the update")
        .get(0);
    assert_eq!(state, "available");
}

#[test]
fn an_update_hands_over_objects_whose_initial_privileges_name_a_dropped_role() {
    // An earlier update by another superuser, since dropped: PostgreSQL 15 keeps its oid in the
    // initial privileges of what that update created. Before the fix, the hand-over could not
    // write such an item back and the update failed ("role ... does not exist"); with the
    // objects reassigned to the extension's owner (nothing to hand over), it left the oid there
    // and pg_dump wrote GRANT and REVOKE for a role that does not exist.
    // (Reassigned to, dropped): also kept, the former owner is no owner of the objects now.
    for (reassigned_to, dropped) in [("postgres", true), ("first_owner", true), ("first_owner", false)] {
        let cluster = Cluster::start_without_extension("");
        let mut admin = cluster.connect();
        admin
            .batch_execute("CREATE ROLE first_owner SUPERUSER LOGIN; CREATE ROLE updater SUPERUSER LOGIN")
            .unwrap();
        cluster
            .connect_as("first_owner")
            .batch_execute("CREATE EXTENSION durable_jobs VERSION '0.2.0'")
            .unwrap();
        cluster
            .connect_as("updater")
            .batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.3.0'")
            .unwrap();
        admin.batch_execute(&format!("REASSIGN OWNED BY updater TO {reassigned_to}")).unwrap();
        if dropped {
            admin.batch_execute("DROP ROLE updater").unwrap();
        }
        admin.batch_execute("ALTER EXTENSION durable_jobs UPDATE").expect("update");
        let foreign = members_not_of_the_owner(&mut admin);
        assert!(foreign.is_empty(), "reassigned to {reassigned_to}, not handed to first_owner: {foreign:?}");
        let naming_another_role = count(
            &mut admin,
            "SELECT count(*)
             FROM pg_init_privs i
             JOIN pg_depend d ON d.classid = i.classoid AND d.objid = i.objoid AND d.deptype = 'e'
             JOIN pg_extension x ON x.oid = d.refobjid AND x.extname = 'durable_jobs',
             aclexplode(i.initprivs) a
             WHERE a.grantor NOT IN (SELECT oid FROM pg_roles)
                OR (a.grantee <> 0 AND a.grantee NOT IN (SELECT oid FROM pg_roles))
                OR a.grantor <> x.extowner OR a.grantee::regrole::text = 'updater'",
        );
        assert_eq!(
            naming_another_role, 0,
            "reassigned to {reassigned_to} (updater dropped: {dropped}): initial privileges of the \
             extension's objects that name a dropped role or a former owner"
        );
        admin
            .batch_execute("SELECT durable_jobs.enqueue_durable_job('external', '{}')")
            .expect("enqueue after the update");
    }
}

#[test]
fn pg_upgrade_accepts_a_cluster_with_durable_jobs_and_keeps_its_jobs() {
    let old = Cluster::start("");
    let mut client = old.connect();
    client
        .batch_execute(&format!(
            "{RECORD_HANDLER}
             SELECT durable_jobs.enqueue_durable_job('record', jsonb_build_object('n', g))
             FROM generate_series(1, 3) g;
             SELECT durable_jobs.pause_durable_job_queue('paused');"
        ))
        .unwrap();
    let before = extension_data(&mut client);
    drop(client);
    old.pg_ctl(&["stop", "-w"]);

    // Preloaded, so that the binary-upgrade servers pg_upgrade starts load durable_jobs too; the
    // worker stays off until the comparison is done.
    let new = Cluster::start_without_extension(
        "shared_preload_libraries = 'durable_jobs'\ndurable_jobs.poll_interval = '50ms'",
    );
    new.pg_ctl(&["stop", "-w"]);
    let args = [
        format!("--old-datadir={}", old.data_dir.display()),
        format!("--new-datadir={}", new.data_dir.display()),
        format!("--old-bindir={}", old.program("").display()),
        format!("--new-bindir={}", new.program("").display()),
        format!("--old-port={}", old.port),
        format!("--new-port={}", new.port),
        format!("--socketdir={}", new.data_dir.display()),
    ];
    let work_dir = new.data_dir.parent().expect("cluster root");
    let output = new.run_server_program("pg_upgrade", &args, work_dir);
    assert!(
        output.status.success(),
        "pg_upgrade refused the cluster:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );

    new.pg_ctl(&["start", "-w", "-t", "60"]);
    let mut client = new.connect();
    assert_eq!(
        extension_data(&mut client),
        before,
        "jobs, handlers and queue controls come through as they were"
    );
    client.batch_execute("ALTER SYSTEM SET durable_jobs.worker_enabled = on").unwrap();
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
    wait_until(Duration::from_secs(30), "the upgraded cluster's worker to run the jobs", || {
        count(&mut client, "SELECT count(*) FROM public.effects") == 3
    });
}

#[test]
fn a_call_that_waits_for_an_update_runs_against_the_schema_the_update_left() {
    let cluster = Cluster::start_without_extension("shared_preload_libraries = 'durable_jobs'");
    let mut client = cluster.connect();
    client.batch_execute("CREATE EXTENSION durable_jobs VERSION '0.3.0'").unwrap();
    let job_id: i64 =
        client.query_one("SELECT durable_jobs.enqueue_durable_job('external', '{}')", &[]).unwrap().get(0);
    let mut updating = client.transaction().unwrap();
    updating.batch_execute("ALTER EXTENSION durable_jobs UPDATE").unwrap();
    // A cancel started now waits for the update's lock on the job table.
    let mut canceller = cluster.connect();
    let cancel = std::thread::spawn(move || {
        canceller
            .query_one("SELECT durable_jobs.cancel_durable_job($1)", &[&job_id])
            .map(|row| row.get::<_, bool>(0))
    });
    let mut watcher = cluster.connect();
    wait_until(Duration::from_secs(10), "the cancel to wait for the update", || {
        count(
            &mut watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%cancel_durable_job%'",
        ) == 1
    });
    updating.commit().unwrap();
    assert!(cancel.join().unwrap().expect("the cancel"));
    // 0.4.0's cancel moved state_version and wrote its audit row (before the fix: the 0.3.0
    // statement ran, version 1 and no audit).
    let row = client
        .query_one(
            "SELECT job_state, state_version,
                    (SELECT count(*) FROM durable_jobs.durable_job_audit a WHERE a.job_id = j.job_id)
             FROM durable_jobs.durable_job j WHERE job_id = $1",
            &[&job_id],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, i64>(1), row.get::<_, i64>(2)),
        ("cancelled".into(), 2, 1)
    );
}

/// The grants on fail_durable_job, whose arguments 0.6.0 changed, are carried over by the roles
/// that made them, both ways: a grant made with another's grant option stays that role's to
/// revoke, and goes with a CASCADE revoke of the option; the roles named still cannot be dropped
/// while they hold them. (Failed before: every carried grant was made by the extension's owner,
/// so the chain w1 -> w2 was lost.)
#[test]
fn the_grants_on_fail_durable_job_keep_their_grantors_through_the_update_and_back() {
    let cluster = Cluster::start_without_extension("");
    let mut admin = cluster.connect();
    admin
        .batch_execute(
            "CREATE EXTENSION durable_jobs VERSION '0.5.0';
             CREATE ROLE w1;  CREATE ROLE w2;
             GRANT USAGE ON SCHEMA durable_jobs TO w1, w2;
             GRANT EXECUTE ON FUNCTION durable_jobs.fail_durable_job(bigint, text, uuid, text) TO w1 WITH GRANT OPTION;
             SET ROLE w1;
             GRANT EXECUTE ON FUNCTION durable_jobs.fail_durable_job(bigint, text, uuid, text) TO w2;
             RESET ROLE;",
        )
        .unwrap();
    let grants = |client: &mut Client, signature: &str| -> Vec<String> {
        client
            .query(
                &format!(
                    "SELECT a.grantee::regrole || ' by ' || a.grantor::regrole || CASE WHEN a.is_grantable THEN ' with option' ELSE '' END
                     FROM pg_proc p, aclexplode(p.proacl) a
                     WHERE p.oid = 'durable_jobs.fail_durable_job({signature})'::regprocedure AND a.grantee <> p.proowner
                     ORDER BY 1"
                ),
                &[],
            )
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect()
    };
    let expected = ["w1 by postgres with option", "w2 by w1"];
    assert_eq!(grants(&mut admin, "bigint, text, uuid, text"), expected);
    // The grantor has lost USAGE on the schema since, and the update is run by an administrator
    // who logged in as itself and became a superuser with SET ROLE: neither stops it, and the
    // session's role is as the administrator left it. (Failed when the grants were made again
    // as their grantors, with SET ROLE: "permission denied to set role", "permission denied for
    // schema", and the script's role left set in the session.)
    admin
        .batch_execute(
            "REVOKE USAGE ON SCHEMA durable_jobs FROM w1;
             CREATE ROLE dba SUPERUSER NOLOGIN;  CREATE ROLE dave LOGIN;  GRANT dba TO dave;",
        )
        .unwrap();
    let mut dave = cluster.connect_as("dave");
    dave.batch_execute("SET ROLE dba").unwrap();
    dave.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.6.0'").expect("the update");
    let role: String = dave.query_one("SELECT current_setting('role')", &[]).unwrap().get(0);
    assert_eq!(role, "dba");
    assert_eq!(grants(&mut admin, "bigint, text, uuid, text, text"), expected);
    dave.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.5.0'").expect("the downgrade");
    assert_eq!(grants(&mut admin, "bigint, text, uuid, text"), expected);
    admin.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.6.0'").unwrap();
    admin.batch_execute("REVOKE USAGE ON SCHEMA durable_jobs FROM w2").unwrap();
    let dropped = admin.batch_execute("DROP ROLE w2").unwrap_err();
    assert_eq!(harness::sqlstate(&dropped), "2BP01", "w2's grant depends on it");
    admin
        .batch_execute("REVOKE EXECUTE ON FUNCTION durable_jobs.fail_durable_job(bigint, text, uuid, text, text) FROM w1 CASCADE")
        .unwrap();
    assert_eq!(
        grants(&mut admin, "bigint, text, uuid, text, text"),
        Vec::<String>::new(),
        "w2's grant went with w1's option"
    );
}

/// A downgrade after the extension's objects were reassigned and their first owner dropped (the
/// initial privileges keep that role's oid): the view it makes again gets its initial privileges
/// back as they were. (Failed before: they were kept as text, which named the dropped role by
/// its oid and could not be read back, "role ... does not exist".)
#[test]
fn a_downgrade_after_the_first_owner_was_reassigned_and_dropped_succeeds() {
    let cluster = Cluster::start_without_extension("");
    let mut admin = cluster.connect();
    admin.batch_execute("CREATE ROLE first_owner SUPERUSER LOGIN; CREATE ROLE queue_owner").unwrap();
    cluster.connect_as("first_owner").batch_execute("CREATE EXTENSION durable_jobs").unwrap();
    admin.batch_execute("REASSIGN OWNED BY first_owner TO queue_owner; DROP ROLE first_owner").unwrap();
    admin.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.5.0'").expect("downgrade");
    admin.batch_execute("ALTER EXTENSION durable_jobs UPDATE TO '0.6.0'").expect("update again");
    admin
        .batch_execute("SELECT durable_jobs.enqueue_durable_job('external', '{}')")
        .expect("enqueue after both");
}
