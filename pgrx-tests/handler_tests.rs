// Handler registration, failure classification and metrics.

fn create_handlers() {
    Spi::run(
        "CREATE FUNCTION public.dj_ok(payload jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE PROCEDURE public.dj_proc(payload jsonb) LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.dj_two(a jsonb, b jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.dj_text(a text) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE AGGREGATE public.dj_agg(jsonb) (SFUNC = jsonb_concat, STYPE = jsonb);",
    )
    .unwrap();
}

fn registered_handler(job_kind: &str) -> Option<String> {
    Spi::get_one_with_args::<String>(
        "SELECT (SELECT handler::text FROM durable_jobs.durable_job_handler WHERE job_kind = $1)",
        &[job_kind.into()],
    )
    .unwrap()
}

#[pg_test]
fn functions_and_procedures_with_one_jsonb_argument_register() {
    create_handlers();
    Spi::run("SELECT durable_jobs.register_durable_job_handler('mail', 'public.dj_ok(jsonb)')").unwrap();
    Spi::run("SELECT durable_jobs.register_durable_job_handler('load', 'public.dj_proc(jsonb)')").unwrap();
    assert_eq!(registered_handler("mail").as_deref(), Some("public.dj_ok(jsonb)"));
    assert_eq!(registered_handler("load").as_deref(), Some("public.dj_proc(jsonb)"));
    // Registering again replaces the handler.
    Spi::run("SELECT durable_jobs.register_durable_job_handler('mail', 'public.dj_proc(jsonb)')").unwrap();
    assert_eq!(registered_handler("mail").as_deref(), Some("public.dj_proc(jsonb)"));
    assert!(one::<bool>("SELECT durable_jobs.unregister_durable_job_handler('mail')"));
    assert!(!one::<bool>("SELECT durable_jobs.unregister_durable_job_handler('mail')"));
    assert_eq!(registered_handler("mail"), None);
}

#[pg_test]
fn handlers_of_the_wrong_shape_are_rejected() {
    create_handlers();
    for (arguments, sqlstate) in [
        ("'k', 'public.dj_two(jsonb, jsonb)'", "22023"),
        ("'k', 'public.dj_text(text)'", "22023"),
        ("'k', 'public.dj_agg(jsonb)'", "22023"),
        ("'k', 'pg_catalog.now()'", "22023"),
        ("'k', 12345678::oid::regprocedure", "22023"),
        ("NULL, 'public.dj_ok(jsonb)'", "22004"),
        ("'k', NULL", "22004"),
        ("'bad kind', 'public.dj_ok(jsonb)'", "22023"),
    ] {
        assert_rejected(&format!("SELECT durable_jobs.register_durable_job_handler({arguments})"), sqlstate);
    }
    assert_rejected("SELECT durable_jobs.unregister_durable_job_handler(NULL)", "22004");
    assert_eq!(one::<i64>("SELECT count(*) FROM durable_jobs.durable_job_handler"), 0);
}

#[pg_test]
fn registering_needs_execute_on_the_handler_and_ownership_to_replace() {
    create_handlers();
    Spi::run(
        "CREATE ROLE dj_test_registrar; CREATE ROLE dj_test_rival;
         REVOKE EXECUTE ON FUNCTION public.dj_ok(jsonb) FROM PUBLIC;
         GRANT USAGE ON SCHEMA durable_jobs, tests TO dj_test_registrar, dj_test_rival;
         GRANT EXECUTE ON FUNCTION durable_jobs.register_durable_job_handler(text, regprocedure),
                                   durable_jobs.unregister_durable_job_handler(text)
             TO dj_test_registrar, dj_test_rival;
         SET LOCAL ROLE dj_test_registrar",
    )
    .unwrap();
    let refused = sqlstate_of("SELECT durable_jobs.register_durable_job_handler('k', 'public.dj_ok(jsonb)')");
    assert_eq!(refused.as_deref(), Some("42501"), "no EXECUTE on the handler");
    Spi::run("SELECT durable_jobs.register_durable_job_handler('k', 'public.dj_proc(jsonb)')").unwrap();
    Spi::run("SET LOCAL ROLE dj_test_rival").unwrap();
    for statement in [
        "SELECT durable_jobs.register_durable_job_handler('k', 'public.dj_proc(jsonb)')",
        "SELECT durable_jobs.unregister_durable_job_handler('k')",
    ] {
        assert_eq!(sqlstate_of(statement).as_deref(), Some("42501"), "{statement}");
    }
    Spi::run("RESET ROLE").unwrap();
    let registration = Spi::get_two::<String, String>(
        "SELECT handler::text, registered_by::text FROM durable_jobs.durable_job_handler WHERE job_kind = 'k'",
    );
    assert_eq!(registration, Ok((Some("public.dj_proc(jsonb)".into()), Some("dj_test_registrar".into()))));
}

