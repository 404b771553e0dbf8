//! The stored checkpoint format, in one place: what a version of one rank
//! is ([`Manifest`], [`LabelLayout`], [`DataKind`]), how the controller
//! records a complete version ([`VersionRecord`]), the chunk checksums, the
//! rules for application names, and the bounded codec for structures kept
//! in files.
//!
//! Architecture invariant: this is a leaf. It imports nothing from
//! `protocol`, `service`, `pfs` or `fabric` (only the pure `distribution`
//! metadata a label carries), so the stores, the wire protocol and the
//! client library all build on it and none of them on each other for it.
//!
//! Architecture invariant: a manifest that comes from outside this process
//! (a file of either store, a peer agent, an agent's reply) is used only
//! after [`Manifest::validate`]: every label lies inside the data, labels
//! are back to back, there is one checksum list per label of the right
//! length, the chunk size is [`CHUNK_SIZE`], and counts are bounded. After
//! that, slicing the data by a label's offsets cannot go out of bounds.
//! [`Manifest::verify`] is the one loop that checks data against it.

#![forbid(unsafe_code)]
// Decoders of untrusted sizes: no silent truncation or sign change (the
// Firecracker lints); conversions go through try_from.
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use bincode::Options;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::distribution::Adapt;

/// Bytes per checksum chunk, as a length in memory.
pub const CHUNK_BYTES: usize = 4 << 20;
/// Bytes per checksum chunk, as recorded in manifests.
pub const CHUNK_SIZE: u64 = CHUNK_BYTES as u64;
/// Most labels one rank may register.
pub const MAX_LABELS: usize = 65_536;
/// Largest structure stored in a file (PFS manifests of many ranks).
pub const MAX_STORED: u64 = 256 << 20;
/// Longest label name, in bytes.
pub const MAX_LABEL_NAME: usize = 4096;

/// Why stored bytes or a manifest were refused.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The application name cannot be a directory name.
    #[error("application name {0:?} is not allowed (use 1-128 of A-Z a-z 0-9 . _ -, not starting with '.')")]
    BadName(String),
    /// A manifest contradicts itself or its data.
    #[error("manifest of version {version}, rank {rank} of {app:?}: {reason}")]
    BadManifest {
        /// Application the manifest names.
        app: String,
        /// Version it names.
        version: u64,
        /// Rank it names.
        rank: u32,
        /// What is wrong.
        reason: String,
    },
    /// The bytes do not decode as the expected structure.
    #[error("malformed stored structure: {0}")]
    Malformed(String),
}

/// Whether `name` is a plain file name: not empty, no leading dot, only
/// A-Z a-z 0-9 . _ -, so it can never leave the directory it is joined to.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Checks that `app` is safe as a single path component.
pub fn check_app_name(app: &str) -> Result<(), FormatError> {
    if app.len() <= 128 && is_plain_name(app) {
        Ok(())
    } else {
        Err(FormatError::BadName(app.to_string()))
    }
}

/// The CRC-32C (Castagnoli) of `data`: the checksum of every chunk and
/// block. Computed with `crc-fast`'s carry-less-multiply folding, which
/// reads 256 MiB here at ~22 GB/s against ~14 GB/s for the `crc32c`
/// crate's hardware `crc32` instruction loop (the value is the same; that
/// crate still combines checksums of adjacent pieces). Every commit and
/// every restart passes over all of its bytes once with it.
pub fn crc32c(data: &[u8]) -> u32 {
    let crc = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data);
    u32::try_from(crc).expect("a CRC-32 fits 32 bits")
}

/// The CRC-32C polynomial, bit-reflected (x^0 is the top bit).
const CRC32C_REFLECTED: u32 = 0x82F6_3B78;

/// `a * b mod P` in GF(2), both in the reflected representation.
const fn multiply_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut product = 0;
    while m != 0 {
        if a & m != 0 {
            product ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ CRC32C_REFLECTED } else { b >> 1 };
    }
    product
}

/// `x^(2^k) mod P` for each bit k of a 64-bit shift.
const X_POW_2K: [u32; 64] = {
    let mut table = [0u32; 64];
    // x^1: the bit for x^1 in the reflected representation.
    let mut power = 1u32 << 30;
    let mut k = 0;
    while k < 64 {
        table[k] = power;
        power = multiply_mod_p(power, power);
        k += 1;
    }
    table
};

