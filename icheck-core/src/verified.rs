//! Reading a rank's bytes over the fabric and checking them as they arrive.
//!
//! Everyone who reads a stored version checks it against the rank's chunk
//! checksums: a restoring rank, and an agent building a copy or taking a
//! rank over. Checking after the whole read passes over the bytes a second
//! time, from memory, after the transfer; here the reading thread checks
//! each chunk between two polls of its completion queue as soon as every
//! byte of it has arrived, while it is still in the cache and while the
//! rest is still moving. The read is one batch
//! ([`Endpoint::read_observed`]): the fabric's pipeline never drains.
//!
//! Architecture invariant: a check reads only chunks the transfer has
//! completely written and will not write again; the caller holds the
//! destination exclusively for the whole call; nothing unwinds out of a
//! batch with operations in flight.

use crate::fabric::{Endpoint, FabricError, MemoryRegion, Peer, PeerOp, RegisteredBuffer, RemoteRegion, RmaOp};
use crate::fabric::{StableBuffer, TransferOptions};
use crate::format::{crc32c, crc32c_combine, CHUNK_BYTES};
use crate::kernel_copy::{self, PlacedBuffer};

// A handed-over file is read and checked a chunk at a time: the placed
// reads' steps are those chunks.
const _: () = assert!(kernel_copy::PLACED_STEP == CHUNK_BYTES);

/// Bytes of a chunk checksummed at once as they arrive over the fabric:
/// small enough to be still in the reading core's L2 (2 MiB on the Intel
/// hosts here, 512 KiB on the AMD ones). `crc-fast` on this machine: ~95 GB/s
/// over 1 MiB in L2, ~22 GB/s over a 4 MiB chunk, ~10 GB/s from memory.
const CHECK_PIECE_BYTES: usize = 1 << 20;
const _: () = assert!(CHUNK_BYTES.is_multiple_of(CHECK_PIECE_BYTES));

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
    // SAFETY: the caller's guarantees, passed on.
    let bad = unsafe { read_checked_from(endpoint, local, &[PeerRange { peer, range }]) }?;
    Ok(bad.map(|(_, chunk)| chunk))
}

/// One range of a [`read_checked_from`] batch, and whose memory it is in.
#[derive(Clone, Copy, Debug)]
pub struct PeerRange<'a> {
    /// The peer holding the range.
    pub peer: &'a Peer,
    /// The range.
    pub range: CheckedRange<'a>,
}

