//! Which `PutPiece` owns each piece file being received on an agent.
//!
//! An encoder writes a parity shard into its holder's file (`PutPiece`,
//! RMA writes, `SealPiece`). When the controller protects the same version
//! again (a superseded attempt, after a lost node), a second encoder may
//! put the same piece while the first one's session still holds its
//! receiving end. Both name one file. The first session, ending unsealed,
//! deleted that file (`Store::discard_piece`) while the second was writing
//! it, and the second then sealed a description of a file no longer there.
//!
//! Architecture invariant: only the newest `PutPiece` of a piece seals,
//! discards or otherwise touches its file; an older receiver that is
//! superseded leaves the file alone, and its `SealPiece` is refused.
//! Claiming, sealing and discarding run under one lock, so no older
//! receiver's discard falls between a newer one's claim and its seal.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use icheck_core::redundancy::PieceId;

/// The current owner (a ticket) of each (version, piece) being received.
#[derive(Default)]
pub(super) struct PieceOwners {
    owners: Mutex<HashMap<(u64, PieceId), u64>>,
    next: AtomicU64,
}

impl PieceOwners {
    /// Makes a new receiver the owner of `key`'s file, superseding any
    /// earlier one, and runs `create` (which makes the file) as the owner.
    /// Returns the receiver's ticket with what `create` returned.
    pub(super) fn claim<T>(&self, key: (u64, PieceId), create: impl FnOnce() -> T) -> (u64, T) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        owners.insert(key, ticket);
        (ticket, create())
    }

    /// Runs `last` (a seal or a discard of the file) if `ticket` still owns
    /// `key`, and gives the ownership up; `None` (and nothing run) if a
    /// newer receiver owns it now.
    pub(super) fn finish<T>(&self, key: (u64, PieceId), ticket: u64, last: impl FnOnce() -> T) -> Option<T> {
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        if owners.get(&key) != Some(&ticket) {
            return None;
        }
        let result = last();
        owners.remove(&key);
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARD: PieceId = PieceId::Parity { group: 0, index: 1 };

    /// A superseded receiver neither seals nor discards; the newest does,
    /// once; other pieces are their own.
    #[test]
    fn only_the_newest_receiver_of_a_piece_seals_or_discards_its_file() {
        let owners = PieceOwners::default();
        let (old, ()) = owners.claim((7, SHARD), || ());
        let (new, ()) = owners.claim((7, SHARD), || ());
        let (other, ()) = owners.claim((8, SHARD), || ());
        assert_eq!(owners.finish((7, SHARD), old, || "discarded"), None, "a superseded receiver touched the file");
        assert_eq!(owners.finish((7, SHARD), new, || "sealed"), Some("sealed"));
        assert_eq!(owners.finish((7, SHARD), new, || "again"), None, "finished twice");
        assert_eq!(owners.finish((8, SHARD), other, || "sealed"), Some("sealed"), "another version's piece");
        let (after, ()) = owners.claim((7, SHARD), || ());
        assert_eq!(owners.finish((7, SHARD), after, || "discarded"), Some("discarded"), "a later receiver owns it");
    }
}
