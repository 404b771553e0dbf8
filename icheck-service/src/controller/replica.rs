//! A primary controller and its standby (thesis §6.1.1.3, §6.5.2): the
//! standby follows the primary's journal over the control plane and takes
//! over, with a higher fencing epoch, when the primary falls silent.
//!
//! The stream (one TCP connection the standby opens with a `Standby`
//! Hello): the primary sends a snapshot of its journal's state, then every
//! event it appends ([`ToStandby::Append`]) and a heartbeat every eighth of
//! the takeover window ([`ToStandby::Beat`]); the standby syncs each event
//! to its own journal before it acknowledges it ([`ToPrimary::Ack`]).
//!
//! **The fencing rule.** Every takeover raises the epoch, journaled before
//! the new primary answers anyone. Managers and clients send the highest
//! epoch they have seen in their Hello and obey only a primary at that
//! epoch or a higher one; a controller that hears of a higher epoch than
//! its own steps down and becomes a standby.
//!
//! **The lease** ([`Lease`], sans-IO). Epochs alone cannot stop a primary
//! that was paused (SIGSTOP) or cut off from acting on requests queued
//! before its replacement took over. So a primary with a standby
//! configured acts (answers registrations and versions, accepts managers)
//! only while it holds its lease: its standby acknowledged a heartbeat
//! sent less than half the takeover window ago, or the standby was found
//! unable to take over (nothing listens at its address, or it answers that
//! it holds no copy of the journal). The standby takes over only after a
//! whole window without a word from the primary, so the two never act at
//! once. Every answer that acknowledges something journaled waits until
//! the standby acknowledged it too: what a client was told is complete
//! is on both.
//!
//! Architecture invariant: the takeover decision ([`takeover_due`]) and
//! the lease are pure and tested on simulated time; the tasks below only
//! move frames.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::journal::Event;

/// Events per snapshot frame (an event is at most a few hundred bytes; a
/// frame holds 1 MiB).
pub(super) const SNAPSHOT_CHUNK: usize = 256;

/// Primary → standby.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) enum ToStandby {
    /// Part of the journal's state when the standby attached.
    Snapshot {
        /// The primary's epoch.
        epoch: u64,
        /// Events of this part.
        events: Vec<Event>,
        /// Last part: `Append`s follow, numbered from `seq + 1`.
        done: bool,
        /// Events the primary appended before the snapshot was taken.
        seq: u64,
    },
    /// One event the primary appended (and synced) to its journal.
    Append {
        /// Its number in this primary's stream.
        seq: u64,
        /// The event.
        event: Event,
    },
    /// The primary is alive.
    Beat {
        /// Echoed in the acknowledgement.
        id: u64,
    },
}

/// Standby → primary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) enum ToPrimary {
    /// Every event up to `seq` is synced to the standby's journal, and
    /// heartbeat `beat` arrived.
    Ack {
        /// Highest event synced.
        seq: u64,
        /// Highest heartbeat received.
        beat: u64,
    },
}

/// Whether a standby takes over now: it holds a copy of the journal, has
/// heard nothing from the primary for the whole `window`, and could not
/// reach it just now.
pub(super) fn takeover_due(synced: bool, last_heard: Instant, now: Instant, window: Duration) -> bool {
    synced && now.saturating_duration_since(last_heard) >= window
}

/// The primary's lease and its standby's progress (no I/O; time passed in).
#[derive(Debug)]
pub(super) struct Lease {
    /// The takeover window; the lease lasts half of it.
    window: Duration,
    /// Another controller is configured.
    partners: bool,
    /// The attached standby (its address).
    attached: Option<String>,
    /// Heartbeats sent and not yet acknowledged: (id, when sent).
    beats: VecDeque<(u64, Instant)>,
    next_beat: u64,
    /// When the newest acknowledged heartbeat was sent.
    acked_beat_sent: Option<Instant>,
    /// When the standby was last found unable to take over.
    partner_inert: Option<Instant>,
    /// This primary raised the epoch itself (it took over) and no standby
    /// has attached since: nobody else can hold a copy of the journal at
    /// this epoch, so nobody can take over from it, whatever the old
    /// primary (paused, cut off) does.
    sole_holder: bool,
    /// Events appended by this primary process, and acknowledged.
    appended: u64,
    acked: u64,
}