/// The CRC-32C of two byte strings one after the other, from their CRCs
/// and the second one's length: `crc1 · x^(8·len2) + crc2 mod P` (zlib's
/// method). The `crc32c` crate's combine squares a 32×32 matrix per bit of
/// the length (15.5 µs per combine of a megabyte here); this is at most
/// ~64 multiplications (0.24 µs). Incremental checksums combine pieces at every chunk and block
/// edge (`delta`), several per megabyte of a label not aligned to a block.
pub fn crc32c_combine(crc1: u32, crc2: u32, len2: usize) -> u32 {
    // x^(8·len2): the factors x^(2^k) for the set bits of 8·len2.
    let mut shift = (len2 as u64) << 3;
    let mut factor = 1u32 << 31; // x^0
    let mut k = 0;
    while shift != 0 {
        if shift & 1 != 0 {
            factor = multiply_mod_p(X_POW_2K[k], factor);
        }
        shift >>= 1;
        k += 1;
    }
    multiply_mod_p(factor, crc1) ^ crc2
}

/// crc32c of each [`CHUNK_SIZE`] chunk of `data`.
pub fn chunk_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(CHUNK_BYTES).map(crc32c).collect()
}

/// Per-label checksums: [`chunk_crcs`] of each label's bytes. Chunks start
/// at each label's first byte, so any one label can be verified alone.
pub fn label_crcs(labels: &[&[u8]]) -> Vec<Vec<u32>> {
    labels.iter().map(|bytes| chunk_crcs(bytes)).collect()
}

/// The first chunk of `data` whose crc32c differs from `crcs`, if any (a
/// checksum list of the wrong length counts as damage at its first gap).
///
/// Data of at least [`PARALLEL_CHECK_BYTES`] is checked on every core at
/// once: an agent checks a whole version before a restart may read it,
/// with the restarting rank waiting, so a single core's pass (~25 ms per
/// 256 MiB here) was time the restart lost.
pub fn first_bad_chunk(data: &[u8], crcs: &[u32]) -> Option<usize> {
    let expected_chunks = data.len().div_ceil(CHUNK_BYTES);
    if crcs.len() != expected_chunks {
        return Some(crcs.len().min(expected_chunks));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if data.len() < PARALLEL_CHECK_BYTES || threads < 2 {
        return first_bad_chunk_of(data, crcs, 0);
    }
    // Contiguous runs of whole chunks, one per thread; the earliest bad
    // chunk of any run is the answer.
    let per_thread = expected_chunks.div_ceil(threads);
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..expected_chunks)
            .step_by(per_thread)
            .map(|first| {
                let last = (first + per_thread).min(expected_chunks);
                let bytes = &data[first * CHUNK_BYTES..(last * CHUNK_BYTES).min(data.len())];
                let crcs = &crcs[first..last];
                (first, scope.spawn(move || first_bad_chunk_of(bytes, crcs, first)))
            })
            .collect();
        // A thread that could not finish counts as damage at its run's start.
        runs.into_iter().filter_map(|(first, run)| run.join().unwrap_or(Some(first))).min()
    })
}

/// Data from which [`first_bad_chunk`] checks on several threads.
pub const PARALLEL_CHECK_BYTES: usize = 64 << 20;

/// [`first_bad_chunk`] on one thread, numbering chunks from `first`.
fn first_bad_chunk_of(data: &[u8], crcs: &[u32], first: usize) -> Option<usize> {
    data.chunks(CHUNK_BYTES).zip(crcs).position(|(chunk, crc)| crc32c(chunk) != *crc).map(|i| first + i)
}

/// Checks that labels are unique, at most [`MAX_LABELS`], and lie back to
/// back from offset 0; returns the total length.
pub fn check_layout(labels: &[LabelLayout]) -> Result<u64, String> {
    if labels.len() > MAX_LABELS {
        return Err(format!("{} labels exceed the limit of {MAX_LABELS}", labels.len()));
    }
    let mut end = 0u64;
    let mut seen = std::collections::HashSet::new();
    for label in labels {
        if label.label.len() > MAX_LABEL_NAME {
            return Err(format!("a label name of {} bytes exceeds {MAX_LABEL_NAME}", label.label.len()));
        }
        if !seen.insert(label.label.as_str()) {
            return Err(format!("label {:?} appears twice", label.label));
        }
        if label.offset != end {
            return Err(format!("label {:?} starts at {} instead of {end}", label.label, label.offset));
        }
        end = end.checked_add(label.len).ok_or("label lengths overflow")?;
    }
    Ok(end)
}

