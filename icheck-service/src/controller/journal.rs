//! The controller's durable state: an append-only journal of what it must
//! not forget (applications, their agents and mapping, complete versions,
//! drained nodes), fsync'd before the controller acknowledges anything it
//! records, replayed on start and compacted as it grows.
//!
//! File layout (`<state dir>/controller.journal`):
//!
//! ```text
//! "ICKJRNL1"                         8-byte magic
//! [len: u32 LE][crc32c: u32 LE][bincode Event; len bytes]   repeated
//! ```
//!
//! Architecture invariants:
//! * An event is on stable storage (written and `fdatasync`'d) before the
//!   caller acts on it; a failed append leaves the state unchanged.
//! * Replay stops at the first record that is truncated, fails its
//!   checksum or does not decode. The valid prefix is the state; the file
//!   is cut back to it (the ignored bytes are kept beside it for
//!   forensics) and [`JournalReport::damage`] says what was ignored.
//! * Compaction writes the whole state as fresh events to a temporary
//!   file, syncs it and renames it over the journal: a crash leaves either
//!   the old journal or the new one, never a mix.
//! * [`Replayed`] is pure state: applying the same events gives the same
//!   state, which is what both replay and compaction rely on.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use bincode::Options;
use serde::{Deserialize, Serialize};

use icheck_core::credentials::Owner;
use icheck_core::protocol::{AgentInfo, AppRegistration, JournalReport, VersionRecord};
use icheck_core::redundancy::{Group, Plan, Redundancy};

/// File name of the journal in the controller's state directory.
pub const JOURNAL_FILE: &str = "controller.journal";
const MAGIC: &[u8; 8] = b"ICKJRNL1";
/// No event is anywhere near this large; a length beyond it is damage.
const MAX_RECORD: u32 = 16 << 20;
/// Complete versions remembered per application (newest last): when the
/// newest cannot be found in agent memory after a restart, an older one
/// the agents still hold may be.
pub const VERSIONS_KEPT: usize = 4;
/// Events appended after which the journal is compacted.
const COMPACT_AFTER: u64 = 4096;

/// One thing the controller must not forget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A controller process started; its agent ids are unique to it.
    Started {
        /// How many controller processes used this journal, this one included.
        incarnation: u32,
    },
    /// An application got agents (registration, re-registration, or a
    /// change of its agents).
    Placed {
        /// The registration in force.
        registration: AppRegistration,
        /// Its agents, in rank-mapping order.
        agents: Vec<AgentInfo>,
        /// Who owns it (the digest of its capability, never the capability).
        owner: Option<Owner>,
    },
    /// A version of an application completed.
    VersionComplete {
        /// Application.
        app: String,
        /// The version.
        record: VersionRecord,
        /// Files it was written as (processes in MR mode, nodes in SHMR).
        writers: u32,
    },
    /// An application finished with IC_PERSIST (or started again).
    Persisted {
        /// Application.
        app: String,
        /// Whether its checkpoints persist without a running job.
        persisted: bool,
    },
    /// An application was finished without IC_PERSIST, or deleted.
    Forgotten {
        /// Application.
        app: String,
    },
    /// An operator drained a node (or opened it again).
    Drained {
        /// Node.
        node: String,
        /// Draining or open.
        drain: bool,
    },
    /// The controller's fencing epoch (raised by every takeover).
    Epoch {
        /// The epoch now in force.
        epoch: u64,
        /// When the last takeover happened (Unix ms), if one did.
        took_over_unix_ms: Option<u64>,
        /// Takeovers so far.
        takeovers: u64,
    },
    /// Events recorded so far (ends a compacted journal, whose events are
    /// fewer than were recorded).
    Sequence {
        /// The count.
        events: u64,
    },
    /// Every piece of a version's redundancy is in place, as journals
    /// recorded it before groups could be sliced: replayed, never written
    /// ([`Event::Protected`] replaced it).
    ProtectedUnsliced {
        /// Application.
        app: String,
        /// The version, its plan and who holds it.
        protection: UnslicedProtection,
    },
    /// Every piece of a version's redundancy is in place (appended last in
    /// the enum: journals written before it existed still decode).
    Protected {
        /// Application.
        app: String,
        /// The version, its plan and who holds it.
        protection: JournaledProtection,
    },
}

