//! A rank's session with its agent as a state machine that does no I/O:
//! which requests are allowed when (Open, then Begin → Pull* → Seal, then
//! Complete), what a Begin must satisfy, which bytes of the version a Pull
//! may write, what the sealed manifest says, and whether a new version fits
//! the node's checkpoint memory.
//!
//! Architecture invariant: nothing here touches a file, a socket, the
//! fabric or a clock. The agent's session thread (`super::handle`) asks
//! this core first and performs what it allows: it creates and maps the
//! version's file, moves the bytes and seals the store, and passes the
//! current time in. The tests below drive sessions on simulated time.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::time::Instant;

use icheck_core::credentials::Owner;
use icheck_core::delta::{check_runs, BlockMap, BlockRun};
use icheck_core::fabric::RmaOp;
use icheck_core::format::{check_layout, CHUNK_SIZE};
use icheck_core::protocol::{DeliverSegment, LabelLayout, Manifest, Privilege, PullSegment};

/// The version a rank is writing, as the session knows it.
#[derive(Debug)]
struct Begun {
    version: u64,
    ranks: u32,
    epoch: u32,
    labels: Vec<LabelLayout>,
    total_len: u64,
    started: Instant,
    /// In the node's store (not spilled to the PFS).
    in_memory: bool,
    /// An incremental version: where its blocks live, and the bytes of
    /// changed blocks the rank writes (packed).
    delta: Option<Incremental>,
}

/// What makes a version incremental at the agent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Incremental {
    /// The version's block map (its parent's, with the changed blocks in
    /// its own file).
    pub(crate) map: BlockMap,
    /// Bytes of the changed blocks: the version's own file.
    pub(crate) written_len: u64,
}

/// A Begin [`SessionCore::begin`] accepted, waiting for its destination.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BeginChecked {
    /// The version.
    pub(crate) version: u64,
    ranks: u32,
    epoch: u32,
    labels: Vec<LabelLayout>,
    /// Bytes of the version (all labels).
    pub(crate) total_len: u64,
    /// Set by [`BeginChecked::make_incremental`].
    pub(crate) delta: Option<Incremental>,
}

impl BeginChecked {
    /// Makes the checked Begin incremental over `parent` (the parent's
    /// block map at this agent) with the rank's `changed` blocks, if they
    /// describe the same bytes: a parent of another length cannot lend
    /// blocks (the caller then takes the whole version).
    pub(crate) fn make_incremental(&mut self, parent: &BlockMap, changed: &[BlockRun]) -> Result<(), String> {
        if parent.total_len != self.total_len {
            return Err(format!(
                "version {} has {} bytes, its parent version {} has {}",
                self.version, self.total_len, parent.version, parent.total_len
            ));
        }
        if parent.version >= self.version {
            return Err(format!("version {} cannot build on version {}", self.version, parent.version));
        }
        let written_len = check_runs(changed, self.total_len)?;
        self.delta = Some(Incremental { map: parent.next(self.version, changed), written_len });
        Ok(())
    }

    /// Bytes the rank writes into this version's own file.
    pub(crate) fn written_len(&self) -> u64 {
        self.delta.as_ref().map_or(self.total_len, |d| d.written_len)
    }
}

/// A version given up before its Seal.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Abandoned {
    /// Its number.
    pub(crate) version: u64,
    /// Its unsealed file is in the store (and must go): not spilled.
    pub(crate) in_memory: bool,
}

/// What Seal produced: the manifest to store, and the transfer's duration.
#[derive(Debug)]
pub(crate) struct Sealed {
    /// The version's manifest, validated.
    pub(crate) manifest: Manifest,
    /// Seconds from Begin to Seal.
    pub(crate) transfer_secs: f64,
    /// An incremental version's block map and the bytes the rank sent.
    pub(crate) delta: Option<Incremental>,
}

/// One rank's session.
#[derive(Debug)]
pub(crate) struct SessionCore {
    app: String,
    rank: u32,
    writing: Option<Begun>,
    /// The version this session sealed last (in the store or spilled).
    last_sealed: Option<u64>,
}