fn stored_options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_STORED).reject_trailing_bytes()
}

/// Encodes a structure stored in a file (not sent), up to [`MAX_STORED`] bytes.
pub fn encode_stored<T: Serialize>(value: &T) -> Result<Vec<u8>, FormatError> {
    stored_options().serialize(value).map_err(|e| FormatError::Malformed(e.to_string()))
}

/// Decodes a structure read from a file; never panics, allocates at most
/// [`MAX_STORED`] bytes.
pub fn decode_stored<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    stored_options().deserialize(bytes).map_err(|e| FormatError::Malformed(e.to_string()))
}

/// How the application moves data (thesis §6.2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// Every process registers its memory (P:M).
    Mr,
    /// One shared-memory segment per node (N:M).
    Shmr,
}

impl std::fmt::Display for TransferMode {
    /// The thesis's names: every process registers (MR, P:M), or one
    /// shared-memory segment per node (SHMR, N:M).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransferMode::Mr => "MR (P:M)",
            TransferMode::Shmr => "SHMR (N:M)",
        })
    }
}

impl TransferMode {
    /// How the configuration names it (`[client] mode`, `ICHECK_MODE`).
    pub fn setting(self) -> &'static str {
        match self {
            TransferMode::Mr => "mr",
            TransferMode::Shmr => "shmr",
        }
    }

    /// Why `version` of `app`, whose files were written in this mode, cannot
    /// be restored by a run in mode `asked`, and what to do: MR keeps a
    /// file per process and SHMR one per node, and neither reads the
    /// other's. `place` says where the version is ("agent memory", "the
    /// PFS"). The controller and the library say the same.
    pub fn cannot_restore_in(self, asked: TransferMode, app: &str, version: u64, place: &str) -> String {
        let setting = self.setting();
        let unit = match self {
            TransferMode::Mr => "process",
            TransferMode::Shmr => "node",
        };
        format!(
            "version {version} of {app:?} was written in {self} mode and cannot be restored in {asked} mode \
             ({place} keeps it as one file per {unit}): restart with mode = \"{setting}\" \
             (ICHECK_MODE={setting}), or start afresh after `icheck delete {app} --yes`"
        )
    }
}

/// A complete version as the controller records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VersionRecord {
    /// Version number (1, 2, ...).
    pub version: u64,
    /// Process count it was written with.
    pub ranks: u32,
    /// Resize epoch: how many times the process count changed before this
    /// version was written.
    pub epoch: u32,
    /// Bytes over all ranks.
    pub bytes: u64,
    /// Seconds the commit took.
    pub commit_secs: f64,
    /// When it completed, in milliseconds since the Unix epoch.
    pub completed_unix_ms: u64,
}

/// Element type of a label (the C API's ICHECK_CHAR ... ICHECK_BINARY).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataKind {
    /// `char` / u8.
    Char,
    /// 32-bit integer.
    Int,
    /// 64-bit integer.
    Long,
    /// 32-bit float.
    Float,
    /// 64-bit float.
    Double,
    /// Raw bytes.
    Binary,
}

impl DataKind {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataKind::Char | DataKind::Binary => 1,
            DataKind::Int | DataKind::Float => 4,
            DataKind::Long | DataKind::Double => 8,
        }
    }
}

/// Where one label lies in a rank's checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelLayout {
    /// The label.
    pub label: String,
    /// Element type.
    pub kind: DataKind,
    /// Byte offset in the rank's data.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// How the label is restored with another process count (labels added
    /// with `add_adapt` / `add_adapt_global`); `None` for plain labels.
    pub adapt: Option<Adapt>,
}

