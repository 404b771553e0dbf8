//! Restart and restore: fetching the newest complete version (from the
//! agent, the node segment or the PFS), and reading labels into the
//! application's memory with each chunk verified against the manifest.

use super::*;
use icheck_core::fabric::ProgressMode;
use icheck_core::format::first_bad_chunk;
use icheck_core::handoff::VersionFiles;
use icheck_core::protocol::DeliverSegment;
use icheck_core::verified::{read_checked_into, CheckedRange};

/// Bytes the agent writes per `Deliver` (`restore = "push"`): eight
/// checksum chunks. The rank checks one step while the agent writes the
/// next, so only the last step's check is not hidden behind the transfer.
const DELIVER_STEP: usize = 8 * CHUNK_BYTES;

/// A version `restart` exposed at the agent; `restore` reads labels from it
/// straight into the caller's memory.
pub(super) struct Restored {
    pub(super) manifest: Manifest,
    pub(super) data: RestoredData,
}

/// Where the bytes of a restarted version are.
pub(super) enum RestoredData {
    /// At this rank's agent until `FetchDone`: exposed for reading over the
    /// fabric, or (an agent on this host) as the version's files.
    Agent(ReadFrom),
    /// SHMR: in the node segment, read and verified by the node leader;
    /// labels are named `<rank>/<label>` there.
    Segment,
    /// Fallback: this rank's data, read and verified from the PFS.
    Local(Vec<u8>),
    /// Written by another process count: `restore` reads each label's
    /// pieces from the old ranks (`resize.rs`).
    Resized(Resized),
}

/// Reads `out.len()` bytes at `remote_offset` of `region` into `out` in one
/// batch, checking each chunk against `crcs` (one per `chunk` bytes of
/// `out`) as soon as it has arrived, while it is still in the last-level
/// cache ([`icheck_core::verified`]; 64 MiB steps checked from memory made a
/// 256 MiB restore over tcp 0.65-0.75 of raw `fi_read`, 4 MiB chunks
/// 0.83-0.96). Returns the first bad chunk. `spare_core`: this process
/// has a core beside its own for a checking thread (see the staging rule
/// below).
#[allow(clippy::too_many_arguments)]
pub(super) fn read_and_verify(
    endpoint: &Endpoint,
    peer: &Peer,
    region: RemoteRegion,
    remote_offset: u64,
    out: &mut [u8],
    chunk: usize,
    crcs: &[u32],
    staging: &RestoreStaging,
    spare_core: bool,
) -> Result<Option<usize>> {
    if chunk != CHUNK_BYTES {
        return Ok(Some(0));
    }
    if out.is_empty() {
        return Ok(None);
    }
    // Over shm into memory just past the agent's bytes' place in a page:
    // staged where this CPU copies slowly there, and also where a core is
    // spare for the staging's checking thread. Over shm the reader copies
    // the bytes itself (`process_vm_readv` in its post), so a direct read
    // copies and checks on one thread, while the staged one checks and
    // copies out on another core. On an Intel Xeon without the slow copy
    // (2026-11-28, `commit-bench --providers shm`, three runs each) one
    // rank of 256 MiB on two cores restored at 0.75-0.82 of raw `fi_read`
    // staged and 0.50-0.58 direct, while four ranks on two cores (no core
    // spare, and the extra copy competes with the others' reads) restored
    // at 0.75-0.88 staged and 0.94-1.26 direct.
    let staged = icheck_core::kernel_copy::worth_placing_on_a_slow_cpu(out.as_ptr(), remote_offset, out.len())
        && (spare_core || icheck_core::kernel_copy::copies_slowly_behind_the_source());
    if endpoint.provider() == "shm" && staged {
        let mut buffer = staging.take();
        let read = read_staged_and_verify(endpoint, peer, region, remote_offset, out, crcs, &mut buffer);
        staging.give_back(buffer);
        return read;
    }
    // SAFETY: `out` stays borrowed, alive and unmoved until the registration
    // is dropped at the end of this function.
    let local = unsafe { endpoint.register_raw(out.as_mut_ptr(), out.len(), Access::LOCAL)? };
    let range = CheckedRange { remote: region, remote_offset, local_offset: 0, len: out.len(), crcs };
    // SAFETY: `out` is borrowed exclusively for the whole call, and `local`
    // registers exactly it.
    Ok(unsafe { read_checked_into(endpoint, peer, &local, range) }?)
}

/// Chunks [`read_staged_and_verify`] stages at once: one is read while the
/// chunk before it is checked and copied out, and one more lets the reader
/// run ahead when a check is late. Few, because a restarted process's
/// staging buffer is new memory whose every page is faulted in by the first
/// read into it (32 MiB of slots, as eight were, cost a 256 MiB restore
/// over shm 73–80 ms against 54–65 with two).
const STAGED_SLOTS: usize = 3;

