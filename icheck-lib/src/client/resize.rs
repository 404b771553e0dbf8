//! Malleability (§7.4): labels that survive a change of the process count.
//!
//! A label added with `add_adapt` (replicated data) or `add_adapt_global`
//! (a distributed 1-D array) carries its [`Adapt`] metadata in every
//! version's manifest. A run whose process count differs from the one a
//! version was written with restores such labels by reading, for each
//! process, exactly the pieces the distribution for the new count gives it,
//! from the agents that hold the old ranks' data (or from the PFS in
//! fallback mode), following `distribution::receive_plan`. Old ranks are
//! read a group at a time (sessions open for the duration of one `restore`
//! call), all of a group's reads in one fabric batch, every chunk verified
//! against its old rank's checksums as it arrives. Whole chunks of a
//! contiguous piece land straight in the application's memory; only the
//! partial chunks at a piece's ends, and scattered (CYCLIC) pieces, go
//! through a buffer and are copied ([`ReadPlan`]).

use std::collections::BTreeMap;

use icheck_core::decide::agent_for_rank;
use icheck_core::distribution::{receive_plan, Adapt, Attribute, GlobalLayout, Piece};
use icheck_core::fabric::{Access, RemoteRegion};
use icheck_core::format::CHUNK_BYTES;
use icheck_core::handoff::VersionFiles;
use icheck_core::protocol::{DataKind, FetchWanted, LabelLayout, Manifest};
use icheck_core::verified::{read_checked_from, CheckedRange, PeerRange};

use super::{fetch_version, read_files_and_verify, ReadFrom};
use super::{AgentLink, Error, Icheck, Restored, RestoredData, Result};
use crate::region::{as_bytes_mut, Element, Region};

/// What a volatile label's recalculation callback learns about the change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resize {
    /// Processes that wrote the version being restored.
    pub old_size: u32,
    /// Processes now.
    pub size: u32,
    /// This process's rank now.
    pub rank: u32,
}

/// How replicated data (`add_adapt`) is restored, in particular in a run
/// with another process count (§7.4.1.1).
pub enum Replicated<T: Element> {
    /// The same on every process: every process gets rank 0's value.
    Constant,
    /// The process count: restored as the current count.
    Size,
    /// The rank: restored as the current rank.
    Rank,
    /// Restored as `value` in every element; with `joining_only`, only
    /// processes that did not exist when the version was written get it,
    /// the others restore their own stored value.
    Default {
        /// The value.
        value: T,
        /// Only for joining processes.
        joining_only: bool,
    },
    /// Not read at all: `recalc` computes it when the label is restored.
    Volatile(Recalculate<T>),
}

/// A VOLATILE label's recalculation: fills the label's elements for the
/// process's new place.
pub type Recalculate<T> = Box<dyn Fn(&mut [T], Resize) + Send + Sync>;

/// How a distributed array (`add_adapt_global`) is spread: BLOCK, CYCLIC
/// with a width, PREDEFINED 2-D grids (`ProcessorMapping::add`) or MANUAL
/// (the whole array to one root). The same type the manifests record.
pub use icheck_core::distribution::GlobalLayout as Global;

/// A recalculation callback over a label's bytes.
pub type Recalc = Box<dyn Fn(&mut [u8], Resize) + Send + Sync>;

/// A version written by another process count, restored piece by piece.
pub(super) struct Resized {
    /// Processes that wrote it.
    pub(super) written: u32,
}

/// One old rank's data, open for reading during one restore.
enum OldRank {
    /// Exposed by the agent holding it: over the fabric, or as its files
    /// when the agent runs on this host.
    Agent { link: Box<AgentLink>, manifest: Manifest, from: ReadFrom },
    /// Read (and verified) from the PFS in fallback mode.
    Local { manifest: Manifest, bytes: Vec<u8> },
}

impl OldRank {
    fn manifest(&self) -> &Manifest {
        match self {
            OldRank::Agent { manifest, .. } | OldRank::Local { manifest, .. } => manifest,
        }
    }
}

/// Old ranks whose data one restore reads at once, in one fabric batch:
/// with several agents (on several nodes) their transfers add up, and each
/// open session keeps a progress thread busy at its agent.
const PARALLEL_OLD_RANKS: usize = 4;

/// Bytes one group may read through a buffer (the partial chunks at the
/// ends of its pieces, and scattered pieces' spans), which waits beside
/// the application's memory before its pieces are copied.
const PARALLEL_READ_BYTES: u64 = 512 << 20;