/// Everything known about one rank's data of one version; written by the
/// agent next to the data (last, atomically) and returned on fetch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Application name.
    pub app: String,
    /// Rank.
    pub rank: u32,
    /// Process count of the application when written.
    pub ranks: u32,
    /// Resize epoch of the version (see [`VersionRecord::epoch`]).
    pub epoch: u32,
    /// Version number.
    pub version: u64,
    /// Labels, in file order.
    pub labels: Vec<LabelLayout>,
    /// Total bytes of data.
    pub total_len: u64,
    /// Bytes per checksum chunk.
    pub chunk_size: u64,
    /// Per label (in `labels` order): crc32c of each `chunk_size` chunk
    /// of the label's bytes, as the rank computed them from its own memory.
    pub crcs: Vec<Vec<u32>>,
    /// When sealed, in milliseconds since the Unix epoch.
    pub sealed_unix_ms: u64,
}

impl Manifest {
    fn refuse(&self, reason: String) -> FormatError {
        FormatError::BadManifest { app: self.app.clone(), version: self.version, rank: self.rank, reason }
    }

    /// Checks everything a reader relies on before it uses an offset of
    /// this manifest: see the module's invariant. `O(labels)`; the data is
    /// not read.
    pub fn validate(&self) -> Result<(), FormatError> {
        check_app_name(&self.app)?;
        if self.version == 0 || self.ranks == 0 {
            return Err(self.refuse(format!("version {} of {} processes", self.version, self.ranks)));
        }
        if self.chunk_size != CHUNK_SIZE {
            return Err(self.refuse(format!("checksum chunks of {} bytes, expected {CHUNK_SIZE}", self.chunk_size)));
        }
        let end = check_layout(&self.labels).map_err(|reason| self.refuse(reason))?;
        if end != self.total_len {
            return Err(self.refuse(format!("labels end at byte {end}, the data has {} bytes", self.total_len)));
        }
        if self.crcs.len() != self.labels.len() {
            return Err(self.refuse(format!("{} checksum lists for {} labels", self.crcs.len(), self.labels.len())));
        }
        for (label, crcs) in self.labels.iter().zip(&self.crcs) {
            let chunks = label.len.div_ceil(CHUNK_SIZE);
            if crcs.len() as u64 != chunks {
                return Err(self.refuse(format!(
                    "label {:?}: {} checksums for {chunks} chunks",
                    label.label,
                    crcs.len()
                )));
            }
        }
        usize::try_from(self.total_len)
            .map_err(|_| self.refuse(format!("{} bytes do not fit this machine's address space", self.total_len)))?;
        Ok(())
    }

    /// The bytes of label `index` in `data` (the whole rank's data), or an
    /// error if the data is shorter than the manifest says. Call on a
    /// validated manifest.
    pub fn label_bytes<'a>(&self, index: usize, data: &'a [u8]) -> Result<&'a [u8], FormatError> {
        let label = self.labels.get(index).ok_or_else(|| self.refuse(format!("no label number {index}")))?;
        let end = label.offset.checked_add(label.len);
        let range = usize::try_from(label.offset).ok().zip(end.and_then(|end| usize::try_from(end).ok()));
        range
            .and_then(|(start, end)| data.get(start..end))
            .ok_or_else(|| self.refuse(format!("label {:?} lies beyond the {} bytes of data", label.label, data.len())))
    }

    /// Checks `data` (the whole rank's data) against the rank's checksums:
    /// the one verification loop of every reader (the PFS level, take-overs,
    /// fetches). The error names the first damaged label and chunk.
    pub fn verify(&self, data: &[u8]) -> Result<(), FormatError> {
        self.validate()?;
        if (data.len() as u64) < self.total_len {
            return Err(self.refuse(format!("{} bytes of data, the manifest says {}", data.len(), self.total_len)));
        }
        for (index, (label, crcs)) in self.labels.iter().zip(&self.crcs).enumerate() {
            if let Some(chunk) = first_bad_chunk(self.label_bytes(index, data)?, crcs) {
                return Err(
                    self.refuse(format!("label {:?}: chunk {chunk} does not match the rank's checksum", label.label))
                );
            }
        }
        Ok(())
    }

    /// Cuts the rank's data into `count` contiguous slices (start, end) that
    /// cover it in order, each as near to an equal share as the rank's
    /// checksum chunks allow: every cut lies on a chunk boundary (a label's
    /// start or end, or a whole number of chunks into a label), so each
    /// slice is checked against the rank's own checksums
    /// ([`InOrderCheck::over`]). Slices may be empty (a rank shorter than
    /// `count` chunks). Call on a validated manifest.
    pub fn slices(&self, count: usize) -> Vec<(u64, u64)> {
        let count = count.max(1);
        let total = self.total_len;
        let mut cuts = Vec::with_capacity(count + 1);
        cuts.push(0);
        for i in 1..count {
            // At most `total`: it fits.
            let target = u64::try_from(u128::from(total) * i as u128 / count as u128).unwrap_or(total);
            let cut = self.nearest_chunk_boundary(target).max(*cuts.last().unwrap_or(&0));
            cuts.push(cut);
        }
        cuts.push(total);
        cuts.windows(2).map(|w| (w[0], w[1])).collect()
    }

    /// The chunk boundary nearest to byte `at` (the earlier one on a tie).
    fn nearest_chunk_boundary(&self, at: u64) -> u64 {
        let Some(label) = self.labels.iter().find(|l| l.offset <= at && at < l.offset + l.len) else {
            return at.min(self.total_len);
        };
        let before = label.offset + (at - label.offset) / self.chunk_size * self.chunk_size;
        let after = (before + self.chunk_size).min(label.offset + label.len);
        if after - at < at - before {
            after
        } else {
            before
        }
    }

    /// Whether byte offset `at` starts a chunk (or ends the data).
    pub fn is_chunk_boundary(&self, at: u64) -> bool {
        at == self.total_len
            || self
                .labels
                .iter()
                .any(|l| at >= l.offset && at < l.offset + l.len && (at - l.offset).is_multiple_of(self.chunk_size))
    }
}