impl Lease {
    /// A primary's lease: held at once without partners, else not until
    /// a standby attached or was found unable to take over.
    pub(super) fn new(window: Duration, partners: bool) -> Lease {
        Lease {
            window,
            partners,
            attached: None,
            beats: VecDeque::new(),
            next_beat: 1,
            acked_beat_sent: None,
            partner_inert: None,
            sole_holder: false,
            appended: 0,
            acked: 0,
        }
    }

    fn term(&self) -> Duration {
        self.window / 2
    }

    /// This primary took over: it raised the epoch, so until a standby
    /// attaches, no other controller holds its journal.
    pub(super) fn took_over(&mut self) {
        self.sole_holder = true;
    }

    /// A standby attached; it will receive every event after `appended()`.
    pub(super) fn attach(&mut self, peer: &str) {
        self.sole_holder = false;
        self.attached = Some(peer.to_string());
        self.beats.clear();
        self.acked = self.appended;
    }

    /// The standby's stream ended.
    pub(super) fn detach(&mut self) {
        self.attached = None;
        self.beats.clear();
        self.acked_beat_sent = None;
    }

    /// Whether a standby is attached.
    pub(super) fn attached(&self) -> Option<&str> {
        self.attached.as_deref()
    }

    /// One more event appended to the journal; returns its number.
    pub(super) fn appended(&mut self) -> u64 {
        self.appended += 1;
        self.appended
    }

    /// Events appended so far.
    pub(super) fn seq(&self) -> u64 {
        self.appended
    }

    /// A heartbeat goes to the standby now; returns its id.
    pub(super) fn beat_sent(&mut self, now: Instant) -> u64 {
        let id = self.next_beat;
        self.next_beat += 1;
        self.beats.push_back((id, now));
        // A standby that stopped answering must not grow this without bound.
        while self.beats.len() > 1024 {
            self.beats.pop_front();
        }
        id
    }

    /// The standby synced every event up to `seq` and received heartbeat `beat`.
    pub(super) fn acked(&mut self, seq: u64, beat: u64) {
        self.acked = self.acked.max(seq.min(self.appended));
        while let Some(&(id, sent)) = self.beats.front() {
            if id > beat {
                break;
            }
            self.beats.pop_front();
            if id == beat {
                self.acked_beat_sent = Some(sent);
            }
        }
    }

    /// No standby listens at the partner's address, or it holds no copy of
    /// the journal: it cannot take over (checked again every probe).
    pub(super) fn partner_inert(&mut self, now: Instant) {
        self.partner_inert = Some(now);
    }

    /// Whether this primary may act now, or why not.
    pub(super) fn may_act(&self, now: Instant) -> Result<(), String> {
        if !self.partners {
            return Ok(());
        }
        let fresh = |since: Option<Instant>| since.is_some_and(|t| now.saturating_duration_since(t) < self.term());
        match &self.attached {
            Some(_) if fresh(self.acked_beat_sent) => Ok(()),
            Some(peer) => Err(format!(
                "its standby {peer} has not acknowledged a heartbeat for {:.1} s (the lease is {:.1} s), so it \
                 cannot be sure it is still the primary",
                self.acked_beat_sent.map_or(f64::INFINITY, |t| now.saturating_duration_since(t).as_secs_f64()),
                self.term().as_secs_f64()
            )),
            None if self.sole_holder || fresh(self.partner_inert) => Ok(()),
            None => Err("no standby follows it and the other controllers did not say they cannot take over, so it \
                         cannot be sure it is still the primary"
                .into()),
        }
    }

    /// Whether managers still hear from this primary: while it may act,
    /// and for the rest of the takeover window after its lease ran out (a
    /// standby slow to answer has not taken over: it still hears this
    /// primary; managers that left would only be told to come back).
    pub(super) fn answers_managers(&self, now: Instant) -> bool {
        self.may_act(now).is_ok()
            || self.acked_beat_sent.is_some_and(|sent| now.saturating_duration_since(sent) < self.window)
    }

    /// Whether event `seq` is on the standby too (or no standby follows).
    pub(super) fn replicated(&self, seq: u64) -> bool {
        self.attached.is_none() || self.acked >= seq
    }

    /// Events sent to the standby and not yet acknowledged.
    pub(super) fn lag(&self) -> u64 {
        self.appended - self.acked
    }