/// Reads several ranges, each from its own peer, into `local` as one batch
/// (every peer's reads in flight at once), checking each chunk of each
/// range as it arrives. Returns the first chunk that does not match its
/// checksum, as (range index, chunk index within the range); a range whose
/// checksum list has the wrong length counts as damage at its chunk 0.
///
/// # Safety
/// Nothing else may read or write `local`'s memory during the call, and
/// that memory must stay valid for it.
pub unsafe fn read_checked_from(
    endpoint: &Endpoint,
    local: &MemoryRegion,
    ranges: &[PeerRange<'_>],
) -> Result<Option<(usize, usize)>, FabricError> {
    if let Some(index) = ranges.iter().position(|r| r.range.crcs.len() != r.range.len.div_ceil(CHUNK_BYTES)) {
        check_bounds(local, ranges)?;
        return Ok(Some((index, 0)));
    }
    // Each chunk is checksummed a piece at a time, each piece as soon as it
    // has arrived (the pieces of a chunk combined, `crc32c_combine`), and
    // compared when its last piece is in: a piece still in the reading
    // core's L2 is checksummed several times faster than a whole chunk,
    // which is larger than the L2 of the cores here.
    let mut chunk_so_far: Option<(usize, usize, u32)> = None;
    let check = |index: usize, start: usize, bytes: &[u8]| {
        let range = &ranges[index].range;
        let chunk = start / CHUNK_BYTES;
        let crc = crc32c(bytes);
        let crc = match chunk_so_far.take() {
            Some((i, c, before)) if (i, c) == (index, chunk) => crc32c_combine(before, crc, bytes.len()),
            _ => crc,
        };
        let chunk_end = ((chunk + 1) * CHUNK_BYTES).min(range.len);
        if start + bytes.len() < chunk_end {
            chunk_so_far = Some((index, chunk, crc));
            return true;
        }
        range.crcs.get(chunk) == Some(&crc)
    };
    // SAFETY: the caller's guarantees, passed on.
    let refused = unsafe { read_in_pieces_from(endpoint, local, ranges, CHECK_PIECE_BYTES, check) }?;
    Ok(refused.map(|(index, start)| (index, start / CHUNK_BYTES)))
}

/// Reads `len` bytes at `remote_offset` of `remote` into the start of
/// `into`, in one batch, and hands each `piece` bytes to `take` in order
/// (the last piece shorter), on the reading thread, as soon as every byte of
/// it has arrived: a reader that checksums what it reads at another
/// granularity than the rank's chunks (a parity shard's stripes) does it
/// while the bytes are in cache and the rest still moves. `take` returns
/// false to refuse a piece; no later piece is handed over, and the
/// refused piece's offset is returned.
pub fn read_in_pieces<B: StableBuffer>(
    endpoint: &Endpoint,
    peer: &Peer,
    into: &mut RegisteredBuffer<B>,
    from: (RemoteRegion, u64, usize),
    piece: usize,
    take: impl FnMut(&[u8]) -> bool,
) -> Result<Option<usize>, FabricError> {
    // SAFETY: `&mut into` keeps every other user of the buffer out for the
    // whole call, and the registration covers it.
    unsafe { read_in_pieces_into(endpoint, peer, into.region(), from, piece, take) }
}

/// [`read_in_pieces`] into memory registered as `local`.
///
/// # Safety
/// Nothing else may read or write `local`'s memory during the call, and
/// that memory must stay valid for it.
pub unsafe fn read_in_pieces_into(
    endpoint: &Endpoint,
    peer: &Peer,
    local: &MemoryRegion,
    (remote, remote_offset, len): (RemoteRegion, u64, usize),
    piece: usize,
    mut take: impl FnMut(&[u8]) -> bool,
) -> Result<Option<usize>, FabricError> {
    let range = CheckedRange { remote, remote_offset, local_offset: 0, len, crcs: &[] };
    let ranges = [PeerRange { peer, range }];
    // SAFETY: the caller's guarantees, passed on.
    let refused = unsafe { read_in_pieces_from(endpoint, local, &ranges, piece, |_, _, bytes| take(bytes)) }?;
    Ok(refused.map(|(_, start)| start))
}

/// Refuses ranges outside `local` or sharing a destination byte (a piece
/// handed over must never be written again).
fn check_bounds(local: &MemoryRegion, ranges: &[PeerRange<'_>]) -> Result<(), FabricError> {
    for PeerRange { range, .. } in ranges {
        if range.local_offset.checked_add(range.len).is_none_or(|end| end > local.len) {
            return Err(FabricError::OutOfRange {
                side: "local",
                offset: range.local_offset as u64,
                len: range.len as u64,
                region_len: local.len as u64,
            });
        }
    }
    let mut spans: Vec<(usize, usize)> =
        ranges.iter().map(|r| (r.range.local_offset, r.range.local_offset + r.range.len)).collect();
    spans.sort_unstable();
    if let Some(pair) = spans.windows(2).find(|pair| pair[0].1 > pair[1].0) {
        return Err(FabricError::Config(format!(
            "ranges of one checked read overlap in local memory ({}..{} and {}..{})",
            pair[0].0, pair[0].1, pair[1].0, pair[1].1
        )));
    }
    Ok(())
}

/// The core of [`read_checked_from`] and [`read_in_pieces`]: reads the
/// ranges as one batch and calls `take(range index, offset in the range,
/// bytes)` for each `piece` bytes of each range (pieces start at the
/// range's start), in order, as soon as all of the piece has arrived.
/// Returns the first piece `take` refused, as (range index, offset in the
/// range); none after it is handed over.
///
/// `take` runs on the reading thread, between two polls of the completion
/// queue: the pipeline stays full meanwhile (a 4 MiB checksum takes about
/// 70 µs, the operations in flight 1.6 ms to arrive over loopback tcp), and
/// the reader would otherwise only spin. A checking thread of its own was
/// a third busy thread beside the reader and the sender on two cores, and
/// read bytes the cache had dropped: a 256 MiB restore took 66.5–68.8 ms
/// over tcp with it and 59.7–61.5 ms without.
///
/// # Safety
/// Nothing else may read or write `local`'s memory during the call, and
/// that memory must stay valid for it.
unsafe fn read_in_pieces_from(
    endpoint: &Endpoint,
    local: &MemoryRegion,
    ranges: &[PeerRange<'_>],
    piece: usize,
    mut take: impl FnMut(usize, usize, &[u8]) -> bool,
) -> Result<Option<(usize, usize)>, FabricError> {
    check_bounds(local, ranges)?;
    if piece == 0 {
        return Err(FabricError::Config("pieces of a read must not be empty".into()));
    }
    if ranges.iter().all(|r| r.range.len == 0) {
        return Ok(None);
    }
    let base = local.ptr as usize;
    let ops: Vec<PeerOp<'_>> = ranges
        .iter()
        .map(|PeerRange { peer, range }| PeerOp {
            peer,
            op: RmaOp {
                local_offset: range.local_offset,
                remote: range.remote,
                remote_offset: range.remote_offset,
                len: range.len,
            },
        })
        .collect();
    let mut refused: Option<(usize, usize)> = None;
    // The batch's bytes arrive as a prefix over the ranges in order: the
    // next piece to hand over is the one at `next` of range `current`,
    // which starts at byte `before` of the batch.
    let (mut current, mut next, mut before) = (0usize, 0usize, 0usize);
    let mut hand_over = |arrived: usize| {
        while current < ranges.len() && refused.is_none() {
            let range = ranges[current].range;
            if next >= range.len {
                before += range.len;
                current += 1;
                next = 0;
                continue;
            }
            let end = (next + piece).min(range.len);
            if before + end > arrived {
                break;
            }
            // SAFETY: bytes next..end of the range have all arrived, no
            // later operation of the batch writes them (ranges do not
            // overlap), and the caller keeps everyone else out.
            let bytes =
                unsafe { std::slice::from_raw_parts((base + range.local_offset + next) as *const u8, end - next) };
            // A panic must not unwind out of the batch while operations
            // are in flight into the caller's memory: it refuses the piece.
            let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| take(current, next, bytes)));
            if !taken.unwrap_or(false) {
                refused = Some((current, next));
            }
            next += piece;
        }
    };
    // SAFETY: `take` reads only pieces whose bytes have all arrived and
    // which no later operation of the batch writes; the caller keeps
    // everyone else out.
    let target = unsafe { local.target_unchecked() };
    let read = endpoint.read_observed_from(target, &ops, &TransferOptions::default(), &mut hand_over);
    read.map(|_| refused)
}

/// Reads `out.len()` bytes at `offset` of a version through `read_at`
/// (`pread` from the files an agent on this host handed over,
/// `handoff::VersionFiles::read_exact_at`) into `out`, on `threads` threads
/// that each read a contiguous run of whole chunks and check every chunk as
/// soon as they have read it, while it is still in the cache. Returns the
/// index of the first chunk that does not match its checksum, if any (a
/// checksum list of the wrong length counts as damage at chunk 0); a
/// failed read (a file shorter than the range) is an error.
pub fn read_file_checked(
    read_at: &(impl Fn(&mut [u8], u64) -> std::io::Result<()> + Sync),
    offset: u64,
    out: &mut [u8],
    crcs: &[u32],
    threads: usize,
) -> std::io::Result<Option<usize>> {
    read_file_checked_placing(read_at, offset, out, crcs, threads, kernel_copy::worth_placing)
}

/// [`read_file_checked`] with the choice of reads through a placed buffer
/// made by `worth_placing` (`kernel_copy::worth_placing`'s signature), so
/// that tests cover the placed reads on CPUs that do not need them.
fn read_file_checked_placing(
    read_at: &(impl Fn(&mut [u8], u64) -> std::io::Result<()> + Sync),
    offset: u64,
    out: &mut [u8],
    crcs: &[u32],
    threads: usize,
    worth_placing: fn(*const u8, u64, usize) -> bool,
) -> std::io::Result<Option<usize>> {
    let chunks = out.len().div_ceil(CHUNK_BYTES);
    if crcs.len() != chunks {
        return Ok(Some(0));
    }
    let per_thread = chunks.div_ceil(threads.clamp(1, chunks.max(1)));
    let read_run = |first: usize, run: &mut [u8]| -> std::io::Result<Option<usize>> {
        // Chunks start at the same place in a page of the file, so one
        // bounce buffer placed like them serves the whole run.
        let bounced = worth_placing(run.as_ptr(), offset, run.len());
        let mut bounce = bounced.then(|| PlacedBuffer::new(CHUNK_BYTES));
        for (i, bytes) in run.chunks_mut(CHUNK_BYTES).enumerate() {
            let chunk = first + i;
            let at = offset + (chunk * CHUNK_BYTES) as u64;
            // A piece at a time, each checksummed right after its read,
            // while it is in the core's L2 (`CHECK_PIECE_BYTES`).
            let mut crc = None;
            for (j, piece) in bytes.chunks_mut(CHECK_PIECE_BYTES).enumerate() {
                let at = at + (j * CHECK_PIECE_BYTES) as u64;
                let piece_crc = match bounce.as_mut() {
                    Some(bounce) => {
                        let staged = bounce.placed(at, piece.len());
                        read_at(staged, at)?;
                        piece.copy_from_slice(staged);
                        crc32c(staged)
                    }
                    None => {
                        read_at(piece, at)?;
                        crc32c(piece)
                    }
                };
                crc = Some(crc.map_or(piece_crc, |before| crc32c_combine(before, piece_crc, piece.len())));
            }
            if crc != Some(crcs[chunk]) {
                return Ok(Some(chunk));
            }
        }
        Ok(None)
    };
    if per_thread >= chunks {
        return read_run(0, out);
    }
    std::thread::scope(|scope| {
        let runs: Vec<_> = out
            .chunks_mut(per_thread * CHUNK_BYTES)
            .enumerate()
            .map(|(i, run)| {
                let first = i * per_thread;
                (first, scope.spawn(move || read_run(first, run)))
            })
            .collect();
        let mut bad: Option<usize> = None;
        for (first, run) in runs {
            let found = run.join().unwrap_or(Ok(Some(first)))?;
            bad = match (bad, found) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(bad)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::chunk_crcs;
    use crate::kernel_copy::unlinked_file_with;
    use std::os::unix::fs::FileExt;

    /// `pread` from `file`.
    fn reader(file: &std::fs::File) -> impl Fn(&mut [u8], u64) -> std::io::Result<()> + Sync + '_ {
        move |buf, offset| file.read_exact_at(buf, offset)
    }

    #[test]
    fn a_file_range_is_read_bit_exact_on_any_number_of_threads() {
        // Three and a half chunks after a 1000-byte header.
        let data: Vec<u8> = (0..CHUNK_BYTES * 7 / 2).map(|i| (i * 31 % 251) as u8).collect();
        let file = unlinked_file_with(&[vec![9u8; 1000], data.clone()].concat());
        let crcs = chunk_crcs(&data);
        for threads in [1, 2, 3, 8] {
            let mut out = vec![0u8; data.len()];
            assert_eq!(read_file_checked(&reader(&file), 1000, &mut out, &crcs, threads).unwrap(), None, "{threads}");
            assert!(out == data, "{threads} threads");
        }
        let mut empty = [];
        assert_eq!(read_file_checked(&reader(&file), 0, &mut empty, &[], 2).unwrap(), None);
    }

    /// `len` bytes of `backing` starting `past` bytes after a page boundary.
    fn placed(backing: &mut [u8], past: usize, len: usize) -> &mut [u8] {
        let skip = (4096 - backing.as_ptr() as usize % 4096) % 4096 + past;
        &mut backing[skip..skip + len]
    }

    #[test]
    fn a_destination_just_past_the_source_in_its_page_is_read_through_a_bounce_buffer_bit_exact() {
        let mut data: Vec<u8> = (0..CHUNK_BYTES * 5 / 2).map(|i| (i * 7 % 241) as u8).collect();
        let crcs = chunk_crcs(&data);
        let file = unlinked_file_with(&[vec![3u8; 4096], data.clone()].concat());
        let mut backing = vec![0u8; data.len() + 8192];
        // As on a CPU with the weakness, whichever this one is.
        let slow_cpu = kernel_copy::worth_placing_on_a_slow_cpu;
        for past in [0, 16, 31, 32, 48, 2000] {
            let out = placed(&mut backing, past, data.len());
            assert_eq!(kernel_copy::is_slow(out.as_ptr(), 4096), (1..32).contains(&past), "{past}");
            for threads in [1, 2] {
                for placing in [slow_cpu, kernel_copy::worth_placing] {
                    out.fill(0);
                    let read = read_file_checked_placing(&reader(&file), 4096, out, &crcs, threads, placing);
                    assert_eq!(read.unwrap(), None, "{past}");
                    assert!(*out == data[..], "{past} bytes past a page, {threads} threads");
                }
            }
        }
        data[CHUNK_BYTES * 2 + 9] ^= 0x40;
        let damaged = unlinked_file_with(&data);
        let out = placed(&mut backing, 16, data.len());
        assert!(kernel_copy::is_slow(out.as_ptr(), 0));
        // One thread: the whole range is one run, read through the bounce.
        for threads in [1, 2] {
            for placing in [slow_cpu, kernel_copy::worth_placing] {
                let read = read_file_checked_placing(&reader(&damaged), 0, out, &crcs, threads, placing);
                assert_eq!(read.unwrap(), Some(2), "{threads}");
            }
        }
    }

    #[test]
    fn the_earliest_damaged_chunk_is_named_and_a_short_file_is_an_error() {
        let mut data: Vec<u8> = (0..CHUNK_BYTES * 4).map(|i| (i % 253) as u8).collect();
        let crcs = chunk_crcs(&data);
        data[CHUNK_BYTES * 3 + 5] ^= 1;
        data[CHUNK_BYTES + 7] ^= 1;
        let file = unlinked_file_with(&data);
        for threads in [1, 2, 4] {
            let mut out = vec![0u8; data.len()];
            assert_eq!(read_file_checked(&reader(&file), 0, &mut out, &crcs, threads).unwrap(), Some(1), "{threads}");
        }
        let mut out = vec![0u8; data.len()];
        assert_eq!(
            read_file_checked(&reader(&file), 0, &mut out, &crcs[..3], 2).unwrap(),
            Some(0),
            "wrong checksum count"
        );
        // The range runs past the file's end: one chunk more than it holds.
        let three = vec![5u8; CHUNK_BYTES * 3];
        let short = unlinked_file_with(&three);
        let four_crcs = [chunk_crcs(&three), vec![0]].concat();
        let mut longer = vec![0u8; CHUNK_BYTES * 4];
        let err = read_file_checked(&reader(&short), 0, &mut longer, &four_crcs, 2).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