/// Checks a rank's bytes against its manifest as they arrive, in order and
/// in pieces of any size: a coder reading a member a stripe at a time,
/// whose stripes cut the rank's chunks anywhere. Each chunk's checksum is
/// combined from its pieces' and compared when the chunk is complete, so
/// the bytes are checked while they are in cache, by the reader, instead
/// of in a pass of their own. Bytes past the rank's data (a shard's zero
/// padding) are not the rank's and are not checked.
#[derive(Debug)]
pub struct InOrderCheck<'a> {
    manifest: &'a Manifest,
    /// Offset in the rank's data of the next byte fed.
    fed: u64,
    /// Where the checked bytes end (the rank's end, or a slice's).
    end: u64,
    /// The label and chunk the next byte belongs to.
    label: usize,
    chunk: usize,
    /// The checksum of the current chunk's bytes fed so far.
    partial: u32,
}

impl<'a> InOrderCheck<'a> {
    /// A check of `manifest`'s rank from its first byte; refuses a manifest
    /// whose checksums do not fit its labels.
    pub fn new(manifest: &'a Manifest) -> Result<InOrderCheck<'a>, FormatError> {
        manifest.validate()?;
        Ok(InOrderCheck { manifest, fed: 0, end: manifest.total_len, label: 0, chunk: 0, partial: 0 })
    }

    /// A check of bytes `start..end` of `manifest`'s rank (a slice of it,
    /// [`Manifest::slices`]), fed from `start`; both ends must be chunk
    /// boundaries, so every chunk in the range is checked whole.
    pub fn over(manifest: &'a Manifest, (start, end): (u64, u64)) -> Result<InOrderCheck<'a>, FormatError> {
        manifest.validate()?;
        if start > end
            || end > manifest.total_len
            || !manifest.is_chunk_boundary(start)
            || !manifest.is_chunk_boundary(end)
        {
            return Err(manifest.refuse(format!("bytes {start}..{end} are not a range of whole chunks")));
        }
        let mut label = 0;
        while label < manifest.labels.len() && manifest.labels[label].offset + manifest.labels[label].len <= start {
            label += 1;
        }
        let chunk = manifest.labels.get(label).map_or(0, |l| ((start.max(l.offset) - l.offset) / CHUNK_SIZE) as usize);
        Ok(InOrderCheck { manifest, fed: start, end, label, chunk, partial: 0 })
    }

    /// The next `bytes` of the rank's data (and perhaps padding after it).
    /// Returns the crc32c of all of `bytes`, padding included, combined
    /// from the same pass (a reader that keeps its own checksums at another
    /// granularity, as a parity shard's stripes, reads the bytes once).
    /// The error names the label and chunk that does not match.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<u32, FormatError> {
        let m = self.manifest;
        let mut whole = 0;
        while !bytes.is_empty() && self.fed < self.end {
            let label = &m.labels[self.label];
            let label_end = label.offset + label.len;
            if self.fed == label_end {
                // An empty label, or this one's last chunk was complete.
                (self.label, self.chunk) = (self.label + 1, 0);
                continue;
            }
            let chunk_end = (label.offset + (self.chunk as u64 + 1) * CHUNK_SIZE).min(label_end);
            let take = bytes.len().min(usize::try_from(chunk_end - self.fed).unwrap_or(usize::MAX));
            let crc = crc32c(&bytes[..take]);
            self.partial = crc32c_combine(self.partial, crc, take);
            whole = crc32c_combine(whole, crc, take);
            (self.fed, bytes) = (self.fed + take as u64, &bytes[take..]);
            if self.fed == chunk_end {
                if self.partial != m.crcs[self.label][self.chunk] {
                    let reason =
                        format!("label {:?}: chunk {} does not match the rank's checksum", label.label, self.chunk);
                    return Err(m.refuse(reason));
                }
                (self.chunk, self.partial) = (self.chunk + 1, 0);
            }
        }
        // Padding past the rank's data.
        Ok(if bytes.is_empty() { whole } else { crc32c_combine(whole, crc32c(bytes), bytes.len()) })
    }

    /// Whether every byte to check (the rank's data, or the range's) has been fed.
    pub fn complete(&self) -> bool {
        self.fed == self.end
    }
}

/// Manifests for decoder tests in every crate: one good manifest and every
/// way a damaged or hostile one can lie. Not part of the format.
#[doc(hidden)]
pub mod samples {
    use super::*;

