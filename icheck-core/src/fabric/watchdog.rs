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
//! regularly ([`WedgeWatch`]): a call
//! inside for far longer than any healthy one means the endpoint is
//! wedged, and the only way out is a new process (the manager exits; its
//! controller starts it again, and the store it leaves is kept).
//!
//! Two signs count. Wall time inside a call must be generous (a thread of
//! the lowest priority may wait seconds for a core on a loaded node), but
//! a thread spinning on such a lock also burns CPU all the while, and a
//! healthy call never burns seconds of it: [`WedgeWatch`] samples each
//! watched thread's CPU time from the kernel and reports a call that has
//! spent [`WedgeWatch::check`]'s CPU bound inside, long before the wall
//! bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// One watched thread: its clock (milliseconds since [`epoch`] plus one
/// when its current call entered, 0 outside a call), its name and its
/// kernel thread id.
struct Watched {
    clock: Weak<AtomicU64>,
    name: String,
    tid: i32,
}

/// Every watched thread that has made a call.
static CLOCKS: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

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
        let tid = nix::unistd::gettid().as_raw();
        let mut clocks = CLOCKS.lock().unwrap_or_else(|p| p.into_inner());
        clocks.retain(|watched| watched.clock.strong_count() > 0);
        clocks.push(Watched { clock: Arc::downgrade(&clock), name, tid });
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
            spin_for(Duration::from_secs(60));
        }
        let result = call();
        clock.store(0, Ordering::Release);
        result
    })
}

/// The longest any thread of this process has been inside a watched call
/// right now, and that thread's name; `None` when none is inside one.
/// (The tests' view of the clocks; daemons ask a [`WedgeWatch`].)
#[cfg(test)]
fn longest_libfabric_call() -> Option<(Duration, String)> {
    calls_inside().into_iter().map(|call| (call.inside, call.name)).max_by_key(|(inside, _)| *inside)
}

/// A watched call under way.
struct CallInside {
    /// When it entered (the clock's value).
    entered: u64,
    /// How long it has been inside.
    inside: Duration,
    /// Its thread's name and kernel id.
    name: String,
    tid: i32,
}

/// Every watched call under way now.
fn calls_inside() -> Vec<CallInside> {
    let now = epoch().elapsed().as_millis() as u64 + 1;
    let clocks = CLOCKS.lock().unwrap_or_else(|p| p.into_inner());
    clocks
        .iter()
        .filter_map(|watched| {
            let entered = watched.clock.upgrade()?.load(Ordering::Acquire);
            (entered > 0).then(|| CallInside {
                entered,
                inside: Duration::from_millis(now.saturating_sub(entered)),
                name: watched.name.clone(),
                tid: watched.tid,
            })
        })
        .collect()
}

/// CPU time thread `tid` of this process has used (the kernel's
/// `schedstat`); `None` when the thread is gone.
fn thread_cpu_time(tid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    let nanos: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// A watched call judged wedged by [`WedgeWatch::check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WedgedCall {
    /// How long it has been inside.
    pub inside: Duration,
    /// CPU time its thread used since this watch first saw the call
    /// (a lower bound of what it used inside).
    pub cpu: Duration,
    /// Its thread's name.
    pub thread: String,
}

/// Looks, on each [`check`](Self::check), for a watched call that is
/// wedged: inside past a wall-time bound, or having burned a CPU-time
/// bound while inside (a spin). Keeps, per call under way, its thread's
/// CPU time when the call was first seen.
#[derive(Debug, Default)]
pub struct WedgeWatch {
    /// (thread id, entered) → the thread's CPU time when first seen inside.
    first_seen: HashMap<(i32, u64), Duration>,
}

impl WedgeWatch {
    /// A watch that has seen nothing yet.
    pub fn new() -> WedgeWatch {
        WedgeWatch::default()
    }

