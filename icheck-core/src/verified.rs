//! Reading a rank's bytes over the fabric and checking them as they arrive.
//!
//! Everyone who reads a stored version checks it against the rank's chunk
//! checksums: a restoring rank, and an agent building a copy or taking a
//! rank over. Checking after the whole read passes over the bytes a second
//! time, from memory, after the transfer; here each chunk goes to a checking
//! thread as soon as every byte of it has arrived, while it is still in the
//! last-level cache and while the rest is still moving. The read is one
//! batch ([`Endpoint::read_observed`]): the fabric's pipeline never drains.
//!
//! Architecture invariant: the checking thread reads only chunks the
//! transfer has completely written and will not write again; the caller
//! holds the destination exclusively for the whole call.

use std::sync::mpsc;

use crate::fabric::{Endpoint, FabricError, MemoryRegion, Peer, RegisteredBuffer, RemoteRegion, RmaOp};
use crate::fabric::{StableBuffer, TransferOptions};
use crate::format::{first_bad_chunk, CHUNK_BYTES};

/// One range to read: `len` bytes at `remote_offset` of `remote` into
/// `local_offset` of the destination, with one checksum per
/// [`CHUNK_BYTES`] of it (chunks start at `local_offset`).
#[derive(Clone, Copy, Debug)]
pub struct CheckedRange<'a> {
    /// Where the bytes are.
    pub remote: RemoteRegion,
    /// Offset in `remote`.
    pub remote_offset: u64,
    /// Offset in the destination.
    pub local_offset: usize,
    /// Bytes.
    pub len: usize,
    /// The rank's checksum of each chunk of the range.
    pub crcs: &'a [u32],
}

/// Reads `range` into `into`, checking each chunk as it arrives. Returns
/// the index (within the range) of the first chunk that does not match its
/// checksum, if any; a checksum list of the wrong length counts as damage
/// at chunk 0.
pub fn read_checked<B: StableBuffer>(
    endpoint: &Endpoint,
    peer: &Peer,
    into: &mut RegisteredBuffer<B>,
    range: CheckedRange<'_>,
) -> Result<Option<usize>, FabricError> {
    // SAFETY: `&mut into` keeps every other user of the buffer out for the
    // whole call, and the registration covers it.
    unsafe { read_checked_into(endpoint, peer, into.region(), range) }
}

/// [`read_checked`] into memory registered as `local`.
///
/// # Safety
/// Nothing else may read or write `local`'s memory during the call, and
/// that memory must stay valid for it.
pub unsafe fn read_checked_into(
    endpoint: &Endpoint,
    peer: &Peer,
    local: &MemoryRegion,
    range: CheckedRange<'_>,
) -> Result<Option<usize>, FabricError> {
    let CheckedRange { remote, remote_offset, local_offset, len: total, crcs } = range;
    if local_offset.checked_add(total).is_none_or(|end| end > local.len) {
        return Err(FabricError::OutOfRange {
            side: "local",
            offset: local_offset as u64,
            len: total as u64,
            region_len: local.len as u64,
        });
    }
    if crcs.len() != total.div_ceil(CHUNK_BYTES) {
        return Ok(Some(0));
    }
    if total == 0 {
        return Ok(None);
    }
    let base = local.ptr as usize + local_offset;
    let (to_check, chunks) = mpsc::channel::<usize>();
    std::thread::scope(|scope| {
        let checker = scope.spawn(move || {
            for start in chunks {
                let end = (start + CHUNK_BYTES).min(total);
                // SAFETY: bytes start..end were completely read before this
                // chunk was sent, no later operation of the batch writes
                // them, and the caller keeps everyone else out.
                let bytes = unsafe { std::slice::from_raw_parts((base + start) as *const u8, end - start) };
                let index = start / CHUNK_BYTES;
                if first_bad_chunk(bytes, &crcs[index..=index]).is_some() {
                    return Some(index);
                }
            }
            None
        });
        let op = RmaOp { local_offset, remote, remote_offset, len: total };
        let mut next = 0usize;
        let mut hand_over = |arrived: usize| {
            while next < total && (arrived >= total || arrived >= next + CHUNK_BYTES) {
                // A checker that stopped (a bad chunk) needs no more.
                let _ = to_check.send(next);
                next += CHUNK_BYTES;
            }
        };
        // SAFETY: the checker reads only chunks handed over, whose bytes
        // have all arrived and which no later operation of the batch
        // writes; the caller keeps everyone else out.
        let target = unsafe { local.target_unchecked() };
        let read = endpoint.read_observed(peer, target, &[op], &TransferOptions::default(), &mut hand_over);
        drop(to_check);
        let bad = checker.join().unwrap_or(Some(0));
        read.map(|_| bad)
    })
}