/// Bytes of [`read_staged_and_verify`]'s staging buffer.
const STAGE: usize = STAGED_SLOTS * CHUNK_BYTES;

/// The staging buffer of [`read_staged_and_verify`], kept from label to
/// label of one restart: a new one's pages are faulted in by the reads, a
/// kept one's only once. Let go when the restart is released (the next
/// commit, or finalize). A restore that finds it in use by another thread
/// stages through a buffer of its own.
#[derive(Default)]
pub(super) struct RestoreStaging(std::sync::Mutex<Option<icheck_core::kernel_copy::PlacedBuffer>>);

impl RestoreStaging {
    fn take(&self) -> icheck_core::kernel_copy::PlacedBuffer {
        let kept = self.0.try_lock().ok().and_then(|mut kept| kept.take());
        kept.unwrap_or_else(|| icheck_core::kernel_copy::PlacedBuffer::new(STAGE))
    }

    fn give_back(&self, buffer: icheck_core::kernel_copy::PlacedBuffer) {
        if let Ok(mut kept) = self.0.try_lock() {
            *kept = Some(buffer);
        }
    }

    /// Frees the kept buffer.
    pub(super) fn release(&mut self) {
        *self.0.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }
}

/// [`read_and_verify`] over `shm` into memory just past the agent's bytes'
/// place in a page: the provider copies a read with `process_vm_readv`,
/// which is the kernel's slow copy there (`icheck_core::kernel_copy`;
/// `fabric-bench --local-offset 16`: 1.25–1.88 against 2.96–3.14 GB/s
/// page-aligned). Each chunk is read into one of [`STAGED_SLOTS`] slots of
/// a registered buffer placed like the source; another thread checks it
/// there and copies it into `out` while it is in the cache, and hands the
/// slot back, while this one reads the next chunks into the other slots.
/// (The agent's pushed writes over shm were tried the same way and came
/// out no faster, so `deliver_and_verify` writes into `out` directly.)
///
/// A slot the checker has just read may sit in the other core's cache,
/// where taking it back for the next read costs little at times and at
/// others triples the reader's copy ([`EvictionProbe`]): each read of a
/// long label measures both ways early on and keeps the faster.
fn read_staged_and_verify(
    endpoint: &Endpoint,
    peer: &Peer,
    region: RemoteRegion,
    remote_offset: u64,
    out: &mut [u8],
    crcs: &[u32],
    staging: &mut icheck_core::kernel_copy::PlacedBuffer,
) -> Result<Option<usize>> {
    if crcs.len() != out.len().div_ceil(CHUNK_BYTES) {
        return Ok(Some(0));
    }
    // Every chunk starts a whole number of pages after the first, and so
    // does every slot: one placement serves them all.
    let buffer = staging.placed(remote_offset, STAGE);
    let slots = buffer.as_mut_ptr() as usize;
    // SAFETY: `buffer` lives in `staging`, borrowed for the whole function
    // (the registration is dropped at its end), and nothing but the reads
    // below and the checks and copies out of what they read touches it.
    let local = unsafe { endpoint.register_raw(buffer.as_mut_ptr(), STAGE, Access::LOCAL)? };
    let (chunks, total) = (crcs.len(), out.len());
    let (to_check, arrived) = std::sync::mpsc::sync_channel::<(usize, usize, bool)>(STAGED_SLOTS);
    let (to_reuse, free) = std::sync::mpsc::sync_channel::<usize>(STAGED_SLOTS);
    for slot in 0..STAGED_SLOTS {
        let _ = to_reuse.send(slot);
    }
    std::thread::scope(|scope| {
        let checker = scope.spawn(move || {
            for (chunk, slot, evict) in arrived {
                let place = &mut out[chunk * CHUNK_BYTES..((chunk + 1) * CHUNK_BYTES).min(total)];
                // SAFETY: the slot holds a completely read chunk, and the
                // reader writes it again only after it comes back through
                // `to_reuse` below.
                let bytes =
                    unsafe { std::slice::from_raw_parts((slots + slot * CHUNK_BYTES) as *const u8, place.len()) };
                if first_bad_chunk(bytes, &crcs[chunk..=chunk]).is_some() {
                    return Some(chunk);
                }
                place.copy_from_slice(bytes);
                if evict {
                    icheck_core::kernel_copy::evict_from_caches(bytes);
                }
                // A reader that stopped (an error) takes no slot back.
                let _ = to_reuse.send(slot);
            }
            None
        });
        let mut probe = EvictionProbe::new(chunks, icheck_core::kernel_copy::can_evict_from_caches());
        let read = (|| -> Result<()> {
            for chunk in 0..chunks {
                // A checker that stopped (a bad chunk) takes no more.
                let Ok(slot) = free.recv() else { return Ok(()) };
                let len = CHUNK_BYTES.min(total - chunk * CHUNK_BYTES);
                let op = RmaOp {
                    local_offset: slot * CHUNK_BYTES,
                    remote: region,
                    remote_offset: remote_offset + (chunk * CHUNK_BYTES) as u64,
                    len,
                };
                // SAFETY: the slot was handed back (or never handed out):
                // the checker no longer reads it, and nothing else uses the
                // buffer `local` registers.
                let target = unsafe { local.target_unchecked() };
                let started = Instant::now();
                endpoint.read(peer, target, &[op], &TransferOptions::default())?;
                if let Some(evict) = probe.read_took(chunk, started.elapsed()) {
                    tracing::debug!(
                        evict,
                        without = ?probe.without,
                        with = ?probe.with,
                        "staged reads: chose whether the checker evicts each slot from its cache"
                    );
                }
                if to_check.send((chunk, slot, probe.evict_after(chunk))).is_err() {
                    return Ok(());
                }
            }
            Ok(())
        })();
        drop(to_check);
        let refused = checker.join().unwrap_or(Some(0));
        read.map(|()| refused)
    })
}