    /// Seconds since the newest acknowledged heartbeat was sent.
    pub(super) fn last_ack_secs(&self, now: Instant) -> f64 {
        self.acked_beat_sent.map_or(f64::INFINITY, |t| now.saturating_duration_since(t).as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(4);

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(500),
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// The journal stream's frames from a peer: random bytes decode to a
        /// message or a typed error, never a panic.
        #[test]
        fn stream_frames_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048)) {
            let _ = icheck_core::protocol::decode::<ToStandby>(&bytes);
            let _ = icheck_core::protocol::decode::<ToPrimary>(&bytes);
        }
    }

    #[test]
    fn without_partners_the_lease_always_holds() {
        let lease = Lease::new(WINDOW, false);
        assert!(lease.may_act(Instant::now()).is_ok());
        assert!(lease.replicated(0));
    }

    #[test]
    fn the_lease_lasts_half_the_window_after_the_last_acknowledged_beat_was_sent() {
        let t0 = Instant::now();
        let mut lease = Lease::new(WINDOW, true);
        assert!(lease.may_act(t0).is_err(), "nobody confirmed anything yet");
        lease.attach("standby:1");
        let beat = lease.beat_sent(t0);
        assert!(lease.may_act(t0).is_err(), "not acknowledged yet");
        lease.acked(0, beat);
        assert!(lease.may_act(t0 + Duration::from_millis(1999)).is_ok());
        // A primary paused past half the window finds its lease gone on waking,
        // before it looks at any request queued meanwhile.
        let err = lease.may_act(t0 + Duration::from_secs(2)).unwrap_err();
        assert!(err.contains("standby:1") && err.contains("lease"), "{err}");
        // Managers keep hearing it until a takeover could have happened.
        assert!(lease.answers_managers(t0 + Duration::from_millis(3999)));
        assert!(!lease.answers_managers(t0 + WINDOW));
        // The standby cannot have taken over before a whole window without beats.
        assert!(!takeover_due(true, t0, t0 + Duration::from_millis(3999), WINDOW));
        assert!(takeover_due(true, t0, t0 + WINDOW, WINDOW));
        assert!(!takeover_due(false, t0, t0 + WINDOW * 10, WINDOW), "a standby without the journal never takes over");
    }

    #[test]
    fn a_late_acknowledgement_counts_from_when_its_beat_was_sent() {
        let t0 = Instant::now();
        let mut lease = Lease::new(WINDOW, true);
        lease.attach("s");
        let first = lease.beat_sent(t0);
        let _second = lease.beat_sent(t0 + Duration::from_secs(1));
        // The first beat's acknowledgement arrives 1.9 s late: the lease runs
        // from when it was sent.
        lease.acked(0, first);
        assert!(lease.may_act(t0 + Duration::from_millis(1900)).is_ok());
        assert!(lease.may_act(t0 + Duration::from_millis(2100)).is_err());
    }

    #[test]
    fn events_count_as_replicated_once_acknowledged() {
        let mut lease = Lease::new(WINDOW, true);
        let before = lease.appended();
        assert!(lease.replicated(before), "no standby attached: nothing to wait for");
        lease.attach("s");
        let seq = lease.appended();
        assert!(!lease.replicated(seq));
        assert_eq!(lease.lag(), 1);
        lease.acked(seq + 5, 0);
        assert!(lease.replicated(seq), "an acknowledgement never counts events not sent");
        assert_eq!(lease.lag(), 0);
        lease.detach();
        assert!(lease.may_act(Instant::now()).is_err(), "a lost standby may be taking over");
    }

    #[test]
    fn a_primary_that_took_over_acts_alone_until_a_standby_attached_and_left() {
        let t0 = Instant::now();
        let mut lease = Lease::new(WINDOW, true);
        lease.took_over();
        // The old primary is paused: it answers nothing, yet it cannot take
        // over (it holds no copy of this epoch's journal).
        assert!(lease.may_act(t0 + WINDOW * 10).is_ok());
        lease.attach("s");
        lease.detach();
        assert!(lease.may_act(t0).is_err(), "the standby that left holds this epoch's journal");
    }

    #[test]
    fn an_inert_partner_lets_the_primary_act_alone_until_the_next_probe_is_due() {
        let t0 = Instant::now();
        let mut lease = Lease::new(WINDOW, true);
        lease.partner_inert(t0);
        assert!(lease.may_act(t0 + Duration::from_secs(1)).is_ok());
        assert!(lease.may_act(t0 + Duration::from_secs(2)).is_err());
    }
}
