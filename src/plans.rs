//! Our hot statements, prepared once per backend and kept (SPI_keepplan), so that a claim or a
//! completion does not parse and plan its SQL on every call. PostgreSQL's plan cache revalidates
//! kept plans after DDL, and checks privileges on every execution.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    static PLANS: RefCell<HashMap<String, OwnedPreparedStatement>> = RefCell::new(HashMap::new());
}

/// Executes `query` with `args`, preparing it on first use with the argument types of `args`
/// (every caller of one query passes the same types).
pub fn execute<'conn>(
    client: &mut SpiClient<'conn>,
    query: &str,
    args: &[DatumWithOid],
) -> SpiTupleTable<'conn> {
    PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        if !plans.contains_key(query) {
            let types: Vec<PgOid> = args.iter().map(|arg| PgOid::from(arg.oid())).collect();
            let plan = client.prepare_mut(query, &types).expect(query).keep();
            plans.insert(query.to_owned(), plan);
        }
        client.update(&plans[query], None, args).expect(query)
    })
}