/// Chooses, during one [`read_staged_and_verify`], whether the checker
/// evicts each slot from its cache once it has copied the chunk out
/// ([`icheck_core::kernel_copy::evict_from_caches`]), by measuring both.
///
/// On this project's two-core virtual machines a read into a slot the
/// checker has just read took 0.5–1.1 ms per 4 MiB for minutes, then
/// 1.1–2.3 ms for minutes (the first reads, into slots no checker had
/// read, 0.45–0.6 ms all along): a 256 MiB restore took 35–66 ms
/// (mostly under 50) or 97–126. With every slot evicted it took 46–83 ms
/// (mostly 50–65) either way. So the reads into the slots' second use
/// (chunks S..2S, S = [`STAGED_SLOTS`]) are
/// timed without eviction, those into their third use (2S..3S) with it,
/// and eviction stays on for the rest only where it made them at least a
/// fifth faster. Labels too short to measure (fewer than 4S chunks) are
/// read without it, and a change of mode after the decision is not
/// followed.
///
/// Architecture invariant: eviction never changes the bytes; only the
/// time a read takes decides it.
#[derive(Debug)]
struct EvictionProbe {
    measuring: bool,
    without: Duration,
    with: Duration,
    decided: Option<bool>,
}

impl EvictionProbe {
    fn new(chunks: usize, can_evict: bool) -> EvictionProbe {
        let measuring = can_evict && chunks >= 4 * STAGED_SLOTS;
        EvictionProbe { measuring, without: Duration::ZERO, with: Duration::ZERO, decided: None }
    }

    /// Whether the checker evicts the slot of `chunk` after copying it out:
    /// never for the slots' first use (their second-use reads measure
    /// without), always while measuring after that, then as decided.
    fn evict_after(&self, chunk: usize) -> bool {
        match self.decided {
            Some(decided) => decided,
            None => self.measuring && chunk >= STAGED_SLOTS,
        }
    }

    /// Records how long the read of `chunk` took; returns the decision
    /// when this read completes the measurement.
    fn read_took(&mut self, chunk: usize, took: Duration) -> Option<bool> {
        if !self.measuring || self.decided.is_some() {
            return None;
        }
        match chunk / STAGED_SLOTS {
            1 => self.without += took,
            2 => self.with += took,
            _ => {}
        }
        if chunk + 1 == 3 * STAGED_SLOTS {
            let evict = self.with * 5 < self.without * 4;
            self.decided = Some(evict);
            return Some(evict);
        }
        None
    }
}

