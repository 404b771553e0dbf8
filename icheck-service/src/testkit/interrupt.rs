//! Stopping what a benchmark or campaign started when it is interrupted.
//!
//! The daemons a run starts leave its session (`icheck up --detach`), so
//! Ctrl-C reaches the run alone. Before this module, a run interrupted
//! part-way (Ctrl-C, or SIGTERM from a batch system's time limit) died
//! without running its destructors and left every daemon it had started
//! running, their stores holding memory, and their shm regions behind.
//!
//! A binary that calls [`stop_on_interrupt`] instead runs every clean-up
//! registered with [`on_interrupt`] when SIGINT, SIGTERM or SIGHUP
//! arrives, and then exits with 128 + the signal's number, as a shell
//! reports a death by that signal. Owners register their clean-up when
//! they start something and drop the [`Registered`] guard when they have
//! cleaned up themselves. Without [`stop_on_interrupt`] (tests), the
//! registrations cost a map entry and nothing else.
//!
//! *Invariant:* once a signal has come, the process ends only after every
//! clean-up has run, whichever thread exits first (no clean-up may exit or
//! take [`hold_off`]). The signals are caught by handlers (tokio's), never
//! blocked: a handler is reset to the default in every process this one
//! executes, while a blocked mask would be inherited, and the daemons a
//! run starts would then ignore the SIGTERM `icheck down` sends them (a
//! first version blocked them, and `icheck down` had to SIGKILL every
//! daemon after its 5 s grace).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use tokio::signal::unix::{signal, SignalKind};

/// A clean-up action and what it stops, for the message printed as it runs.
type Action = (String, Box<dyn FnOnce() + Send>);

static ACTIONS: Mutex<BTreeMap<u64, Action>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);
/// Held while something is being started ([`hold_off`]), and taken for
/// good by the clean-up once a signal has come.
static STARTING: Mutex<()> = Mutex::new(());
/// The signal being handled (0: none yet), and whether its clean-up has
/// finished; an exit on another thread waits for it ([`wait_for_clean_up`]).
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);
static CLEANED_UP: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

/// A clean-up registered with [`on_interrupt`]; dropping it forgets the
/// action (its owner has cleaned up by itself).
#[must_use = "dropping the guard forgets the clean-up at once"]
pub struct Registered(u64);

impl Drop for Registered {
    fn drop(&mut self) {
        actions().remove(&self.0);
    }
}

fn actions() -> std::sync::MutexGuard<'static, BTreeMap<u64, Action>> {
    // An action that panicked poisoned nothing the map relies on.
    ACTIONS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Registers `action`, which stops `what`, to run if the process is
/// interrupted before the returned guard drops. Actions run newest first,
/// so a job started on a service is stopped before the service.
pub fn on_interrupt(what: impl Into<String>, action: impl FnOnce() + Send + 'static) -> Registered {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    actions().insert(id, (what.into(), Box::new(action)));
    Registered(id)
}

/// Holds the clean-up off until the guard drops: take it while starting
/// something a registered action stops (`icheck up` writing its `pids`
/// file, a job being spawned and registered), so that an interrupt neither
/// stops a half-started service nor races a restart of its daemons. After
/// an interrupt it blocks for good: the process is about to exit.
pub fn hold_off() -> std::sync::MutexGuard<'static, ()> {
    STARTING.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs every registered clean-up, newest first, on SIGINT, SIGTERM or
/// SIGHUP, then exits with 128 + the signal's number. The handlers are in
/// place when it returns. Call it first in `main`, before other threads
/// start: it first undoes the handlers libfabric's PSM dependencies
/// installed for SIGINT and SIGTERM at load time, which tokio's handler
/// would otherwise call after its own (they ended the process at once,
/// with status 1 and no word, before any clean-up ran).
pub fn stop_on_interrupt() -> std::io::Result<()> {
    icheck_core::fabric::disarm_provider_crash_handlers();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    let (mut int, mut term, mut hup) = runtime.block_on(async {
        std::io::Result::Ok((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
            signal(SignalKind::hangup())?,
        ))
    })?;
    // SAFETY: `wait_for_clean_up` is an `extern "C" fn()` that never
    // unwinds (it only waits on a condition variable and may `_exit`).
    if unsafe { libc::atexit(wait_for_clean_up) } != 0 {
        return Err(std::io::Error::other("atexit refused the clean-up's exit handler"));
    }
    std::thread::Builder::new().name("icheck-interrupt".into()).spawn(move || {
        let number = runtime.block_on(async {
            tokio::select! {
                _ = int.recv() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
                _ = hup.recv() => libc::SIGHUP,
            }
        });
        INTERRUPTED_BY.store(number, Ordering::SeqCst);
        // Nothing starts from here on; whatever was starting has finished.
        let _starting = hold_off();
        let pending: Vec<Action> = std::mem::take(&mut *actions()).into_values().rev().collect();
        let name = nix::sys::signal::Signal::try_from(number).map_or_else(|_| number.to_string(), |s| s.to_string());
        eprintln!("{name}: stopping what this run started ({} to stop)", pending.len());
        for (what, action) in pending {
            eprintln!("  stopping {what}");
            action();
        }
        *CLEANED_UP.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        CLEANED_UP.1.notify_all();
        exit_now(number);
    })?;
    Ok(())
}

/// Runs at `exit` (registered by [`stop_on_interrupt`]): once a signal has
/// come, the main thread's exit (a run failing because its jobs were just
/// killed, say) waits until the clean-up has finished, so that it cannot
/// end the process half-way through, then exits as interrupted.
extern "C" fn wait_for_clean_up() {
    let number = INTERRUPTED_BY.load(Ordering::SeqCst);
    if number == 0 {
        return;
    }
    let mut done = CLEANED_UP.0.lock().unwrap_or_else(|p| p.into_inner());
    while !*done {
        done = CLEANED_UP.1.wait(done).unwrap_or_else(|p| p.into_inner());
    }
    exit_now(number);
}

/// Ends the process with 128 + `signal` without running exit handlers
/// again (two threads may be exiting at once).
fn exit_now(signal: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: `_exit` ends the process at once; nothing after it runs, and
    // it is safe to call from any thread, also while another is in `exit`.
    unsafe { libc::_exit(128 + signal) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_guard_forgets_its_action_and_a_kept_one_stays() {
        let kept = on_interrupt("kept", || {});
        let dropped = on_interrupt("dropped", || {});
        let (kept_id, dropped_id) = (kept.0, dropped.0);
        drop(dropped);
        let registered = actions();
        assert!(registered.contains_key(&kept_id));
        assert!(!registered.contains_key(&dropped_id));
        drop(registered);
        drop(kept);
        assert!(!actions().contains_key(&kept_id));
    }
}