/// Cuts old ranks that read `sizes` bytes through a buffer, in order, into groups
/// read at once: at most [`PARALLEL_OLD_RANKS`] and [`PARALLEL_READ_BYTES`]
/// each, and at least one rank however large.
fn read_groups(sizes: &[u64]) -> Vec<std::ops::Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (index, size) in sizes.iter().enumerate() {
        let full = index - start == PARALLEL_OLD_RANKS || bytes + size > PARALLEL_READ_BYTES;
        if index > start && full {
            groups.push(start..index);
            (start, bytes) = (index, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        groups.push(start..sizes.len());
    }
    groups
}

/// How one old rank's pieces are read (byte offsets in its label).
#[derive(Clone, Debug, PartialEq, Eq)]
struct ReadPlan {
    /// Whole chunks of the label read straight into place: the label's
    /// bytes, and where they go in this process's part.
    direct: Option<(std::ops::Range<u64>, u64)>,
    /// Ranges read through a buffer (the whole chunks around them, for
    /// their checksums) and copied piece by piece.
    buffered: Vec<std::ops::Range<u64>>,
}

/// Plans the reads of one old rank's `pieces` (elements of `esize` bytes)
/// from its label of `label_len` bytes checksummed per `chunk`. When the
/// pieces are one run, in the old part and in the new (BLOCK to BLOCK),
/// every whole chunk inside it is read straight into place, and only the
/// partial chunks at its ends go through a buffer; otherwise (CYCLIC, or a
/// run within one chunk) the span around all pieces does.
fn plan_reads(pieces: &[Piece], esize: u64, chunk: u64, label_len: u64) -> ReadPlan {
    let lo = pieces.iter().map(|p| p.from_offset).min().unwrap_or(0) * esize;
    let hi = pieces.iter().map(|p| p.from_offset + p.len).max().unwrap_or(0) * esize;
    let mut sorted: Vec<&Piece> = pieces.iter().collect();
    sorted.sort_by_key(|p| p.from_offset);
    let one_run = sorted
        .windows(2)
        .all(|w| w[1].from_offset == w[0].from_offset + w[0].len && w[1].to_offset == w[0].to_offset + w[0].len);
    if let (true, Some(first), true) = (one_run, sorted.first(), chunk > 0) {
        let start = lo.next_multiple_of(chunk);
        // The label's last chunk may be short: up to its end is whole.
        let end = if hi == label_len { hi } else { hi / chunk * chunk };
        if start < end {
            let to = first.to_offset * esize + (start - lo);
            let buffered = [lo..start, end..hi].into_iter().filter(|r| r.start < r.end).collect();
            return ReadPlan { direct: Some((start..end, to)), buffered };
        }
    }
    ReadPlan { direct: None, buffered: std::iter::once(lo..hi).filter(|r| r.start < r.end).collect() }
}

/// One range of one old rank's label to read ([`Icheck::read_old_spans`]).
struct OldRead<'a> {
    old: &'a OldRank,
    label: &'a LabelLayout,
    /// The label's index in the old rank's manifest.
    index: usize,
    /// Bytes of the label.
    range: std::ops::Range<u64>,
}

/// One agent read of [`Icheck::read_old_spans`]: the chunk-aligned span,
/// placed in the buffer at `range.local_offset` (`range.remote` is unused
/// when the agent handed over its files).
struct AgentSpan<'a> {
    link: &'a AgentLink,
    manifest: &'a Manifest,
    label: &'a LabelLayout,
    files: Option<&'a VersionFiles>,
    range: CheckedRange<'a>,
}

/// The read of `range` of a label (`found`: its layout and index in the
/// old rank's manifest) in old rank `rank`'s open data.
fn old_read<'a>(
    open: &'a BTreeMap<u32, OldRank>,
    rank: u32,
    (layout, index): &'a (LabelLayout, usize),
    range: std::ops::Range<u64>,
) -> OldRead<'a> {
    OldRead { old: &open[&rank], label: layout, index: *index, range }
}

/// What [`Icheck::read_old_spans`] read: one buffer, and where each
/// request's first byte lies in it.
struct OldSpans {
    bytes: Vec<u8>,
    starts: Vec<usize>,
}

/// The chunk-aligned span of an old rank's label around `request.range`,
/// to be read to `local_offset` of the destination, and where the range's
/// first byte lies in it. `request.old` must be an agent's.
fn agent_span<'a>(request: &OldRead<'a>, local_offset: usize) -> Result<(AgentSpan<'a>, usize)> {
    let OldRead { old, label, index, ref range } = *request;
    let OldRank::Agent { link, manifest, from } = old else {
        return Err(Error::Order("an old rank read from the PFS has no agent span"));
    };
    let (region, files) = match from {
        ReadFrom::Fabric(region) => (*region, None),
        ReadFrom::Files(files) => (RemoteRegion { addr: 0, key: 0, len: 0 }, Some(files)),
    };
    let chunk = manifest.chunk_size.max(1);
    let first = range.start / chunk;
    let end = range.end.div_ceil(chunk).saturating_mul(chunk).min(label.len);
    let last = end.div_ceil(chunk) as usize;
    if last > manifest.crcs[index].len() {
        return Err(link.error(format!("label {:?}: its manifest lacks checksums", label.label)));
    }
    if chunk as usize != CHUNK_BYTES {
        return Err(corrupt(manifest, label, first * chunk, chunk));
    }
    let span = AgentSpan {
        link,
        manifest,
        label,
        files,
        range: CheckedRange {
            remote: region,
            remote_offset: label.offset + first * chunk,
            local_offset,
            len: (end - first * chunk) as usize,
            crcs: &manifest.crcs[index][first as usize..last],
        },
    };
    Ok((span, (range.start - first * chunk) as usize))
}

/// The error for a damaged chunk at byte `start` of `label` in an old
/// rank's data.
fn corrupt(manifest: &Manifest, label: &LabelLayout, start: u64, chunk: u64) -> Error {
    Error::Corrupt {
        version: manifest.version,
        rank: manifest.rank,
        start,
        end: (start + chunk).min(label.len),
        labels: format!("{:?}", label.label),
    }
}

impl Drop for OldRank {
    fn drop(&mut self) {
        if let OldRank::Agent { link, .. } = self {
            if let Err(err) = link.fetch_done() {
                tracing::debug!(%err, "agent did not acknowledge the end of a read of an old rank");
            }
        }
    }
}

