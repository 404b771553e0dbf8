//! Incremental commits as pure logic: which blocks of a rank's version
//! changed since the version before it, and where every block of a
//! version lives when versions share unchanged blocks.
//!
//! A version's bytes (its labels back to back, as in [`crate::format`]) are
//! cut into [`BLOCK_SIZE`] blocks on a grid of the whole version, not of
//! each label: blocks are what an agent's store shares between versions,
//! and a shared block must be whole pages of a file. The library computes
//! each block's crc32c in the same pass as the labels' chunk checksums
//! ([`checksums`]); blocks whose crc32c differs from the previous version's
//! are the only ones sent ([`changed_runs`]), packed back to back.
//!
//! At the agent, a version written this way has a [`BlockMap`]: for each
//! block, which version's data file holds it and at which block index of
//! that file. A whole version's file holds block `i` at index `i`; a
//! version sent incrementally holds only its changed blocks, packed, and
//! refers to its parent's files for the rest. Maps are flat (a reference
//! always names the file that holds the bytes), so reading a block never
//! follows a chain.
//!
//! Architecture invariant: a leaf like `format`; no I/O. The store
//! (`icheck-service/src/store.rs`) composes views and frees files with it,
//! the client library decides what to send with it.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::format::CHUNK_BYTES;

/// Bytes per block, as a length in memory (1 MiB: one contiguous 1% change
/// of a 512 MiB rank moves at most 7 blocks, 1.4%).
pub const BLOCK_BYTES: usize = 1 << 20;
/// Bytes per block, as recorded.
pub const BLOCK_SIZE: u64 = BLOCK_BYTES as u64;

// A label chunk boundary is always a block boundary of the label's own
// grid; the segment walk in `checksums` relies on neither grid being finer
// than a page, and on chunks being whole blocks.
const _: () = assert!(CHUNK_BYTES.is_multiple_of(BLOCK_BYTES) && BLOCK_BYTES.is_multiple_of(4096));

/// Blocks in a version of `total_len` bytes (the last may be short).
pub fn block_count(total_len: u64) -> u64 {
    total_len.div_ceil(BLOCK_SIZE)
}

/// Bytes of block `index` of a version of `total_len` bytes.
pub fn block_len(index: u64, total_len: u64) -> u64 {
    total_len.saturating_sub(index.saturating_mul(BLOCK_SIZE)).min(BLOCK_SIZE)
}

/// One pass over a version's labels: each label's chunk checksums (the
/// same as [`crate::format::label_crcs`]) and each block's crc32c on the
/// version's grid. Every byte is read once; a piece of a chunk that is
/// also a piece of a block is checksummed once and combined into both
/// (crc32c combines in O(log n)). Runs on every core for large versions.
pub fn checksums(labels: &[&[u8]]) -> Checksums {
    checksums_on(labels, std::thread::available_parallelism().map_or(1, |n| n.get()).min(8))
}

/// [`checksums`] on at most `threads` threads (one: beside a transfer
/// that needs the other cores).
pub fn checksums_on(labels: &[&[u8]], threads: usize) -> Checksums {
    let spans: Vec<Vec<Range<usize>>> = labels.iter().map(|l| std::iter::once(0..l.len()).collect()).collect();
    let mut chunks: Vec<Vec<u32>> = labels.iter().map(|l| vec![0; l.len().div_ceil(CHUNK_BYTES)]).collect();
    let mut blocks = vec![0; labels.iter().map(|l| l.len()).sum::<usize>().div_ceil(BLOCK_BYTES)];
    checksum_spans(labels, &spans, threads, &mut chunks, &mut blocks, |_, _| true, |_| true);
    (chunks, blocks)
}

/// A version's checksums: each label's chunk checksums and the block
/// checksums, as [`checksums`] gives them.
pub type Checksums = (Vec<Vec<u32>>, Vec<u32>);