    /// A good two-label manifest of `data`.
    pub fn manifest(data: &[u8]) -> Manifest {
        let (a, b) = data.split_at(data.len() / 3);
        Manifest {
            app: "app".into(),
            rank: 1,
            ranks: 2,
            epoch: 0,
            version: 3,
            labels: vec![
                LabelLayout { label: "a".into(), kind: DataKind::Binary, offset: 0, len: a.len() as u64, adapt: None },
                LabelLayout {
                    label: "b".into(),
                    kind: DataKind::Binary,
                    offset: a.len() as u64,
                    len: b.len() as u64,
                    adapt: None,
                },
            ],
            total_len: data.len() as u64,
            chunk_size: CHUNK_SIZE,
            crcs: label_crcs(&[a, b]),
            sealed_unix_ms: 0,
        }
    }

    /// The manifest of one label "x" holding `data`: version `version` of
    /// rank `rank` of `app`, a job of one process.
    pub fn single_label(app: &str, rank: u32, version: u64, data: &[u8]) -> Manifest {
        Manifest {
            app: app.into(),
            rank,
            ranks: 1,
            epoch: 0,
            version,
            labels: vec![LabelLayout {
                label: "x".into(),
                kind: DataKind::Binary,
                offset: 0,
                len: data.len() as u64,
                adapt: None,
            }],
            total_len: data.len() as u64,
            chunk_size: CHUNK_SIZE,
            crcs: vec![chunk_crcs(data)],
            sealed_unix_ms: 0,
        }
    }

