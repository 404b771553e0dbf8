//! Commit: the blocking data paths (zero-copy, pipelined), the async path
//! and its background thread, and completing a version with the controller
//! once every rank has sealed. Every path moves its bytes through the one
//! sequence in `link.rs` (`commit_version`).

use std::sync::atomic::{AtomicBool, Ordering};

use super::direction::Measured;
use super::*;
use crate::tracking::{written_per_label, PageTracker, Written};

/// The fraction of changed blocks above which the next incremental commit
/// sends the whole version (see `commit_incremental`). Sending blocks costs
/// a checksum pass first (~0.2 of a whole commit here) and a new file for
/// them, ~1.8× a whole commit's time per byte (commit-bench's sweep), so
/// blocks win below about 0.44 of the version changed.
const MOST_CHANGED: f64 = 0.4;

/// What the last blocking zero-copy commit of this process did
/// ([`Icheck::last_commit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitStats {
    /// The version.
    pub version: u64,
    /// Bytes of the version (all labels).
    pub total_bytes: u64,
    /// Bytes that crossed the fabric (with incremental commits, the
    /// changed blocks).
    pub moved_bytes: u64,
    /// Bytes read to checksum the version: all of them, unless page
    /// tracking knew which pages were written.
    pub checksummed_bytes: u64,
    /// Whether page tracking decided what to checksum.
    pub page_tracking: bool,
}

/// Page tracking between commits (`crate::tracking`): the kernel's record
/// and what it is relative to.
pub(super) struct Tracking {
    tracker: PageTracker,
    /// The version whose commit last took the written pages, its chunk
    /// checksums, and where each of its labels was in memory, in order:
    /// the pages written since are relative to it, and mean something
    /// only for the same labels at the same places (an application that
    /// swaps two buffers between labels changes nothing in the pages).
    since: Option<Since>,
    /// Set by a restore: its bytes may have arrived by DMA, which the
    /// kernel does not see, so the next commit compares every byte.
    pub(super) restored: AtomicBool,
    /// Commits in a row whose tracking failed; at [`TRACKING_GIVES_UP`]
    /// tracking stops for the rest of the run (memory the kernel cannot
    /// track fails every time, and each failure would cost a warning and
    /// a registration).
    failures: u32,
}

/// Failed commits in a row after which page tracking stops.
const TRACKING_GIVES_UP: u32 = 3;

/// What a tracked commit leaves for the next (see `Tracking::since`).
struct Since {
    version: u64,
    chunks: Vec<Vec<u32>>,
    labels: Vec<std::ops::Range<usize>>,
}

/// What page tracking tells one commit: the bytes of each label written
/// since the version `since`, and that version's chunk checksums.
pub(super) struct WrittenSince {
    pub(super) since: u64,
    pub(super) ranges: Vec<Vec<std::ops::Range<usize>>>,
    pub(super) chunks: Vec<Vec<u32>>,
}

impl Tracking {
    /// Page tracking, or `None` (said once, with the kernel's reason)
    /// where this kernel cannot track pages.
    pub(super) fn start() -> Option<Tracking> {
        match PageTracker::new() {
            Ok(tracker) => Some(Tracking { tracker, since: None, restored: AtomicBool::new(false), failures: 0 }),
            Err(err) => {
                tracing::warn!(%err, "page tracking is off: incremental commits compare checksums");
                None
            }
        }
    }

    /// Takes the pages written since the last call over `labels` (address
    /// ranges; this protects them again, so it must be called once per
    /// commit) and says what they are relative to, if that is the version
    /// this rank sealed last (`sealed`) and no restore came between.
    fn take(&mut self, labels: &[std::ops::Range<usize>], sealed: Option<u64>) -> Option<WrittenSince> {
        let since = self.since.take();
        let restored = self.restored.swap(false, Ordering::AcqRel);
        if self.failures >= TRACKING_GIVES_UP {
            return None;
        }
        let pages = match self.tracker.take_written(labels) {
            Ok(written) => {
                self.failures = 0;
                match written {
                    Written::Pages(pages) => pages,
                    Written::Everything => return None,
                }
            }
            Err(err) => {
                self.failures += 1;
                if self.failures < TRACKING_GIVES_UP {
                    tracing::warn!(%err, "page tracking failed; this commit compares every checksum");
                } else {
                    tracing::warn!(%err, "page tracking failed at {TRACKING_GIVES_UP} commits in a row: it is off for the rest of this run");
                    // Lets go of every registered range.
                    let _ = self.tracker.take_written(&[]);
                }
                return None;
            }
        };
        let Since { version, chunks, labels: placed } = since?;
        (Some(version) == sealed && !restored && placed == labels).then(|| WrittenSince {
            since: version,
            ranges: written_per_label(&pages, labels),
            chunks,
        })
    }

    /// Records that version `version`, whose labels were at `labels` and
    /// whose chunk checksums are `chunks`, took the written pages.
    fn sealed(&mut self, version: u64, chunks: Vec<Vec<u32>>, labels: Vec<std::ops::Range<usize>>) {
        self.since = Some(Since { version, chunks, labels });
    }
}