/// [`checksums`] when only the bytes in `written` (for each label, byte
/// ranges of it) can differ from a version whose checksums were
/// `before_chunks` and `before_blocks` (page tracking knows which bytes
/// the process wrote since). Only the chunks and blocks that touch a
/// written byte are read, each byte once; the others keep their
/// checksums. Returns the checksums and the bytes read; `None` when
/// `before` does not fit these labels (their sizes changed): compute them
/// all.
pub fn checksums_where_written(
    labels: &[&[u8]],
    written: &[Vec<Range<usize>>],
    before_chunks: &[Vec<u32>],
    before_blocks: &[u32],
    threads: usize,
) -> Option<(Checksums, u64)> {
    let total: usize = labels.iter().map(|l| l.len()).sum();
    let fits = labels.len() == written.len()
        && labels.len() == before_chunks.len()
        && labels.iter().zip(before_chunks).all(|(l, c)| l.len().div_ceil(CHUNK_BYTES) == c.len())
        && before_blocks.len() == total.div_ceil(BLOCK_BYTES);
    if !fits {
        return None;
    }
    // The chunks (per label) and blocks (of the version) a written byte touches.
    let mut dirty_chunks: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); labels.len()];
    let mut dirty_blocks = BTreeSet::new();
    let mut offset = 0usize;
    for (label, (bytes, ranges)) in labels.iter().zip(written).enumerate() {
        for range in ranges {
            let (start, end) = (range.start.min(bytes.len()), range.end.min(bytes.len()));
            if start < end {
                dirty_chunks[label].extend(start / CHUNK_BYTES..end.div_ceil(CHUNK_BYTES));
                dirty_blocks.extend((offset + start) / BLOCK_BYTES..(offset + end).div_ceil(BLOCK_BYTES));
            }
        }
        offset += bytes.len();
    }
    // What to read of each label: its dirty chunks and its part of every
    // dirty block, merged.
    let mut spans: Vec<Vec<Range<usize>>> = Vec::with_capacity(labels.len());
    let mut offset = 0usize;
    for (bytes, chunks) in labels.iter().zip(&dirty_chunks) {
        let end_of_label = offset + bytes.len();
        let mut span: Vec<Range<usize>> =
            chunks.iter().map(|c| c * CHUNK_BYTES..((c + 1) * CHUNK_BYTES).min(bytes.len())).collect();
        let first_block = offset / BLOCK_BYTES;
        for block in dirty_blocks.range(first_block..end_of_label.div_ceil(BLOCK_BYTES)) {
            let (from, to) = ((block * BLOCK_BYTES).max(offset), ((block + 1) * BLOCK_BYTES).min(end_of_label));
            if from < to {
                span.push(from - offset..to - offset);
            }
        }
        spans.push(merge_ranges(span));
        offset = end_of_label;
    }
    let mut chunks = before_chunks.to_vec();
    let mut blocks = before_blocks.to_vec();
    checksum_spans(
        labels,
        &spans,
        threads,
        &mut chunks,
        &mut blocks,
        |label, chunk| dirty_chunks[label].contains(&chunk),
        |block| dirty_blocks.contains(&block),
    );
    let read: usize = spans.iter().flatten().map(|span| span.len()).sum();
    Some(((chunks, blocks), read as u64))
}