/// [`JournaledProtection`] as journals wrote it before a Reed-Solomon
/// group could be sliced (`Group::slices`): the same fields, its groups
/// without slices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnslicedProtection {
    record: VersionRecord,
    policy: Redundancy,
    copies: BTreeMap<u32, Vec<usize>>,
    /// Each group's members and parity slots.
    groups: Vec<(Vec<Option<u32>>, Vec<usize>)>,
    agents: Vec<AgentInfo>,
    units: u32,
}

impl From<UnslicedProtection> for JournaledProtection {
    fn from(old: UnslicedProtection) -> JournaledProtection {
        let groups = old.groups.into_iter().map(|(members, parity)| Group { members, parity, slices: Vec::new() });
        JournaledProtection {
            record: old.record,
            policy: old.policy,
            plan: Plan { copies: old.copies, groups: groups.collect() },
            agents: old.agents,
            units: old.units,
        }
    }
}

/// A protected version as the journal remembers it: enough to rebuild it
/// after a lost node, also when the node was lost while no controller ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournaledProtection {
    /// The version's record.
    pub record: VersionRecord,
    /// The policy it was protected under.
    pub policy: Redundancy,
    /// Where its copies or parity shards are (slots of `agents`).
    pub plan: Plan,
    /// The application's agents then (rank-mapping order): the primaries
    /// and the pieces' holders.
    pub agents: Vec<AgentInfo>,
    /// Ranks (or SHMR nodes) of the version.
    pub units: u32,
}

/// A complete version as the journal remembers it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JournaledVersion {
    /// The record the library reported.
    pub record: VersionRecord,
    /// Files it was written as (see [`Event::VersionComplete`]).
    pub writers: u32,
}

/// An application as the journal remembers it.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct JournaledApp {
    /// The registration in force (`None` only for an application whose
    /// placement was never journaled, which replay does not produce).
    pub registration: Option<AppRegistration>,
    /// Its agents when last placed.
    pub agents: Vec<AgentInfo>,
    /// Its newest complete versions, oldest first (at most [`VERSIONS_KEPT`]).
    pub versions: Vec<JournaledVersion>,
    /// Finished with IC_PERSIST.
    pub persisted: bool,
    /// Who owns it.
    pub owner: Option<Owner>,
    /// Its newest protected version, if any.
    pub protected: Option<JournaledProtection>,
}

/// The state the events describe.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Replayed {
    /// Controller processes that used the journal.
    pub incarnation: u32,
    /// Applications by name.
    pub apps: BTreeMap<String, JournaledApp>,
    /// Nodes an operator drained.
    pub drained: BTreeSet<String>,
    /// The fencing epoch in force (0: none recorded yet).
    pub epoch: u64,
    /// When the last takeover happened (Unix ms), if one did.
    pub took_over_unix_ms: Option<u64>,
    /// Takeovers so far.
    pub takeovers: u64,
    /// Events ever recorded (through compactions): of two controllers at
    /// one epoch, the one with more holds the newer state.
    pub sequence: u64,
}