/// How [`Icheck::record_agreed`] ended when every rank stored its part.
enum Recording {
    /// The controller recorded the version: it is complete.
    Recorded,
    /// The controller had given up the agents that hold the version and
    /// named new ones, to which every rank has moved; the error is what
    /// the commit reports unless the version is stored there too.
    Moved(Error),
}

/// What a background commit thread hands back.
pub(super) struct Background {
    pub(super) link: AgentLink,
    pub(super) staging: Option<RegisteredBuffer>,
    pub(super) result: Result<()>,
    /// An incremental commit's version, block checksums and changed
    /// fraction (what the next commit compares against).
    pub(super) blocks: Option<(u64, Vec<u32>, f64)>,
}

/// A joined background commit: version, start, bytes, its result, and
/// (MR) the layout of the staged bytes.
type Joined = (u64, Instant, u64, Result<()>, Option<Vec<LabelLayout>>);

/// Holds an async commit's background thread before its first step (the
/// comparison with the last version, then the transfer) until every rank
/// has staged its data. A rank that staged first would otherwise checksum
/// and transfer beside ranks still copying, on the cores they copy on
/// (one rank per core leaves none spare), and every rank's `commit`
/// returns only when the slowest copy ends: four ranks × 256 MiB on two
/// cores blocked for 1.2–3.6× four concurrent memcpys of their bytes
/// without the gate, 0.9–1.3× with it in 13 of 16 medians
/// (`commit-bench`). The cost: a rank that reaches `commit` early no
/// longer transfers while it waits for the others. Opens when dropped,
/// whichever way the commit goes on, so a rank that has to join the
/// thread never waits for itself.
pub(super) struct StartGate(std::sync::mpsc::Sender<()>);

impl StartGate {
    /// Lets the background thread start.
    pub(super) fn open(self) {
        drop(self.0);
    }
}

/// A background commit. Processes without a transfer of their own (SHMR
/// non-leaders) have no thread but still complete the version in `wait`.
pub(super) struct InFlight {
    pub(super) version: u64,
    pub(super) started: Instant,
    pub(super) bytes: u64,
    pub(super) handle: Option<JoinHandle<Background>>,
    /// MR: the layout of the staged bytes, so that the version can be
    /// stored again from the staging buffer on replacement agents.
    pub(super) layout: Option<Vec<LabelLayout>>,
}

pub(super) fn layouts(labels: &[Label], lens: &[usize]) -> Vec<LabelLayout> {
    let mut offset = 0u64;
    labels
        .iter()
        .zip(lens)
        .map(|(label, len)| {
            let layout = LabelLayout {
                label: label.name.clone(),
                kind: label.source.kind(),
                offset,
                len: *len as u64,
                adapt: label.adapt.clone(),
            };
            offset += *len as u64;
            layout
        })
        .collect()
}

impl Icheck {
    /// Checkpoints every added label as the next version (*collective*).
    /// Blocking mode returns when the version is complete; asynchronous mode
    /// returns once the data is staged. A commit while another is in flight
    /// waits for it first. Returns the version number.
    pub fn commit(&mut self) -> Result<u64> {
        self.check_open()?;
        self.wait()?;
        self.release_restart();
        self.check_global_labels()?;
        self.last_commit = None;
        if let Some(link) = self.link.as_mut() {
            // What a failed commit moved says nothing about this one.
            link.moved = TransferTally::default();
        }
        let version = self.next_version;
        self.next_version += 1;
        self.size_hint = u64::MAX;
        let span = tracing::info_span!("commit", app = %self.app, rank = self.comm.rank(), version);
        let _entered = span.enter();
        let started = Instant::now();
        // Every rank must take the same branch (both are collective): the
        // ranks' clocks differ, so they agree on whether t_wait has passed.
        if self.fallback.is_some() && self.comm.all_true(self.fallback_tried.elapsed() >= self.t_wait) {
            self.try_service_again();
        }
        if self.fallback.is_some() {
            self.commit_fallback(version)?;
            return Ok(version);
        }
        if self.mode == TransferMode::Shmr {
            let stored = self.store_shmr(version, started);
            if self.asynchronous {
                let ok = self.comm.all_true(stored.is_ok());
                return match (stored, ok) {
                    (Ok(_), true) => Ok(version),
                    (Err(err), _) => Err(err),
                    (Ok(_), false) => {
                        let _ = self.finish_in_flight();
                        Err(self.incomplete(version, "another rank failed to stage its data".into()))
                    }
                };
            }
            let stored = self.store_elsewhere_on_failure(stored, |me| me.store_shmr(version, started));
            self.complete_or_fall_back(version, stored, started, |me| me.store_shmr(version, started))?;
            return Ok(version);
        }
        if self.asynchronous {
            let staged = self.stage_async(version, started);
            let staged_at = started.elapsed();
            let ok = self.comm.all_true(staged.is_ok());
            tracing::debug!(
                stage_ms = staged_at.as_secs_f64() * 1e3,
                agreed_ms = started.elapsed().as_secs_f64() * 1e3,
                "staged for an async commit"
            );
            // Every rank has staged (or failed to): the transfers may start.
            let staged = staged.map(StartGate::open);
            return match (staged, ok) {
                (Ok(()), true) => Ok(version),
                (Err(err), _) => Err(err),
                (Ok(()), false) => {
                    // Others failed: finish ours, then report.
                    let _ = self.finish_in_flight();
                    Err(self.incomplete(version, "another rank failed to stage its data".into()))
                }
            };
        }
        let stored = self.store_blocking(version);
        let stored = self.store_elsewhere_on_failure(stored, |me| me.store_blocking(version));
        self.complete_or_fall_back(version, stored, started, |me| me.store_blocking(version))?;
        Ok(version)
    }

