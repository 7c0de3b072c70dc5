// Look-alike objects ahead on the search_path change nothing our functions do.

#[pg_test]
fn look_alike_functions_and_operators_cannot_hijack_the_api() {
    Spi::run(
        "CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'infinity'::timestamptz $$;
         CREATE FUNCTION public.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2000-01-01'::timestamptz $$;
         CREATE FUNCTION public.gen_random_uuid() RETURNS uuid LANGUAGE sql AS $$ SELECT '00000000-0000-0000-0000-000000000000'::uuid $$;
         CREATE FUNCTION public.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::bytea $$;
         CREATE FUNCTION public.always_true(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
         CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.always_true);
         CREATE FUNCTION public.uuid_always_true(uuid, uuid) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
         CREATE OPERATOR public.= (LEFTARG = uuid, RIGHTARG = uuid, FUNCTION = public.uuid_always_true);
         CREATE TABLE public.durable_job (job_id bigint);
         SET LOCAL search_path = public, pg_catalog",
    )
    .unwrap();
    // Idempotency fingerprints still tell payloads apart.
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{\"a\": 1}', 'key')").unwrap();
    assert_rejected("SELECT durable_jobs.enqueue_durable_job('k', '{\"a\": 2}', 'key')", "23505");
    Spi::run("SELECT durable_jobs.enqueue_durable_job('k', '{\"b\": 1}')").unwrap();

    // Tokens are random, leases end in the future, and the fence compares for real.
    let (first, first_token) = claim("w").unwrap();
    let (second, second_token) = claim("w").unwrap();
    assert_ne!(first_token, second_token);
    assert_eq!(
        job_field::<bool>(first, "lease_expires_at > pg_catalog.clock_timestamp() + interval '50 seconds'
                                  AND lease_expires_at < pg_catalog.clock_timestamp() + interval '61 seconds'"),
        Some(true)
    );
    assert_eq!(complete(first, "intruder", first_token), "stale");
    assert_eq!(complete(first, "w", second_token), "stale");
    assert_eq!(complete(first, "w", first_token), "succeeded");
    assert_eq!(fail(second, "w", second_token, "target_unavailable"), "retried");
    assert_eq!(
        job_field::<bool>(second, "run_after - updated_at BETWEEN interval '0.499 seconds' AND interval '1 second'"),
        Some(true)
    );
    assert_eq!(one::<i64>("SELECT count(*) FROM public.durable_job"), 0);
}