impl Replayed {
    /// Applies one event.
    pub fn apply(&mut self, event: &Event) {
        self.sequence += 1;
        match event {
            Event::Started { incarnation } => self.incarnation = self.incarnation.max(*incarnation),
            Event::Placed { registration, agents, owner } => {
                let app = self.apps.entry(registration.name.clone()).or_default();
                app.registration = Some(registration.clone());
                app.agents = agents.clone();
                app.owner = owner.or(app.owner);
            }
            Event::VersionComplete { app, record, writers } => {
                let entry = self.apps.entry(app.clone()).or_default();
                entry.versions.retain(|v| v.record.version < record.version);
                entry.versions.push(JournaledVersion { record: record.clone(), writers: *writers });
                let excess = entry.versions.len().saturating_sub(VERSIONS_KEPT);
                entry.versions.drain(..excess);
            }
            Event::Persisted { app, persisted } => {
                if let Some(entry) = self.apps.get_mut(app) {
                    entry.persisted = *persisted;
                }
            }
            Event::Forgotten { app } => {
                self.apps.remove(app);
            }
            Event::Drained { node, drain } => {
                if *drain {
                    self.drained.insert(node.clone());
                } else {
                    self.drained.remove(node);
                }
            }
            Event::Sequence { events } => self.sequence = *events,
            Event::Protected { app, protection } => {
                if let Some(entry) = self.apps.get_mut(app) {
                    entry.protected = Some(protection.clone());
                }
            }
            Event::ProtectedUnsliced { app, protection } => {
                if let Some(entry) = self.apps.get_mut(app) {
                    entry.protected = Some(protection.clone().into());
                }
            }
            Event::Epoch { epoch, took_over_unix_ms, takeovers } => {
                if *epoch >= self.epoch {
                    self.epoch = *epoch;
                    self.took_over_unix_ms = *took_over_unix_ms;
                    self.takeovers = *takeovers;
                }
            }
        }
    }

    /// The events that rebuild this state from nothing (what compaction
    /// writes). Applications without a journaled placement are left out:
    /// nothing could restart them.
    pub fn snapshot(&self) -> Vec<Event> {
        let mut events = vec![Event::Started { incarnation: self.incarnation }];
        if self.epoch > 0 {
            events.push(Event::Epoch {
                epoch: self.epoch,
                took_over_unix_ms: self.took_over_unix_ms,
                takeovers: self.takeovers,
            });
        }
        for (name, app) in &self.apps {
            let Some(registration) = &app.registration else { continue };
            events.push(Event::Placed {
                registration: registration.clone(),
                agents: app.agents.clone(),
                owner: app.owner,
            });
            for version in &app.versions {
                events.push(Event::VersionComplete {
                    app: name.clone(),
                    record: version.record.clone(),
                    writers: version.writers,
                });
            }
            if app.persisted {
                events.push(Event::Persisted { app: name.clone(), persisted: true });
            }
            if let Some(protection) = &app.protected {
                events.push(Event::Protected { app: name.clone(), protection: protection.clone() });
            }
        }
        events.extend(self.drained.iter().map(|node| Event::Drained { node: node.clone(), drain: true }));
        events.push(Event::Sequence { events: self.sequence });
        events
    }
}

/// Why the journal cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A file operation failed.
    #[error("controller journal {path}: cannot {what}: {error}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
    /// The file is not a journal (wrong magic): refused rather than overwritten.
    #[error("{path} is not an icheck controller journal (it does not start with {magic:?}); move it away or point the controller at another state directory")]
    NotAJournal {
        /// The file.
        path: PathBuf,
        /// The magic expected.
        magic: &'static str,
    },
    /// An event could not be encoded.
    #[error("controller journal: cannot encode an event: {0}")]
    Encode(String),
}

fn codec() -> impl bincode::Options {
    bincode::DefaultOptions::new().with_fixint_encoding().with_limit(u64::from(MAX_RECORD))
}

/// One record's bytes: length, checksum, payload.
fn encode_record(event: &Event) -> Result<Vec<u8>, JournalError> {
    let payload = codec().serialize(event).map_err(|e| JournalError::Encode(e.to_string()))?;
    let len = u32::try_from(payload.len()).map_err(|_| JournalError::Encode("event too large".into()))?;
    let mut record = Vec::with_capacity(payload.len() + 8);
    record.extend_from_slice(&len.to_le_bytes());
    record.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    record.extend_from_slice(&payload);
    Ok(record)
}