    /// The wedged call that has been inside longest, if any: one inside
    /// for `wall` or more, or whose thread used `cpu` or more of CPU time
    /// between this watch first seeing the call and now.
    pub fn check(&mut self, wall: Duration, cpu: Duration) -> Option<WedgedCall> {
        let calls = calls_inside();
        // Calls that returned since are forgotten.
        self.first_seen.retain(|key, _| calls.iter().any(|call| (call.tid, call.entered) == *key));
        let mut wedged: Option<WedgedCall> = None;
        for call in calls {
            let Some(now) = thread_cpu_time(call.tid) else { continue };
            let first = *self.first_seen.entry((call.tid, call.entered)).or_insert(now);
            let used = now.saturating_sub(first);
            if (call.inside >= wall || used >= cpu) && wedged.as_ref().is_none_or(|w| call.inside > w.inside) {
                wedged = Some(WedgedCall { inside: call.inside, cpu: used, thread: call.name });
            }
        }
        wedged
    }
}

/// For fault-injection tests: the next watched call of this process
/// spins for a minute before it enters libfabric, burning its core as one
/// spinning on a dead process's lock does (so a watchdog finds it by its
/// CPU time, as it finds the real ones).
pub fn wedge_next_call() {
    WEDGE_NEXT.store(true, Ordering::Release);
}

/// Busy-waits for `how_long` (the injected wedge of [`wedge_next_call`]).
fn spin_for(how_long: Duration) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        for _ in 0..1024 {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests here share this process's clocks, and each asks for the
    /// longest call inside before it looks for its own thread's: run side by
    /// side, one test's call hid another's (a spinning call inside longer
    /// than the one looked for).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[test]
    fn a_call_still_inside_is_reported_with_its_thread_and_one_that_returned_is_not() {
        let _alone = one_at_a_time();
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
        let still = clocks.iter().any(|w| w.name == "watched-test" && w.clock.upgrade().is_some());
        assert!(!still, "an ended thread's clock is dropped with it");
    }

    /// Runs `inside` on a thread named `name` inside a watched call, and
    /// checks `watch` (bounds `wall`, `cpu`) every 20 ms until it reports
    /// that thread or `give_up` passes; then lets the call return.
    fn watch_a_call(
        name: &str,
        inside: impl Fn(&AtomicBool) + Send + 'static,
        (wall, cpu): (Duration, Duration),
        give_up: Duration,
    ) -> Option<WedgedCall> {
        let release = Arc::new(AtomicBool::new(false));
        let released = release.clone();
        let thread =
            std::thread::Builder::new().name(name.into()).spawn(move || watched(|| inside(&released))).unwrap();
        let mut watch = WedgeWatch::new();
        let started = Instant::now();
        let mut found = None;
        while found.is_none() && started.elapsed() < give_up {
            found = watch.check(wall, cpu).filter(|w| w.thread == name);
            std::thread::sleep(Duration::from_millis(20));
        }
        release.store(true, Ordering::Release);
        thread.join().unwrap();
        found
    }

    #[test]
    fn a_call_that_spins_is_reported_once_it_burned_the_cpu_bound_long_before_the_wall_bound() {
        let _alone = one_at_a_time();
        let spin = |release: &AtomicBool| {
            while !release.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        };
        let bounds = (Duration::from_secs(600), Duration::from_millis(200));
        let found = watch_a_call("spin-test", spin, bounds, Duration::from_secs(30));
        let found = found.expect("a spinning call is reported");
        assert!(found.cpu >= Duration::from_millis(200), "{found:?}");
        assert!(found.inside < Duration::from_secs(600), "{found:?}");
    }

    #[test]
    fn a_call_that_waits_without_burning_cpu_is_reported_only_past_the_wall_bound() {
        let _alone = one_at_a_time();
        let wait = |release: &AtomicBool| {
            while !release.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        // Descheduled, as a thread of the lowest priority on a loaded
        // node: no CPU bound is met in 1.5 s.
        let bounds = (Duration::from_secs(600), Duration::from_millis(300));
        assert_eq!(watch_a_call("wait-test", wait, bounds, Duration::from_millis(1500)), None);
        // The wall bound still holds.
        let bounds = (Duration::from_millis(300), Duration::from_secs(600));
        let found = watch_a_call("wait-test-2", wait, bounds, Duration::from_secs(30));
        assert!(found.is_some_and(|w| w.inside >= Duration::from_millis(300) && w.cpu < Duration::from_millis(300)));
    }
}