/// Sorts `ranges` and merges those that overlap or touch.
pub fn merge_ranges(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Checksums the `spans` of each label (sorted, disjoint byte ranges),
/// cut at every chunk (per label) and block (per version) boundary, and
/// sets the checksum of each chunk and block that `chunk_wanted` and
/// `block_wanted` accept, which the spans must cover whole. Every byte of
/// the spans is read once; a piece that is part of a chunk and of a block
/// is checksummed once and combined into both (crc32c combines in
/// O(log n)).
fn checksum_spans(
    labels: &[&[u8]],
    spans: &[Vec<Range<usize>>],
    threads: usize,
    chunks: &mut [Vec<u32>],
    blocks: &mut [u32],
    chunk_wanted: impl Fn(usize, usize) -> bool,
    block_wanted: impl Fn(usize) -> bool,
) {
    struct Piece<'a> {
        label: usize,
        /// Byte offset in the label.
        at: usize,
        /// Byte offset in the version.
        file_offset: usize,
        bytes: &'a [u8],
    }
    let mut pieces = Vec::new();
    let mut label_offset = 0usize;
    for (label, (bytes, spans)) in labels.iter().zip(spans).enumerate() {
        for span in spans {
            let mut at = span.start;
            while at < span.end {
                let to_chunk_end = CHUNK_BYTES - at % CHUNK_BYTES;
                let to_block_end = BLOCK_BYTES - (label_offset + at) % BLOCK_BYTES;
                let len = to_chunk_end.min(to_block_end).min(span.end - at);
                pieces.push(Piece { label, at, file_offset: label_offset + at, bytes: &bytes[at..at + len] });
                at += len;
            }
        }
        label_offset += bytes.len();
    }
    let crcs = piece_crcs(&pieces.iter().map(|p| p.bytes).collect::<Vec<_>>(), threads);
    for (piece, crc) in pieces.iter().zip(crcs) {
        let chunk = piece.at / CHUNK_BYTES;
        if chunk_wanted(piece.label, chunk) {
            let sum = &mut chunks[piece.label][chunk];
            *sum = if piece.at % CHUNK_BYTES == 0 {
                crc
            } else {
                crate::format::crc32c_combine(*sum, crc, piece.bytes.len())
            };
        }
        let block = piece.file_offset / BLOCK_BYTES;
        if block_wanted(block) {
            let sum = &mut blocks[block];
            *sum = if piece.file_offset % BLOCK_BYTES == 0 {
                crc
            } else {
                crate::format::crc32c_combine(*sum, crc, piece.bytes.len())
            };
        }
    }
}

/// Bytes from which [`checksums`] uses several threads.
const PARALLEL_BYTES: usize = 32 << 20;

/// crc32c of each piece, on up to `threads` threads when there are many bytes.
fn piece_crcs(pieces: &[&[u8]], threads: usize) -> Vec<u32> {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    if total < PARALLEL_BYTES || threads < 2 || pieces.len() < 2 {
        return pieces.iter().map(|p| crate::format::crc32c(p)).collect();
    }
    let per_thread = pieces.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let runs: Vec<_> = pieces
            .chunks(per_thread)
            .map(|run| scope.spawn(move || run.iter().map(|p| crate::format::crc32c(p)).collect::<Vec<u32>>()))
            .collect();
        runs.into_iter()
            .zip(pieces.chunks(per_thread))
            // A thread that could not finish: its pieces are checksummed here.
            .flat_map(|(run, mine)| {
                run.join().unwrap_or_else(|_| mine.iter().map(|p| crate::format::crc32c(p)).collect())
            })
            .collect()
    })
}

/// Consecutive blocks `first..first + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRun {
    /// First block.
    pub first: u64,
    /// How many blocks.
    pub count: u64,
}

/// The blocks whose checksum differs between the previous version
/// (`before`) and this one (`now`), as runs in order; `None` when the two
/// have different block counts (the layout changed: send everything).
pub fn changed_runs(before: &[u32], now: &[u32]) -> Option<Vec<BlockRun>> {
    if before.len() != now.len() {
        return None;
    }
    let mut runs: Vec<BlockRun> = Vec::new();
    for (index, _) in before.iter().zip(now).enumerate().filter(|(_, (a, b))| a != b) {
        let index = index as u64;
        match runs.last_mut() {
            Some(run) if run.first + run.count == index => run.count += 1,
            _ => runs.push(BlockRun { first: index, count: 1 }),
        }
    }
    Some(runs)
}