/// What parsing a journal's bytes gave: the events of the valid prefix,
/// its length in bytes, and what was wrong after it (if anything).
#[derive(Debug, PartialEq)]
pub struct Parsed {
    /// Events of the valid prefix.
    pub events: Vec<Event>,
    /// Bytes of the valid prefix (magic included).
    pub valid_len: usize,
    /// Why the rest was ignored.
    pub damage: Option<String>,
}

/// Parses a journal's bytes (after the magic was checked; bytes shorter
/// than the magic hold no event).
pub fn parse(bytes: &[u8]) -> Parsed {
    let mut events = Vec::new();
    let mut at = MAGIC.len();
    let damage = loop {
        let rest = bytes.get(at..).unwrap_or_default();
        if rest.is_empty() {
            break None;
        }
        let number = events.len() + 1;
        if rest.len() < 8 {
            break Some(format!(
                "record {number} at byte {at} is truncated (its 8-byte header has {} bytes)",
                rest.len()
            ));
        }
        let len = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        if len > MAX_RECORD {
            break Some(format!("record {number} at byte {at} claims {len} bytes, more than any event"));
        }
        let Some(payload) = rest.get(8..8 + len as usize) else {
            break Some(format!(
                "record {number} at byte {at} is truncated (needs {len} bytes, {} are left)",
                rest.len() - 8
            ));
        };
        if crc32c::crc32c(payload) != crc {
            break Some(format!("record {number} at byte {at} fails its checksum"));
        }
        match codec().deserialize::<Event>(payload) {
            Ok(event) => events.push(event),
            Err(err) => break Some(format!("record {number} at byte {at} does not decode: {err}")),
        }
        at += 8 + len as usize;
    };
    Parsed { events, valid_len: at, damage }
}

/// The open journal: the file, appended to, and the state it describes.
pub struct Journal {
    path: PathBuf,
    file: File,
    state: Replayed,
    records: u64,
    since_compaction: u64,
    damage: Option<String>,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> JournalError + 'a {
    move |error| JournalError::Io { what, path: path.to_path_buf(), error }
}

