//! Take-overs and rebuilds under way on one agent, one per rank's version.
//!
//! The controller asks an agent to fill a rank's version (a take-over or a
//! rebuild, `ControllerToManager::TakeOver`/`Rebuild`) and may ask again
//! while the first job still runs: its answer timed out, or a controller
//! that took over from a dead primary planned the rebuild anew. Two jobs
//! writing one version's file would replace each other's file under their
//! mappings (`Store::create` renames a spare or warm file into place, and
//! unseals a sealed one), and the one that seals last could publish bytes
//! the other was still writing.
//!
//! Architecture invariant: at most one job fills a given rank's version
//! on an agent at a time. A second one waits for the first, and answers
//! with the version the first sealed instead of writing it again.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The rank versions being filled, and a signal when one is no longer.
#[derive(Default)]
pub(super) struct Fills {
    running: Mutex<HashSet<(u32, u64)>>,
    ended: Condvar,
}

/// Removes its key from [`Fills`] when dropped, however the job ended.
struct Running<'a> {
    fills: &'a Fills,
    key: (u32, u64),
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.fills.running.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
        self.fills.ended.notify_all();
    }
}

impl Fills {
    /// Runs `fill` for `rank`'s `version`, unless a job for the same
    /// version runs here: that one is waited for (at most `patience`), and
    /// then `sealed` says whether it left the version sealed (its bytes,
    /// the answer) or `fill` must run after all.
    pub(super) fn one_at_a_time(
        &self,
        (rank, version): (u32, u64),
        patience: Duration,
        sealed: impl FnOnce() -> Option<u64>,
        fill: impl FnOnce() -> Result<u64, String>,
    ) -> Result<u64, String> {
        let key = (rank, version);
        let deadline = Instant::now() + patience;
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let mut waited = false;
        while running.contains(&key) {
            waited = true;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "rank {rank} version {version}: another take-over or rebuild of it still runs here after {patience:?}"
                ));
            }
            running = self.ended.wait_timeout(running, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        if waited {
            if let Some(bytes) = sealed() {
                tracing::info!(rank, version, "the version was filled by the job this one waited for");
                return Ok(bytes);
            }
        }
        running.insert(key);
        drop(running);
        let _running = Running { fills: self, key };
        fill()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Two jobs for one version: the second starts only after the first
    /// ended, and answers with what the first sealed without filling.
    #[test]
    fn a_second_job_for_the_same_version_waits_and_answers_with_what_the_first_sealed() {
        let fills = Arc::new(Fills::default());
        let (inside, most_inside, filled) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let sealed_bytes = Arc::new(Mutex::new(None));
        let job = |delay: Duration| {
            let (fills, inside, most_inside, filled, sealed_bytes) =
                (fills.clone(), inside.clone(), most_inside.clone(), filled.clone(), sealed_bytes.clone());
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let sealed = || *sealed_bytes.lock().unwrap();
                fills.one_at_a_time((3, 7), Duration::from_secs(30), sealed, || {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most_inside.fetch_max(now, Ordering::SeqCst);
                    filled.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(300));
                    *sealed_bytes.lock().unwrap() = Some(4096);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    Ok(4096)
                })
            })
        };
        let first = job(Duration::ZERO);
        let second = job(Duration::from_millis(50));
        assert_eq!(first.join().unwrap(), Ok(4096));
        assert_eq!(second.join().unwrap(), Ok(4096));
        assert_eq!(most_inside.load(Ordering::SeqCst), 1, "two jobs filled the version at once");
        assert_eq!(filled.load(Ordering::SeqCst), 1, "the second job filled a version the first had sealed");
    }

    /// A first job that failed leaves the version to the one that waited;
    /// another version's job never waits; a job still running past the
    /// patience is reported by rank and version.
    #[test]
    fn a_failed_first_job_leaves_the_version_to_the_next_and_other_versions_never_wait() {
        let fills = Arc::new(Fills::default());
        let slow = {
            let fills = fills.clone();
            std::thread::spawn(move || {
                fills.one_at_a_time(
                    (1, 5),
                    Duration::from_secs(30),
                    || None,
                    || {
                        std::thread::sleep(Duration::from_millis(400));
                        Err("the source was lost".into())
                    },
                )
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        let other = fills.one_at_a_time((1, 6), Duration::from_secs(30), || None, || Ok(1));
        assert_eq!(other, Ok(1));
        assert!(started.elapsed() < Duration::from_millis(300), "another version's job waited");
        let impatient = fills.one_at_a_time((1, 5), Duration::from_millis(20), || None, || Ok(2));
        let err = impatient.unwrap_err();
        assert!(err.contains("rank 1 version 5") && err.contains("still runs"), "{err}");
        let retried = fills.one_at_a_time((1, 5), Duration::from_secs(30), || None, || Ok(3));
        assert_eq!(retried, Ok(3), "the job after a failed one fills the version");
        assert_eq!(slow.join().unwrap(), Err("the source was lost".into()));
    }
}