    /// What this process's last commit moved and checksummed, when it was
    /// a blocking zero-copy commit (the default data path); `None` after
    /// other commits. Lets an application (or a benchmark) see what
    /// incremental commits and page tracking saved.
    pub fn last_commit(&self) -> Option<CommitStats> {
        self.last_commit
    }

    /// A blocking MR commit's transfer, by the configured data path.
    fn store_blocking(&mut self, version: u64) -> Result<u64> {
        if self.zero_copy {
            self.store_zero_copy(version)
        } else {
            self.store_pipelined(version)
        }
    }

    /// §6.5.2, in the thesis's order (controller, then PFS): when some
    /// rank's agent failed to store its part, the controller is asked for
    /// new agents; with them, every rank stores the version again there
    /// with `store`. Otherwise (no controller, or it has no new agents:
    /// it does not know of a lost agent) the first outcome stands, and the
    /// caller falls back to the PFS or reports it (*collective*).
    pub(super) fn store_elsewhere_on_failure(
        &mut self,
        stored: Result<u64>,
        store: impl FnOnce(&mut Self) -> Result<u64>,
    ) -> Result<u64> {
        if self.comm.all_true(stored.is_ok()) {
            return stored;
        }
        if let Err(err) = &stored {
            tracing::warn!(%err, "this rank's agent failed; asking the controller for new agents");
        }
        let unreached = stored.as_ref().err().and_then(|err| self.unreached_in_store(err));
        match self.ask_for_new_agents(false, unreached) {
            Ok(ProbeOutcome::Reconnected { agents }) => {
                tracing::warn!(agents, "the controller replaced the application's agents; storing the version there");
                store(self)
            }
            Ok(ProbeOutcome::Unchanged) => stored,
            Err(err) => {
                tracing::warn!(%err, "no new agents from the controller");
                stored
            }
        }
    }

    /// The agent a failed store of this rank says it could not reach: one
    /// named so by the session ([`Error::unreached_agent`]), or this rank's
    /// own agent when the store's RMA with it stalled or broke (a pushed
    /// version's writes go nowhere else).
    fn unreached_in_store(&self, err: &Error) -> Option<u64> {
        use icheck_core::fabric::FabricError;
        let own = || self.link.as_ref().map(|link| link.info.id);
        match err {
            Error::Fabric(FabricError::Timeout { .. } | FabricError::Completion { .. } | FabricError::Closed) => own(),
            other => other.unreached_agent(),
        }
    }

    /// Async MR: stores the staged version again, from the staging buffer,
    /// through this rank's (new) agent session.
    fn restore_staged(&mut self, version: u64, layout: Vec<LabelLayout>) -> Result<u64> {
        let total: u64 = layout.iter().map(|l| l.len).sum();
        let staging = self.staging.take().ok_or(Error::Order("the staged version is gone"))?;
        let staging = self.endpoint.register(staging, Access::REMOTE_READ)?;
        let push = self.direction == TransferDirection::Push;
        let header = VersionHeader { version, shape: self.shape(self.comm.size()), layout, push };
        let result = match self.link.as_mut() {
            Some(link) => {
                let bytes = &staging.as_slice()[..total as usize];
                commit_buffer(link, &self.endpoint, header, Some((staging.source(), staging.remote())), bytes)
            }
            None => Err(Error::Order("no agent session")),
        };
        self.staging = Some(staging.into_inner());
        result
    }

    /// Completes a blocking commit; when some rank's agent failed it and a
    /// PFS is configured, every rank writes the version directly to the PFS
    /// instead (§6.5.1) and keeps doing so until the service answers again
    /// (tried every `t_wait`). `store_again` stores the version once more
    /// when it reached only agents the controller has given up since
    /// ([`Self::complete_agreed`]).
    pub(super) fn complete_or_fall_back(
        &mut self,
        version: u64,
        stored: Result<u64>,
        started: Instant,
        store_again: impl FnOnce(&mut Self) -> Result<u64>,
    ) -> Result<()> {
        let all_stored = self.comm.all_true(stored.is_ok());
        if !all_stored {
            if let Some(pfs) = self.pfs.clone() {
                // Rank 0 announces the switch (once, not per commit); other
                // ranks only say what failed on their side.
                let cause = stored.as_ref().err().map(|e| e.to_string());
                if self.comm.rank() == 0 {
                    tracing::warn!(
                        err = cause.as_deref().unwrap_or("another rank's agent failed"),
                        pfs = %pfs.root().display(),
                        "an agent failed during a commit: checkpoints go directly to the PFS until the service answers again"
                    );
                } else if let Some(err) = cause {
                    tracing::warn!(%err, "this rank's agent failed during a commit");
                }
                self.link = None;
                self.fallback = Some(pfs);
                self.fallback_tried = Instant::now();
                return self.commit_fallback(version);
            }
        }
        self.complete_agreed(version, stored, all_stored, started, store_again)
    }