/// Checks runs an agent received against a version of `total_len` bytes:
/// in order, not overlapping, not empty, inside the version. Returns the
/// bytes they hold (what the rank sends, packed back to back).
pub fn check_runs(runs: &[BlockRun], total_len: u64) -> Result<u64, String> {
    let blocks = block_count(total_len);
    let mut next_free = 0u64;
    let mut bytes = 0u64;
    for run in runs {
        let end = run.first.checked_add(run.count).filter(|end| run.count > 0 && *end <= blocks);
        let Some(end) = end.filter(|_| run.first >= next_free) else {
            return Err(format!(
                "changed blocks {}+{} are out of order, empty or outside the version's {blocks} blocks",
                run.first, run.count
            ));
        };
        bytes += (run.first..end).map(|b| block_len(b, total_len)).sum::<u64>();
        next_free = end;
    }
    Ok(bytes)
}

/// Where one block of a version lives: block `index` of `version`'s data file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockRef {
    /// The version whose data file holds the block.
    pub version: u64,
    /// The block's index in that file (offset `index * BLOCK_SIZE`).
    pub index: u64,
}

/// Consecutive blocks of a version held by consecutive blocks of one file:
/// one mapping when the version is composed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// First block of the version.
    pub first: u64,
    /// Blocks.
    pub count: u64,
    /// The file holding them, from block `index` on.
    pub source: BlockRef,
}

/// Where each block of a version sent incrementally lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMap {
    /// The version this map composes.
    pub version: u64,
    /// Its length in bytes.
    pub total_len: u64,
    /// One reference per block.
    pub blocks: Vec<BlockRef>,
}

impl BlockMap {
    /// The map of a version stored whole in its own file.
    pub fn whole(version: u64, total_len: u64) -> BlockMap {
        let blocks = (0..block_count(total_len)).map(|index| BlockRef { version, index }).collect();
        BlockMap { version, total_len, blocks }
    }

    /// The map of `version`, which changed `runs` of this (its parent's)
    /// map and holds them packed in its own file, in order.
    pub fn next(&self, version: u64, runs: &[BlockRun]) -> BlockMap {
        let mut blocks = self.blocks.clone();
        let mut packed = 0u64;
        for run in runs {
            for block in run.first..run.first + run.count {
                if let Some(slot) = blocks.get_mut(usize::try_from(block).unwrap_or(usize::MAX)) {
                    *slot = BlockRef { version, index: packed };
                }
                packed += 1;
            }
        }
        BlockMap { version, total_len: self.total_len, blocks }
    }

    /// Checks a map read from a file: it describes `version` of `total_len`
    /// bytes, has one reference per block, and refers only to older
    /// versions or to its own file within `own_blocks` blocks.
    pub fn validate(&self, version: u64, total_len: u64, own_blocks: u64) -> Result<(), String> {
        if self.version != version || self.total_len != total_len {
            return Err(format!(
                "the block map describes version {} of {} bytes, not version {version} of {total_len}",
                self.version, self.total_len
            ));
        }
        if self.blocks.len() as u64 != block_count(total_len) {
            return Err(format!("{} block references for {} blocks", self.blocks.len(), block_count(total_len)));
        }
        match self.blocks.iter().find(|r| r.version > version || (r.version == version && r.index >= own_blocks)) {
            Some(bad) => Err(format!("a block refers to block {} of version {}", bad.index, bad.version)),
            None => Ok(()),
        }
    }

    /// The map as extents: runs of blocks that are consecutive in one file.
    pub fn extents(&self) -> Vec<Extent> {
        let mut extents: Vec<Extent> = Vec::new();
        for (block, source) in self.blocks.iter().enumerate() {
            let block = block as u64;
            match extents.last_mut() {
                Some(e) if e.source.version == source.version && e.source.index + e.count == source.index => {
                    e.count += 1;
                }
                _ => extents.push(Extent { first: block, count: 1, source: *source }),
            }
        }
        extents
    }