    /// Every way a damaged or hostile manifest can lie, each refused with a
    /// typed error before any offset in it is used.
    pub fn damaged_manifests(data: &[u8]) -> Vec<(&'static str, Manifest)> {
        let good = manifest(data);
        let with = |what: &'static str, change: &dyn Fn(&mut Manifest)| {
            let mut m = good.clone();
            change(&mut m);
            (what, m)
        };
        vec![
            with("offset past the end", &|m| m.labels[1].offset = u64::MAX - 3),
            with("length past the end", &|m| m.labels[1].len += 1),
            with("total beyond the labels", &|m| m.total_len += 4096),
            with("missing checksum list", &|m| {
                m.crcs.pop();
            }),
            with("short checksum list", &|m| m.crcs[0].clear()),
            with("zero chunk size", &|m| m.chunk_size = 0),
            with("huge label count", &|m| {
                m.labels = (0..=MAX_LABELS as u64)
                    .map(|i| LabelLayout {
                        label: i.to_string(),
                        kind: DataKind::Binary,
                        offset: 0,
                        len: 0,
                        adapt: None,
                    })
                    .collect()
            }),
            with("no process count", &|m| m.ranks = 0),
            with("name escaping the store", &|m| m.app = "../x".into()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::samples::{damaged_manifests, manifest};
    use super::{
        chunk_crcs, crc32c, crc32c_combine, first_bad_chunk, first_bad_chunk_of, CHUNK_BYTES, PARALLEL_CHECK_BYTES,
    };

    /// Two and a half chunks and a few bytes of pseudo-random data (byte
    /// `which` of a multiplicative hash of each offset).
    fn two_and_a_half_chunks(which: usize) -> Vec<u8> {
        (0..2 * CHUNK_BYTES + CHUNK_BYTES / 2 + 1234)
            .map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[which])
            .collect()
    }

    #[test]
    fn in_order_checks_pieces_cut_anywhere_and_names_the_damaged_chunk() {
        // Three chunks and a tail over two labels, fed in pieces that cut
        // chunks and labels anywhere, then zero padding.
        let data = two_and_a_half_chunks(5);
        let good = manifest(&data);
        // Each piece's own checksum comes back, padding included (the last
        // piece of some cuts is the data's tail and padding together).
        let padded: Vec<u8> = data.iter().copied().chain([0u8; 4096]).collect();
        for piece in [1 << 20, 999_998, CHUNK_BYTES + 2, data.len(), padded.len()] {
            let mut check = super::InOrderCheck::new(&good).unwrap();
            for bytes in padded.chunks(piece) {
                assert_eq!(check.feed(bytes).unwrap(), crc32c(bytes), "pieces of {piece}");
            }
            assert!(check.complete(), "pieces of {piece}");
        }
        let mut damaged = data.clone();
        damaged[CHUNK_BYTES + CHUNK_BYTES / 3 + 5] ^= 1;
        let mut check = super::InOrderCheck::new(&good).unwrap();
        let err = damaged
            .chunks(777_777)
            .try_for_each(|bytes| check.feed(bytes).map(drop))
            .expect_err("a flipped bit passed");
        assert!(err.to_string().contains("label \"b\": chunk 0 does not match"), "{err}");
        assert!(!check.complete());
    }

    #[test]
    fn slices_cover_the_rank_on_chunk_boundaries_and_each_checks_alone() {
        // Two labels (a partial chunk, then two chunks and a tail).
        let data = two_and_a_half_chunks(3);
        let good = manifest(&data);
        for count in 1..=6 {
            let slices = good.slices(count);
            assert_eq!(slices.len(), count);
            assert_eq!(slices.first().map(|s| s.0), Some(0));
            assert_eq!(slices.last().map(|s| s.1), Some(data.len() as u64));
            for (i, (start, end)) in slices.iter().copied().enumerate() {
                let (from, to) = (usize::try_from(start).unwrap(), usize::try_from(end).unwrap());
                assert!(good.is_chunk_boundary(start) && good.is_chunk_boundary(end), "{count}: slice {i}");
                if i > 0 {
                    assert_eq!(slices[i - 1].1, start, "{count}: slices follow each other");
                }
                // Each slice checks on its own, padding after it unchecked.
                let mut check = super::InOrderCheck::over(&good, (start, end)).unwrap();
                let bytes: Vec<u8> = data[from..to].iter().copied().chain([0u8; 100]).collect();
                for piece in bytes.chunks(777_777) {
                    assert_eq!(check.feed(piece).unwrap(), crc32c(piece));
                }
                assert!(check.complete(), "{count}: slice {i}");
                if to > from {
                    let mut damaged = bytes.clone();
                    damaged[to - from - 1] ^= 4;
                    let mut check = super::InOrderCheck::over(&good, (start, end)).unwrap();
                    assert!(check.feed(&damaged).is_err(), "{count}: a flipped bit in slice {i} passed");
                }
            }
        }
        // 48 chunks whose labels start on chunk multiples: four equal slices.
        let even = manifest(&vec![7u8; 48 * CHUNK_BYTES]);
        assert!(even.slices(4).iter().all(|(s, e)| e - s == 12 * CHUNK_BYTES as u64), "{:?}", even.slices(4));
        assert!(super::InOrderCheck::over(&good, (1, CHUNK_BYTES as u64)).is_err(), "not a chunk boundary");
        assert!(super::InOrderCheck::over(&good, (0, data.len() as u64 + 1)).is_err(), "past the end");
    }

    #[test]
    fn combined_checksums_equal_the_checksum_of_the_joined_bytes_and_the_crc32c_crates_combine() {
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[1]).collect();
        for split in [0, 1, 7, 64, 4095, 4096, 1 << 20, (1 << 20) + 17, 2_999_999, 3_000_000] {
            let (head, tail) = bytes.split_at(split);
            let combined = crc32c_combine(crc32c(head), crc32c(tail), tail.len());
            assert_eq!(combined, crc32c(&bytes), "split at {split}");
            assert_eq!(combined, crc32c::crc32c_combine(crc32c(head), crc32c(tail), tail.len()), "split at {split}");
        }
        // Lengths far beyond any label: the crate's answer is the reference.
        for len in [1usize << 33, (1 << 40) + 3, usize::MAX >> 3] {
            assert_eq!(
                crc32c_combine(0x1234_5678, 0x9abc_def0, len),
                crc32c::crc32c_combine(0x1234_5678, 0x9abc_def0, len)
            );
        }
    }

