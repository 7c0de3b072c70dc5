//! SQL types pgrx has no fitting Rust type for.
//!
//! `JsonbDatum`: a jsonb value passed through untouched. pgrx's `JsonB` parses into serde_json
//! and back, which costs time and can round numbers; a job queue must hand the payload on
//! exactly as given. `JsonbArray`: a jsonb[] handed on to SQL the same way. `JobStatusRow` and
//! `JobListingRow`: rows of the status API's composite types, the same way. `Regprocedure`: a
//! routine's oid, declared in SQL as `regprocedure`.

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::prelude::*;
use pgrx::{pg_sys, FromDatum, IntoDatum, PgMemoryContexts};

/// A varlena SQL value held as its Datum and handed on as it is, never converted.
macro_rules! passthrough_varlena {
    ($name:ident, $type_oid:expr, $sql:literal) => {
        #[derive(Clone, Copy)]
        pub struct $name(pg_sys::Datum);

        impl FromDatum for $name {
            unsafe fn from_polymorphic_datum(
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                (!is_null).then_some($name(datum))
            }

            // SPI results vanish at SPI_finish: copy the value into the caller's context.
            unsafe fn from_datum_in_memory_context(
                mut memory_context: PgMemoryContexts,
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                if is_null {
                    return None;
                }
                memory_context.switch_to(|_| {
                    let copy = unsafe { pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr()) };
                    Some($name(pg_sys::Datum::from(copy)))
                })
            }
        }

        impl IntoDatum for $name {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(self.0)
            }

            fn type_oid() -> pg_sys::Oid {
                $type_oid
            }
        }

        unsafe impl<'fcx> ArgAbi<'fcx> for $name {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                unsafe { arg.unbox_arg_using_from_datum().expect(concat!("a non-NULL ", $sql, " argument")) }
            }
        }

        unsafe impl BoxRet for $name {
            unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
                unsafe { fcinfo.return_raw_datum(self.0) }
            }
        }

        impl_sql_translatable!($name, $sql);
    };
}

passthrough_varlena!(JsonbDatum, pg_sys::JSONBOID, "jsonb");
passthrough_varlena!(JsonbArray, pg_sys::JSONBARRAYOID, "jsonb[]");
// Rows of the status API's composite types, formed by SQL (`ROW(...)::type`) and handed on.
passthrough_varlena!(JobStatusRow, pg_sys::RECORDOID, "durable_jobs.durable_job_status");
passthrough_varlena!(JobListingRow, pg_sys::RECORDOID, "durable_jobs.durable_job_listing");

impl JsonbDatum {
    /// The payload's size in bytes once decompressed.
    pub fn raw_size(&self) -> usize {
        unsafe { pg_sys::toast_raw_datum_size(self.0) }
    }

    /// The value's bytes, detoasted, to outlive the memory it is in (a transaction's, say).
    /// Out of memory is an ERROR, as palloc's, not an abort of the process.
    pub fn to_bytes(self) -> Vec<u8> {
        unsafe {
            let value = pg_sys::pg_detoast_datum(self.0.cast_mut_ptr());
            let size = pgrx::varlena::varsize_any(value);
            let mut bytes = Vec::new();
            if bytes.try_reserve_exact(size).is_err() {
                ereport!(ERROR, PgSqlErrorCode::ERRCODE_OUT_OF_MEMORY, "out of memory");
            }
            bytes.extend_from_slice(std::slice::from_raw_parts(value as *const u8, size));
            bytes
        }
    }

    /// The value `to_bytes` kept, copied into the current memory context.
    pub fn from_bytes(bytes: &[u8]) -> JsonbDatum {
        unsafe {
            let copy = pg_sys::palloc(bytes.len()) as *mut u8;
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), copy, bytes.len());
            JsonbDatum(pg_sys::Datum::from(copy))
        }
    }
}

#[derive(Clone, Copy)]
pub struct Regprocedure(pub pg_sys::Oid);

impl FromDatum for Regprocedure {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        typoid: pg_sys::Oid,
    ) -> Option<Self> {
        unsafe { pg_sys::Oid::from_polymorphic_datum(datum, is_null, typoid) }.map(Regprocedure)
    }
}

impl IntoDatum for Regprocedure {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        self.0.into_datum()
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::REGPROCEDUREOID
    }
}

unsafe impl<'fcx> ArgAbi<'fcx> for Regprocedure {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        unsafe { arg.unbox_arg_using_from_datum().expect("a non-NULL regprocedure argument") }
    }
}

impl_sql_translatable!(Regprocedure, "regprocedure");