/// The worker's check of a handler and its enqueuer (`handlers::runnable_handler`, catalog
/// caches) against a reference query, over superuser and ordinary owners and enqueuers,
/// membership with and without inheritance, no EXECUTE, a set-returning function, a procedure,
/// a handler or role that does not exist. An owner's code runs as an enqueuer only when the
/// owner holds the enqueuer's rights: a member's code may run as its group, a group's never as
/// its members (until 0.6.0 the reference and the assertions below said the opposite, and a
/// group's member could run code as every other member; reverting `runs_code_of` to
/// `has_privs_of_role(enqueuer, author)` fails this test at its first assertion).
#[pg_test]
fn the_worker_checks_a_handler_as_its_load_query_did() {
    Spi::run(
        "CREATE ROLE dj_rh_super SUPERUSER; CREATE ROLE dj_rh_owner; CREATE ROLE dj_rh_member IN ROLE dj_rh_owner;
         CREATE ROLE dj_rh_noinherit NOINHERIT IN ROLE dj_rh_owner; CREATE ROLE dj_rh_stranger;
         CREATE ROLE dj_rh_grandchild IN ROLE dj_rh_member; CREATE ROLE dj_rh_below_noinherit IN ROLE dj_rh_noinherit;
         CREATE FUNCTION public.dj_rh_super_private(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         ALTER FUNCTION public.dj_rh_super_private(jsonb) OWNER TO dj_rh_super;
         REVOKE EXECUTE ON FUNCTION public.dj_rh_super_private(jsonb) FROM PUBLIC;
         CREATE FUNCTION public.dj_rh_f(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.dj_rh_g(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.dj_rh_private(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION public.dj_rh_set(jsonb) RETURNS SETOF integer LANGUAGE sql AS 'SELECT 1';
         CREATE PROCEDURE public.dj_rh_p(jsonb) LANGUAGE sql AS 'SELECT 1';
         CREATE PROCEDURE public.dj_rh_q(jsonb) LANGUAGE sql AS 'SELECT 1';
         ALTER FUNCTION public.dj_rh_f(jsonb) OWNER TO dj_rh_super;
         ALTER FUNCTION public.dj_rh_private(jsonb) OWNER TO dj_rh_owner;
         REVOKE EXECUTE ON FUNCTION public.dj_rh_private(jsonb) FROM PUBLIC;
         ALTER FUNCTION public.dj_rh_g(jsonb) OWNER TO dj_rh_owner;
         ALTER FUNCTION public.dj_rh_set(jsonb) OWNER TO dj_rh_super;
         ALTER PROCEDURE public.dj_rh_q(jsonb) OWNER TO dj_rh_owner;
         CREATE FUNCTION public.dj_rh_m(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         ALTER FUNCTION public.dj_rh_m(jsonb) OWNER TO dj_rh_member;
         CREATE FUNCTION public.dj_rh_gc(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         ALTER FUNCTION public.dj_rh_gc(jsonb) OWNER TO dj_rh_grandchild;
         CREATE FUNCTION public.dj_rh_n(jsonb) RETURNS void LANGUAGE sql AS 'SELECT 1';
         ALTER FUNCTION public.dj_rh_n(jsonb) OWNER TO dj_rh_noinherit;",
    )
    .unwrap();
    let handlers = ["public.dj_rh_f(jsonb)", "public.dj_rh_g(jsonb)", "public.dj_rh_private(jsonb)",
                    "public.dj_rh_set(jsonb)", "public.dj_rh_p(jsonb)", "public.dj_rh_q(jsonb)",
                    "public.dj_rh_none(jsonb)", "dj_rh_f(jsonb)", "public.dj_rh_super_private(jsonb)",
                    "public.dj_rh_m(jsonb)", "public.dj_rh_gc(jsonb)", "public.dj_rh_n(jsonb)"];
    let enqueuers = ["dj_rh_super", "dj_rh_owner", "dj_rh_member", "dj_rh_noinherit", "dj_rh_stranger",
                     "dj_rh_grandchild", "dj_rh_below_noinherit", "dj_rh_gone"];
    let reference = "
        SELECT p.oid, p.prokind = 'p', r.oid,
               COALESCE(pg_catalog.has_function_privilege(r.oid, p.oid, 'EXECUTE') AND NOT p.proretset
                        AND (o.rolsuper OR (NOT r.rolsuper AND pg_catalog.pg_has_role(o.oid, r.oid, 'USAGE'))),
                        false)
        FROM (SELECT $1::text AS handler, $2::name AS enqueued_by) k
        LEFT JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(k.handler)
        LEFT JOIN pg_catalog.pg_roles o ON o.oid = p.proowner
        LEFT JOIN pg_catalog.pg_roles r ON r.rolname = k.enqueued_by";
    let (mut runnable, mut refused) = (0, 0);
    for handler in handlers {
        for enqueuer in enqueuers {
            let expected = Spi::connect(|client| {
                let row = client.select(reference, Some(1), &[handler.into(), enqueuer.into()]).unwrap().first();
                let may_run = row.get::<bool>(4).unwrap().unwrap();
                may_run.then(|| {
                    (row.get::<pg_sys::Oid>(1).unwrap().unwrap(), row.get::<bool>(2).unwrap().unwrap(),
                     row.get::<pg_sys::Oid>(3).unwrap().unwrap())
                })
            });
            let checked = crate::jobs::trust::runnable_handler(handler, enqueuer, enqueuer)
                .map(|found| (found.routine, found.is_procedure, found.role));
            assert_eq!(checked, expected, "{handler} enqueued by {enqueuer}");
            if checked.is_some() { runnable += 1 } else { refused += 1 }
        }
    }
    assert!(runnable >= 8 && refused >= 20, "{runnable} runnable, {refused} refused");
    let may_run = |handler: &str, enqueuer: &str| crate::jobs::trust::runnable_handler(handler, enqueuer, enqueuer).is_some();
    assert!(!may_run("public.dj_rh_g(jsonb)", "dj_rh_member"), "a group's code never runs as its member");
    assert!(!may_run("public.dj_rh_g(jsonb)", "dj_rh_grandchild"), "nor as a member's member");
    assert!(may_run("public.dj_rh_g(jsonb)", "dj_rh_owner"), "the owner's own code runs as itself");
    assert!(may_run("public.dj_rh_m(jsonb)", "dj_rh_owner"), "a member's code runs as the group whose rights it holds");
    assert!(may_run("public.dj_rh_gc(jsonb)", "dj_rh_owner"), "through two memberships");
    assert!(may_run("public.dj_rh_gc(jsonb)", "dj_rh_member"), "and through one");
    assert!(!may_run("public.dj_rh_m(jsonb)", "dj_rh_grandchild"), "never down to a member's member");
    assert!(!may_run("public.dj_rh_n(jsonb)", "dj_rh_owner"), "not without inheriting the group's privileges");
    assert!(!may_run("public.dj_rh_m(jsonb)", "dj_rh_stranger"), "never as an unrelated role");
    assert!(!may_run("public.dj_rh_g(jsonb)", "dj_rh_super"), "a superuser never runs an ordinary role's code");
    assert!(!may_run("public.dj_rh_m(jsonb)", "dj_rh_super"), "whatever the memberships");
    assert!(may_run("public.dj_rh_f(jsonb)", "dj_rh_stranger"), "a superuser's handler runs for anyone");
    assert!(!may_run("public.dj_rh_private(jsonb)", "dj_rh_stranger"), "without EXECUTE");
    assert!(!may_run("public.dj_rh_super_private(jsonb)", "dj_rh_stranger"), "a superuser's, without EXECUTE");
}

/// Whose jobs a registration serves (`durable_job_handler_serves`, which the worker's claim and
/// the enqueue's direct lease ask) over superusers, groups, members with and without inheritance
/// and unrelated roles, and `durable_job_handlers` saying the same of every pair. Until 0.6.0 a
/// group's registration served its members, so one member could run code as another
/// (`runs_code_of` reverted to `has_privs_of_role(enqueuer, author)` fails the first assertion).
#[pg_test]
fn a_registration_serves_only_the_roles_whose_rights_its_registrant_holds() {
    Spi::run(
        "CREATE ROLE dj_sv_super SUPERUSER; CREATE ROLE dj_sv_group; CREATE ROLE dj_sv_member IN ROLE dj_sv_group;
         CREATE ROLE dj_sv_other IN ROLE dj_sv_group; CREATE ROLE dj_sv_noinherit NOINHERIT IN ROLE dj_sv_group;
         CREATE ROLE dj_sv_stranger; CREATE ROLE dj_sv_grandchild IN ROLE dj_sv_member;",
    )
    .unwrap();
    let serves = |registrant: &str, enqueuer: &str| -> bool {
        Spi::get_one_with_args::<bool>(
            "SELECT durable_jobs.durable_job_handler_serves($1, $2)",
            &[registrant.into(), enqueuer.into()],
        )
        .unwrap()
        .unwrap()
    };
    assert!(!serves("dj_sv_group", "dj_sv_member"), "a group's registration never serves its members");
    assert!(!serves("dj_sv_member", "dj_sv_other"), "nor one member's another member");
    assert!(!serves("dj_sv_group", "dj_sv_grandchild"), "nor a member's member");
    assert!(serves("dj_sv_member", "dj_sv_group"), "a member's serves the group whose rights it holds");
    assert!(serves("dj_sv_grandchild", "dj_sv_group"), "through two memberships");
    assert!(!serves("dj_sv_noinherit", "dj_sv_group"), "not without inheriting the group's privileges");
    assert!(serves("dj_sv_stranger", "dj_sv_stranger"), "a role's own");
    assert!(!serves("dj_sv_stranger", "dj_sv_member"), "never an unrelated role's");
    assert!(serves("dj_sv_super", "dj_sv_stranger"), "a superuser's serves every role");
    let me = Spi::get_one::<String>("SELECT current_user::text").unwrap().unwrap();
    assert!(serves("dj_sv_super", &me), "superusers too");
    assert!(!serves("dj_sv_member", "dj_sv_super"), "an ordinary role's never a superuser's");
    assert!(!serves("dj_sv_gone", "dj_sv_stranger"), "a registrant that does not exist serves nobody");

    let roles = ["dj_sv_super", "dj_sv_group", "dj_sv_member", "dj_sv_other", "dj_sv_noinherit",
                 "dj_sv_stranger", "dj_sv_grandchild", me.as_str()];
    for registrant in roles {
        Spi::run_with_args(
            "INSERT INTO durable_jobs.durable_job_handler (job_kind, handler, registered_by)
             VALUES ($1, 'public.dj_sv(jsonb)', $1)",
            &[registrant.into()],
        )
        .unwrap();
    }
    let mut served = 0;
    for registrant in roles {
        for enqueuer in roles {
            let shown = Spi::get_one_with_args::<bool>(
                "SELECT serves_every_role OR $2 = ANY (serves_roles) FROM durable_jobs.durable_job_handlers
                 WHERE job_kind = $1",
                &[registrant.into(), enqueuer.into()],
            )
            .unwrap()
            .unwrap();
            assert_eq!(shown, serves(registrant, enqueuer), "durable_job_handlers: {registrant} for {enqueuer}");
            served += i32::from(shown);
        }
    }
    assert_eq!(served, 2 * 8 + 6 + 4, "two superusers serve all eight, six roles themselves, four memberships");
    let listed = Spi::get_one::<Vec<String>>(
        "SELECT serves_roles::text[] FROM durable_jobs.durable_job_handlers WHERE job_kind = 'dj_sv_grandchild'",
    );
    assert_eq!(listed, Ok(Some(vec!["dj_sv_grandchild".into(), "dj_sv_group".into(), "dj_sv_member".into()])));
}

/// Calls `handler` as the worker would at a job's turn, with an empty payload, in a
/// subtransaction: "ran", or the SQLSTATE of the error that stopped it.
fn call_handler_in_subtransaction(handler: crate::jobs::trust::RunnableHandler) -> String {
    let payload = Spi::get_one::<crate::pg::sql_types::JsonbDatum>("SELECT '{}'::jsonb").unwrap().unwrap();
    match crate::worker::sandbox::in_subtransaction(|| {
        crate::worker::sandbox::call_handler(handler, payload);
        true
    }) {
        Ok(_) => "ran".to_string(),
        Err(error) => error.sqlstate(),
    }
}

/// A registration changed between a job's claim and the load of its batch (a role runner's
/// batch, a batch after the first of a claim, a job handed over at enqueue, a rerun) is judged
/// again at the load: unregistered and registered again by a role that holds none of the
/// enqueuer's rights, it does not run, even with a routine the enqueuer owns (which the owner
/// check alone lets run), and the job goes back to the queue with its attempt, to wait for an
/// external worker as it would have at the claim. Failed before: the load took the kind's
/// registration whoever made it. And a registering role that loses the enqueuer's rights after
/// the load (its membership revoked while the batch runs) stops the job at its call, as a
/// handler's owner does: failed before, the job ran.
#[pg_test]
fn a_registration_made_after_the_claim_runs_only_if_it_serves_the_enqueuer() {
    Spi::run(
        "CREATE ROLE dj_rc_enqueuer; CREATE ROLE dj_rc_admin IN ROLE dj_rc_enqueuer; CREATE ROLE dj_rc_stranger;
         CREATE FUNCTION public.dj_rc_admins(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         CREATE FUNCTION public.dj_rc_purge(jsonb) RETURNS void LANGUAGE sql AS 'SELECT';
         ALTER FUNCTION public.dj_rc_purge(jsonb) OWNER TO dj_rc_enqueuer;
         INSERT INTO durable_jobs.durable_job_handler (job_kind, handler, registered_by)
         VALUES ('dj_rc', 'public.dj_rc_admins(jsonb)', 'dj_rc_admin');
         GRANT USAGE ON SCHEMA durable_jobs TO dj_rc_enqueuer;
         GRANT EXECUTE ON FUNCTION durable_jobs.enqueue_durable_job TO dj_rc_enqueuer;
         SET LOCAL ROLE dj_rc_enqueuer;
         SELECT durable_jobs.enqueue_durable_job('dj_rc', '{}');
         SELECT durable_jobs.enqueue_durable_job('dj_rc', '{}');
         RESET ROLE;",
    )
    .unwrap();
    let claimed: Vec<(i64, pgrx::Uuid)> = (0..2).map(|_| claim("w").unwrap()).collect();
    let load = |job: (i64, pgrx::Uuid)| crate::worker::load::load_jobs(&[job], "w").remove(&job.0).expect("loaded");
    let admins = one::<pg_sys::Oid>("SELECT 'public.dj_rc_admins(jsonb)'::regprocedure::oid");
    let first = load(claimed[0]);
    assert_eq!(first.handler.map(|handler| handler.routine), Some(admins), "the registration that served the claim");
    Spi::run(
        "UPDATE durable_jobs.durable_job_handler
         SET handler = 'public.dj_rc_purge(jsonb)', registered_by = 'dj_rc_stranger' WHERE job_kind = 'dj_rc'",
    )
    .unwrap();
    let second = load(claimed[1]);
    assert!(second.handler.is_none() && second.given_back, "a stranger's registration made after the claim");
    assert_eq!(
        (job_state(claimed[1].0), job_field::<i32>(claimed[1].0, "attempt_count")),
        ("available".to_string(), Some(0)),
        "given back with its attempt"
    );
    // Registered again by a role with the enqueuer's rights: loaded, and runnable until that
    // role's membership goes.
    Spi::run("UPDATE durable_jobs.durable_job_handler SET registered_by = 'dj_rc_admin' WHERE job_kind = 'dj_rc'")
        .unwrap();
    Spi::run(&format!("UPDATE durable_jobs.durable_job SET run_after = now() WHERE job_id = {}", claimed[1].0)).unwrap();
    let again = claim("w").expect("claimed again");
    let handler = load(again).handler.expect("runnable");
    let purge = one::<pg_sys::Oid>("SELECT 'public.dj_rc_purge(jsonb)'::regprocedure::oid");
    assert_eq!(handler.routine, purge, "the same routine registered by a role holding the enqueuer's rights");
    let call = || call_handler_in_subtransaction(handler);
    assert_eq!(call(), "ran");
    Spi::run("REVOKE dj_rc_enqueuer FROM dj_rc_admin").unwrap();
    assert_eq!(call(), "42501", "the registering role no longer holds the enqueuer's rights");
}

#[pg_test]
fn the_worker_checks_a_handler_again_when_it_calls_it() {
    // The load checks a batch's handlers once; a job later in the batch must not run a handler
    // that changed hands (or was dropped) since.
    Spi::run(
        "CREATE ROLE dj_ch_enqueuer; CREATE ROLE dj_ch_other;
         CREATE TABLE public.dj_ch_effects (n integer);
         CREATE FUNCTION public.dj_ch(jsonb) RETURNS void LANGUAGE sql AS 'INSERT INTO public.dj_ch_effects VALUES (1)';
         ALTER FUNCTION public.dj_ch(jsonb) OWNER TO dj_ch_enqueuer;",
    )
    .unwrap();
    let handler =
        crate::jobs::trust::runnable_handler("public.dj_ch(jsonb)", "dj_ch_enqueuer", "dj_ch_enqueuer").expect("runnable at load");
    let call = || call_handler_in_subtransaction(handler);
    assert_eq!(call(), "ran");
    Spi::run("ALTER FUNCTION public.dj_ch(jsonb) OWNER TO dj_ch_other").unwrap();
    assert_eq!(call(), "42501", "the owner changed after the load: dj_ch_enqueuer may not run dj_ch_other's code");
    Spi::run("ALTER FUNCTION public.dj_ch(jsonb) OWNER TO dj_ch_enqueuer").unwrap();
    assert_eq!(call(), "ran");
    Spi::run("DROP FUNCTION public.dj_ch(jsonb)").unwrap();
    assert_eq!(call(), "42883", "dropped after the load");
    assert_eq!(Spi::get_one::<i64>("SELECT count(*) FROM public.dj_ch_effects").unwrap(), Some(2));
}

#[pg_test]
fn sqlstates_map_to_stable_failure_codes() {
    use crate::jobs::failure::FailureCode::*;
    for (sqlstate, expected) in [
        ("22012", InvalidRequest),
        ("22P02", InvalidRequest),
        ("23505", IntegrityViolation),
        ("23514", IntegrityViolation),
        ("42P01", TargetRejected),
        ("42501", TargetRejected),
        ("28000", TargetRejected),
        ("40001", TargetUnavailable),
        ("40P01", TargetUnavailable),
        ("53100", TargetUnavailable),
        ("55P03", TargetUnavailable),
        ("57014", TargetUnavailable),
        ("08006", TargetUnavailable),
        ("P0001", UnexpectedFailure),
        ("XX000", UnexpectedFailure),
        ("55000", UnexpectedFailure),
    ] {
        assert_eq!(crate::jobs::failure::FailureCode::from_sqlstate(sqlstate), expected, "{sqlstate}");
    }
    assert!(TargetUnavailable.is_retryable() && UnexpectedFailure.is_retryable());
    assert!(!InvalidRequest.is_retryable() && !IntegrityViolation.is_retryable());
    assert!(!TargetRejected.is_retryable() && !LeaseExpired.is_retryable());
}

#[pg_test]
fn a_caught_error_yields_its_sqlstate() {
    // The worker reads SQLSTATEs from caught errors; a standard code must survive the round trip.
    let caught = PgTryBuilder::new(|| {
        Spi::run("SELECT 1 / 0").unwrap();
        String::new()
    })
    .catch_others(|error| match error {
        pg_sys::panic::CaughtError::PostgresError(report) => {
            crate::worker::sandbox::sqlstate_text(report.sql_error_code() as i32)
        }
        _ => "not a postgres error".into(),
    })
    .execute();
    assert_eq!(caught, "22012");
}

#[pg_test]
fn metrics_have_a_fixed_set_of_names() {
    enqueue("k", r#"{"secret": "never in metrics"}"#);
    let running = enqueue("k", "{}");
    Spi::run_with_args("UPDATE durable_jobs.durable_job SET priority = 9 WHERE job_id = $1", &[running.into()]).unwrap();
    claim("w").unwrap();
    let metrics: Vec<(String, i64)> = Spi::connect(|client| {
        client
            .select("SELECT metric_name, metric_value FROM durable_jobs.durable_job_metrics()", None, &[])
            .unwrap()
            .map(|row| (row.get(1).unwrap().unwrap(), row.get(2).unwrap().unwrap()))
            .collect()
    });
    let names: Vec<&str> = metrics.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "idle_polls", "claimed", "succeeded", "retried", "failed", "stale", "sql_api_claimed",
            "sql_api_succeeded", "sql_api_retried", "sql_api_failed", "sql_api_stale", "jobs_available",
            "jobs_running", "jobs_succeeded", "jobs_failed", "jobs_cancelled"
        ]
    );
    let value = |name: &str| metrics.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!((value("jobs_available"), value("jobs_running"), value("jobs_succeeded")), (1, 1, 0));
}

#[pg_test]
fn metrics_count_every_state_in_one_pass_over_the_job_table() {
    Spi::run(
        "INSERT INTO durable_jobs.durable_job (queue_name, job_kind, job_state, payload, max_attempts, attempt_count,
                                               enqueued_by, finished_at, last_failure_code)
         SELECT 'q', 'k', s, NULL, 1, 1, current_user, now(), CASE WHEN s = 'failed' THEN 'target_rejected' END
         FROM unnest(ARRAY['succeeded', 'succeeded', 'failed', 'cancelled', 'cancelled', 'cancelled']) AS s",
    )
    .unwrap();
    enqueue("k", "{}");
    let value = |name: &str| -> i64 {
        Spi::get_one_with_args("SELECT metric_value FROM durable_jobs.durable_job_metrics() WHERE metric_name = $1", &[
            name.into(),
        ])
        .unwrap()
        .unwrap()
    };
    let counts: Vec<i64> =
        ["jobs_available", "jobs_running", "jobs_succeeded", "jobs_failed", "jobs_cancelled"].map(value).into();
    assert_eq!(counts, [1, 0, 2, 1, 3]);
    // A scrape reads the table once, not once per state (five reads of a big table before).
    // Without parallel workers, whose share of one parallel scan counts as a loop each: with a
    // big estimate (other tests' rows, rolled back, leave the table's pages) the planner may
    // pick a parallel scan.
    Spi::run("SET LOCAL max_parallel_workers_per_gather = 0").unwrap();
    let plan = one::<pgrx::Json>(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", crate::api::metrics::JOBS_PER_STATE)).0;
    let reads: i64 = Spi::get_one_with_args(
        r#"SELECT sum((n ->> 'Actual Loops')::bigint)::bigint
           FROM jsonb_path_query($1::jsonb, 'strict $.** ? (@."Relation Name" == "durable_job")') AS n"#,
        &[plan.to_string().into()],
    )
    .unwrap()
    .unwrap();
    assert_eq!(reads, 1, "{plan}");
}

#[pg_test]
fn prometheus_exposition_has_fixed_names_and_types() {
    enqueue("k", r#"{"secret": "not in metrics"}"#);
    let text: String = one("SELECT durable_jobs.durable_job_metrics_prometheus()");
    let expected_counters = [
        "idle_polls", "claimed", "succeeded", "retried", "failed", "stale", "sql_api_claimed",
        "sql_api_succeeded", "sql_api_retried", "sql_api_failed", "sql_api_stale",
    ];
    for counter in expected_counters {
        let name = format!("durable_jobs_{counter}_total");
        assert!(text.contains(&format!("# TYPE {name} counter\n")), "{text}");
        assert!(text.contains(&format!("\n{name} 0\n")), "{text}");
    }
    assert!(text.contains("# TYPE durable_jobs_jobs gauge\n"));
    assert!(text.contains("durable_jobs_jobs{state=\"available\"} 1\n"), "{text}");
    assert!(text.contains("durable_jobs_jobs{state=\"cancelled\"} 0\n"), "{text}");
    assert!(!text.contains("secret"));
    // Every sample line names a durable_jobs_ metric; every metric has HELP and TYPE.
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    // Sixteen, three per-queue gauges for the one queue, and the count of queues left out; no
    // histogram sample, since no attempt ended.
    assert_eq!(samples.len(), 20, "{text}");
    assert!(samples.iter().all(|l| l.starts_with("durable_jobs_")));
    // Eleven counters, the state gauge, three queue gauges, the queues left out, the two gauges
    // of limits per key and rates (no sample without such a limit), two histograms.
    assert_eq!(text.lines().filter(|l| l.starts_with("# HELP ")).count(), 20);
}

/// A queue's series goes once it has no pending job and no control: a queue paused and resumed
/// keeps its control row, open and unlimited, and exported no series after all. Broken before:
/// the row kept the series for ever.
#[pg_test]
fn a_resumed_unlimited_queue_without_pending_jobs_has_no_series() {
    Spi::run(
        "SELECT durable_jobs.pause_durable_job_queue('was_paused');
         SELECT durable_jobs.resume_durable_job_queue('was_paused');
         SELECT durable_jobs.set_durable_job_queue_concurrency('was_limited', 3);
         SELECT durable_jobs.set_durable_job_queue_concurrency('was_limited', NULL);
         SELECT durable_jobs.set_durable_job_queue_concurrency('limited_series', 3);",
    )
    .unwrap();
    let text: String = one("SELECT durable_jobs.durable_job_metrics_prometheus()");
    assert!(!text.contains("queue=\"was_paused\""), "{text}");
    assert!(!text.contains("queue=\"was_limited\""), "{text}");
    assert!(text.contains("durable_jobs_queue_ready_jobs{queue=\"limited_series\"} 0\n"), "{text}");
}

#[pg_test]
fn prometheus_exposition_counts_keys_at_their_limit_and_usable_rate_tokens() {
    // Keys are counted per queue, never labels; a rate limit shows its usable tokens. Failed
    // before the gauges existed.
    Spi::run(
        "SELECT durable_jobs.set_durable_job_queue_key_concurrency('tenants_metrics', 1);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'tenants_metrics', concurrency_key => key)
         FROM unnest(ARRAY['acme', 'acme', 'globex']) key;
         SELECT durable_jobs.set_durable_job_queue_rate('api_metrics', 0.001, 3);
         SELECT durable_jobs.enqueue_durable_job('k', '{}', queue_name => 'api_metrics');",
    )
    .unwrap();
    claim_from("tenants_metrics").unwrap();
    claim_from("api_metrics").unwrap();
    let text: String = one("SELECT durable_jobs.durable_job_metrics_prometheus()");
    for line in [
        "durable_jobs_queue_keys_at_limit{queue=\"tenants_metrics\"} 1\n",
        "durable_jobs_queue_rate_tokens{queue=\"api_metrics\"} 2\n",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
    assert!(!text.contains("acme"), "a key is no label");
    // The queue summary shows the same.
    let summary = Spi::get_two::<i64, i64>(
        "SELECT (SELECT max(keys_at_limit) FROM durable_jobs.durable_job_queue_summary WHERE queue_name = 'tenants_metrics'),
                (SELECT max(rate_tokens) FROM durable_jobs.durable_job_queue_summary WHERE queue_name = 'api_metrics')",
    );
    assert_eq!(summary, Ok((Some(1), Some(2))));
}

#[pg_test]
fn prometheus_exposition_has_per_queue_gauges() {
    Spi::run(
        "SELECT durable_jobs.enqueue_durable_jobs('k', array_fill('{}'::jsonb, ARRAY[3]), NULL, 'emails',
                                                 now() - interval '90 seconds');
         SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'reports', now() + interval '1 hour');
         SELECT durable_jobs.pause_durable_job_queue('paused_empty');",
    )
    .unwrap();
    claim_from("emails").unwrap();
    let text: String = one("SELECT durable_jobs.durable_job_metrics_prometheus()");
    for line in [
        "durable_jobs_queue_ready_jobs{queue=\"emails\"} 2\n",
        "durable_jobs_queue_running_jobs{queue=\"emails\"} 1\n",
        "durable_jobs_queue_ready_jobs{queue=\"reports\"} 0\n",
        "durable_jobs_queue_oldest_ready_age_seconds{queue=\"reports\"} 0.000\n",
        "durable_jobs_queue_ready_jobs{queue=\"paused_empty\"} 0\n",
        "durable_jobs_queues_not_exported 0\n",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
    let age: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("durable_jobs_queue_oldest_ready_age_seconds{queue=\"emails\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!((90.0..3600.0).contains(&age), "{age}");
    // Bounded: past 100 queues the rest is only counted.
    Spi::run(
        "SELECT durable_jobs.enqueue_durable_job('k', '{}', NULL, 'q' || g) FROM generate_series(1, 120) g",
    )
    .unwrap();
    let text: String = one("SELECT durable_jobs.durable_job_metrics_prometheus()");
    assert_eq!(text.lines().filter(|l| l.starts_with("durable_jobs_queue_ready_jobs{")).count(), 100);
    assert!(text.contains("durable_jobs_queues_not_exported 23\n"), "{text}");
}