    pub(super) fn incomplete(&self, version: u64, detail: String) -> Error {
        let previous = self.latest.as_ref().map_or("no version".to_string(), |l| format!("version {}", l.version));
        Error::Incomplete { version, detail, previous }
    }

    /// Agrees with all ranks, records the version at the controller and
    /// lets agents drop older versions (see [`Self::complete_agreed`]).
    pub(super) fn complete(
        &mut self,
        version: u64,
        stored: Result<u64>,
        started: Instant,
        store_again: impl FnOnce(&mut Self) -> Result<u64>,
    ) -> Result<()> {
        let all_ok = self.comm.all_true(stored.is_ok());
        self.complete_agreed(version, stored, all_ok, started, store_again)
    }

    /// [`Self::complete`] once the ranks agreed whether all stored their
    /// data (`stored`: this rank's bytes). When the controller answers that
    /// the version went to agents it has given up since (their node went
    /// silent or died after the bytes were sealed there), every rank has
    /// moved to the new agents it named, stores the version there with
    /// `store_again`, and records it once more (*collective*): the
    /// application still holds every byte, so a checkpoint node lost (or
    /// silent for a few heartbeats) between the seal and the record costs
    /// the commit a second transfer, not its version.
    pub(super) fn complete_agreed(
        &mut self,
        version: u64,
        stored: Result<u64>,
        all_ok: bool,
        started: Instant,
        store_again: impl FnOnce(&mut Self) -> Result<u64>,
    ) -> Result<()> {
        let bytes = *stored.as_ref().unwrap_or(&0);
        let first = match self.record_agreed(version, stored.map(|_| ()), all_ok, bytes, started)? {
            Recording::Recorded => return Ok(()),
            Recording::Moved(first) => first,
        };
        tracing::warn!(%first, "storing the version again on the new agents");
        // The new agents hold no version an incremental commit could
        // build on: this one moves whole.
        self.sealed_blocks = None;
        let again = store_again(self);
        let all_ok = self.comm.all_true(again.is_ok());
        let bytes = *again.as_ref().unwrap_or(&0);
        match self.record_agreed(version, again.map(|_| ()), all_ok, bytes, started) {
            Ok(Recording::Recorded) => Ok(()),
            // Given up twice within one commit: the next commit goes to the
            // newest agents, as it did before the retry existed.
            Ok(Recording::Moved(_)) => Err(first),
            // The commit reports why the version was not recorded; the
            // failed second try is in the log.
            Err(again) => {
                tracing::warn!(%again, "storing the version again on the new agents failed");
                Err(first)
            }
        }
    }