/// `restore = "push"`: the agent writes `out.len()` bytes at
/// `file_offset` of the fetched version into `out`, in steps of
/// [`DELIVER_STEP`] with the next step always queued at the agent; each
/// step is checked against `crcs` (one per `chunk` bytes of `out`) once
/// the agent said it is delivered, while the next moves. Returns the first
/// bad chunk.
pub(super) fn deliver_and_verify(
    endpoint: &Endpoint,
    link: &AgentLink,
    file_offset: u64,
    out: &mut [u8],
    chunk: usize,
    crcs: &[u32],
) -> Result<Option<usize>> {
    if chunk != CHUNK_BYTES || crcs.len() != out.len().div_ceil(CHUNK_BYTES) {
        return Ok(Some(0));
    }
    if out.is_empty() {
        return Ok(None);
    }
    let base = out.as_mut_ptr();
    // SAFETY: `out` stays borrowed, alive and unmoved until the registration
    // is dropped at the end of this function, after every Deliver sent has
    // been answered (the agent writes nothing into it after that).
    let local = unsafe { endpoint.register_raw(base, out.len(), Access::REMOTE_WRITE)? };
    let destination = local.remote();
    let steps: Vec<(usize, usize)> =
        (0..out.len()).step_by(DELIVER_STEP).map(|start| (start, (start + DELIVER_STEP).min(out.len()))).collect();
    let request = |(start, end): (usize, usize)| {
        AgentRequest::Deliver(vec![DeliverSegment {
            destination,
            destination_offset: start as u64,
            file_offset: file_offset + start as u64,
            len: (end - start) as u64,
        }])
    };
    // The rank's endpoint is the target of the agent's writes: over tcp it
    // receives them, over shm it copies them (delivery completion).
    let progress = ProgressThread::spawn(endpoint, ProgressMode::Spin)
        .map_err(|e| link.error(format!("cannot start a progress thread: {e}")))?;
    link.expect_bytes(DELIVER_STEP as u64 * 2);
    let mut sent = 0;
    let mut answered = 0;
    let mut outcome = Ok(None);
    while answered < steps.len() {
        // Two requests outstanding: the agent starts the next step as soon
        // as it has answered one.
        while sent < steps.len() && sent < answered + 2 {
            if let Err(err) = link.send(&request(steps[sent])) {
                outcome = Err(err);
                break;
            }
            sent += 1;
        }
        if outcome.is_err() {
            break;
        }
        match link.receive(&request(steps[answered])) {
            Ok(AgentReply::Delivered { .. }) => {}
            Ok(other) => {
                outcome = Err(link.error(format!("unexpected answer to Deliver: {other:?}")));
                answered += 1;
                break;
            }
            Err(err) => {
                outcome = Err(err);
                answered += 1;
                break;
            }
        }
        let (start, end) = steps[answered];
        answered += 1;
        // SAFETY: the agent's writes into start..end completed (delivery
        // completion) before it answered, and no later step writes these
        // bytes; the caller holds `out` exclusively.
        let bytes = unsafe { std::slice::from_raw_parts(base.add(start).cast_const(), end - start) };
        let first = start / CHUNK_BYTES;
        if let Some(bad) = first_bad_chunk(bytes, &crcs[first..first + (end - start).div_ceil(CHUNK_BYTES)]) {
            outcome = Ok(Some(first + bad));
            break;
        }
    }
    // Nothing may still be writing into `out` once it is deregistered and
    // handed back: the answers to the steps already sent are awaited (a
    // connection that fails here is stale, and the next request reopens it).
    for step in &steps[answered..sent] {
        if let Err(err) = link.receive(&request(*step)) {
            tracing::debug!(%err, "no answer to an outstanding Deliver");
            break;
        }
    }
    progress.stop();
    drop(local);
    link.expect_bytes(0);
    outcome
}

/// Where a fetched version's bytes are read from.
pub(super) enum ReadFrom {
    /// The agent's registered memory, over the fabric.
    Fabric(RemoteRegion),
    /// The version's files, handed over by an agent on this host.
    Files(VersionFiles),
}

/// Asks `link`'s agent for `wanted.version` and checks the answer. With
/// `same_host` (`restore = "auto"`) the rank names its host, and an agent on
/// the same host hands over the version's files; one the rank cannot take
/// is fetched again over the fabric (the agent started no reads for the
/// first fetch). Returns the manifest, where to read, and the damage the
/// agent reported.
pub(super) fn fetch_version(
    link: &mut AgentLink,
    wanted: FetchWanted<'_>,
    same_host: bool,
) -> Result<(Manifest, ReadFrom, Option<String>)> {
    let version = wanted.version;
    let reader = if same_host { HostId::current() } else { None };
    let reply = link.fetch(version, reader)?;
    // From the agent: checked before any offset in it is used.
    let Fetched { manifest, region, damaged, handoff } =
        check_fetched(reply, wanted).map_err(|e| link.error(format!("version {version}: {e}")))?;
    let source = match handoff.map(|mut handoff| {
        // A test's way to make the agent refuse the ticket for real.
        if icheck_core::failpoint::fails("client.take_files") {
            handoff.ticket.0[0] ^= 1;
        }
        icheck_core::handoff::take_files(&handoff, manifest.total_len)
    }) {
        None => ReadFrom::Fabric(region),
        Some(Ok(files)) => {
            tracing::debug!(version, "the agent on this host handed over the version's files");
            ReadFrom::Files(files)
        }
        Some(Err(err)) => {
            tracing::warn!(version, %err, "cannot take the version's files from the agent on this host; reading over the fabric");
            let reply = link.fetch(version, None)?;
            let fetched = check_fetched(reply, wanted).map_err(|e| link.error(format!("version {version}: {e}")))?;
            if fetched.manifest != manifest {
                return Err(link.error(format!("version {version}: the manifest changed between two fetches")));
            }
            ReadFrom::Fabric(fetched.region)
        }
    };
    Ok((manifest, source, damaged))
}