impl SessionCore {
    /// Open: the rank `rank` of `app` starts a session with agent `agent`,
    /// which serves `serving`.
    pub(crate) fn open(serving: &str, agent: u64, app: String, rank: u32) -> Result<SessionCore, String> {
        if app != serving {
            return Err(format!("agent {agent} serves {serving:?}, not {app:?}"));
        }
        Ok(SessionCore { app, rank, writing: None, last_sealed: None })
    }

    /// The application.
    pub(crate) fn app(&self) -> &str {
        &self.app
    }

    /// The rank.
    pub(crate) fn rank(&self) -> u32 {
        self.rank
    }

    /// Gives up the version being written, if any: a version whose Seal
    /// never came can never be served.
    pub(crate) fn abandon(&mut self) -> Option<Abandoned> {
        self.writing.take().map(|begun| Abandoned { version: begun.version, in_memory: begun.in_memory })
    }

    /// Checks a Begin of `version` of resize epoch `epoch`, written by
    /// `ranks` processes with `labels`, while `complete` is the rank's
    /// newest complete version here and `sealed` says whether the store
    /// holds a version sealed. A Begin never overwrites a complete version:
    /// one at or below `complete` that is still stored is refused. The
    /// caller abandons the version being written first.
    pub(crate) fn begin(
        &self,
        version: u64,
        ranks: u32,
        epoch: u32,
        labels: Vec<LabelLayout>,
        complete: Option<u64>,
        sealed: impl FnOnce(u64) -> bool,
    ) -> Result<BeginChecked, String> {
        let total_len = check_layout(&labels)?;
        if version == 0 || ranks == 0 || self.rank >= ranks {
            return Err(format!("bad version {version} or rank {} of {ranks}", self.rank));
        }
        if let Some(complete) = complete.filter(|c| version <= *c) {
            if sealed(version) {
                return Err(format!(
                    "version {version} of rank {} is stored and complete (the newest complete version is \
                     {complete}): it is never overwritten; begin a newer version",
                    self.rank
                ));
            }
        }
        Ok(BeginChecked { version, ranks, epoch, labels, total_len, delta: None })
    }

    /// Checks a Complete of `version`: the rank sealed it (this session
    /// sealed or spilled it last, or else `sealed` says the store holds it:
    /// asked only then, it reads the store's directory) and it is not older
    /// than the rank's newest complete version `complete`. Only then may
    /// older versions go.
    pub(crate) fn complete(
        &self,
        version: u64,
        complete: Option<u64>,
        sealed: impl FnOnce() -> bool,
    ) -> Result<(), String> {
        if !(self.last_sealed == Some(version) || sealed()) {
            return Err(format!(
                "Complete of version {version} of rank {}: no such version was sealed here",
                self.rank
            ));
        }
        if let Some(complete) = complete.filter(|c| version < *c) {
            return Err(format!(
                "Complete of version {version} of rank {}: version {complete} is complete already",
                self.rank
            ));
        }
        Ok(())
    }

    /// The version [`begin`](Self::begin) checked has its destination
    /// (`in_memory`: the store; else a spill to the PFS) since `now`.
    pub(crate) fn begun(&mut self, checked: BeginChecked, in_memory: bool, now: Instant) {
        let BeginChecked { version, ranks, epoch, labels, total_len, delta } = checked;
        // A spilled version goes to the PFS whole.
        let delta = delta.filter(|_| in_memory);
        self.writing = Some(Begun { version, ranks, epoch, labels, total_len, started: now, in_memory, delta });
    }

    /// The reads a Pull of `segments` makes into the version's file: each
    /// segment must lie inside the version.
    pub(crate) fn pull_ops(&self, segments: &[PullSegment]) -> Result<Vec<RmaOp>, String> {
        let begun = self.writing.as_ref().ok_or("Pull without Begin")?;
        segments
            .iter()
            .map(|s| {
                let writable = begun.delta.as_ref().map_or(begun.total_len, |d| d.written_len);
                let end = s.file_offset.checked_add(s.len).filter(|end| *end <= writable);
                match (end, usize::try_from(s.file_offset), usize::try_from(s.len)) {
                    (Some(_), Ok(local_offset), Ok(len)) => {
                        Ok(RmaOp { local_offset, remote: s.source, remote_offset: s.source_offset, len })
                    }
                    _ => Err(format!(
                        "segment at file offset {} of {} bytes lies outside the version ({writable} bytes)",
                        s.file_offset, s.len
                    )),
                }
            })
            .collect()
    }

