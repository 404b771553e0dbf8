//! A process whose fabric is wedged ends itself.
//!
//! libfabric 1.17's shm provider can leave a call spinning for ever on the
//! lock of a process killed while it held it
//! (`icheck_core::fabric::WedgeWatch` explains how such a call is seen).
//! Nothing takes the thread back out, so the process ends: a manager is
//! started again by its controller and finds the store it leaves; `icheck
//! fabric churn` reports the wedge by its exit code instead of spinning
//! until its caller's bound.
//!
//! *Invariant:* the exit is `_exit`, never `exit`: libfabric's destructors
//! would wait for the same lock.

use std::time::Duration;

/// How long a call into libfabric that returns at once when healthy (a
/// progress poll) may stay inside before its fabric counts as wedged: a
/// thousand times any healthy one, and longer than a thread of the lowest
/// priority waits for a core on a loaded node.
pub const WEDGED_AFTER: Duration = Duration::from_secs(20);

/// How much CPU time a thread may burn inside one such call before its
/// fabric counts as wedged: a spin on a dead process's lock burns a core
/// all the while, a healthy poll a few microseconds. Found in a few
/// seconds this way, where [`WEDGED_AFTER`] alone left every wedge 20 s
/// of a restart's time (six in one shm fault campaign of 20 rounds).
pub const WEDGED_SPINNING: Duration = Duration::from_secs(3);

/// Exit code of a process that ends because its fabric is wedged.
pub const EXIT_WEDGED: i32 = 75;

/// How often the watch looks.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// Starts a thread that, every half second for as long as the process
/// runs, looks for a call into libfabric inside for [`WEDGED_AFTER`] or
/// having burned [`WEDGED_SPINNING`] of CPU inside, and if it finds one
/// logs it with `consequence` (what ending this process means) and ends
/// the process with [`EXIT_WEDGED`]. It runs on a thread of its own so that
/// it looks whatever the process's other threads are stuck in.
pub fn exit_when_wedged(consequence: &'static str) {
    let watch = move || {
        let mut watch = icheck_core::fabric::WedgeWatch::new();
        loop {
            std::thread::sleep(WATCH_EVERY);
            let Some(wedged) = watch.check(WEDGED_AFTER, WEDGED_SPINNING) else { continue };
            tracing::error!(
                inside = ?wedged.inside,
                cpu = ?wedged.cpu,
                thread = %wedged.thread,
                "a call into libfabric has not returned (shm spinning on a dead process's lock?); {consequence}"
            );
            // SAFETY: `_exit` takes no pointer and never returns; it ends the
            // process without running handlers that could block on the same
            // lock.
            unsafe { libc::_exit(EXIT_WEDGED) }
        }
    };
    if let Err(err) = std::thread::Builder::new().name("icheck-wedge-watch".into()).spawn(watch) {
        tracing::error!(%err, "cannot start the fabric watchdog: a wedged endpoint is not found");
    }
}