/// Writes `value` into every element of `out` as `kind`.
fn fill_count(label: &str, kind: DataKind, value: u32, out: &mut [u8]) -> Result<()> {
    let bytes: Vec<u8> = match kind {
        DataKind::Int => (value as i32).to_ne_bytes().to_vec(),
        DataKind::Long => i64::from(value).to_ne_bytes().to_vec(),
        DataKind::Float => (value as f32).to_ne_bytes().to_vec(),
        DataKind::Double => f64::from(value).to_ne_bytes().to_vec(),
        DataKind::Char | DataKind::Binary => {
            return Err(Error::Adapt {
                label: label.to_string(),
                detail: format!("SIZE and RANK labels must hold numbers, not {kind:?} elements"),
            })
        }
    };
    fill(out, &bytes);
    Ok(())
}

/// Writes `element` (one element's bytes) into every element of `out`.
pub(super) fn fill(out: &mut [u8], element: &[u8]) {
    for chunk in out.chunks_mut(element.len().max(1)) {
        chunk.copy_from_slice(&element[..chunk.len()]);
    }
}

impl Icheck {
    /// Adds replicated data that a run with another process count restores
    /// as `attribute` says (`icheck_add_adapt`). Otherwise like `add`.
    pub fn add_adapt<T: Element>(&mut self, label: &str, region: &Region<T>, attribute: Replicated<T>) -> Result<()> {
        let (stored, recalc): (Attribute, Option<Recalc>) = match attribute {
            Replicated::Constant => (Attribute::Constant, None),
            Replicated::Size | Replicated::Rank if matches!(T::KIND, DataKind::Char | DataKind::Binary) => {
                return Err(Error::Adapt {
                    label: label.to_string(),
                    detail: "SIZE and RANK labels must hold numbers, not bytes".into(),
                })
            }
            Replicated::Size => (Attribute::Size, None),
            Replicated::Rank => (Attribute::Rank, None),
            Replicated::Default { value, joining_only } => {
                let value = as_bytes_mut(&mut [value]).to_vec();
                (Attribute::Default { value, joining_only }, None)
            }
            Replicated::Volatile(callback) => {
                let recalc: Recalc = Box::new(move |bytes: &mut [u8], resize: Resize| {
                    // SAFETY: the bytes are a label's whole memory, which
                    // came from a `Vec<T>` (or the caller's `T` array), so
                    // they are aligned for T and a multiple of its size; every
                    // bit pattern is a valid T.
                    let (head, elements, tail) = unsafe { bytes.align_to_mut::<T>() };
                    debug_assert!(head.is_empty() && tail.is_empty());
                    callback(elements, resize)
                });
                (Attribute::Volatile, Some(recalc))
            }
        };
        self.add(label, region)?;
        self.set_adapt(label, Adapt::Replicated(stored), recalc)
    }

    /// Adds replicated data in raw memory with a byte-level recalculation
    /// callback (the C interface's `icheck_add_adapt`).
    ///
    /// # Safety
    /// As `add_raw`: `ptr` must be valid for reads and writes of `len`
    /// bytes until the label is replaced or the library finalized.
    pub unsafe fn add_adapt_raw(
        &mut self,
        label: &str,
        ptr: *mut u8,
        len: usize,
        kind: DataKind,
        attribute: Attribute,
        recalc: Option<Recalc>,
    ) -> Result<()> {
        if matches!(attribute, Attribute::Size | Attribute::Rank) && matches!(kind, DataKind::Char | DataKind::Binary) {
            return Err(Error::Adapt { label: label.into(), detail: "SIZE and RANK labels must hold numbers".into() });
        }
        if matches!(attribute, Attribute::Volatile) && recalc.is_none() {
            return Err(Error::Adapt { label: label.into(), detail: "VOLATILE needs a recalculation function".into() });
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.add_raw(label, ptr, len, kind)? };
        self.set_adapt(label, Adapt::Replicated(attribute), recalc)
    }

    /// Adds this process's part of a distributed 1-D array of `global`
    /// elements (`icheck_add_adapt_global`). For BLOCK, CYCLIC and
    /// PREDEFINED the part must have exactly the elements the distribution
    /// gives this rank (a PREDEFINED mapping must cover the current process
    /// count); a MANUAL part may have any size.
    pub fn add_adapt_global<T: Element>(
        &mut self,
        label: &str,
        region: &Region<T>,
        global: u64,
        distribution: Global,
    ) -> Result<()> {
        // A CYCLIC width of 0 means 1, as the distribution arithmetic reads it.
        let layout = match distribution {
            GlobalLayout::Cyclic { width } => GlobalLayout::Cyclic { width: width.max(1) },
            other => other,
        };
        self.check_local_part(label, region.len() as u64, global, &layout)?;
        self.add(label, region)?;
        self.set_adapt(label, Adapt::Global { global, layout }, None)
    }

