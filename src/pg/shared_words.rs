//! Values that shared memory keeps in atomic words, so that a reader never sees half of one:
//! a lease token in two words, a name (a role's in `ROLE_WORDS`, a queue's) in a fixed number.

use pgrx::pg_sys;
use pgrx::Uuid;
use std::sync::atomic::{AtomicU64, Ordering};

/// A role's name as the hand-over carries it (NAMEDATALEN bytes, NUL-terminated).
pub(crate) const ROLE_WORDS: usize = pg_sys::NAMEDATALEN as usize / 8;

/// A lease token in two words of shared memory (relaxed: the caller orders the stores).
pub(crate) fn store_token(words: &[AtomicU64; 2], token: Uuid) {
    let bytes = token.as_bytes();
    words[0].store(u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")), Ordering::Relaxed);
    words[1].store(u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")), Ordering::Relaxed);
}

/// The lease token `store_token` stored.
pub(crate) fn load_token(words: &[AtomicU64; 2]) -> Uuid {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&words[0].load(Ordering::Relaxed).to_le_bytes());
    bytes[8..].copy_from_slice(&words[1].load(Ordering::Relaxed).to_le_bytes());
    Uuid::from_bytes(bytes)
}

/// A name in shared memory, cut to its words' bytes (relaxed, as `store_token`).
pub(crate) fn store_name<const N: usize>(words: &[AtomicU64; N], name: &str) {
    for (word, value) in words.iter().zip(name_words::<N>(name)) {
        word.store(value, Ordering::Relaxed);
    }
}

/// The name `store_name` stored.
pub(crate) fn load_name<const N: usize>(words: &[AtomicU64; N]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|word| word.load(Ordering::Relaxed).to_le_bytes()).collect();
    let length = bytes.iter().position(|byte| *byte == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..length]).into_owned()
}

fn name_words<const N: usize>(name: &str) -> [u64; N] {
    let mut bytes = vec![0u8; N * 8];
    let name = name.as_bytes();
    let length = name.len().min(N * 8);
    bytes[..length].copy_from_slice(&name[..length]);
    std::array::from_fn(|word| u64::from_le_bytes(bytes[word * 8..word * 8 + 8].try_into().expect("8 bytes")))
}