impl Journal {
    /// Opens (or creates) the journal in `dir`, replays it, and appends a
    /// [`Event::Started`] for this controller process.
    pub fn open(dir: &Path) -> Result<Journal, JournalError> {
        let path = dir.join(JOURNAL_FILE);
        std::fs::create_dir_all(dir).map_err(io("create its directory", dir))?;
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(err) => return Err(io("read it", &path)(err)),
        };
        let (parsed, damage) = if bytes.len() < MAGIC.len() {
            // Empty, or a crash while the magic was written: a new journal.
            (Parsed { events: Vec::new(), valid_len: 0, damage: None }, None)
        } else if &bytes[..MAGIC.len()] != MAGIC {
            return Err(JournalError::NotAJournal { path, magic: "ICKJRNL1" });
        } else {
            let parsed = parse(&bytes);
            let damage = parsed.damage.as_ref().map(|why| {
                let ignored = bytes.len() - parsed.valid_len;
                let kept = path.with_extension(format!("journal.damaged-{}", std::process::id()));
                let saved = std::fs::write(&kept, &bytes[parsed.valid_len..]).is_ok();
                format!(
                    "journal {} is damaged: {why}; its first {} events were used and the {ignored} bytes after them ignored{}",
                    path.display(),
                    parsed.events.len(),
                    if saved { format!(" (kept in {})", kept.display()) } else { String::new() }
                )
            });
            (parsed, damage)
        };
        let mut state = Replayed::default();
        for event in &parsed.events {
            state.apply(event);
        }
        let records = parsed.events.len() as u64;
        let mut journal =
            Journal { file: Self::open_for_append(&path)?, path, state, records, since_compaction: 0, damage };
        if parsed.valid_len < MAGIC.len() || journal.damage.is_some() || records > COMPACT_AFTER {
            // New, damaged (cut back to the valid prefix) or long: start
            // from a clean, compact file.
            journal.compact()?;
        }
        let incarnation = journal.state.incarnation + 1;
        journal.append(&Event::Started { incarnation })?;
        Ok(journal)
    }

    /// Replaces the journal in `dir` by `events` (a primary's snapshot, as
    /// a standby receives it): written to a temporary file, synced and
    /// renamed, as compaction does. Appends no [`Event::Started`]: this
    /// process has not acted as a controller on it.
    pub fn mirror(dir: &Path, events: &[Event]) -> Result<Journal, JournalError> {
        let path = dir.join(JOURNAL_FILE);
        std::fs::create_dir_all(dir).map_err(io("create its directory", dir))?;
        let mut state = Replayed::default();
        for event in events {
            state.apply(event);
        }
        // Compaction writes the state's events and reopens the file.
        let placeholder = File::open(dir).map_err(io("open its directory", dir))?;
        let mut journal = Journal { file: placeholder, path, state, records: 0, since_compaction: 0, damage: None };
        journal.compact()?;
        Ok(journal)
    }

    /// The state of the journal in `dir` as it stands, read without
    /// changing anything (empty if there is none or it is unreadable).
    pub fn peek(dir: &Path) -> Replayed {
        let mut state = Replayed::default();
        if let Ok(bytes) = std::fs::read(dir.join(JOURNAL_FILE)) {
            if bytes.len() >= MAGIC.len() && &bytes[..MAGIC.len()] == MAGIC {
                parse(&bytes).events.iter().for_each(|e| state.apply(e));
            }
        }
        state
    }

    fn open_for_append(path: &Path) -> Result<File, JournalError> {
        OpenOptions::new().create(true).append(true).open(path).map_err(io("open it for appending", path))
    }

    /// Writes `event` and syncs it to stable storage, then applies it to
    /// the state. On error the state is unchanged.
    pub fn append(&mut self, event: &Event) -> Result<(), JournalError> {
        let record = encode_record(event)?;
        icheck_core::failpoint::hit("journal.before_append");
        self.file.write_all(&record).map_err(io("append to it", &self.path))?;
        self.file.sync_data().map_err(io("sync it", &self.path))?;
        self.state.apply(event);
        self.records += 1;
        self.since_compaction += 1;
        if self.since_compaction >= COMPACT_AFTER {
            if let Err(err) = self.compact() {
                // The appended journal is still whole; compaction retries later.
                tracing::warn!(%err, "cannot compact the controller journal");
            }
        }
        Ok(())
    }

    /// Rewrites the journal as the events of its current state.
    pub fn compact(&mut self) -> Result<(), JournalError> {
        let tmp = self.path.with_extension("journal.tmp");
        let events = self.state.snapshot();
        let mut bytes = MAGIC.to_vec();
        for event in &events {
            bytes.extend(encode_record(event)?);
        }
        let mut file = File::create(&tmp).map_err(io("create its compacted copy", &tmp))?;
        file.write_all(&bytes).and_then(|_| file.sync_all()).map_err(io("write its compacted copy", &tmp))?;
        std::fs::rename(&tmp, &self.path).map_err(io("replace it by its compacted copy", &self.path))?;
        if let Some(dir) = self.path.parent() {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io("sync its directory", dir))?;
        }
        self.file = Self::open_for_append(&self.path)?;
        self.records = events.len() as u64;
        self.since_compaction = 0;
        Ok(())
    }

    /// The state the journal describes.
    pub fn state(&self) -> &Replayed {
        &self.state
    }

    /// What operators see of it.
    pub fn report(&self) -> JournalReport {
        JournalReport {
            path: self.path.display().to_string(),
            records: self.records,
            bytes: std::fs::metadata(&self.path).map_or(0, |m| m.len()),
            incarnation: self.state.incarnation,
            damage: self.damage.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::protocol::TransferMode;

    fn registration(name: &str) -> AppRegistration {
        AppRegistration {
            name: name.into(),
            ranks: 4,
            nodes: 1,
            ranks_per_node: 4,
            mode: TransferMode::Mr,
            pfs_interval: 0,
            compression: icheck_core::pfs::CompressionPolicy::Never,
            encrypted: false,
            redundancy: None,
        }
    }

    fn record(version: u64) -> VersionRecord {
        VersionRecord { version, ranks: 4, epoch: 0, bytes: 1 << 20, commit_secs: 0.1, completed_unix_ms: 7 }
    }

    fn complete(app: &str, version: u64) -> Event {
        Event::VersionComplete { app: app.into(), record: record(version), writers: 4 }
    }

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("icheck-journal-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn replay_keeps_the_newest_versions_and_forgets_what_was_forgotten() {
        let mut state = Replayed::default();
        state.apply(&Event::Placed { registration: registration("a"), agents: vec![], owner: None });
        state.apply(&Event::Placed { registration: registration("b"), agents: vec![], owner: None });
        for version in 1..=6 {
            state.apply(&complete("a", version));
        }
        let protection = JournaledProtection {
            record: record(6),
            policy: "rs:2+1".parse().unwrap(),
            plan: Plan::default(),
            agents: vec![],
            units: 4,
        };
        state.apply(&Event::Protected { app: "a".into(), protection: protection.clone() });
        state.apply(&Event::Protected { app: "b".into(), protection: protection.clone() });
        state.apply(&Event::Forgotten { app: "b".into() });
        state.apply(&Event::Drained { node: "n1".into(), drain: true });
        assert_eq!(state.apps["a"].protected.as_ref(), Some(&protection));
        let a = &state.apps["a"];
        assert_eq!(a.versions.iter().map(|v| v.record.version).collect::<Vec<_>>(), vec![3, 4, 5, 6]);
        assert!(!state.apps.contains_key("b"));
        assert!(state.drained.contains("n1"));
        // The snapshot rebuilds the same state.
        let mut rebuilt = Replayed::default();
        state.snapshot().iter().for_each(|e| rebuilt.apply(e));
        assert_eq!(rebuilt, state);
    }

    #[test]
    fn a_protection_journaled_before_groups_were_sliced_still_replays() {
        // The types an older controller wrote, and the event's index then
        // (the ninth variant; bincode writes it as a u32).
        #[derive(Serialize)]
        struct OldGroup {
            members: Vec<Option<u32>>,
            parity: Vec<usize>,
        }
        #[derive(Serialize)]
        struct OldPlan {
            copies: BTreeMap<u32, Vec<usize>>,
            groups: Vec<OldGroup>,
        }
        #[derive(Serialize)]
        struct OldProtection {
            record: VersionRecord,
            policy: Redundancy,
            plan: OldPlan,
            agents: Vec<AgentInfo>,
            units: u32,
        }
        let old = OldProtection {
            record: record(6),
            policy: "rs:2+1".parse().unwrap(),
            plan: OldPlan {
                copies: BTreeMap::new(),
                groups: vec![OldGroup { members: vec![Some(0), Some(1)], parity: vec![2] }],
            },
            agents: vec![],
            units: 2,
        };
        let framed = codec().serialize(&(8u32, "a", &old)).unwrap();
        let decoded: Event = codec().deserialize(&framed).unwrap();
        assert!(matches!(&decoded, Event::ProtectedUnsliced { .. }), "{decoded:?}");
        let mut state = Replayed::default();
        state.apply(&Event::Placed { registration: registration("a"), agents: vec![], owner: None });
        state.apply(&decoded);
        let protected = state.apps["a"].protected.clone().expect("replayed");
        assert_eq!(protected.plan.groups, [Group { members: vec![Some(0), Some(1)], parity: vec![2], slices: vec![] }]);
        assert_eq!((protected.record, protected.units), (record(6), 2));
    }

    #[test]
    fn a_mirrored_journal_is_the_primary_s_state_and_keeps_its_epoch() {
        let dir = dir("mirror");
        let mut primary = Replayed::default();
        primary.apply(&Event::Started { incarnation: 3 });
        primary.apply(&Event::Epoch { epoch: 2, took_over_unix_ms: Some(9), takeovers: 1 });
        primary.apply(&Event::Placed { registration: registration("a"), agents: vec![], owner: None });
        primary.apply(&complete("a", 5));
        // An older epoch never lowers the one in force.
        primary.apply(&Event::Epoch { epoch: 1, took_over_unix_ms: None, takeovers: 0 });
        assert_eq!((primary.epoch, primary.takeovers, primary.sequence), (2, 1, 5));
        let mut mirror = Journal::mirror(&dir, &primary.snapshot()).unwrap();
        assert_eq!(mirror.state(), &primary);
        mirror.append(&complete("a", 6)).unwrap();
        mirror.append(&Event::Epoch { epoch: 3, took_over_unix_ms: Some(10), takeovers: 2 }).unwrap();
        drop(mirror);
        // The standby that takes over opens it as its own: a new incarnation.
        let reopened = Journal::open(&dir).unwrap();
        let state = reopened.state();
        assert_eq!((state.incarnation, state.epoch, state.takeovers), (4, 3, 2));
        // Counted through the snapshot: 5, then two appends, then Started.
        assert_eq!(state.sequence, 8);
        assert_eq!(state.apps["a"].versions.last().map(|v| v.record.version), Some(6));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_journal_survives_reopening_and_counts_incarnations() {
        let dir = dir("reopen");
        {
            let mut journal = Journal::open(&dir).unwrap();
            journal.append(&Event::Placed { registration: registration("a"), agents: vec![], owner: None }).unwrap();
            journal.append(&complete("a", 1)).unwrap();
        }
        let journal = Journal::open(&dir).unwrap();
        assert_eq!(journal.state().incarnation, 2);
        assert_eq!(journal.state().apps["a"].versions[0].record, record(1));
        assert_eq!(journal.report().damage, None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every way the tail can be damaged: cut anywhere inside the last
    /// record, or a flipped byte in it. The valid prefix is used, the file
    /// is cut back to it, and the report says what was ignored.
    #[test]
    fn a_damaged_tail_is_detected_and_the_valid_prefix_used() {
        let dir = dir("damage");
        {
            let mut journal = Journal::open(&dir).unwrap();
            journal.append(&Event::Placed { registration: registration("a"), agents: vec![], owner: None }).unwrap();
            journal.append(&complete("a", 1)).unwrap();
            journal.append(&complete("a", 2)).unwrap();
        }
        let path = dir.join(JOURNAL_FILE);
        let whole = std::fs::read(&path).unwrap();
        let last = encode_record(&complete("a", 2)).unwrap().len();
        let mut damaged: Vec<(String, Vec<u8>)> =
            (1..last).map(|cut| (format!("cut {cut} bytes"), whole[..whole.len() - cut].to_vec())).collect();
        for flip in [whole.len() - last, whole.len() - last + 5, whole.len() - 1] {
            let mut bytes = whole.clone();
            bytes[flip] ^= 0x40;
            damaged.push((format!("flipped byte {flip}"), bytes));
        }
        for (what, bytes) in damaged {
            std::fs::write(&path, &bytes).unwrap();
            let journal = Journal::open(&dir).unwrap();
            let versions: Vec<u64> = journal.state().apps["a"].versions.iter().map(|v| v.record.version).collect();
            assert_eq!(versions, vec![1], "{what}");
            let damage = journal.report().damage.unwrap_or_else(|| panic!("{what}: damage not reported"));
            assert!(damage.contains("is damaged") && damage.contains(JOURNAL_FILE), "{what}: {damage}");
            drop(journal);
            // Cut back: the next open finds no damage, and still version 1.
            let again = Journal::open(&dir).unwrap();
            assert_eq!(again.report().damage, None, "{what}");
            assert_eq!(again.state().apps["a"].versions.len(), 1, "{what}");
            drop(again);
            std::fs::write(&path, &whole).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_not_a_journal_is_refused_not_overwritten() {
        let dir = dir("foreign");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(JOURNAL_FILE), b"precious data, not a journal").unwrap();
        let err = Journal::open(&dir).err().expect("refused");
        assert!(err.to_string().contains("is not an icheck controller journal"), "{err}");
        assert_eq!(std::fs::read(dir.join(JOURNAL_FILE)).unwrap(), b"precious data, not a journal");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn compaction_keeps_the_state_and_shrinks_the_file() {
        let dir = dir("compact");
        let mut journal = Journal::open(&dir).unwrap();
        journal.append(&Event::Placed { registration: registration("a"), agents: vec![], owner: None }).unwrap();
        for version in 1..=200 {
            journal.append(&complete("a", version)).unwrap();
        }
        let before = journal.report().bytes;
        let state = journal.state().clone();
        journal.compact().unwrap();
        assert!(journal.report().bytes < before / 10, "{} -> {}", before, journal.report().bytes);
        drop(journal);
        let reopened = Journal::open(&dir).unwrap();
        assert_eq!(reopened.state().apps, state.apps);
        let _ = std::fs::remove_dir_all(&dir);
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// A valid journal of a few events, and the events.
        fn journal() -> (Vec<u8>, Vec<Event>) {
            let events = vec![
                Event::Started { incarnation: 1 },
                Event::Placed { registration: registration("a"), agents: vec![], owner: None },
                complete("a", 1),
                complete("a", 2),
                Event::Drained { node: "n".into(), drain: true },
            ];
            let mut bytes = MAGIC.to_vec();
            for event in &events {
                bytes.extend(encode_record(event).unwrap());
            }
            (bytes, events)
        }

        fn cases() -> ProptestConfig {
            let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(500);
            ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
        }

        proptest! {
            #![proptest_config(cases())]

            /// Random bytes after the magic: no panic, no event without a
            /// valid checksum.
            #[test]
            fn random_journals_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..4096)) {
                let mut bytes = MAGIC.to_vec();
                bytes.extend(tail);
                let parsed = parse(&bytes);
                prop_assert!(parsed.valid_len <= bytes.len());
            }

            /// A damaged journal yields a prefix of what was written, never
            /// an altered event.
            #[test]
            fn a_damaged_journal_replays_a_prefix_of_its_events(
                edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
                cut in proptest::option::of(any::<usize>()),
            ) {
                let (mut bytes, events) = journal();
                for (at, byte) in &edits {
                    let len = bytes.len() - MAGIC.len();
                    bytes[MAGIC.len() + at % len] = *byte;
                }
                if let Some(cut) = cut {
                    bytes.truncate(cut % (bytes.len() + 1));
                }
                let parsed = parse(&bytes);
                prop_assert!(parsed.events.len() <= events.len());
                prop_assert_eq!(&parsed.events[..], &events[..parsed.events.len()]);
            }

            /// Any file where the journal should be: open either refuses it
            /// or replays it; it never panics.
            #[test]
            fn open_survives_any_file(bytes in proptest::collection::vec(any::<u8>(), 0..512), magic in any::<bool>()) {
                let dir = std::env::temp_dir().join(format!("icheck-journal-fuzz-{}", std::process::id()));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).unwrap();
                let mut file = if magic { MAGIC.to_vec() } else { Vec::new() };
                file.extend(bytes);
                std::fs::write(dir.join(JOURNAL_FILE), &file).unwrap();
                let _ = Journal::open(&dir);
                let _ = Journal::peek(&dir);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}