    /// `add_adapt_global` over raw memory of `count` elements of `kind`.
    ///
    /// # Safety
    /// As `add_raw`.
    pub unsafe fn add_adapt_global_raw(
        &mut self,
        label: &str,
        ptr: *mut u8,
        count: u64,
        kind: DataKind,
        global: u64,
        layout: GlobalLayout,
    ) -> Result<()> {
        self.check_local_part(label, count, global, &layout)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.add_raw(label, ptr, count as usize * kind.size(), kind)? };
        self.set_adapt(label, Adapt::Global { global, layout }, None)
    }

    fn check_local_part(&self, label: &str, count: u64, global: u64, layout: &GlobalLayout) -> Result<()> {
        let (rank, size) = (self.comm.rank(), self.comm.size());
        let distribution =
            layout.for_procs(size).map_err(|error| Error::Distribution { label: label.into(), error })?;
        if let Some(distribution) = distribution {
            let expected = distribution.local_count(global, size, rank);
            if count != expected {
                return Err(Error::Adapt {
                    label: label.into(),
                    detail: format!(
                        "rank {rank} of {size} gives {count} elements, but {global} elements under {layout:?} give it {expected}"
                    ),
                });
            }
        }
        if let GlobalLayout::Manual { root } = layout {
            if *root >= size {
                return Err(Error::Adapt {
                    label: label.into(),
                    detail: format!("MANUAL root {root} of {size} ranks"),
                });
            }
        }
        Ok(())
    }

    fn set_adapt(&mut self, label: &str, adapt: Adapt, recalc: Option<Recalc>) -> Result<()> {
        let entry = self
            .labels
            .iter_mut()
            .find(|l| l.name == label)
            .ok_or_else(|| Error::UnknownLabel { label: label.into(), detail: "just added, then gone" })?;
        entry.adapt = Some(adapt);
        entry.recalc = recalc;
        Ok(())
    }

    /// Checks, before a commit (*collective*), that every rank added the
    /// same distributed arrays with the same global size and distribution,
    /// and that MANUAL parts add up to their global size; the error names
    /// the label and the two sizes.
    pub(super) fn check_global_labels(&self) -> Result<()> {
        let mine: Vec<(String, u64, GlobalLayout)> = self
            .labels
            .iter()
            .filter_map(|l| match &l.adapt {
                Some(Adapt::Global { global, layout }) => Some((l.name.clone(), *global, layout.clone())),
                _ => None,
            })
            .collect();
        let encoded = icheck_core::protocol::encode(&mine).unwrap_or_default();
        let root: Vec<(String, u64, GlobalLayout)> =
            icheck_core::protocol::decode(&self.comm.broadcast_from_root(encoded)).unwrap_or_default();
        let mismatch = if root == mine {
            None
        } else {
            let differing = root.iter().zip(&mine).find(|(a, b)| a != b);
            Some(match differing {
                Some(((label, g0, l0), (_, g, l))) => Error::Adapt {
                    label: label.clone(),
                    detail: format!(
                        "rank {} declares {g} elements under {l:?}, rank 0 declares {g0} elements under {l0:?}",
                        self.comm.rank()
                    ),
                },
                // Same prefix, different lengths: the first extra array.
                None => Error::Adapt {
                    label: mine.get(root.len()).or(root.get(mine.len())).map(|m| m.0.clone()).unwrap_or_default(),
                    detail: format!(
                        "rank {} declares {} distributed arrays, rank 0 declares {}",
                        self.comm.rank(),
                        mine.len(),
                        root.len()
                    ),
                },
            })
        };
        let agreed = self.comm.all_true(mismatch.is_none());
        if let Some(err) = mismatch {
            return Err(err);
        }
        if !agreed {
            return Err(Error::Adapt {
                label: root.first().map(|m| m.0.clone()).unwrap_or_default(),
                detail: "another rank declares its distributed arrays differently".into(),
            });
        }
        for (name, global, layout) in &mine {
            if matches!(layout, GlobalLayout::Manual { .. }) {
                let label = self.labels.iter().find(|l| &l.name == name).expect("listed from labels");
                let count = (label.source.bytes().len() / label.source.kind().size()) as u64;
                let total = self.comm.sum(count);
                if total != *global {
                    return Err(Error::Adapt {
                        label: name.clone(),
                        detail: format!("the MANUAL parts add up to {total} elements, {global} were declared"),
                    });
                }
            }
        }
        Ok(())
    }

    /// Prepares a restart from `version`, written by `written` processes,
    /// in this run of another size: only old rank 0's manifest is read now
    /// (the labels and their metadata); `restore` reads the pieces.
    pub(super) fn fetch_resized(&mut self, version: u64, written: u32) -> Result<u64> {
        if self.mode == icheck_core::protocol::TransferMode::Shmr {
            return Err(Error::RankCount { version, written, now: self.comm.size() });
        }
        let first = self.open_old_rank(version, 0, written)?;
        let manifest = first.manifest().clone();
        drop(first);
        self.restored = Some(Restored { manifest, data: RestoredData::Resized(Resized { written }) });
        Ok(version)
    }

    fn open_old_rank(&self, version: u64, rank: u32, written: u32) -> Result<OldRank> {
        let manifest_check = |manifest: &Manifest| -> Result<()> {
            manifest.validate().map_err(|e| Error::Unsupported(format!("version {version}, old rank {rank}: {e}")))?;
            if manifest.rank != rank || manifest.ranks != written || manifest.crcs.len() != manifest.labels.len() {
                return Err(Error::Unsupported(format!(
                    "version {version}: the data of rank {rank} of {written} describes rank {} of {}",
                    manifest.rank, manifest.ranks
                )));
            }
            Ok(())
        };
        if let Some(pfs) = &self.fallback {
            let fail = |e: icheck_core::pfs::PfsError| Error::Unsupported(format!("restart from the PFS: {e}"));
            let pfs_manifest = pfs.manifest(&self.app, version).map_err(fail)?;
            let (manifest, bytes) = pfs.read_rank(&pfs_manifest, rank).map_err(fail)?;
            manifest_check(&manifest)?;
            return Ok(OldRank::Local { manifest, bytes });
        }
        let agent = &self.agents[agent_for_rank(rank, written, self.agents.len() as u32) as usize];
        let mut link = AgentLink::open(&self.endpoint, agent, &self.access, &self.app, rank, self.waits())?;
        link.expect_bytes(self.version_bytes());
        let wanted = FetchWanted { app: &self.app, rank, version };
        let (manifest, from) = match fetch_version(&mut link, wanted, self.restore_same_host) {
            Ok((_, _, Some(damage))) => return Err(link.error(damage)),
            Ok((manifest, from, None)) => (manifest, from),
            // Which old rank, beside the agent's own words.
            Err(Error::Agent { agent, node, peer, message, unreachable }) => {
                let message = format!("old rank {rank}: {message}");
                return Err(Error::Agent { agent, node, peer, message, unreachable });
            }
            Err(err) => return Err(err),
        };
        let old = OldRank::Agent { link: Box::new(link), manifest, from };
        manifest_check(old.manifest())?;
        Ok(old)
    }

    /// Reads every request's bytes into one buffer, verified: from agents
    /// as one fabric batch, every old rank's reads in flight at once (each
    /// the chunk-aligned span around its range, checked against that rank's
    /// checksums as it arrives); from the PFS, copied. Returns the buffer
    /// and, per request, where its range's first byte lies in it.
    fn read_old_spans(&self, requests: &[OldRead<'_>]) -> Result<OldSpans> {
        let mut bytes = Vec::new();
        let mut starts = Vec::with_capacity(requests.len());
        let mut reads: Vec<AgentSpan<'_>> = Vec::new();
        for request in requests {
            match request.old {
                OldRank::Local { bytes: data, .. } => {
                    let at = (request.label.offset + request.range.start) as usize;
                    starts.push(bytes.len());
                    bytes.extend_from_slice(&data[at..at + (request.range.end - request.range.start) as usize]);
                }
                OldRank::Agent { .. } => {
                    let (span, skip) = agent_span(request, bytes.len())?;
                    starts.push(bytes.len() + skip);
                    bytes.resize(bytes.len() + span.range.len, 0);
                    reads.push(span);
                }
            }
        }
        self.read_agent_spans(&mut bytes, &reads)?;
        Ok(OldSpans { bytes, starts })
    }

    /// Reads requests whose ranges are whole chunks of their labels (see
    /// [`ReadPlan`]) straight into `out`, each at its offset: the bulk of a
    /// resized restore, with no buffer and no copy. Verified as
    /// [`Self::read_old_spans`] verifies.
    fn read_old_into(&self, requests: &[(OldRead<'_>, usize)], out: &mut [u8]) -> Result<()> {
        let mut reads: Vec<AgentSpan<'_>> = Vec::new();
        for (request, at) in requests {
            let len = (request.range.end - request.range.start) as usize;
            match request.old {
                OldRank::Local { bytes: data, .. } => {
                    let from = (request.label.offset + request.range.start) as usize;
                    out[*at..*at + len].copy_from_slice(&data[from..from + len]);
                }
                OldRank::Agent { .. } => {
                    let (span, skip) = agent_span(request, *at)?;
                    if skip != 0 || span.range.len != len {
                        return Err(Error::Order("a direct read of an old rank must cover whole chunks"));
                    }
                    reads.push(span);
                }
            }
        }
        self.read_agent_spans(out, &reads)
    }

    /// Reads `spans` from their agents into `local` as one fabric batch,
    /// each chunk checked against its rank's checksum as it arrives.
    fn read_agent_spans(&self, local: &mut [u8], spans: &[AgentSpan<'_>]) -> Result<()> {
        // Spans of agents on this host: read from their files, one after
        // another on this process's share of the cores.
        for span in spans {
            let (Some(files), range) = (span.files, &span.range) else { continue };
            let out = &mut local[range.local_offset..range.local_offset + range.len];
            let chunk = span.manifest.chunk_size.max(1);
            if let Some(bad) =
                read_files_and_verify(files, range.remote_offset, out, chunk as usize, range.crcs, self.read_threads())?
            {
                let start = range.remote_offset - span.label.offset + bad as u64 * chunk;
                return Err(corrupt(span.manifest, span.label, start, chunk));
            }
        }
        let spans: Vec<&AgentSpan<'_>> = spans.iter().filter(|s| s.files.is_none()).collect();
        if spans.iter().all(|s| s.range.len == 0) {
            return Ok(());
        }
        let ranges: Vec<PeerRange<'_>> =
            spans.iter().map(|r| PeerRange { peer: r.link.read_peer(), range: r.range }).collect();
        // SAFETY: `local` stays borrowed, alive and unmoved until the
        // registration is dropped at the end of this function.
        let registered = unsafe { self.endpoint.register_raw(local.as_mut_ptr(), local.len(), Access::LOCAL)? };
        // SAFETY: `registered` covers exactly `local`, which the exclusive
        // borrow keeps from everyone else during the call.
        let checked = unsafe { read_checked_from(&self.endpoint, &registered, &ranges) };
        drop(registered);
        match checked {
            Ok(None) => Ok(()),
            Ok(Some((bad, chunk_index))) => {
                let AgentSpan { manifest, label, range, .. } = &spans[bad];
                let chunk = manifest.chunk_size.max(1);
                let start = range.remote_offset - label.offset + chunk_index as u64 * chunk;
                Err(corrupt(manifest, label, start, chunk))
            }
            Err(err) => {
                // Name the agent whose peer the fabric's error names.
                let text = err.to_string();
                match spans.iter().find(|r| text.contains(r.link.read_peer().name())) {
                    Some(r) => Err(r.link.error(format!("reading label {:?}: {err}", r.label.label))),
                    None => Err(Error::Fabric(err)),
                }
            }
        }
    }

    /// Opens old rank `rank` (or reuses it) and finds `label` in its data,
    /// checking that it is what rank 0 recorded.
    fn old_label<'a>(
        &self,
        open: &'a mut BTreeMap<u32, OldRank>,
        version: u64,
        written: u32,
        rank: u32,
        expected: &LabelLayout,
    ) -> Result<(&'a OldRank, LabelLayout, usize)> {
        let old = match open.entry(rank) {
            std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::btree_map::Entry::Vacant(entry) => {
                entry.insert(self.open_old_rank(version, rank, written)?)
            }
        };
        let old = &*old;
        let manifest = old.manifest();
        let index = manifest.labels.iter().position(|l| l.label == expected.label).ok_or_else(|| Error::Adapt {
            label: expected.label.clone(),
            detail: format!("rank {rank} of the {written} that wrote version {version} has no such label"),
        })?;
        let layout = manifest.labels[index].clone();
        if layout.kind != expected.kind || layout.adapt != expected.adapt {
            return Err(Error::Adapt {
                label: expected.label.clone(),
                detail: format!(
                    "rank {rank} wrote it as {:?} {:?}, rank 0 as {:?} {:?}",
                    layout.kind, layout.adapt, expected.kind, expected.adapt
                ),
            });
        }
        Ok((old, layout, index))
    }

    /// Elements of `label` this process receives from the restarted version:
    /// what it allocates before `restore` (`icheck_local_count`).
    pub fn local_count(&self, label: &str) -> Result<u64> {
        let (restored, index) = self.restored_label(label)?;
        let layout = &restored.manifest.labels[index];
        let size = layout.kind.size() as u64;
        let manual = matches!(layout.adapt, Some(Adapt::Global { layout: GlobalLayout::Manual { .. }, .. }));
        let written = match &restored.data {
            RestoredData::Resized(resized) => resized.written,
            // MANUAL arrays go whole to their root whatever the count.
            _ if manual => self.comm.size(),
            _ => return Ok(layout.len / size),
        };
        match &layout.adapt {
            Some(Adapt::Global { global, layout: global_layout }) => {
                let (rank, procs) = (self.comm.rank(), self.comm.size());
                match global_layout
                    .for_procs(procs)
                    .map_err(|error| Error::Distribution { label: label.into(), error })?
                {
                    Some(distribution) => Ok(distribution.local_count(*global, procs, rank)),
                    None => Ok(if matches!(global_layout, GlobalLayout::Manual { root } if *root == rank) {
                        *global
                    } else {
                        0
                    }),
                }
            }
            Some(Adapt::Replicated(_)) => Ok(layout.len / size),
            None => Err(self.not_adaptable(label, written)),
        }
    }

    fn not_adaptable(&self, label: &str, written: u32) -> Error {
        Error::Adapt {
            label: label.into(),
            detail: format!(
                "it was added with add(), which a run with another process count cannot restore (written by {written} processes, this run has {}); add it with add_adapt or add_adapt_global",
                self.comm.size()
            ),
        }
    }

    /// Restores an adapt label of a version written by another process
    /// count into `out` (this process's part under the current count).
    pub(super) fn restore_resized(
        &self,
        version: u64,
        written: u32,
        layout: &LabelLayout,
        kind: DataKind,
        out: &mut [u8],
    ) -> Result<()> {
        let label = layout.label.as_str();
        let (rank, size) = (self.comm.rank(), self.comm.size());
        if layout.kind != kind {
            return Err(Error::KindMismatch { label: label.into(), stored: layout.kind, given: kind });
        }
        let expected = self.local_count(label)? * kind.size() as u64;
        if out.len() as u64 != expected {
            return Err(Error::SizeMismatch { label: label.into(), stored: expected, given: out.len() as u64 });
        }
        let esize = kind.size() as u64;
        let mut open = BTreeMap::new();
        let mut copy_whole_label = |from: u32, out: &mut [u8]| -> Result<()> {
            let (old, old_layout, index) = self.old_label(&mut open, version, written, from, layout)?;
            if old_layout.len != out.len() as u64 {
                return Err(Error::SizeMismatch {
                    label: label.into(),
                    stored: old_layout.len,
                    given: out.len() as u64,
                });
            }
            let whole = OldRead { old, label: &old_layout, index, range: 0..old_layout.len };
            self.read_old_into(&[(whole, 0)], out)
        };
        match layout.adapt.as_ref().ok_or_else(|| self.not_adaptable(label, written))? {
            Adapt::Replicated(Attribute::Constant) => copy_whole_label(0, out),
            Adapt::Replicated(Attribute::Size) => fill_count(label, kind, size, out),
            Adapt::Replicated(Attribute::Rank) => fill_count(label, kind, rank, out),
            Adapt::Replicated(Attribute::Default { joining_only: true, .. }) if rank < written => {
                copy_whole_label(rank, out)
            }
            Adapt::Replicated(Attribute::Default { value, .. }) => {
                fill(out, value);
                Ok(())
            }
            Adapt::Replicated(Attribute::Volatile) => self.recalculate(label, written, out),
            Adapt::Global { global, layout: global_layout } => {
                let distribution = |procs| {
                    global_layout.for_procs(procs).map_err(|error| Error::Distribution { label: label.into(), error })
                };
                let (Some(from), Some(to)) = (distribution(written)?, distribution(size)?) else {
                    // MANUAL: the root gets every old part, in rank order,
                    // a group of old ranks at a time.
                    if out.is_empty() {
                        return Ok(());
                    }
                    let (mut at, mut next) = (0usize, 0u32);
                    while next < written {
                        let mut group: Vec<(u32, (LabelLayout, usize))> = Vec::new();
                        let mut group_bytes = 0u64;
                        while next < written && group.len() < PARALLEL_OLD_RANKS {
                            let (_, old_layout, index) = self.old_label(&mut open, version, written, next, layout)?;
                            group_bytes += old_layout.len;
                            group.push((next, (old_layout, index)));
                            next += 1;
                        }
                        if at as u64 + group_bytes > out.len() as u64 {
                            return Err(Error::Adapt {
                                label: label.into(),
                                detail: format!("the old parts hold more than the {global} elements declared"),
                            });
                        }
                        // Whole labels, one after another: straight into place.
                        let mut requests = Vec::with_capacity(group.len());
                        for (rank, found) in &group {
                            let len = found.0.len;
                            requests.push((old_read(&open, *rank, found, 0..len), at));
                            at += len as usize;
                        }
                        self.read_old_into(&requests, out)?;
                        for (rank, ..) in &group {
                            open.remove(rank);
                        }
                    }
                    return Ok(());
                };
                let plan = receive_plan(*global, from, written, to, size, rank);
                let covered: u64 = plan.iter().map(|p| p.len).sum();
                if covered * esize != out.len() as u64 {
                    return Err(Error::Adapt {
                        label: label.into(),
                        detail: format!(
                            "the old parts cover {covered} of this process's {} elements (a damaged record?)",
                            out.len() as u64 / esize
                        ),
                    });
                }
                let mut by_rank: BTreeMap<u32, Vec<_>> = BTreeMap::new();
                for piece in plan {
                    by_rank.entry(piece.from_rank).or_default().push(piece);
                }
                // How each old rank's pieces are read: whole chunks straight
                // into place, the rest through a buffer.
                let chunk = CHUNK_BYTES as u64;
                let olds: Vec<(u32, Vec<_>, ReadPlan)> = by_rank
                    .into_iter()
                    .map(|(rank, pieces)| {
                        let old_len = from.local_count(*global, written, rank) * esize;
                        let plan = plan_reads(&pieces, esize, chunk, old_len);
                        (rank, pieces, plan)
                    })
                    .collect();
                let buffered = |plan: &ReadPlan| plan.buffered.iter().map(|r| r.end - r.start + 2 * chunk).sum();
                for group in read_groups(&olds.iter().map(|(_, _, plan)| buffered(plan)).collect::<Vec<_>>()) {
                    let group = &olds[group];
                    let mut found = Vec::with_capacity(group.len());
                    for (from_rank, ..) in group {
                        let (_, old_layout, index) = self.old_label(&mut open, version, written, *from_rank, layout)?;
                        let old_count = from.local_count(*global, written, *from_rank);
                        if old_layout.len != old_count * esize {
                            return Err(Error::Adapt {
                                label: label.into(),
                                detail: format!(
                                    "rank {from_rank} of {written} wrote {} elements, {global} elements under {global_layout:?} give it {old_count}",
                                    old_layout.len / esize
                                ),
                            });
                        }
                        found.push((old_layout, index));
                    }
                    let direct: Vec<(OldRead<'_>, usize)> = group
                        .iter()
                        .zip(&found)
                        .filter_map(|((rank, _, plan), found)| {
                            let (range, to) = plan.direct.clone()?;
                            Some((old_read(&open, *rank, found, range), to as usize))
                        })
                        .collect();
                    self.read_old_into(&direct, out)?;
                    // The head and tail chunks (or all of a scattered rank's
                    // span), copied piece by piece.
                    let mut requests = Vec::new();
                    let mut copies = Vec::new();
                    for ((rank, pieces, plan), found) in group.iter().zip(&found) {
                        for range in &plan.buffered {
                            requests.push(old_read(&open, *rank, found, range.clone()));
                            copies.push((range.clone(), pieces));
                        }
                    }
                    let spans = self.read_old_spans(&requests)?;
                    for ((range, pieces), start) in copies.iter().zip(&spans.starts) {
                        for p in pieces.iter() {
                            let (from_start, from_end) = (p.from_offset * esize, (p.from_offset + p.len) * esize);
                            let (x, y) = (from_start.max(range.start), from_end.min(range.end));
                            if x < y {
                                let src = start + (x - range.start) as usize;
                                let dst = (p.to_offset * esize + (x - from_start)) as usize;
                                let len = (y - x) as usize;
                                out[dst..dst + len].copy_from_slice(&spans.bytes[src..src + len]);
                            }
                        }
                    }
                    // Each open session keeps a progress thread busy at its
                    // agent: a group's sessions end before the next opens.
                    for (rank, ..) in group {
                        open.remove(rank);
                    }
                }
                Ok(())
            }
        }
    }

    /// Calls a volatile label's recalculation callback on `out`.
    pub(super) fn recalculate(&self, label: &str, written: u32, out: &mut [u8]) -> Result<()> {
        let recalc = self.labels.iter().find(|l| l.name == label).and_then(|l| l.recalc.as_ref()).ok_or_else(|| {
            Error::Adapt {
                label: label.into(),
                detail: "VOLATILE: add the label with its recalculation function before restoring it".into(),
            }
        })?;
        recalc(out, Resize { old_size: written, size: self.comm.size(), rank: self.comm.rank() });
        Ok(())
    }

    /// Restores `label` into `region` after the process count changed
    /// (*collective*: the first call prepares the restart from the newest
    /// complete version, as `restart` does). The application commits right
    /// before it resizes, then every process of the new communicator calls
    /// this for each label (§7.4, `icheck_redistribute`).
    pub fn redistribute<T: Element>(&mut self, label: &str, region: &Region<T>) -> Result<()> {
        if self.restored.is_none() {
            self.restart()?;
        }
        self.restore(label, region)
    }
}

#[cfg(test)]
// Lists of byte ranges, some of one range (not a range's numbers).
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    fn piece(from_offset: u64, to_offset: u64, len: u64) -> Piece {
        Piece { from_rank: 0, from_offset, to_offset, len }
    }

    #[test]
    fn whole_chunks_of_one_run_go_straight_into_place_and_only_the_ends_are_buffered() {
        // Elements of 2 bytes, chunks of 100 bytes, an old part of 1000.
        // The whole part, ending in a short chunk: everything direct.
        let plan = plan_reads(&[piece(0, 7, 475)], 2, 100, 950);
        assert_eq!(plan, ReadPlan { direct: Some((0..950, 14)), buffered: vec![] });
        // Elements 75..210 (bytes 150..420) to element 3 of the new part.
        let plan = plan_reads(&[piece(75, 3, 135)], 2, 100, 1000);
        assert_eq!(plan, ReadPlan { direct: Some((200..400, 6 + 50)), buffered: vec![150..200, 400..420] });
        // Two pieces forming one run in both parts read as one.
        let plan = plan_reads(&[piece(175, 103, 35), piece(75, 3, 100)], 2, 100, 1000);
        assert_eq!(plan, ReadPlan { direct: Some((200..400, 56)), buffered: vec![150..200, 400..420] });
    }

    #[test]
    fn scattered_pieces_and_runs_inside_one_chunk_go_through_the_buffer() {
        // Within one chunk: no whole chunk to read directly.
        assert_eq!(plan_reads(&[piece(55, 0, 30)], 2, 100, 1000), ReadPlan { direct: None, buffered: vec![110..170] });
        // CYCLIC-like: the old part's elements are not one run.
        let cyclic = [piece(0, 0, 50), piece(100, 50, 50)];
        assert_eq!(plan_reads(&cyclic, 2, 100, 1000), ReadPlan { direct: None, buffered: vec![0..300] });
        // One run in the old part, two places in the new.
        let split = [piece(0, 0, 100), piece(100, 500, 100)];
        assert_eq!(plan_reads(&split, 2, 100, 1000), ReadPlan { direct: None, buffered: vec![0..400] });
        assert_eq!(plan_reads(&[], 2, 100, 1000), ReadPlan { direct: None, buffered: vec![] });
    }

    #[test]
    fn a_plan_covers_its_pieces_exactly_with_direct_reads_on_whole_chunks() {
        let (chunk, esize, len) = (64u64, 4u64, 4000u64);
        for start in (0..len / esize).step_by(7) {
            for count in [1u64, 3, 16, 17, 40, 200] {
                let count = count.min(len / esize - start);
                let plan = plan_reads(&[piece(start, 9, count)], esize, chunk, len);
                let mut covered: Vec<std::ops::Range<u64>> = plan.buffered.clone();
                if let Some((range, to)) = &plan.direct {
                    assert_eq!(range.start % chunk, 0, "{plan:?}");
                    assert!(range.end % chunk == 0 || range.end == len, "{plan:?}");
                    assert_eq!(*to, 9 * esize + (range.start - start * esize), "{plan:?}");
                    covered.push(range.clone());
                }
                covered.sort_by_key(|r| r.start);
                let mut at = start * esize;
                for r in covered {
                    assert_eq!(r.start, at, "{start}+{count}: {plan:?}");
                    at = r.end;
                }
                assert_eq!(at, (start + count) * esize, "{start}+{count}: {plan:?}");
            }
        }
    }

    #[test]
    fn old_ranks_are_read_in_groups_bounded_by_count_and_bytes() {
        assert_eq!(read_groups(&[]), Vec::<std::ops::Range<usize>>::new());
        let mib = 1 << 20;
        assert_eq!(read_groups(&[mib; 10]), vec![0..4, 4..8, 8..10]);
        // 256 MiB spans: two fit the byte bound.
        assert_eq!(read_groups(&[256 * mib; 5]), vec![0..2, 2..4, 4..5]);
        // One rank larger than the bound is read alone, never skipped.
        assert_eq!(read_groups(&[mib, 2048 * mib, mib]), vec![0..1, 1..2, 2..3]);
        let sizes = [100 * mib, 300 * mib, 200 * mib, 10 * mib, 10 * mib];
        let groups = read_groups(&sizes);
        assert_eq!(groups.iter().flat_map(|g| g.clone()).collect::<Vec<_>>(), (0..sizes.len()).collect::<Vec<_>>());
        for group in groups {
            assert!(group.len() <= PARALLEL_OLD_RANKS);
            assert!(group.len() == 1 || sizes[group].iter().sum::<u64>() <= PARALLEL_READ_BYTES);
        }
    }
}
