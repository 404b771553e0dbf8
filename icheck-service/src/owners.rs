//! Which writer owns a file that two writers may name at once.
//!
//! Files in a node's store are named by what they hold, not by who writes
//! them, so two writers can name one file:
//!
//! * **Pieces of redundancy.** An encoder writes a parity shard into its
//!   holder's file (`PutPiece`, RMA writes, `SealPiece`). When the
//!   controller protects the same version again (a superseded attempt,
//!   after a lost node), a second encoder may put the same piece while the
//!   first one's session still holds its receiving end. The first session,
//!   ending unsealed, deleted the file (`Store::discard_piece`) while the
//!   second was writing it, and the second then sealed a description of a
//!   file no longer there. Keyed per agent by (version, piece).
//! * **A rank's versions.** A node that misses its heartbeats loses its
//!   agents; when it answers again, the controller stops them and may
//!   place the application's new agent on the same node. The stopped
//!   agent's sessions end late (when their ranks' connections go), and one
//!   that was writing version N deleted `rankR/vN.data` while the new
//!   agent's session of the same rank was writing it: the version was lost
//!   with the application told it was committed. Keyed per node (the
//!   store's) by (application, rank, version).
//!
//! Architecture invariant: only the newest claim of a key seals, discards
//! or otherwise finishes its file; an older writer that is superseded
//! leaves the file alone, and its seal is refused. Claiming, sealing and
//! discarding run under one lock, so no older writer's discard falls
//! between a newer one's claim and its seal.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The current owner (a ticket) of each key being written.
#[derive(Debug)]
pub struct Owners<K> {
    owners: Mutex<HashMap<K, u64>>,
    next: AtomicU64,
}

impl<K> Default for Owners<K> {
    fn default() -> Self {
        Owners { owners: Mutex::new(HashMap::new()), next: AtomicU64::new(0) }
    }
}

impl<K: Eq + Hash> Owners<K> {
    /// Makes a new writer the owner of `key`'s file, superseding any
    /// earlier one, and runs `create` (which makes the file) as the owner.
    /// Returns the writer's ticket with what `create` returned.
    pub fn claim<T>(&self, key: K, create: impl FnOnce() -> T) -> (u64, T) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        owners.insert(key, ticket);
        (ticket, create())
    }

    /// Runs `last` (a seal or a discard of the file) if `ticket` still owns
    /// `key`, and gives the ownership up; `None` (and nothing run) if a
    /// newer writer owns it now.
    pub fn finish<T>(&self, key: &K, ticket: u64, last: impl FnOnce() -> T) -> Option<T> {
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        if owners.get(key) != Some(&ticket) {
            return None;
        }
        let result = last();
        owners.remove(key);
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::redundancy::PieceId;

    const SHARD: PieceId = PieceId::Parity { group: 0, index: 1 };

    /// A superseded writer neither seals nor discards; the newest does,
    /// once; other keys are their own.
    #[test]
    fn only_the_newest_writer_of_a_file_seals_or_discards_it() {
        let owners = Owners::default();
        let (old, ()) = owners.claim((7, SHARD), || ());
        let (new, ()) = owners.claim((7, SHARD), || ());
        let (other, ()) = owners.claim((8, SHARD), || ());
        assert_eq!(owners.finish(&(7, SHARD), old, || "discarded"), None, "a superseded writer touched the file");
        assert_eq!(owners.finish(&(7, SHARD), new, || "sealed"), Some("sealed"));
        assert_eq!(owners.finish(&(7, SHARD), new, || "again"), None, "finished twice");
        assert_eq!(owners.finish(&(8, SHARD), other, || "sealed"), Some("sealed"), "another version's piece");
        let (after, ()) = owners.claim((7, SHARD), || ());
        assert_eq!(owners.finish(&(7, SHARD), after, || "discarded"), Some("discarded"), "a later writer owns it");
    }
}
