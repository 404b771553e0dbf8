//! `transfer = "auto"`: which direction an application's bytes move in,
//! measured on its own commits.
//!
//! Neither direction wins everywhere: on one host over shm four ranks
//! pushing beat the agents pulling, one rank pulling beats pushing, and
//! on a cluster it depends on the NIC and the provider. So the library
//! measures. The first [`WARM_UP`] versions pull and are not measured
//! (they touch fresh agent memory and cost several times a later commit);
//! the next [`TRIAL`] alternate pull and push; then the ranks add up what
//! they moved in each direction and how long it took, and every rank keeps
//! the direction that moved bytes faster for the rest of the run.
//!
//! This module is the decision only, with no I/O: the client feeds it each
//! completed version and this rank's transfer of it, and does the
//! collective sum when [`AutoDirection::completed`] says the trial is over.
//!
//! Architecture invariant: every rank's state goes through the same steps
//! (one per complete version), so every rank asks for the collective sum at
//! the same version and then keeps the same direction.

use icheck_core::protocol::AutoTransfer;

/// Versions that pull, unmeasured, before the trial.
pub(super) const WARM_UP: u32 = 2;
/// Versions of the trial: pull, push, pull, push.
pub(super) const TRIAL: u32 = 4;

/// Bytes moved in one direction and the seconds the transfers took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Measured {
    /// Bytes.
    pub(super) bytes: u64,
    /// Seconds spent moving them.
    pub(super) secs: f64,
}

impl Measured {
    /// GB/s (10^9 bytes per second), if anything was measured.
    pub(super) fn gb_per_s(&self) -> Option<f64> {
        (self.bytes > 0 && self.secs > 0.0).then(|| self.bytes as f64 / self.secs / 1e9)
    }

    /// Adds another measurement.
    pub(super) fn add(&mut self, bytes: u64, secs: f64) {
        self.bytes += bytes;
        self.secs += secs;
    }
}

/// What this rank's transfers of one version moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct TransferTally {
    /// Pushed by the library.
    pub(super) push: Measured,
    /// Pulled by the agent.
    pub(super) pull: Measured,
}

/// The choice, and the rates it rests on (per rank, over all ranks).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Decision {
    /// Commits push from now on.
    pub(super) push: bool,
    /// GB/s the agents' reads reached.
    pub(super) pull_gb_per_s: Option<f64>,
    /// GB/s the library's writes reached.
    pub(super) push_gb_per_s: Option<f64>,
}

/// The measurement and the choice (see the module documentation).
#[derive(Clone, Debug, Default)]
pub(super) struct AutoDirection {
    /// Versions completed so far.
    completed: u32,
    /// This rank's measured transfers during the trial.
    tally: TransferTally,
    decision: Option<Decision>,
}

impl AutoDirection {
    /// Whether the next commit pushes.
    pub(super) fn next_push(&self) -> bool {
        match self.decision {
            Some(decision) => decision.push,
            None => self.completed >= WARM_UP && (self.completed - WARM_UP) % 2 == 1,
        }
    }

    /// Counts a completed version of `version_bytes` bytes (this rank's)
    /// and what this rank's transfers of it moved. A transfer counts only
    /// when it moved at least half of the version: an incremental commit
    /// that moves a few changed blocks spends its time checksumming, which
    /// says nothing about the direction. Returns true when the trial is
    /// over: the caller then sums [`Self::tally`] over all ranks and calls
    /// [`Self::decide`].
    pub(super) fn completed(&mut self, moved: TransferTally, version_bytes: u64) -> bool {
        if self.decision.is_some() {
            return false;
        }
        if self.completed >= WARM_UP {
            for (mine, this) in [(&mut self.tally.pull, moved.pull), (&mut self.tally.push, moved.push)] {
                if this.bytes > 0 && this.bytes.saturating_mul(2) >= version_bytes {
                    mine.add(this.bytes, this.secs);
                }
            }
        }
        self.completed += 1;
        self.completed == WARM_UP + TRIAL
    }

    /// This rank's measured transfers so far.
    pub(super) fn tally(&self) -> TransferTally {
        self.tally
    }

    /// Keeps the faster direction, given every rank's measurements added
    /// up. Pull (no registration of agent memory by the library, no
    /// progress thread of its own) stays unless push measured faster.
    pub(super) fn decide(&mut self, all: TransferTally) -> Decision {
        let (pull, push) = (all.pull.gb_per_s(), all.push.gb_per_s());
        let decision = Decision {
            push: matches!((pull, push), (Some(pull), Some(push)) if push > pull),
            pull_gb_per_s: pull,
            push_gb_per_s: push,
        };
        self.decision = Some(decision);
        decision
    }

