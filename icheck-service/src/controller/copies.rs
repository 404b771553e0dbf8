//! An application's PFS copies as a state machine that does no I/O (thesis
//! §6.2.3.2): which recorded version is copied when, which waits, which is
//! skipped, when a copy is whole, and what the status API reports.
//!
//! Architecture invariant: nothing here sends, writes or reads a clock. The
//! controller asks [`CopyBook`] what to do, performs it (asks the agents to
//! copy, completes the PFS version on a blocking thread) and reports back.
//! Commits that come faster than copies are the race this book settles: at
//! most one copy per application runs, the newest due version waits, an
//! older waiting one is counted as skipped, and when the running copy ends
//! the application's newest version is copied.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::{BTreeMap, BTreeSet};

use icheck_core::pfs::RankEntry;
use icheck_core::protocol::{PfsCopyHealth, PfsCopyStats};

/// A copy whose agents have not all answered yet.
#[derive(Debug)]
struct PendingCopy {
    /// Files reported so far.
    entries: Vec<RankEntry>,
    /// Their cost so far.
    stats: PfsCopyStats,
    /// Agents that answered.
    answered: usize,
    /// Agents asked.
    agents: usize,
}

/// What to do about a version just recorded.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnRecorded {
    /// Ask the agents to copy it now.
    CopyNow,
    /// A copy runs: it waits for it (and may be skipped for a newer one).
    Deferred,
    /// Not due for a copy.
    Nothing,
}

/// What an agent's answer to a copy request leaves.
#[derive(Debug)]
pub(crate) enum Answered {
    /// Other agents have yet to answer.
    Waiting,
    /// Every agent answered: complete the PFS version with these entries.
    Whole(Vec<RankEntry>, PfsCopyStats),
    /// The copy failed (counted once per version: a later agent's failure
    /// of the same copy is `Failed` again, not counted again).
    Failed,
    /// A success for no pending copy (it failed already, or was never asked).
    Unknown,
}

/// An application's PFS copies.
#[derive(Debug, Default)]
pub(crate) struct CopyBook {
    /// Copies under way, by version.
    pending: BTreeMap<u64, PendingCopy>,
    /// A due copy that waits for the running one to end (the newest such
    /// version; when its turn comes, the application's newest version is copied).
    deferred: Option<u64>,
    /// Newest version copied to the PFS.
    pub(crate) copied: Option<u64>,
    /// What the newest completed copy cost.
    pub(crate) last: Option<PfsCopyStats>,
    /// Failed and skipped copies.
    pub(crate) health: PfsCopyHealth,
}

impl CopyBook {
    /// A book for an application whose newest PFS version is `copied`.
    pub(crate) fn new(copied: Option<u64>) -> CopyBook {
        CopyBook { copied, ..CopyBook::default() }
    }

    /// `version` was recorded. It is `due` by the application's interval,
    /// `spilled` when some of its ranks are on the PFS only (so its copy
    /// completes it there, due or not); `can_copy` when there is a PFS
    /// level and agents to copy.
    pub(crate) fn on_recorded(&mut self, version: u64, due: bool, spilled: bool, can_copy: bool) -> OnRecorded {
        if can_copy && due && !spilled && !self.pending.is_empty() {
            if self.deferred.replace(version).is_some() {
                self.health.skipped += 1;
            }
            return OnRecorded::Deferred;
        }
        if can_copy && (due || spilled) {
            return OnRecorded::CopyNow;
        }
        OnRecorded::Nothing
    }

    /// The controller asked `agents` agents to copy `version`.
    pub(crate) fn started(&mut self, version: u64, agents: usize) {
        let pending = PendingCopy { entries: Vec::new(), stats: PfsCopyStats::default(), answered: 0, agents };
        self.pending.insert(version, pending);
    }

    /// Whether a copy of `version` is under way.
    pub(crate) fn is_pending(&self, version: u64) -> bool {
        self.pending.contains_key(&version)
    }

    /// Whether no copy is under way.
    pub(crate) fn idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Versions being copied (their partial PFS directories stay).
    pub(crate) fn in_flight(&self) -> BTreeSet<u64> {
        self.pending.keys().copied().collect()
    }

    /// One agent answered the copy of `version`.
    pub(crate) fn answered(
        &mut self,
        version: u64,
        result: Result<(Vec<RankEntry>, PfsCopyStats), String>,
    ) -> Answered {
        let (entries, stats) = match result {
            Err(reason) => {
                // One failed agent fails the version's copy: count it once.
                if self.pending.remove(&version).is_some() {
                    self.health.record_failure(version, &reason);
                }
                return Answered::Failed;
            }
            Ok(done) => done,
        };
        let Some(pending) = self.pending.get_mut(&version) else { return Answered::Unknown };
        pending.entries.extend(entries);
        pending.stats.add(&stats);
        pending.answered += 1;
        if pending.answered < pending.agents {
            return Answered::Waiting;
        }
        match self.pending.remove(&version) {
            Some(PendingCopy { entries, stats, .. }) => Answered::Whole(entries, stats),
            None => Answered::Unknown,
        }
    }

    /// An agent could not copy `version` because retention dropped it for a
    /// newer complete version before the copy started. Counted as skipped
    /// (once per version), and the application's newest version is due
    /// ([`Self::next_deferred`]). False if the copy was not pending (an
    /// earlier agent's answer settled it).
    pub(crate) fn superseded(&mut self, version: u64) -> bool {
        if self.pending.remove(&version).is_none() {
            return false;
        }
        self.health.skipped += 1;
        self.deferred.get_or_insert(version);
        true
    }