    /// The blocks of other versions' files this map uses, by version.
    pub fn borrowed(&self) -> BTreeMap<u64, BTreeSet<u64>> {
        let mut used: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
        for r in self.blocks.iter().filter(|r| r.version != self.version) {
            used.entry(r.version).or_default().insert(r.index);
        }
        used
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use crate::format::label_crcs;

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn one_pass_gives_the_label_checksums_and_the_block_checksums_of_the_concatenation() {
        // Labels that start off the block grid, span blocks and chunks, and are empty.
        for lens in [vec![0], vec![3], vec![BLOCK_BYTES + 5, 0, 7 * BLOCK_BYTES / 2, 10], vec![9 * BLOCK_BYTES + 1]] {
            let data: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, len)| bytes(*len, i as u8)).collect();
            let labels: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            let (chunks, blocks) = checksums(&labels);
            assert_eq!(chunks, label_crcs(&labels), "{lens:?}");
            let whole = data.concat();
            let expected: Vec<u32> = whole.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect();
            assert_eq!(blocks, expected, "{lens:?}");
        }
    }

    #[test]
    fn the_parallel_pass_agrees_with_the_serial_one() {
        let data = bytes(PARALLEL_BYTES + 3 * BLOCK_BYTES + 17, 5);
        let (chunks, blocks) = checksums_on(&[&data], 3);
        assert_eq!((chunks.clone(), blocks.clone()), checksums_on(&[&data], 1));
        assert_eq!(chunks, label_crcs(&[&data]));
        assert_eq!(blocks, data.chunks(BLOCK_BYTES).map(crc32c::crc32c).collect::<Vec<_>>());
    }

    /// Random writes into labels off the block grid: the checksums of the
    /// written chunks and blocks, updated from the old ones, are those of
    /// a full pass; and a layout change is refused.
    #[test]
    fn checksums_where_written_equal_a_full_pass() {
        let lens = [100, CHUNK_BYTES + 3 * BLOCK_BYTES + 17, 0, 2 * BLOCK_BYTES - 1, 9 * BLOCK_BYTES + 5];
        let mut data: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, len)| bytes(*len, i as u8)).collect();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |below: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % below.max(1) as u64) as usize
        };
        for round in 0..40u8 {
            let before = checksums(&data.iter().map(|d| d.as_slice()).collect::<Vec<_>>());
            let mut written: Vec<Vec<Range<usize>>> = vec![Vec::new(); data.len()];
            for _ in 0..next(6) {
                let label = next(data.len());
                let at = next(data[label].len());
                let end = (at + 1 + next(2 * BLOCK_BYTES)).min(data[label].len());
                if at < end {
                    data[label][at..end].iter_mut().for_each(|b| *b = b.wrapping_add(round | 1));
                    written[label].push(at..end);
                }
            }
            // What page tracking reports is whole pages: a wider range.
            for ranges in &mut written {
                for range in ranges.iter_mut() {
                    *range = range.start / 4096 * 4096..range.end.div_ceil(4096) * 4096;
                }
                ranges.sort_by_key(|r| r.start);
            }
            let labels: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            let updated = checksums_where_written(&labels, &written, &before.0, &before.1, 1 + round as usize % 3);
            let (sums, read) = updated.expect("the layout did not change");
            assert_eq!(sums, checksums(&labels), "round {round}");
            // Every written byte of a label is read (in its chunk), and
            // nothing beyond the version.
            let inside: usize = labels
                .iter()
                .zip(&written)
                .map(|(bytes, ranges)| {
                    let clipped = ranges.iter().map(|r| r.start.min(bytes.len())..r.end.min(bytes.len())).collect();
                    merge_ranges(clipped).iter().map(|r| r.len()).sum::<usize>()
                })
                .sum();
            let total: usize = labels.iter().map(|l| l.len()).sum();
            assert!((inside..=total).contains(&(read as usize)), "round {round}: read {read}, written {inside}");
        }
        let labels: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        let (chunks, blocks) = checksums(&labels);
        let none = vec![Vec::new(); labels.len()];
        assert_eq!(
            checksums_where_written(&labels, &none, &chunks, &blocks, 1),
            Some(((chunks.clone(), blocks.clone()), 0)),
            "nothing written, nothing read"
        );
        assert_eq!(checksums_where_written(&labels[1..], &none[1..], &chunks, &blocks, 1), None);
        assert_eq!(checksums_where_written(&labels, &none, &chunks, &blocks[1..], 1), None);
    }

    #[test]
    fn changed_blocks_become_runs_and_a_new_block_count_sends_everything() {
        let before = [1, 2, 3, 4, 5, 6];
        assert_eq!(changed_runs(&before, &before), Some(vec![]));
        let now = [1, 9, 9, 4, 5, 9];
        let runs = vec![BlockRun { first: 1, count: 2 }, BlockRun { first: 5, count: 1 }];
        assert_eq!(changed_runs(&before, &now), Some(runs));
        assert_eq!(changed_runs(&before, &now[..5]), None);
    }

    #[test]
    fn runs_from_outside_are_checked_and_counted_with_a_short_last_block() {
        let total = 3 * BLOCK_SIZE + 100;
        let runs = [BlockRun { first: 0, count: 1 }, BlockRun { first: 2, count: 2 }];
        assert_eq!(check_runs(&runs, total), Ok(2 * BLOCK_SIZE + 100));
        assert_eq!(check_runs(&[], total), Ok(0));
        for bad in [
            vec![BlockRun { first: 2, count: 1 }, BlockRun { first: 1, count: 1 }],
            vec![BlockRun { first: 0, count: 2 }, BlockRun { first: 1, count: 1 }],
            vec![BlockRun { first: 0, count: 0 }],
            vec![BlockRun { first: 3, count: 2 }],
            vec![BlockRun { first: u64::MAX, count: 2 }],
        ] {
            assert!(check_runs(&bad, total).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn maps_point_at_the_file_holding_each_block_and_coalesce_into_extents() {
        let v1 = BlockMap::whole(1, 6 * BLOCK_SIZE);
        assert_eq!(v1.extents(), vec![Extent { first: 0, count: 6, source: BlockRef { version: 1, index: 0 } }]);
        let v2 = v1.next(2, &[BlockRun { first: 2, count: 2 }]);
        let v3 = v2.next(3, &[BlockRun { first: 3, count: 1 }, BlockRun { first: 5, count: 1 }]);
        let r = |version, index| BlockRef { version, index };
        assert_eq!(v3.blocks, vec![r(1, 0), r(1, 1), r(2, 0), r(3, 0), r(1, 4), r(3, 1)]);
        assert_eq!(
            v3.extents(),
            vec![
                Extent { first: 0, count: 2, source: r(1, 0) },
                Extent { first: 2, count: 1, source: r(2, 0) },
                Extent { first: 3, count: 1, source: r(3, 0) },
                Extent { first: 4, count: 1, source: r(1, 4) },
                Extent { first: 5, count: 1, source: r(3, 1) },
            ]
        );
        let borrowed = v3.borrowed();
        assert_eq!(borrowed[&1], [0, 1, 4].into_iter().collect());
        assert_eq!(borrowed[&2], [0].into_iter().collect());
        assert!(!borrowed.contains_key(&3));
        assert!(v3.validate(3, 6 * BLOCK_SIZE, 2).is_ok());
        assert!(v3.validate(3, 6 * BLOCK_SIZE, 1).is_err(), "refers past its own file");
        assert!(v3.validate(2, 6 * BLOCK_SIZE, 2).is_err(), "another version");
        assert!(v2.validate(2, 5 * BLOCK_SIZE, 2).is_err(), "another length");
    }
}