    /// Where the measurement stands, for the controller's status.
    pub(super) fn report(&self) -> AutoTransfer {
        AutoTransfer {
            decided: self.decision.is_some(),
            measured: self.completed.saturating_sub(WARM_UP).min(TRIAL),
            of: TRIAL,
            pull_gb_per_s: self.decision.and_then(|d| d.pull_gb_per_s),
            push_gb_per_s: self.decision.and_then(|d| d.push_gb_per_s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(push: bool, bytes: u64, secs: f64) -> TransferTally {
        let mut tally = TransferTally::default();
        let side = if push { &mut tally.push } else { &mut tally.pull };
        side.add(bytes, secs);
        tally
    }

    /// Runs the warm-up and the trial with a rank that pulls at `pull` and
    /// pushes at `push` bytes per second; returns the directions used.
    fn run_trial(auto: &mut AutoDirection, pull: f64, push: f64) -> Vec<bool> {
        let mut used = Vec::new();
        for _ in 0..WARM_UP + TRIAL {
            let p = auto.next_push();
            used.push(p);
            let bytes = 1 << 30;
            let rate = if p { push } else { pull };
            if auto.completed(moved(p, bytes, bytes as f64 / rate), bytes) {
                let all = auto.tally();
                auto.decide(all);
            }
        }
        used
    }

    #[test]
    fn warm_up_pulls_then_the_trial_alternates_then_the_faster_direction_stays() {
        let mut auto = AutoDirection::default();
        let used = run_trial(&mut auto, 2e9, 3e9);
        assert_eq!(used, vec![false, false, false, true, false, true]);
        let report = auto.report();
        assert!(report.decided);
        assert_eq!((report.measured, report.of), (TRIAL, TRIAL));
        assert!((report.push_gb_per_s.unwrap() - 3.0).abs() < 1e-9, "{report:?}");
        assert!((report.pull_gb_per_s.unwrap() - 2.0).abs() < 1e-9, "{report:?}");
        for _ in 0..10 {
            assert!(auto.next_push());
            // Later versions change nothing, whatever they measure.
            assert!(!auto.completed(moved(true, 1 << 30, 100.0), 1 << 30));
        }
        assert!(auto.next_push());
    }

    #[test]
    fn pull_stays_when_it_is_faster() {
        let mut auto = AutoDirection::default();
        run_trial(&mut auto, 3e9, 2e9);
        assert!(!auto.next_push());
        assert!(auto.report().decided);
    }

    #[test]
    fn the_warm_up_is_not_measured() {
        let mut auto = AutoDirection::default();
        // Warm-up versions that pull very slowly (first touch) must not
        // count against pull.
        for _ in 0..WARM_UP {
            assert!(!auto.completed(moved(false, 1 << 30, 100.0), 1 << 30));
        }
        assert_eq!(auto.tally(), TransferTally::default());
        assert_eq!(auto.report().measured, 0);
    }

    #[test]
    fn small_incremental_transfers_do_not_count_and_nothing_measured_keeps_pull() {
        let mut auto = AutoDirection::default();
        let mut decided = None;
        for _ in 0..WARM_UP + TRIAL {
            let p = auto.next_push();
            // 1% of the version moved: checksumming dominates.
            if auto.completed(moved(p, 10 << 20, 0.05), 1 << 30) {
                decided = Some(auto.decide(auto.tally()));
            }
        }
        let decision = decided.expect("the trial ends after WARM_UP + TRIAL versions");
        assert!(!decision.push);
        assert_eq!((decision.pull_gb_per_s, decision.push_gb_per_s), (None, None));
        assert!(!auto.next_push());
    }

    #[test]
    fn the_decision_uses_every_ranks_sum_not_this_ranks_own() {
        let mut auto = AutoDirection::default();
        for _ in 0..WARM_UP + TRIAL {
            let p = auto.next_push();
            // This rank alone pushes faster ...
            let secs = if p { 0.1 } else { 0.2 };
            if auto.completed(moved(p, 1 << 30, secs), 1 << 30) {
                // ... but over all ranks pull was faster.
                let mut all = TransferTally::default();
                all.pull.add(8 << 30, 1.0);
                all.push.add(8 << 30, 2.0);
                auto.decide(all);
            }
        }
        assert!(!auto.next_push());
    }
}