    /// Seal at `now` (`unix_ms` on the wall clock) with the rank's own
    /// checksums, which must fit the layout it began with. The version
    /// stops being written either way.
    pub(crate) fn seal(&mut self, crcs: Vec<Vec<u32>>, now: Instant, unix_ms: u64) -> Result<Sealed, String> {
        let begun = self.writing.take().ok_or("Seal without Begin")?;
        let manifest = Manifest {
            app: self.app.clone(),
            rank: self.rank,
            ranks: begun.ranks,
            epoch: begun.epoch,
            version: begun.version,
            labels: begun.labels,
            total_len: begun.total_len,
            chunk_size: CHUNK_SIZE,
            crcs,
            sealed_unix_ms: unix_ms,
        };
        manifest.validate().map_err(|e| format!("Seal refused: {e}"))?;
        self.last_sealed = Some(manifest.version);
        let transfer_secs = now.saturating_duration_since(begun.started).as_secs_f64();
        Ok(Sealed { manifest, transfer_secs, delta: begun.delta })
    }
}

/// What a Fetch found of the version in the node's store.
#[derive(Debug)]
pub(crate) enum Found {
    /// Not there (lost with its agents, spilled, or the store was wiped);
    /// the store's error.
    Missing(String),
    /// There but unreadable (a damaged manifest); the store's error.
    Unreadable(String),
    /// There, and every chunk matches the rank's checksums.
    Intact,
    /// There, and this does not match the rank's checksums.
    Damaged(String),
}

/// How a Fetch is served.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Serve {
    /// The stored version.
    Stored,
    /// The stored version with its damage named: no PFS copy can replace
    /// it, and the library agrees across ranks on what to do (an older
    /// version, or an error), while a lone process can still restore its
    /// intact labels.
    Damaged(String),
    /// The PFS copy of the same version, loaded first.
    FromPfs {
        /// What is damaged in the stored version, which the copy replaces
        /// (it is removed first); `None` when the store lacks the version.
        replacing: Option<String>,
    },
}

impl SessionCore {
    /// How to serve a Fetch of `version`, given what the store `found`,
    /// whether there is a PFS level, and (asked only for damaged data)
    /// whether the PFS holds a copy of this very version.
    pub(crate) fn serve_fetch(
        &self,
        version: u64,
        found: Found,
        pfs_level: bool,
        pfs_has_copy: impl FnOnce() -> bool,
    ) -> Result<Serve, String> {
        match found {
            Found::Intact => Ok(Serve::Stored),
            Found::Missing(_) if pfs_level => Ok(Serve::FromPfs { replacing: None }),
            Found::Missing(error) | Found::Unreadable(error) => Err(error),
            Found::Damaged(damage) if pfs_level && pfs_has_copy() => Ok(Serve::FromPfs { replacing: Some(damage) }),
            Found::Damaged(damage) => Ok(Serve::Damaged(format!(
                "stored version {version} of rank {} is damaged ({damage}), and the PFS has no copy of it",
                self.rank
            ))),
        }
    }
}

/// Who may open a session: a peer admitted with the node token (another
/// agent taking a rank over), or one that presents the application's
/// capability from the owner's Unix user where the socket's owner can be
/// seen (`seen_uid`; `None` for a peer on another host).
pub(crate) fn admit_session(
    app: &str,
    owner: &Owner,
    privilege: Privilege,
    presented: &str,
    seen_uid: Option<u32>,
) -> Result<(), String> {
    if privilege == Privilege::Node {
        return Ok(());
    }
    if !owner.verifier.admits(presented) {
        return Err(format!("application {app:?}: wrong or missing capability"));
    }
    if let Some(uid) = seen_uid.filter(|uid| *uid != owner.uid) {
        return Err(format!("application {app:?} belongs to uid {}, this session to uid {uid}", owner.uid));
    }
    Ok(())
}