    /// Stored checksums outlive the implementation that made them: the fast
    /// one must agree with the `crc32c` crate (and with the standard check
    /// value) at every length and alignment, including the SIMD paths' tails.
    #[test]
    fn the_fast_checksum_is_the_standard_crc32c() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let data: Vec<u8> = (0..70_016u32).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[2]).collect();
        for len in (0..300).chain([1023, 1024, 4095, 4096, 4097, 65_536, 69_999]) {
            for start in [0, 1, 7] {
                let bytes = &data[start..start + len];
                assert_eq!(crc32c(bytes), crc32c::crc32c(bytes), "{len} bytes from {start}");
            }
        }
    }

    /// Large data is checked on several threads; the answer is the one
    /// thread's answer whatever chunks are damaged: none, one in any run,
    /// several (the earliest wins), the partial last chunk, and a checksum
    /// list of the wrong length.
    #[test]
    fn the_parallel_check_finds_the_same_first_bad_chunk_as_one_thread() {
        let len = PARALLEL_CHECK_BYTES + 5 * CHUNK_BYTES + 12_345;
        let data: Vec<u8> = (0..len).map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
        let crcs = chunk_crcs(&data);
        let chunks = crcs.len();
        assert_eq!(first_bad_chunk(&data, &crcs), None);
        for damaged in
            [vec![0], vec![chunks / 2], vec![chunks - 1], vec![chunks - 2, 3], vec![chunks / 2 + 1, chunks - 1]]
        {
            let mut bad = data.clone();
            for &chunk in &damaged {
                bad[(chunk * CHUNK_BYTES + 17).min(len - 1)] ^= 0x40;
            }
            let expected = first_bad_chunk_of(&bad, &crcs, 0);
            assert_eq!(expected, damaged.iter().min().copied());
            assert_eq!(first_bad_chunk(&bad, &crcs), expected, "damaged {damaged:?}");
        }
        assert_eq!(first_bad_chunk(&data, &crcs[1..]), Some(chunks - 1), "a short checksum list");
    }

    #[test]
    fn a_good_manifest_validates_and_verifies() {
        let data: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| i.to_le_bytes()[0]).collect();
        let m = manifest(&data);
        m.verify(&data).unwrap();
        let mut bad = data.clone();
        bad[(5 << 20) + 1] ^= 1;
        let err = m.verify(&bad).unwrap_err().to_string();
        assert!(err.contains("label \"b\": chunk"), "{err}");
        assert!(m.verify(&data[..100]).is_err(), "short data is refused");
    }

    #[test]
    fn damaged_manifests_are_typed_errors() {
        let data: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| i.to_le_bytes()[0]).collect();
        for (what, m) in damaged_manifests(&data) {
            assert!(m.validate().is_err(), "{what} passed validation");
            assert!(m.verify(&data).is_err(), "{what} passed verification");
            // Slicing by it never panics either.
            let _ = m.label_bytes(1, &data);
        }
    }
}