    /// Records the version at the controller once the ranks agreed whether
    /// all stored their data; [`Recording::Moved`] when the controller had
    /// given the agents up and every rank moved to the new ones
    /// (*collective*).
    fn record_agreed(
        &mut self,
        version: u64,
        local: Result<()>,
        all_ok: bool,
        bytes: u64,
        started: Instant,
    ) -> Result<Recording> {
        local?;
        if !all_ok {
            return Err(self.incomplete(version, "another rank failed to store its data".into()));
        }
        let total = self.comm.sum(bytes);
        let spilled = self.comm.sum(u64::from(self.link.as_ref().is_some_and(|l| l.spilled))) > 0;
        let transfer = self.transfer_step(bytes);
        let secs = started.elapsed().as_secs_f64();
        let mut recorded = Ok(());
        let mut moved_to = None;
        if let Some(controller) = self.controller.as_mut() {
            let request = ClientRequest::VersionComplete {
                agents: self.agents.iter().map(|a| a.id).collect(),
                name: self.app.clone(),
                version,
                bytes: total,
                commit_secs: secs,
                spilled,
                epoch: self.epoch,
                capability: self.access.capability.clone(),
                transfer: Some(transfer),
            };
            icheck_core::failpoint::hit("client.before_version_complete");
            recorded = match controller.request(&request) {
                // Stored on agents the controller gave up: not recorded;
                // these are the application's agents now (none: still to be placed).
                Ok(ClientReply::Agents(agents)) => {
                    moved_to = Some(agents);
                    Err(self.incomplete(
                        version,
                        "it was stored on agents the controller gave up (their node went silent or died)".into(),
                    ))
                }
                Ok(_) => Ok(()),
                Err(error) => Err(Error::Controller { peer: self.controller_peer.clone(), error }),
            };
        }
        let all_recorded = self.comm.all_true(recorded.is_ok());
        if !all_recorded {
            // Every rank learns whether the controller named new agents, and
            // moves there (both collective), before the error returns.
            let answer = self.comm.broadcast_from_root(protocol::encode(&moved_to).unwrap_or_default());
            // `switch_agents` and the probe move every rank or none, so all
            // agree. No agents named: the controller has not placed the new
            // ones yet, and a probe places them.
            let moved = match protocol::decode::<Option<Vec<AgentInfo>>>(&answer) {
                Ok(Some(agents)) if agents.is_empty() => match self.ask_for_new_agents(false, None) {
                    Ok(ProbeOutcome::Reconnected { .. }) => true,
                    Ok(ProbeOutcome::Unchanged) => false,
                    Err(err) => {
                        tracing::warn!(%err, "no new agents from the controller; the next commit asks again");
                        false
                    }
                },
                Ok(Some(agents)) => match self.switch_agents(agents) {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!(%err, "cannot move to the new agents; the next commit asks again");
                        false
                    }
                },
                _ => false,
            };
            let error = match recorded {
                Err(error) => error,
                Ok(()) => self.incomplete(version, "rank 0 could not record it at the controller".into()),
            };
            return if moved { Ok(Recording::Moved(error)) } else { Err(error) };
        }
        let ranks = self.comm.size();
        let epoch = self.epoch;
        self.latest =
            Some(VersionRecord { version, ranks, epoch, bytes: total, commit_secs: secs, completed_unix_ms: 0 });
        if let Some(link) = self.link.as_mut() {
            if let Err(err) = link.call(&AgentRequest::Complete { version }) {
                tracing::warn!(%err, "agent could not drop older versions");
            }
        }
        tracing::info!(bytes, total, secs, "version complete");
        Ok(Recording::Recorded)
    }

    /// Feeds `transfer = "auto"` what this rank's transfers of the version
    /// just completed (`bytes` of it here) moved, sets the next commit's
    /// direction, and says how commits move now, for the controller's
    /// status. *Collective* when the trial ends: the ranks add up their
    /// measurements so that all keep the same direction.
    fn transfer_step(&mut self, bytes: u64) -> TransferReport {
        let moved = self.link.as_mut().map(|l| std::mem::take(&mut l.moved)).unwrap_or_default();
        if let Some(auto) = self.auto.as_mut() {
            if auto.completed(moved, bytes) {
                let mine = auto.tally();
                let comm = &self.comm;
                let sum = |m: Measured| Measured {
                    bytes: comm.sum(m.bytes),
                    secs: comm.sum((m.secs * 1e6) as u64) as f64 / 1e6,
                };
                let decision = auto.decide(TransferTally { pull: sum(mine.pull), push: sum(mine.push) });
                if comm.rank() == 0 {
                    tracing::info!(
                        push = decision.push,
                        pull_gb_per_s = decision.pull_gb_per_s,
                        push_gb_per_s = decision.push_gb_per_s,
                        "transfer = \"auto\": measured both directions; commits {} from now on",
                        if decision.push { "push" } else { "pull" }
                    );
                }
            }
            self.direction = if auto.next_push() { TransferDirection::Push } else { TransferDirection::Pull };
        }
        self.transfer()
    }

    /// How commits move their bytes now: the library pushes or the agents
    /// pull, and with `transfer = "auto"` where the measurement stands and
    /// the rates it chose by (what `icheck status` shows).
    pub fn transfer(&self) -> TransferReport {
        TransferReport {
            push: self.direction == TransferDirection::Push,
            auto: self.auto.as_ref().map(AutoDirection::report),
        }
    }

    /// Registers each label's own memory and moves it without copies.
    pub(super) fn store_zero_copy(&mut self, version: u64) -> Result<u64> {
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        let lens: Vec<usize> = guards.iter().map(|g| g.len()).collect();
        let layout = layouts(&self.labels, &lens);
        let push = self.direction == TransferDirection::Push;
        let access = if push { Access::LOCAL } else { Access::REMOTE_READ };
        let mut regions: Vec<(usize, MemoryRegion)> = Vec::new();
        for (index, guard) in guards.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            // SAFETY: the read guard keeps the memory alive and unmodified
            // until after `regions` (declared later, dropped first) is gone.
            // The provider only reads it: pull registers it for remote reads,
            // push uses it as the source of writes.
            let region = unsafe { self.endpoint.register_raw(guard.as_ptr().cast_mut(), guard.len(), access)? };
            regions.push((index, region));
        }
        let header = VersionHeader { version, shape: self.shape(self.comm.size()), layout: layout.clone(), push };
        let link = self.link.as_mut().ok_or(Error::Order("no agent session"))?;
        let slices: Vec<&[u8]> = guards.iter().map(|g| &***g).collect();
        if self.incremental {
            // The pieces of version bytes start..end: each label's part of
            // it, from that label's registered memory.
            let pieces_of = |start: u64, end: u64, at: u64| -> Vec<Piece<'_>> {
                regions
                    .iter()
                    .filter_map(|(index, region)| {
                        let label = &layout[*index];
                        let (from, to) = (start.max(label.offset), end.min(label.offset + label.len));
                        (from < to).then(|| Piece {
                            source: region.source(),
                            remote: region.remote(),
                            local_offset: (from - label.offset) as usize,
                            file_offset: at + (from - start),
                            len: (to - from) as usize,
                        })
                    })
                    .collect()
            };
            let previous = self.sealed_blocks.as_ref().map(|(v, blocks)| (*v, blocks.as_slice()));
            let label_ranges: Vec<std::ops::Range<usize>> =
                slices.iter().map(|s| s.as_ptr() as usize..s.as_ptr() as usize + s.len()).collect();
            let written = self.tracking.as_mut().and_then(|t| t.take(&label_ranges, previous.map(|(v, _)| v)));
            let total: u64 = lens.iter().map(|l| *l as u64).sum();
            // What changed last time predicts this time: a run that
            // rewrites most of its memory commits whole, checksumming while
            // the bytes move, and switches back once little changes. Page
            // tracking knows instead of predicting.
            let expect_most_changed = match &written {
                Some(w) => {
                    let bytes: usize = w.ranges.iter().flatten().map(|r| r.len()).sum();
                    bytes as f64 > MOST_CHANGED * total as f64
                }
                None => self.changed_last > MOST_CHANGED,
            };
            let committed = commit_incremental(
                link,
                &self.endpoint,
                header,
                &slices,
                previous,
                expect_most_changed,
                written,
                pieces_of,
            )?;
            if let Some(tracking) = self.tracking.as_mut() {
                tracking.sealed(version, committed.chunks, label_ranges);
            }
            self.sealed_blocks = Some((version, committed.blocks));
            self.changed_last = committed.changed;
            self.last_commit = Some(CommitStats {
                version,
                total_bytes: total,
                moved_bytes: committed.moved,
                checksummed_bytes: committed.checksummed,
                page_tracking: committed.tracked,
            });
            tracing::debug!(
                moved = committed.moved,
                total,
                changed = committed.changed,
                checksummed = committed.checksummed,
                tracked = committed.tracked,
                "incremental commit"
            );
            drop(regions);
            drop(guards);
            // The version holds every byte, whatever crossed the fabric.
            return Ok(total);
        }
        let pieces: Vec<Piece<'_>> = regions
            .iter()
            .map(|(index, region)| Piece {
                source: region.source(),
                remote: region.remote(),
                local_offset: 0,
                file_offset: layout[*index].offset,
                len: region.len(),
            })
            .collect();
        let moved = commit_version(link, &self.endpoint, header, &slices, |mover| mover.send(&pieces))?;
        let total: u64 = lens.iter().map(|l| *l as u64).sum();
        self.last_commit = Some(CommitStats {
            version,
            total_bytes: total,
            moved_bytes: moved,
            checksummed_bytes: total,
            page_tracking: false,
        });
        drop(regions);
        drop(guards);
        Ok(moved)
    }

    /// A staging buffer of at least `len` bytes, registered for this
    /// transfer (the caller hands it back unregistered with `into_inner`).
    pub(super) fn staging(&mut self, len: usize) -> Result<RegisteredBuffer> {
        if let Some(ahead) = self.staging_ahead.take() {
            // The larger of the two is kept (the kept one may be a blocking
            // commit's bounded buffer, or an async one of larger labels).
            if let Ok(buffer) = ahead.join() {
                let kept = self.staging.as_ref().map_or(0, icheck_core::fabric::StableBuffer::len);
                if icheck_core::fabric::StableBuffer::len(&buffer) > kept {
                    self.staging = Some(buffer);
                }
            }
        }
        let buffer = match self.staging.take() {
            Some(buffer) if icheck_core::fabric::StableBuffer::len(&buffer) >= len => buffer,
            _ => AlignedBuffer::zeroed(len.max(4096)),
        };
        Ok(self.endpoint.register(buffer, Access::REMOTE_READ)?)
    }

    /// Streams the labels through the two halves of the bounded staging
    /// buffer: one half is filled while the other is transferred.
    pub(super) fn store_pipelined(&mut self, version: u64) -> Result<u64> {
        let mut staging = self.staging(self.staging_size)?;
        let result = self.pipeline(version, &mut staging);
        self.staging = Some(staging.into_inner());
        result
    }

    pub(super) fn pipeline(&mut self, version: u64, staging: &mut RegisteredBuffer) -> Result<u64> {
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        let lens: Vec<usize> = guards.iter().map(|g| g.len()).collect();
        let layout = layouts(&self.labels, &lens);
        let total: usize = lens.iter().sum();
        let push = self.direction == TransferDirection::Push;
        let header = VersionHeader { version, shape: self.shape(self.comm.size()), layout, push };
        let link = self.link.as_mut().ok_or(Error::Order("no agent session"))?;
        let half = staging.len() / 2;
        let base = staging.as_mut_slice().as_mut_ptr() as usize;
        let (remote, source) = (staging.remote(), staging.source());
        // Halves go to the transfer thread as (half, file offset, len) and
        // come back free.
        let (to_transfer, transfers) = mpsc::sync_channel::<(usize, u64, usize)>(2);
        let (to_fill, free_halves) = mpsc::sync_channel::<usize>(2);
        to_fill.send(0).and_then(|_| to_fill.send(1)).expect("channel has room for both halves");
        let slices: Vec<&[u8]> = guards.iter().map(|g| &***g).collect();
        commit_version(link, &self.endpoint, header, &slices, |mover| {
            std::thread::scope(|scope| {
                let transfer = scope.spawn(move || -> Result<u64> {
                    let mut moved = 0;
                    for (which, file_offset, len) in transfers {
                        let local_offset = which * half;
                        moved += mover.send(&[Piece { source, remote, local_offset, file_offset, len }])?;
                        if to_fill.send(which).is_err() {
                            break;
                        }
                    }
                    Ok(moved)
                });
                // Fill halves in order from the labels' bytes.
                let mut file_offset = 0usize;
                let mut pieces = guards.iter().flat_map(|g| g.chunks(half.max(1))).peekable();
                let mut pending: Option<&[u8]> = None;
                'fill: while file_offset < total {
                    let Ok(which) = free_halves.recv() else { break };
                    let mut filled = 0usize;
                    while filled < half {
                        let piece = match pending.take().or_else(|| pieces.next()) {
                            Some(piece) => piece,
                            None => break,
                        };
                        let take = piece.len().min(half - filled);
                        // SAFETY: the destination lies inside half `which` of the
                        // staging buffer (filled + take <= half), which the
                        // transfer thread does not touch until it receives it below.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                piece.as_ptr(),
                                (base + which * half + filled) as *mut u8,
                                take,
                            );
                        }
                        filled += take;
                        if take < piece.len() {
                            pending = Some(&piece[take..]);
                        }
                    }
                    if filled == 0 || to_transfer.send((which, file_offset as u64, filled)).is_err() {
                        break 'fill;
                    }
                    file_offset += filled;
                }
                drop(to_transfer);
                transfer.join().unwrap_or(Err(Error::Order("the transfer thread panicked")))
            })
        })
    }

    /// Async mode: copy everything into the staging buffer and let a thread
    /// transfer and seal it once the returned gate opens.
    pub(super) fn stage_async(&mut self, version: u64, started: Instant) -> Result<StartGate> {
        let lens: Vec<usize> = self.labels.iter().map(|l| l.source.bytes().len()).collect();
        let total: usize = lens.iter().sum();
        // Tests make one rank's staging fail, as a refused registration would.
        if icheck_core::failpoint::fails("client.stage_async") {
            let refused = "the failpoint client.stage_async refused the staging buffer".to_string();
            return Err(FabricError::Call { call: "fi_mr_reg", code: libc::ENOMEM, message: refused }.into());
        }
        let mut staging = self.staging(total)?;
        {
            let out = staging.as_mut_slice();
            let mut offset = 0;
            for label in &self.labels {
                let bytes = label.source.bytes();
                out[offset..offset + bytes.len()].copy_from_slice(&bytes);
                offset += bytes.len();
            }
        }
        let layout = layouts(&self.labels, &lens);
        let layout_kept = layout.clone();
        let mut link = self.link.take().ok_or(Error::Order("no agent session"))?;
        let push = self.direction == TransferDirection::Push;
        let (endpoint, shape) = (self.endpoint.clone(), self.shape(self.comm.size()));
        // Incremental: the thread compares the staged copy with the last
        // version (taken: a failed commit leaves none to compare with).
        let incremental = self.incremental.then(|| (self.sealed_blocks.take(), self.changed_last > MOST_CHANGED));
        let span = tracing::Span::current();
        let (gate, opened) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("icheck-async-commit".into())
            .spawn(move || {
                let _entered = span.enter();
                // Nothing is ever sent: the gate opens when it is dropped.
                let _ = opened.recv();
                let bytes = &staging.as_slice()[..total];
                let header = VersionHeader { version, shape, layout, push };
                let registered = (staging.source(), staging.remote());
                let Some((previous, expect_most_changed)) = incremental else {
                    let result = commit_buffer(&mut link, &endpoint, header, Some(registered), bytes).map(|_| ());
                    return Background { link, staging: Some(staging), result, blocks: None };
                };
                let labels: Vec<&[u8]> =
                    header.layout.iter().map(|l| &bytes[l.offset as usize..(l.offset + l.len) as usize]).collect();
                // The staged bytes are the version's, back to back: a range
                // of the version is the same range of the staging buffer.
                let pieces_of = |start: u64, end: u64, at: u64| -> Vec<Piece<'_>> {
                    let (source, remote) = registered;
                    let len = (end - start) as usize;
                    let piece = Piece { source, remote, local_offset: start as usize, file_offset: at, len };
                    if len == 0 {
                        Vec::new()
                    } else {
                        vec![piece]
                    }
                };
                let previous = previous.as_ref().map(|(v, blocks)| (*v, blocks.as_slice()));
                let committed = commit_incremental(
                    &mut link,
                    &endpoint,
                    header,
                    &labels,
                    previous,
                    expect_most_changed,
                    None,
                    pieces_of,
                );
                let (result, blocks) = match committed {
                    Ok(c) => (Ok(()), Some((version, c.blocks, c.changed))),
                    Err(err) => (Err(err), None),
                };
                Background { link, staging: Some(staging), result, blocks }
            })
            .map_err(|e| Error::Unsupported(format!("cannot start the async commit thread: {e}")))?;
        self.in_flight =
            Some(InFlight { version, started, bytes: total as u64, handle: Some(handle), layout: Some(layout_kept) });
        Ok(StartGate(gate))
    }

    /// Joins the background commit: (version, start, bytes, its result).
    pub(super) fn finish_in_flight(&mut self) -> Option<(u64, Instant, u64, Result<()>)> {
        let (version, started, bytes, result, _) = self.finish_in_flight_with_layout()?;
        Some((version, started, bytes, result))
    }

    /// [`Self::finish_in_flight`], with the staged layout (MR).
    fn finish_in_flight_with_layout(&mut self) -> Option<Joined> {
        let InFlight { version, started, bytes, handle, layout } = self.in_flight.take()?;
        let result = match handle.map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok(background)) => {
                self.link = Some(background.link);
                if let Some((version, blocks, changed)) = background.blocks {
                    self.sealed_blocks = Some((version, blocks));
                    self.changed_last = changed;
                }
                if let Some(staging) = background.staging {
                    self.staging = Some(staging.into_inner());
                }
                background.result
            }
            Some(Err(_)) => Err(Error::Order("the async commit thread panicked")),
        };
        Some((version, started, bytes, result, layout))
    }

    /// Whether the background commit has finished its transfer (this rank
    /// only; `wait` completes the version for all ranks).
    pub fn test(&self) -> bool {
        self.in_flight.as_ref().and_then(|f| f.handle.as_ref()).is_none_or(|h| h.is_finished())
    }

    /// Waits for a background commit and completes its version (*collective*).
    pub fn wait(&mut self) -> Result<()> {
        let Some((version, started, bytes, result, layout)) = self.finish_in_flight_with_layout() else {
            return Ok(());
        };
        // The staging buffer (MR) or the node segment (SHMR) still holds the
        // version; new agents can take it from there.
        let all_staged = self.comm.all_true(layout.is_some());
        let layout = layout.filter(|_| all_staged);
        let kept = layout.clone();
        let result = match layout {
            Some(layout) => self
                .store_elsewhere_on_failure(result.map(|_| bytes), |me| me.store_staged_again(version, layout))
                .map(|_| bytes),
            None => result.map(|_| bytes),
        };
        self.complete(version, result, started, |me| match kept {
            Some(layout) => me.store_staged_again(version, layout).map(|_| bytes),
            None => Err(me.incomplete(version, "its staged bytes are gone".into())),
        })
    }

    /// Stores an async commit's version again through this rank's (new)
    /// agent session, from where it was staged: the staging buffer (MR)
    /// or the node segment (SHMR).
    fn store_staged_again(&mut self, version: u64, layout: Vec<LabelLayout>) -> Result<u64> {
        match self.mode {
            TransferMode::Mr => self.restore_staged(version, layout),
            TransferMode::Shmr => self.restore_segment(version, layout),
        }
    }
}