    /// The PFS version `version` was completed (or could not be).
    pub(crate) fn completed(&mut self, version: u64, result: Result<(), String>, stats: PfsCopyStats) {
        match result {
            Err(reason) => self.health.record_failure(version, &reason),
            Ok(()) if self.copied.is_none_or(|v| v < version) => {
                self.copied = Some(version);
                self.last = Some(PfsCopyStats { version, ..stats });
            }
            Ok(()) => {}
        }
    }

    /// The version to copy now that the running copy ended, if one waited:
    /// the application's `newest` version (a newer one than the one that
    /// waited counts the waiting one as skipped), unless it is copied
    /// already. Nothing while a copy runs, while the application finishes,
    /// or without agents.
    pub(crate) fn next_deferred(&mut self, newest: Option<u64>, finishing: bool, has_agents: bool) -> Option<u64> {
        if !self.pending.is_empty() || finishing || !has_agents {
            return None;
        }
        let (waited, newest) = (self.deferred.take()?, newest?);
        if self.copied.is_some_and(|copied| copied >= newest) {
            return None;
        }
        if newest > waited {
            self.health.skipped += 1;
        }
        Some(newest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_overtaken_before_it_started_is_skipped_and_the_newest_copied() {
        let mut book = CopyBook::new(None);
        assert_eq!(record(&mut book, 1, 2), OnRecorded::CopyNow);
        assert!(book.superseded(1), "the first agent's answer settles it");
        assert!(!book.superseded(1), "the second agent's does not count again");
        assert!(matches!(book.answered(1, Ok((Vec::new(), stats(1)))), Answered::Unknown));
        assert_eq!((book.health.skipped, book.health.failed), (1, 0));
        assert_eq!(book.next_deferred(Some(3), false, true), Some(3), "the newest version is copied");
        assert_eq!(book.next_deferred(Some(3), false, true), None, "once");
    }

    fn stats(bytes: u64) -> PfsCopyStats {
        PfsCopyStats { raw: bytes, stored: bytes, ..PfsCopyStats::default() }
    }

    /// Records `version` (due) and starts its copy when the book says so.
    fn record(book: &mut CopyBook, version: u64, agents: usize) -> OnRecorded {
        let decision = book.on_recorded(version, true, false, true);
        if decision == OnRecorded::CopyNow {
            book.started(version, agents);
        }
        decision
    }

    #[test]
    fn a_copy_is_whole_when_every_agent_answered() {
        let mut book = CopyBook::new(None);
        assert_eq!(record(&mut book, 1, 2), OnRecorded::CopyNow);
        assert!(matches!(book.answered(1, Ok((Vec::new(), stats(10)))), Answered::Waiting));
        let Answered::Whole(_, total) = book.answered(1, Ok((Vec::new(), stats(5)))) else { panic!("not whole") };
        assert_eq!(total.raw, 15);
        assert!(book.idle());
        book.completed(1, Ok(()), total);
        assert_eq!((book.copied, book.last.map(|s| s.version)), (Some(1), Some(1)));
        assert!(matches!(book.answered(1, Ok((Vec::new(), stats(1)))), Answered::Unknown), "a late answer");
    }

    #[test]
    fn commits_faster_than_copies_copy_the_newest_and_count_what_they_skip() {
        let mut book = CopyBook::new(None);
        assert_eq!(record(&mut book, 1, 1), OnRecorded::CopyNow);
        // Versions 2 and 3 are due while version 1 is still being copied.
        assert_eq!(record(&mut book, 2, 1), OnRecorded::Deferred);
        assert_eq!(record(&mut book, 3, 1), OnRecorded::Deferred);
        assert_eq!(book.health.skipped, 1, "version 2 was overtaken while waiting");
        assert_eq!(book.next_deferred(Some(3), false, true), None, "a copy still runs");
        let Answered::Whole(_, s) = book.answered(1, Ok((Vec::new(), stats(1)))) else { panic!() };
        book.completed(1, Ok(()), s);
        // Version 4 completed meanwhile: the newest is copied, version 3 skipped too.
        assert_eq!(book.next_deferred(Some(4), false, true), Some(4));
        assert_eq!(book.health.skipped, 2);
        assert_eq!(book.next_deferred(Some(4), false, true), None, "nothing waits any more");
    }

    #[test]
    fn a_spilled_version_is_copied_whatever_the_interval_and_a_failure_counts_once() {
        let mut book = CopyBook::new(Some(3));
        assert_eq!(book.on_recorded(5, false, false, true), OnRecorded::Nothing);
        assert_eq!(book.on_recorded(5, false, true, true), OnRecorded::CopyNow);
        assert_eq!(book.on_recorded(6, true, false, false), OnRecorded::Nothing, "no PFS level or no agents");
        book.started(5, 2);
        assert!(book.is_pending(5) && book.in_flight().contains(&5));
        assert!(matches!(book.answered(5, Err("disk full".into())), Answered::Failed));
        assert!(matches!(book.answered(5, Err("disk full".into())), Answered::Failed), "a second agent's failure");
        assert_eq!(book.health.failed, 1);
        book.completed(4, Err("rename failed".into()), stats(0));
        assert_eq!(book.health.failed, 2);
        assert_eq!(book.copied, Some(3), "failures never move the PFS version");
    }

    #[test]
    fn a_waiting_copy_does_not_start_while_finishing_without_agents_or_when_copied() {
        let mut book = CopyBook::new(None);
        record(&mut book, 1, 1);
        record(&mut book, 2, 1);
        let Answered::Whole(_, s) = book.answered(1, Ok((Vec::new(), stats(1)))) else { panic!() };
        book.completed(2, Ok(()), s); // another path copied 2 already
        assert_eq!(book.next_deferred(Some(2), true, true), None, "finishing");
        assert_eq!(book.next_deferred(Some(2), false, false), None, "no agents");
        assert_eq!(book.next_deferred(Some(2), false, true), None, "version 2 is on the PFS already");
    }
}
