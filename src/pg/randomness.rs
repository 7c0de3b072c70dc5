//! Lease tokens and the seeds of `random()` between jobs, from the kernel's random source.
//!
//! The claims take their tokens as an argument, made here. `gen_random_uuid()` and
//! `pg_strong_random` go through OpenSSL's generator (status check, lock,
//! DRBG) on every call: 5-6 % of a batched worker's time for two draws per job. Here each process
//! draws 4 KiB at a time with getrandom(2), which reads the same kernel source, and hands the
//! bytes out once each, in the process that drew them (a forked child draws its own).

use pgrx::prelude::*;
use pgrx::Uuid;
use std::cell::RefCell;

const POOL_BYTES: usize = 4096;

struct Pool {
    bytes: [u8; POOL_BYTES],
    /// Bytes before this index were handed out already.
    next: usize,
    /// The process that filled it: a child forked after a draw must not hand out the same bytes.
    filled_by: i32,
}

thread_local! {
    static POOL: RefCell<Pool> =
        const { RefCell::new(Pool { bytes: [0; POOL_BYTES], next: POOL_BYTES, filled_by: 0 }) };
}

/// Fills `buffer` with bytes of the kernel's random source; no byte is ever handed out twice.
pub fn fill(buffer: &mut [u8]) {
    POOL.with_borrow_mut(|pool| {
        let process = unsafe { pg_sys::MyProcPid };
        let mut filled = 0;
        while filled < buffer.len() {
            if pool.next == POOL_BYTES || pool.filled_by != process {
                refill(&mut pool.bytes);
                pool.next = 0;
                pool.filled_by = process;
            }
            let take = (buffer.len() - filled).min(POOL_BYTES - pool.next);
            buffer[filled..filled + take].copy_from_slice(&pool.bytes[pool.next..pool.next + take]);
            // Spent bytes are wiped, so that a later read of the pool cannot tell a past token.
            pool.bytes[pool.next..pool.next + take].fill(0);
            pool.next += take;
            filled += take;
        }
    })
}

/// getrandom(2) where the kernel and the C library have it (Linux 3.17, glibc 2.25), else
/// PostgreSQL's own source (OpenSSL or /dev/urandom).
fn refill(bytes: &mut [u8; POOL_BYTES]) {
    if !read_kernel_random(bytes)
        && !unsafe { pg_sys::pg_strong_random(bytes.as_mut_ptr().cast(), bytes.len()) }
    {
        error!("could not generate random bytes");
    }
}

#[cfg(target_os = "linux")]
fn read_kernel_random(bytes: &mut [u8]) -> bool {
    unsafe extern "C" {
        fn getrandom(buf: *mut std::ffi::c_void, buflen: usize, flags: std::ffi::c_uint) -> isize;
    }
    let mut filled = 0;
    while filled < bytes.len() {
        // Up to 256 bytes are never cut short; larger reads may be, and a signal may interrupt.
        let read = unsafe { getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0) };
        match read {
            1.. => filled += read as usize,
            -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            // ENOSYS, or refused by a seccomp filter.
            _ => return false,
        }
    }
    true
}

#[cfg(not(target_os = "linux"))]
fn read_kernel_random(_bytes: &mut [u8]) -> bool {
    false
}

/// A version 4 UUID (RFC 9562), as `gen_random_uuid()` makes: 122 random bits.
pub fn new_uuid() -> Uuid {
    let mut bytes = [0u8; 16];
    fill(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    Uuid::from_bytes(bytes)
}

/// A seed for `setseed()`, in [-1, 1].
pub fn new_seed() -> f64 {
    let mut bytes = [0u8; 8];
    fill(&mut bytes);
    (u64::from_le_bytes(bytes) as f64 / u64::MAX as f64) * 2.0 - 1.0
}
