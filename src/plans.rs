//! Our hot statements, prepared once per backend and kept (SPI_keepplan), so that a claim or a
//! completion does not parse and plan its SQL on every call. PostgreSQL's plan cache revalidates
//! kept plans after DDL, and checks privileges on every execution.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiTupleTable};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    static PLANS: RefCell<HashMap<String, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

/// Executes `query` with `args`, preparing it on first use with the argument types of `args`
/// (every caller of one query passes the same types).
pub fn execute<'conn>(
    client: &mut SpiClient<'conn>,
    query: &str,
    args: &[DatumWithOid],
) -> SpiTupleTable<'conn> {
    // The map is not borrowed while the statement runs: a handler the statement calls may call
    // the extension's own functions, which use this map too.
    let kept = PLANS.with(|plans| plans.borrow().get(query).cloned());
    let plan = match kept {
        Some(plan) => plan,
        None => {
            let types: Vec<PgOid> = args.iter().map(|arg| PgOid::from(arg.oid())).collect();
            let plan = Rc::new(client.prepare_mut(query, &types).expect(query).keep());
            PLANS.with(|plans| plans.borrow_mut().insert(query.to_owned(), Rc::clone(&plan)));
            plan
        }
    };
    client.update(&*plan, None, args).expect(query)
}
