//! Calls into libfabric that must return at once, watched.
//!
//! libfabric 1.17's shm provider takes a spinlock in a shared region to
//! queue or take each command. A process killed while it holds one leaves
//! every later call that takes it spinning for ever inside the provider,
//! where no bound of icheck's applies: the fault campaign found a
//! manager's progress threads at 100% of a core in `fi_cq_read`, and the
//! protection that needed that manager's agent stalled until the manager
//! was restarted. Posting to a peer that ended is refused before the
//! provider is entered (`Peer::has_ended`), but a poll of this process's
//! own completion queue can spin as well, and which process holds the
//! lock cannot be seen from outside the provider.
//!
//! So the calls that return within microseconds when healthy (each
//! progress poll) record when they entered, per thread, and a daemon asks
//! [`longest_libfabric_call`] on its heartbeat: a call inside for far
//! longer than any healthy one means the endpoint is wedged, and the only
//! way out is a new process (the manager exits; its controller starts it
//! again, and the store it leaves is kept).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Each watched thread's clock: milliseconds since [`epoch`] plus one when
/// its current call entered, 0 outside a call; and the thread's name.
static CLOCKS: Mutex<Vec<(Weak<AtomicU64>, String)>> = Mutex::new(Vec::new());

/// Makes the next watched progress poll of this process sleep for a minute
/// inside the watched section, as a wedged one would (fault-injection
/// tests only).
static WEDGE_NEXT: AtomicBool = AtomicBool::new(false);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

thread_local! {
    static CLOCK: Arc<AtomicU64> = {
        let clock = Arc::new(AtomicU64::new(0));
        let name = std::thread::current().name().unwrap_or("unnamed").to_string();
        let mut clocks = CLOCKS.lock().unwrap_or_else(|p| p.into_inner());
        clocks.retain(|(weak, _)| weak.strong_count() > 0);
        clocks.push((Arc::downgrade(&clock), name));
        clock
    };
}

/// Runs `call` (one call into libfabric that returns at once when the
/// provider is healthy) with this thread's clock set.
pub(crate) fn watched<T>(call: impl FnOnce() -> T) -> T {
    CLOCK.with(|clock| {
        let entered = epoch().elapsed().as_millis() as u64 + 1;
        clock.store(entered, Ordering::Release);
        // A plain load first: a swap on every call would write the shared
        // line from every polling thread.
        if WEDGE_NEXT.load(Ordering::Relaxed) && WEDGE_NEXT.swap(false, Ordering::AcqRel) {
            std::thread::sleep(Duration::from_secs(60));
        }
        let result = call();
        clock.store(0, Ordering::Release);
        result
    })
}

/// The longest any thread of this process has been inside a watched call
/// right now, and that thread's name; `None` when none is inside one.
pub fn longest_libfabric_call() -> Option<(Duration, String)> {
    let now = epoch().elapsed().as_millis() as u64 + 1;
    let clocks = CLOCKS.lock().unwrap_or_else(|p| p.into_inner());
    clocks
        .iter()
        .filter_map(|(weak, name)| {
            let entered = weak.upgrade()?.load(Ordering::Acquire);
            (entered > 0).then(|| (Duration::from_millis(now.saturating_sub(entered)), name.clone()))
        })
        .max_by_key(|(inside, _)| *inside)
}

/// For fault-injection tests: the next watched call of this process
/// sleeps for a minute before it enters libfabric, as one spinning on a
/// dead process's lock would.
pub fn wedge_next_call() {
    WEDGE_NEXT.store(true, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_still_inside_is_reported_with_its_thread_and_one_that_returned_is_not() {
        let (entered, release) = (Arc::new(std::sync::Barrier::new(2)), Arc::new(std::sync::Barrier::new(2)));
        let (e, r) = (entered.clone(), release.clone());
        let thread = std::thread::Builder::new()
            .name("watched-test".into())
            .spawn(move || {
                watched(|| {
                    e.wait();
                    r.wait();
                });
                watched(|| ());
            })
            .unwrap();
        entered.wait();
        std::thread::sleep(Duration::from_millis(30));
        let inside = longest_libfabric_call().filter(|(_, name)| name == "watched-test");
        assert!(inside.as_ref().is_some_and(|(d, _)| *d >= Duration::from_millis(20)), "{inside:?}");
        release.wait();
        thread.join().unwrap();
        let clocks = CLOCKS.lock().unwrap();
        let still = clocks.iter().any(|(weak, name)| name == "watched-test" && weak.upgrade().is_some());
        assert!(!still, "an ended thread's clock is dropped with it");
    }
}