/// Reads `out.len()` bytes at `file_offset` of a version whose files an
/// agent on this host handed over, on `threads` threads, checking each
/// chunk against `crcs` (one per `chunk` bytes of `out`) as it is read.
/// Returns the first bad chunk.
pub(super) fn read_files_and_verify(
    files: &VersionFiles,
    file_offset: u64,
    out: &mut [u8],
    chunk: usize,
    crcs: &[u32],
    threads: usize,
) -> Result<Option<usize>> {
    if chunk != CHUNK_BYTES {
        return Ok(Some(0));
    }
    let read_at = |buf: &mut [u8], offset: u64| files.read_exact_at(buf, offset);
    icheck_core::verified::read_file_checked(&read_at, file_offset, out, crcs, threads)
        .map_err(|err| Error::Unsupported(format!("reading the version's files handed over by the agent: {err}")))
}

impl Icheck {
    /// Prepares a restart from the newest complete version (*collective*):
    /// this rank's agent exposes its data, and `restore` / `restore_all`
    /// then read each label straight into the caller's memory, verifying its
    /// checksums. Returns the version.
    ///
    /// When the newest version cannot be read (a PFS file damaged or
    /// missing), the restart logs why, naming the file, and falls back to
    /// the previous complete version on the PFS.
    pub fn restart(&mut self) -> Result<u64> {
        self.check_open()?;
        let started = Instant::now();
        let restarted = self.restart_newest_readable();
        tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, ok = restarted.is_ok(), "restart prepared");
        restarted
    }

    /// [`restart`](Self::restart) after its check.
    fn restart_newest_readable(&mut self) -> Result<u64> {
        self.wait()?;
        self.release_restart();
        let newest = self.restart_record()?;
        let size = self.comm.size();
        let mut candidates = vec![newest.version];
        if let Some(pfs) = &self.pfs {
            let older = pfs.versions(&self.app).unwrap_or_default();
            candidates.extend(older.into_iter().rev().filter(|v| *v < newest.version));
        }
        let last = candidates.len() - 1;
        for (tried, version) in candidates.into_iter().enumerate() {
            // The process count that wrote it: recorded for the newest; an
            // older PFS version's manifest is read only if it comes to that.
            let written = match (&self.pfs, version == newest.version) {
                (Some(pfs), false) => pfs.manifest(&self.app, version).map_or(newest.ranks, |m| m.ranks),
                _ => newest.ranks,
            };
            let result = match (&self.fallback, self.mode) {
                _ if written != size => self.fetch_resized(version, written),
                (Some(_), _) => self.fetch_fallback(version),
                (None, TransferMode::Mr) => self.fetch(version),
                (None, TransferMode::Shmr) => self.fetch_shmr(version),
            };
            // Every rank learns whether all could fetch intact data: one
            // damaged or missing rank moves the whole job to the next
            // candidate together, instead of leaving the others in their
            // next collective.
            let damaged = self.restart_damage.take();
            let all_ok = self.comm.all_true(result.is_ok() && damaged.is_none());
            if all_ok {
                if tried > 0 && self.comm.rank() == 0 {
                    tracing::warn!(
                        version,
                        newest = newest.version,
                        "restarted from an older complete version: the newer ones could not be read on every rank"
                    );
                }
                return result;
            }
            if tried == last {
                if let (Some(damage), Ok(_), 1) = (&damaged, &result, size) {
                    // A job of one process has nobody to wait for it: it
                    // restarts from the damaged version, whose damaged labels
                    // `restore` refuses while the intact ones restore.
                    tracing::error!(version, %damage, "no older version to fall back to");
                    return result;
                }
                result?;
                let detail = damaged.unwrap_or_else(|| "another rank could not fetch intact data".into());
                return Err(self.incomplete(version, detail));
            }
            if let Err(err) = &result {
                tracing::error!(version, %err, "cannot restart from this version; trying the previous complete one");
            } else if self.comm.rank() == 0 {
                tracing::error!(
                    version,
                    "another rank cannot restart from this version; trying the previous complete one"
                );
            }
            self.release_restart();
        }
        unreachable!("the last candidate returns")
    }

    /// Bytes of the newest complete version over all ranks (what bounds
    /// the wait for one rank's share of it).
    pub(super) fn version_bytes(&self) -> u64 {
        self.latest.as_ref().map_or(0, |l| l.bytes)
    }

    /// The version a restart fetches, if this run can restore it.
    pub(super) fn restart_record(&self) -> Result<VersionRecord> {
        self.latest.clone().ok_or_else(|| Error::NoCheckpoint(self.app.clone()))
    }

    pub(super) fn fetch(&mut self, version: u64) -> Result<u64> {
        let wanted = FetchWanted { app: &self.app, rank: self.comm.rank(), version };
        let bytes = self.version_bytes();
        let same_host = self.restore_same_host;
        let link = self.link.as_mut().ok_or(Error::Order("no agent session (an earlier failure closed it)"))?;
        // A crash here: the rank dies in the middle of a restart.
        icheck_core::failpoint::hit("client.before_fetch");
        // The agent may check (or read from the PFS) the whole version first.
        link.expect_bytes(bytes);
        let (manifest, from, damaged) = fetch_version(link, wanted, same_host)?;
        self.restart_damage = damaged;
        self.restored = Some(Restored { manifest, data: RestoredData::Agent(from) });
        Ok(version)
    }

    /// This process's share of the node's cores for reading handed-over
    /// files: its neighbours restore at the same time.
    pub(super) fn read_threads(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (_, on_this_node) = self.comm.node_counts();
        (cores / on_this_node.max(1) as usize).max(1)
    }

    /// Tells the agent the restart data is no longer needed.
    pub(super) fn release_restart(&mut self) {
        self.restore_staging.release();
        if self.restored.take().is_some_and(|r| matches!(r.data, RestoredData::Agent(_))) {
            if let Some(link) = self.link.as_mut() {
                if let Err(err) = link.fetch_done() {
                    tracing::warn!(%err, "agent did not acknowledge the end of a restart");
                }
            }
        }
    }

    pub(super) fn restored_label(&self, label: &str) -> Result<(&Restored, usize)> {
        let restored = self.restored.as_ref().ok_or(Error::Order("restore needs a successful restart() first"))?;
        let key = match restored.data {
            RestoredData::Segment => format!("{}/{label}", self.comm.rank()),
            _ => label.to_string(),
        };
        let index = restored.manifest.labels.iter().position(|l| l.label == key).ok_or_else(|| {
            Error::UnknownLabel { label: label.to_string(), detail: "not in the restarted checkpoint" }
        })?;
        Ok((restored, index))
    }

    /// Restores `label` into `out`, its pages populated ahead of the
    /// transfer ([`prefault`]) where the configuration allows.
    pub(super) fn restore_bytes(&self, label: &str, kind: DataKind, out: &mut [u8]) -> Result<()> {
        prefault::ahead_of(out, self.prefault, |out| self.restore_label(label, kind, out))
    }

    fn restore_label(&self, label: &str, kind: DataKind, out: &mut [u8]) -> Result<()> {
        if let Some(tracking) = &self.tracking {
            // The bytes may arrive by DMA, which page tracking cannot see.
            tracking.restored.store(true, std::sync::atomic::Ordering::Release);
        }
        let (restored, index) = self.restored_label(label)?;
        let layout = &restored.manifest.labels[index];
        if let RestoredData::Resized(resized) = &restored.data {
            return self.restore_resized(restored.manifest.version, resized.written, layout, kind, out);
        }
        // Replicated attributes that are not "read my own value back", and
        // MANUAL arrays, which go whole to their root whatever the count.
        match &layout.adapt {
            Some(Adapt::Global { layout: GlobalLayout::Manual { .. }, .. }) => {
                if self.mode == TransferMode::Shmr {
                    return Err(Error::Adapt {
                        label: label.into(),
                        detail: "MANUAL arrays need MR mode (SHMR keeps one file per node)".into(),
                    });
                }
                return self.restore_resized(restored.manifest.version, self.comm.size(), layout, kind, out);
            }
            Some(Adapt::Replicated(Attribute::Default { value, joining_only: false })) if layout.kind == kind => {
                resize::fill(out, value);
                return Ok(());
            }
            Some(Adapt::Replicated(Attribute::Volatile)) => return self.recalculate(label, self.comm.size(), out),
            _ => {}
        }
        if layout.len != out.len() as u64 {
            return Err(Error::SizeMismatch { label: label.to_string(), stored: layout.len, given: out.len() as u64 });
        }
        if layout.kind != kind {
            return Err(Error::KindMismatch { label: label.to_string(), stored: layout.kind, given: kind });
        }
        let start = layout.offset as usize;
        let from = match &restored.data {
            RestoredData::Agent(from) => from,
            // Verified when read from the PFS.
            RestoredData::Local(bytes) => {
                out.copy_from_slice(&bytes[start..start + out.len()]);
                return Ok(());
            }
            // Verified by the node leader when it filled the segment.
            RestoredData::Segment => {
                let segment = self.segment.as_ref().ok_or(Error::Order("the SHMR segment is gone"))?;
                out.copy_from_slice(&segment.as_slice()[start..start + out.len()]);
                return Ok(());
            }
            RestoredData::Resized(_) => unreachable!("handled above"),
        };
        let link = self.link.as_ref().ok_or(Error::Order("no agent session"))?;
        let manifest = &restored.manifest;
        let span =
            tracing::debug_span!("restore", app = %self.app, rank = manifest.rank, version = manifest.version, label);
        let _entered = span.enter();
        let started = Instant::now();
        let chunk = manifest.chunk_size as usize;
        let crcs = &manifest.crcs[index];
        let bad = match (from, self.restore_direction) {
            (ReadFrom::Files(files), _) => {
                read_files_and_verify(files, layout.offset, out, chunk, crcs, self.read_threads())
            }
            (ReadFrom::Fabric(_), RestoreDirection::Push) => {
                deliver_and_verify(&self.endpoint, link, layout.offset, out, chunk, crcs)
            }
            (ReadFrom::Fabric(region), _) => {
                let (staging, spare_core) = (&self.restore_staging, self.read_threads() > 1);
                let peer = link.read_peer();
                read_and_verify(&self.endpoint, peer, *region, layout.offset, out, chunk, crcs, staging, spare_core)
            }
        }
        .map_err(|err| match err {
            Error::Fabric(err) => link.error(format!("reading label {label:?}: {err}")),
            other => other,
        })?;
        if let Some(bad) = bad {
            let start = (bad * chunk) as u64;
            return Err(Error::Corrupt {
                version: manifest.version,
                rank: manifest.rank,
                start,
                end: (start + chunk as u64).min(layout.len),
                labels: format!("{label:?}"),
            });
        }
        tracing::debug!(bytes = out.len(), ms = started.elapsed().as_secs_f64() * 1e3, "restored");
        Ok(())
    }

    /// Bytes label `label` holds in the restarted checkpoint, so callers can
    /// size their memory before `restore`.
    pub fn restored_len(&self, label: &str) -> Result<u64> {
        let (restored, index) = self.restored_label(label)?;
        let layout = &restored.manifest.labels[index];
        match restored.data {
            RestoredData::Resized(_) => Ok(self.local_count(label)? * layout.kind.size() as u64),
            _ => Ok(layout.len),
        }
    }

    /// Element type of label `label` in the restarted checkpoint.
    pub fn restored_kind(&self, label: &str) -> Result<DataKind> {
        let (restored, index) = self.restored_label(label)?;
        Ok(restored.manifest.labels[index].kind)
    }

    /// The process count that wrote the version `restart` fetched (which
    /// may differ from this run's), or `None` before a restart.
    pub fn restarted_from(&self) -> Option<u32> {
        let restored = self.restored.as_ref()?;
        Some(match &restored.data {
            RestoredData::Resized(resized) => resized.written,
            // Anything else was written by this run's count.
            _ => self.comm.size(),
        })
    }

    /// Whether `restart` has fetched a version that `restore` can read.
    pub fn has_restarted(&self) -> bool {
        self.restored.is_some()
    }

    /// Reads label `label` of the restarted version into `region`, whose
    /// length and element type must match the checkpoint's. The bytes are
    /// checked against the checksums the committing rank computed; on a
    /// mismatch the error names the label and byte range.
    pub fn restore<T: Element>(&self, label: &str, region: &Region<T>) -> Result<()> {
        self.restore_bytes(label, T::KIND, as_bytes_mut(&mut region.write()))
    }

    /// Reads label `label` into a plain slice.
    pub fn restore_into<T: Element>(&self, label: &str, out: &mut [T]) -> Result<()> {
        self.restore_bytes(label, T::KIND, as_bytes_mut(out))
    }

    /// Reads label `label` into raw memory of `len` bytes.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes.
    pub unsafe fn restore_raw(&self, label: &str, ptr: *mut u8, len: usize, kind: DataKind) -> Result<()> {
        // SAFETY: the caller guarantees ptr/len.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        self.restore_bytes(label, kind, out)
    }

    /// Restores every added label into its region.
    pub fn restore_all(&self) -> Result<()> {
        for label in &self.labels {
            let mut bytes = label.source.bytes_mut();
            self.restore_bytes(&label.name, label.source.kind(), &mut bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::fabric::{AlignedBuffer, Domain, FabricConfig};
    use icheck_core::format::chunk_crcs;

    /// `len` bytes of `backing` starting `past` bytes after a page boundary.
    fn placed(backing: &mut [u8], past: usize, len: usize) -> &mut [u8] {
        let skip = (4096 - backing.as_ptr() as usize % 4096) % 4096 + past;
        &mut backing[skip..skip + len]
    }

    /// A pulled restore over shm into memory 16 bytes past a page (the
    /// staged path: a `malloc`ed array read from a page-aligned offset) is
    /// bit-exact and names the first damaged chunk, as the direct one is.
    #[test]
    fn a_staged_pull_over_shm_is_bit_exact_and_names_damage() {
        let domain = match Domain::open(&FabricConfig::provider("shm")) {
            Ok(domain) => domain,
            Err(err) => panic!("libfabric's shm provider is part of the test setup: {err}"),
        };
        let agent = Endpoint::new(&domain).unwrap();
        let rank = Endpoint::new(&domain).unwrap();
        // Thirteen and a half chunks: every slot used again and again, long
        // enough for the eviction probe (slots evicted while it measures),
        // the last chunk short.
        let len = 4 * STAGE + CHUNK_BYTES * 3 / 2;
        assert!(EvictionProbe::new(len.div_ceil(CHUNK_BYTES), true).measuring);
        let data: Vec<u8> = (0..len).map(|i| (i * 29 % 253) as u8).collect();
        let crcs = chunk_crcs(&data);
        let mut stored = AlignedBuffer::zeroed(len + 4096);
        stored.as_mut_slice()[4096..].copy_from_slice(&data);
        let stored = agent.register(stored, Access::REMOTE_READ).unwrap();
        let _progress = ProgressThread::spawn(&agent, ProgressMode::Spin).unwrap();
        let peer = rank.insert_peer(agent.address()).unwrap();
        let mut backing = vec![0u8; len + 8192];
        let staging = RestoreStaging::default();
        for past in [16, 0] {
            let out = placed(&mut backing, past, len);
            assert_eq!(icheck_core::kernel_copy::is_slow(out.as_ptr(), 4096), past == 16);
            // Staged with a core spare; without one, staged only if this
            // CPU copies slowly there.
            for spare_core in [true, false] {
                out.fill(0);
                let read =
                    read_and_verify(&rank, &peer, stored.remote(), 4096, out, CHUNK_BYTES, &crcs, &staging, spare_core);
                assert_eq!(read.unwrap(), None, "{past} bytes past a page");
                assert!(*out == data[..], "{past} bytes past a page");
            }
        }
        // Staged directly.
        let out = placed(&mut backing, 16, len);
        out.fill(0);
        // The staging buffer a read above kept (or a new one).
        let mut buffer = staging.take();
        let bad = read_staged_and_verify(&rank, &peer, stored.remote(), 4096, out, &crcs, &mut buffer).unwrap();
        assert_eq!(bad, None);
        assert!(*out == data[..]);
        // Damage in a slot's second use (measured, its slot evicted), and
        // in its fourth (named by its place in `out`, not in the slot).
        for damaged in [4, 9] {
            let mut wrong = crcs.clone();
            wrong[damaged] ^= 1;
            let out = placed(&mut backing, 16, len);
            let bad = read_staged_and_verify(&rank, &peer, stored.remote(), 4096, out, &wrong, &mut buffer).unwrap();
            assert_eq!(bad, Some(damaged));
            for spare_core in [true, false] {
                let read = read_and_verify(
                    &rank,
                    &peer,
                    stored.remote(),
                    4096,
                    out,
                    CHUNK_BYTES,
                    &wrong,
                    &staging,
                    spare_core,
                );
                assert_eq!(read.unwrap(), Some(damaged), "spare core {spare_core}");
            }
        }
    }

    fn tenths_of_ms(n: u64) -> Duration {
        Duration::from_micros(n * 100)
    }

    /// Feeds the probe reads of `without` and then `with` (tenths of a ms)
    /// for the slots' second and third use; returns what it evicts after
    /// each chunk of a 20-chunk label and what it decided.
    fn probe(without: u64, with: u64) -> (Vec<bool>, Option<bool>) {
        let mut probe = EvictionProbe::new(20, true);
        let mut evicted = Vec::new();
        let mut decided = None;
        for chunk in 0..20 {
            let took = match chunk / STAGED_SLOTS {
                0 => tenths_of_ms(5),
                1 => tenths_of_ms(without),
                2 => tenths_of_ms(with),
                _ => tenths_of_ms(1),
            };
            if let Some(decision) = probe.read_took(chunk, took) {
                assert_eq!(chunk, 3 * STAGED_SLOTS - 1, "decided once, after the third use's reads");
                decided = Some(decision);
            }
            evicted.push(probe.evict_after(chunk));
        }
        (evicted, decided)
    }

    #[test]
    fn eviction_is_measured_both_ways_and_kept_only_where_it_is_a_fifth_faster() {
        let s = STAGED_SLOTS;
        // The slow mode: reads into slots the checker read took 1.6 ms,
        // into evicted ones 0.6.
        let (evicted, decided) = probe(16, 6);
        assert_eq!(decided, Some(true));
        assert!(evicted[..s].iter().all(|e| !e), "first use: not evicted, the second use measures without");
        assert!(evicted[s..].iter().all(|e| *e), "{evicted:?}");
        // The fast mode, and eviction only a little faster: not kept.
        for (without, with) in [(5, 6), (5, 5), (10, 9)] {
            let (evicted, decided) = probe(without, with);
            assert_eq!(decided, Some(false), "{without} vs {with}");
            assert!(evicted[s..3 * s - 1].iter().all(|e| *e), "evicted while measuring");
            assert!(evicted[3 * s - 1..].iter().all(|e| !e), "{evicted:?}");
        }
    }

    #[test]
    fn short_labels_and_cpus_that_cannot_evict_are_read_without_eviction() {
        for (chunks, can_evict) in [(4 * STAGED_SLOTS - 1, true), (100, false), (0, true)] {
            let mut probe = EvictionProbe::new(chunks, can_evict);
            for chunk in 0..chunks {
                assert_eq!(probe.read_took(chunk, tenths_of_ms(20)), None);
                assert!(!probe.evict_after(chunk), "{chunks} chunks, can evict {can_evict}");
            }
        }
    }
}