/// Whether `needed` new bytes fit the node's checkpoint memory `budget`
/// (0: no limit) beside the `held` bytes its store holds. The agent decides
/// and creates the file under one lock per node, so that two ranks
/// beginning at once cannot both see room for one.
pub(crate) fn admit(budget: u64, held: u64, needed: u64) -> Result<(), String> {
    if budget > 0 && needed > 0 && held.saturating_add(needed) > budget {
        return Err(format!("{needed} bytes do not fit the node's checkpoint memory ({held} of {budget} bytes held)"));
    }
    Ok(())
}

/// Most ranges one `Deliver` may ask for: a restore asks for one range per
/// step of a label, and a longer list only makes the agent's thread work
/// for one request longer.
pub(crate) const MAX_DELIVER_SEGMENTS: usize = 1024;

/// The writes a `Deliver` of `segments` makes from a fetched version of
/// `exposed` bytes: each op's local offset is the segment's offset in the
/// version. Refused (naming the segment) when a range lies outside the
/// version or its destination, or when there is nothing fetched.
pub(crate) fn deliver_ops(exposed: Option<u64>, segments: &[DeliverSegment]) -> Result<Vec<RmaOp>, String> {
    let exposed = exposed.ok_or("Deliver without a Fetch")?;
    if segments.len() > MAX_DELIVER_SEGMENTS {
        return Err(format!("Deliver of {} ranges refused: at most {MAX_DELIVER_SEGMENTS}", segments.len()));
    }
    segments
        .iter()
        .enumerate()
        .map(|(index, s)| {
            let in_version = s.file_offset.checked_add(s.len).is_some_and(|end| end <= exposed);
            let in_destination = s.destination_offset.checked_add(s.len).is_some_and(|end| end <= s.destination.len);
            match (in_version, in_destination, usize::try_from(s.file_offset), usize::try_from(s.len)) {
                (true, true, Ok(local_offset), Ok(len)) => Ok(RmaOp {
                    local_offset,
                    remote: s.destination,
                    remote_offset: s.destination_offset,
                    len,
                }),
                (false, ..) => Err(format!(
                    "Deliver range {index} (offset {} of the version, {} bytes) lies outside the version ({exposed} bytes)",
                    s.file_offset, s.len
                )),
                _ => Err(format!(
                    "Deliver range {index} (offset {} of the destination, {} bytes) lies outside the destination ({} bytes)",
                    s.destination_offset, s.len, s.destination.len
                )),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use icheck_core::fabric::RemoteRegion;
    use icheck_core::format::{label_crcs, DataKind};

    use super::*;

    fn label(name: &str, offset: u64, len: u64) -> LabelLayout {
        LabelLayout { label: name.into(), kind: DataKind::Binary, offset, len, adapt: None }
    }

    fn session(rank: u32) -> SessionCore {
        SessionCore::open("app", 7, "app".into(), rank).unwrap()
    }

    /// Begins `version` of two labels (8 + 16 bytes) at `now`.
    fn begin(core: &mut SessionCore, version: u64, now: Instant) {
        let checked = core.begin(version, 2, 0, vec![label("a", 0, 8), label("b", 8, 16)], None, |_| false).unwrap();
        assert_eq!(checked.total_len, 24);
        core.begun(checked, true, now);
    }

    #[test]
    fn a_complete_version_is_never_overwritten_nor_retired_on_a_made_up_version() {
        let mut core = session(0);
        let stored = |v: u64| v == 7;
        // Version 7 is complete and stored: a Begin of 7 (or older, stored) is refused.
        let err = core.begin(7, 2, 0, vec![label("a", 0, 8)], Some(7), stored).unwrap_err();
        assert!(err.contains("never overwritten"), "{err}");
        // An older version that is gone, and a newer one, may begin.
        assert!(core.begin(5, 2, 0, vec![label("a", 0, 8)], Some(7), stored).is_ok());
        assert!(core.begin(8, 2, 0, vec![label("a", 0, 8)], Some(7), stored).is_ok());
        // Unknown completeness (an agent started without a record): a stored,
        // never-completed version may be written again.
        assert!(core.begin(7, 2, 0, vec![label("a", 0, 8)], None, stored).is_ok());
        // Complete only of a sealed version, never of an older one.
        let err = core.complete(1000, Some(7), || false).unwrap_err();
        assert!(err.contains("no such version was sealed"), "{err}");
        assert!(core.complete(6, Some(7), || true).unwrap_err().contains("complete already"));
        assert!(core.complete(7, Some(7), || true).is_ok());
        // What this session sealed (spilled versions are not in the store) may complete.
        begin(&mut core, 9, Instant::now());
        let crcs = label_crcs(&[&[0u8; 8], &[0u8; 16]]);
        core.seal(crcs, Instant::now(), 0).unwrap();
        assert!(core.complete(9, Some(7), || false).is_ok());
    }

    #[test]
    fn sessions_need_the_capability_from_the_owner_or_the_node_token() {
        let capability = icheck_core::credentials::Capability::generate().unwrap();
        let owner = Owner { verifier: capability.verifier(), uid: 1000 };
        let key = capability.expose();
        assert!(admit_session("a", &owner, Privilege::Client, key, Some(1000)).is_ok());
        assert!(admit_session("a", &owner, Privilege::Client, key, None).is_ok());
        let err = admit_session("a", &owner, Privilege::Client, "", None).unwrap_err();
        assert!(err.contains("wrong or missing capability"), "{err}");
        assert!(admit_session("a", &owner, Privilege::Client, key, Some(0)).unwrap_err().contains("uid 0"));
        assert!(admit_session("a", &owner, Privilege::Node, "", None).is_ok(), "an agent taking a rank over");
    }

    #[test]
    fn a_session_serves_only_its_agents_application() {
        let err = SessionCore::open("app", 7, "other".into(), 0).unwrap_err();
        assert!(err.contains("agent 7") && err.contains("\"other\""), "{err}");
    }

    #[test]
    fn a_deliver_writes_only_inside_the_fetched_version_and_the_destination() {
        use icheck_core::fabric::RemoteRegion;
        let destination = RemoteRegion { addr: 4096, key: 9, len: 100 };
        let segment =
            |file_offset, destination_offset, len| DeliverSegment { destination, destination_offset, file_offset, len };
        assert_eq!(deliver_ops(None, &[segment(0, 0, 10)]).unwrap_err(), "Deliver without a Fetch");
        let ops = deliver_ops(Some(1000), &[segment(900, 0, 100), segment(0, 50, 50)]).unwrap();
        assert_eq!((ops[0].local_offset, ops[0].remote_offset, ops[0].len), (900, 0, 100));
        assert_eq!((ops[1].local_offset, ops[1].remote_offset, ops[1].len), (0, 50, 50));
        assert_eq!(ops[1].remote, destination);
        let err = deliver_ops(Some(1000), &[segment(0, 0, 10), segment(901, 0, 100)]).unwrap_err();
        assert!(err.contains("range 1") && err.contains("outside the version (1000 bytes)"), "{err}");
        let err = deliver_ops(Some(1000), &[segment(0, 1, 100)]).unwrap_err();
        assert!(err.contains("range 0") && err.contains("outside the destination (100 bytes)"), "{err}");
        assert!(deliver_ops(Some(u64::MAX), &[segment(u64::MAX, 0, 2)]).is_err(), "an overflowing end");
        assert!(deliver_ops(Some(1000), &[segment(0, u64::MAX, 2)]).is_err(), "an overflowing end");
        let many = vec![segment(0, 0, 1); MAX_DELIVER_SEGMENTS + 1];
        assert!(deliver_ops(Some(1000), &many).unwrap_err().contains("at most"));
        assert!(deliver_ops(Some(0), &[]).unwrap().is_empty());
    }

    #[test]
    fn requests_out_of_order_are_refused() {
        let mut core = session(0);
        assert_eq!(core.pull_ops(&[]).unwrap_err(), "Pull without Begin");
        assert_eq!(core.seal(Vec::new(), Instant::now(), 0).unwrap_err(), "Seal without Begin");
        assert!(core.abandon().is_none());
    }

    #[test]
    fn a_begin_must_name_a_version_a_shape_and_a_layout() {
        let core = session(3);
        let labels = || vec![label("a", 0, 8)];
        assert!(core.begin(0, 4, 0, labels(), None, |_| false).unwrap_err().contains("bad version 0"));
        assert!(core.begin(1, 3, 0, labels(), None, |_| false).unwrap_err().contains("rank 3 of 3"));
        assert!(core.begin(1, 0, 0, labels(), None, |_| false).is_err());
        assert!(core
            .begin(1, 4, 0, vec![label("a", 0, 8), label("b", 9, 8)], None, |_| false)
            .unwrap_err()
            .contains("instead of 8"));
        assert!(core.begin(1, 4, 0, vec![label("a", 0, u64::MAX), label("b", u64::MAX, 8)], None, |_| false).is_err());
    }

    #[test]
    fn seal_builds_the_manifest_and_times_the_transfer_on_the_given_clock() {
        let t0 = Instant::now();
        let mut core = session(1);
        begin(&mut core, 5, t0);
        let data = [1u8; 24];
        let crcs = label_crcs(&[&data[..8], &data[8..]]);
        let sealed = core.seal(crcs, t0 + Duration::from_millis(1500), 42).unwrap();
        assert_eq!((sealed.manifest.version, sealed.manifest.rank, sealed.manifest.ranks), (5, 1, 2));
        assert_eq!(sealed.manifest.sealed_unix_ms, 42);
        assert!((sealed.transfer_secs - 1.5).abs() < 1e-9);
        sealed.manifest.verify(&data).unwrap();
        assert_eq!(core.seal(Vec::new(), t0, 0).unwrap_err(), "Seal without Begin", "a version seals once");
    }

    #[test]
    fn checksums_that_do_not_fit_the_layout_refuse_the_seal_and_end_the_version() {
        let t0 = Instant::now();
        let mut core = session(0);
        begin(&mut core, 1, t0);
        let err = core.seal(vec![vec![0]], t0, 0).unwrap_err();
        assert!(err.starts_with("Seal refused"), "{err}");
        assert!(core.abandon().is_none(), "the refused version is no longer being written");
    }

    #[test]
    fn a_new_begin_abandons_the_unsealed_version() {
        let t0 = Instant::now();
        let mut core = session(0);
        begin(&mut core, 1, t0);
        assert_eq!(core.abandon(), Some(Abandoned { version: 1, in_memory: true }));
        begin(&mut core, 2, t0);
        let checked = core.begin(3, 2, 0, Vec::new(), None, |_| false).unwrap();
        core.begun(checked, false, t0);
        assert_eq!(core.abandon(), Some(Abandoned { version: 3, in_memory: false }));
    }

    #[test]
    fn an_incremental_version_writes_only_its_changed_blocks_and_seals_its_map() {
        use icheck_core::delta::{BlockMap, BlockRun, BLOCK_SIZE};
        let t0 = Instant::now();
        let mut core = session(0);
        let total = 3 * BLOCK_SIZE + 10;
        let labels = vec![label("a", 0, total)];
        let parent = BlockMap::whole(4, total);
        let mut checked = core.begin(5, 2, 0, labels.clone(), None, |_| false).unwrap();
        // A parent of another length, or not older, lends nothing.
        assert!(checked.make_incremental(&BlockMap::whole(4, total - 1), &[]).is_err());
        assert!(checked.make_incremental(&BlockMap::whole(5, total), &[]).is_err());
        assert!(checked.make_incremental(&parent, &[BlockRun { first: 3, count: 2 }]).is_err(), "past the end");
        assert_eq!(checked.delta, None, "a refused delta leaves the version whole");
        checked.make_incremental(&parent, &[BlockRun { first: 3, count: 1 }]).unwrap();
        assert_eq!(checked.written_len(), 10, "only the short last block");
        core.begun(checked, true, t0);
        let source = RemoteRegion { addr: 0x1000, len: 64, key: 9 };
        let segment = |file_offset, len| PullSegment { source, source_offset: 0, file_offset, len };
        assert!(core.pull_ops(&[segment(0, 10)]).is_ok());
        assert!(core.pull_ops(&[segment(0, 11)]).unwrap_err().contains("outside the version (10 bytes)"));
        let crcs = vec![vec![0; 1]];
        let sealed = core.seal(crcs, t0, 0).unwrap();
        let delta = sealed.delta.expect("sealed as incremental");
        assert_eq!(delta.map, parent.next(5, &[BlockRun { first: 3, count: 1 }]));
        // A spilled version goes to the PFS whole.
        let mut checked = core.begin(6, 2, 0, labels, None, |_| false).unwrap();
        checked.make_incremental(&parent, &[]).unwrap();
        core.begun(checked, false, t0);
        assert!(core.seal(vec![vec![0; 1]], t0, 0).unwrap().delta.is_none());
    }

    #[test]
    fn pulls_may_write_only_inside_the_version() {
        let t0 = Instant::now();
        let mut core = session(0);
        begin(&mut core, 1, t0);
        let source = RemoteRegion { addr: 0x1000, len: 64, key: 9 };
        let segment = |file_offset, len| PullSegment { source, source_offset: 4, file_offset, len };
        let ops = core.pull_ops(&[segment(0, 8), segment(8, 16)]).unwrap();
        assert_eq!((ops[1].local_offset, ops[1].len, ops[1].remote_offset), (8, 16, 4));
        assert!(core.pull_ops(&[segment(20, 5)]).unwrap_err().contains("outside the version (24 bytes)"));
        assert!(core.pull_ops(&[segment(u64::MAX, 2)]).is_err(), "an overflowing end is refused");
    }

    #[test]
    fn a_fetch_serves_intact_data_and_falls_back_to_the_pfs_copy_of_the_same_version() {
        let core = session(1);
        let never = || -> bool { panic!("the PFS is asked only about damaged data") };
        assert_eq!(core.serve_fetch(4, Found::Intact, true, never), Ok(Serve::Stored));
        let missing = || Found::Missing("version 4 of rank 1 is not stored".into());
        assert_eq!(core.serve_fetch(4, missing(), true, never), Ok(Serve::FromPfs { replacing: None }));
        assert_eq!(core.serve_fetch(4, missing(), false, never).unwrap_err(), "version 4 of rank 1 is not stored");
        let unreadable = Found::Unreadable("bad manifest".into());
        assert_eq!(core.serve_fetch(4, unreadable, true, never).unwrap_err(), "bad manifest");
        let damaged = || Found::Damaged("label \"a\": chunk 2".into());
        let replaced = Some("label \"a\": chunk 2".to_string());
        assert_eq!(core.serve_fetch(4, damaged(), true, || true), Ok(Serve::FromPfs { replacing: replaced }));
        let Ok(Serve::Damaged(report)) = core.serve_fetch(4, damaged(), true, || false) else { panic!() };
        assert!(report.contains("version 4 of rank 1") && report.contains("chunk 2"), "{report}");
        assert!(matches!(core.serve_fetch(4, damaged(), false, never), Ok(Serve::Damaged(_))));
    }

    #[test]
    fn concurrent_begins_never_overrun_the_node_budget() {
        // Two ranks of one node begin 60-byte versions against a 100-byte
        // budget. The agent orders their admissions (one lock per node);
        // whichever comes second sees the first's file and spills.
        let budget = 100;
        let mut held = 0u64;
        let t0 = Instant::now();
        let mut placed = Vec::new();
        for rank in [0u32, 1] {
            let mut core = session(rank);
            let checked = core.begin(1, 2, 0, vec![label("x", 0, 60)], None, |_| false).unwrap();
            let fits = admit(budget, held, checked.total_len).is_ok();
            if fits {
                held += checked.total_len; // the file now exists in the store
            }
            core.begun(checked, fits, t0);
            placed.push(fits);
        }
        assert_eq!(placed, [true, false]);
        assert!(held <= budget);
        let err = admit(budget, held, 60).unwrap_err();
        assert!(err.contains("60 bytes") && err.contains("60 of 100"), "{err}");
        // Reusing a spare file needs no new bytes: admitted even when full;
        // no budget means no limit.
        assert!(admit(budget, 100, 0).is_ok());
        assert!(admit(0, u64::MAX, 60).is_ok());
    }
}