#[cfg(test)]
// Lists of one label's address range are what these tests pass.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    /// Memory the kernel cannot track (here: an unmapped address) fails
    /// every commit; after three in a row tracking stops for the run.
    #[test]
    fn tracking_stops_after_failing_three_commits_in_a_row() {
        let mut tracking = Tracking::start().expect("this kernel tracks pages");
        let unmapped = [4096usize..8192];
        for failed in 1..=TRACKING_GIVES_UP {
            assert!(tracking.take(&unmapped, None).is_none());
            assert_eq!(tracking.failures, failed);
        }
        // Off: even memory it could track is no longer asked about.
        let memory = vec![1u8; 1 << 20];
        let real = [memory.as_ptr() as usize..memory.as_ptr() as usize + memory.len()];
        assert!(tracking.take(&real, None).is_none());
        tracking.sealed(1, Vec::new(), real.to_vec());
        assert!(tracking.take(&real, Some(1)).is_none(), "no answer once tracking is off");
        assert_eq!(tracking.failures, TRACKING_GIVES_UP);
    }

    /// The answer is relative to the version sealed last, with the labels
    /// where they were, and no restore between.
    #[test]
    fn tracking_answers_only_for_the_sealed_version_and_unmoved_labels() {
        let mut tracking = Tracking::start().expect("this kernel tracks pages");
        let memory = vec![1u8; 1 << 20];
        let at = memory.as_ptr() as usize;
        let (whole, half) =
            ([at..at + memory.len()], [at..at + memory.len() / 2, at + memory.len() / 2..at + memory.len()]);
        assert!(tracking.take(&whole, None).is_none(), "tracking starts");
        tracking.sealed(1, vec![Vec::new()], whole.to_vec());
        assert!(tracking.take(&whole, Some(1)).is_some());
        tracking.sealed(2, vec![Vec::new()], whole.to_vec());
        assert!(tracking.take(&whole, Some(1)).is_none(), "another version was sealed last");
        tracking.sealed(3, vec![Vec::new()], whole.to_vec());
        assert!(tracking.take(&half, Some(3)).is_none(), "the same pages, other labels");
        tracking.sealed(4, vec![Vec::new(), Vec::new()], half.to_vec());
        tracking.restored.store(true, Ordering::Release);
        assert!(tracking.take(&half, Some(4)).is_none(), "a restore came between");
        tracking.sealed(5, vec![Vec::new(), Vec::new()], half.to_vec());
        assert!(tracking.take(&half, Some(5)).is_some());
    }
}
