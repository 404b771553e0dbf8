//! Progress for endpoints that are the target of RMA.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::Endpoint;

/// libfabric's parameter for how often ofi_rxm (the tcp and verbs RDM
/// layer) looks at connection requests while an endpoint polls its
/// completion queue, in microseconds.
pub const RXM_CM_PROGRESS_ENV: &str = "FI_OFI_RXM_CM_PROGRESS_INTERVAL";

/// libfabric's parameter for how many receive buffers ofi_rxm posts per
/// endpoint (shared by its connections; 4096 by default in libfabric 1.17).
pub const RXM_MSG_RX_SIZE_ENV: &str = "FI_OFI_RXM_MSG_RX_SIZE";

/// The libfabric parameters icheck's daemons set unless the environment
/// already chose, and why.
///
/// * [`RXM_CM_PROGRESS_ENV`] = 1 ms instead of 10 ms. An endpoint that is
///   the *target* of a new peer's first RMA (an agent serving a restarting
///   rank) looks at connection requests only every 10 ms by default, and
///   the handshake needs several such looks: the first read of every
///   restart paid about 30 ms before any data moved. Checking every
///   millisecond costs one non-blocking event-queue read per millisecond
///   of polling.
/// * [`RXM_MSG_RX_SIZE_ENV`] = 128 instead of 4096. Each buffer is 16 KiB
///   (`FI_OFI_RXM_BUFFER_SIZE`), so every endpoint held 64 MiB for messages
///   icheck never sends: it moves data with RMA only, which ofi_rxm hands
///   to the tcp connection without a receive buffer. An agent has an
///   endpoint plus a lane per rank (up to three), so a manager held about
///   230 MiB per application of two ranks over tcp (75 MiB with 128). ofi_rxm's pool
///   grows 1024 buffers (about 17 MiB, zeroed) at a time, so any count up
///   to 1024 costs the same; 128 leaves room to spare. The buffer size
///   itself is not touched: ofi_rxm's peers must agree on it.
pub const DAEMON_PROVIDER_DEFAULTS: [(&str, &str); 2] = [(RXM_CM_PROGRESS_ENV, "1000"), (RXM_MSG_RX_SIZE_ENV, "128")];

/// The entries of [`DAEMON_PROVIDER_DEFAULTS`] that `current` (a lookup in
/// the environment) has not set: what [`set_daemon_provider_defaults`] sets.
fn daemon_defaults_unset(current: impl Fn(&str) -> Option<std::ffi::OsString>) -> Vec<(&'static str, &'static str)> {
    DAEMON_PROVIDER_DEFAULTS.into_iter().filter(|(name, _)| current(name).is_none()).collect()
}

/// Sets [`DAEMON_PROVIDER_DEFAULTS`] in this process's environment, each
/// unless the environment already chose.
///
/// Call it first thing in `main`, while the process has one thread:
/// libfabric reads the parameters when its providers initialise, and
/// changing the environment is only sound before other threads run, which
/// is also why the client library does not do it inside applications
/// (README, "Memory the fabric takes", says what they can set).
pub fn set_daemon_provider_defaults() {
    for (name, value) in daemon_defaults_unset(|name| std::env::var_os(name)) {
        std::env::set_var(name, value);
    }
}

/// How a [`ProgressThread`] waits between polls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// Poll continuously, yielding the CPU between polls: lowest latency and
    /// full bandwidth, at the cost of one busy core while it runs.
    Spin,
    /// Sleep this long between polls: for idle endpoints.
    Sleep(Duration),
}

/// A thread that polls an endpoint's completion queue so that peers' RMA
/// against this endpoint's memory makes progress. Stops and joins on drop.
pub struct ProgressThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl ProgressThread {
    /// Starts polling `endpoint` (a clone of it is kept until the thread stops).
    pub fn spawn(endpoint: &Endpoint, mode: ProgressMode) -> std::io::Result<ProgressThread> {
        Self::spawn_with(endpoint, mode, || {})
    }

    /// Like [`spawn`](Self::spawn), running `setup` on the new thread first
    /// (to lower its scheduling priority, for example).
    pub fn spawn_with(
        endpoint: &Endpoint,
        mode: ProgressMode,
        setup: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<ProgressThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let endpoint = endpoint.clone();
        let handle = std::thread::Builder::new().name("icheck-fabric-progress".into()).spawn(move || {
            setup();
            while !flag.load(Ordering::Relaxed) {
                endpoint.progress();
                match mode {
                    ProgressMode::Spin => std::thread::yield_now(),
                    ProgressMode::Sleep(pause) => std::thread::sleep(pause),
                }
            }
        })?;
        Ok(ProgressThread { stop, handle: Some(handle) })
    }

    /// Progress for an endpoint whose memory a peer reads: spins. Under
    /// `shm` a read's bytes are copied by the reader itself
    /// (`process_vm_readv` inside its post; writes that ask for delivery
    /// completion are copied by the target instead, so this is for reads
    /// only), and this side only takes the reader's notices off its queue:
    /// the thread spins under `SCHED_IDLE`, because on a node with few
    /// cores any other policy takes CPU from the reader's copy and from the
    /// checksum thread beside it. At nice 19 (as it was) the scheduler saw
    /// its core as busy and stacked the rank's threads on the other one:
    /// `perf` over a one-rank restore on two cores had the spin on one core
    /// for the whole read, and one-rank pull commits measured 0.53–1.04 of
    /// raw `fi_read` (0.71 in the middle of five runs) against 0.85–0.96
    /// (0.89) under `SCHED_IDLE`, a core the scheduler hands to any other
    /// thread as if it were idle. It still runs whenever a core is free, so
    /// a provider that needs this side to copy (shm without CMA) still
    /// progresses on an idle core.
    pub fn serving_reads(endpoint: &Endpoint) -> std::io::Result<ProgressThread> {
        if endpoint.provider() == "shm" {
            Self::spawn_with(endpoint, ProgressMode::Spin, idle_thread_priority)
        } else {
            Self::spawn(endpoint, ProgressMode::Spin)
        }
    }

    /// Progress for an agent's endpoint whose memory a restarting rank
    /// reads. Over shm the rank copies the bytes itself, and this side only
    /// takes its notices off the queue (about one per megabyte, from a
    /// queue of a thousand), so it polls as for another agent's background
    /// reads ([`serving_background_reads`](Self::serving_background_reads):
    /// every `BACKGROUND_SHM_POLL` under `SCHED_IDLE`) instead of spinning:
    /// `perf` over a one-rank 256 MiB restore on two cores had the spin (on
    /// the region lock the reader's copy holds) alone on one core for the
    /// whole read, while the rank's reader and the thread checking and
    /// copying out what it read shared the other. Over other providers this
    /// side moves the bytes and spins
    /// ([`serving_reads`](Self::serving_reads)).
    pub fn serving_restart_reads(endpoint: &Endpoint) -> std::io::Result<ProgressThread> {
        if endpoint.provider() == "shm" {
            Self::serving_background_reads(endpoint)
        } else {
            Self::serving_reads(endpoint)
        }
    }

    /// Progress for an endpoint whose memory another agent reads as
    /// background work (a partner copy, a parity encoder, a rebuild).
    ///
    /// Under `shm` the reader copies the bytes itself, and does so while it
    /// holds this endpoint's region lock (libfabric's fast RMA path); a
    /// progress poll takes the same lock, and spins on it for as long as
    /// the reader's copy lasts. Polled often, the thread spent a fifth of a
    /// two-core node's time spinning while an encoder read four members;
    /// this side only has to take the reader's notices off its queue
    /// (one per operation, from a queue of a thousand), so it polls every
    /// `BACKGROUND_SHM_POLL` under `SCHED_IDLE` (`idle_thread_priority`).
    /// Over other providers this side moves the bytes: it polls every
    /// 50 µs at nice 19. (A restarting rank's reads keep
    /// [`serving_reads`](Self::serving_reads), which spins between polls
    /// instead of sleeping: the rank waits for them.)
    pub fn serving_background_reads(endpoint: &Endpoint) -> std::io::Result<ProgressThread> {
        if endpoint.provider() == "shm" {
            Self::spawn_with(endpoint, ProgressMode::Sleep(BACKGROUND_SHM_POLL), idle_thread_priority)
        } else {
            Self::serving_background_writes(endpoint)
        }
    }

    /// Progress for an endpoint another agent writes into as background
    /// work (a parity shard): the writes ask for delivery completion, so
    /// this side copies them in (under `shm`) or receives them, polling
    /// every 50 µs at nice 19.
    pub fn serving_background_writes(endpoint: &Endpoint) -> std::io::Result<ProgressThread> {
        Self::spawn_with(endpoint, ProgressMode::Sleep(Duration::from_micros(50)), lower_thread_priority)
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How often [`ProgressThread::serving_background_reads`] polls under `shm`.
/// A poll that lands during a reader's copy spins until the copy ends: at
/// 1 ms, four members read by one encoder still spun through 10% of a
/// two-core node's time (`perf`, the encoder's block loop); at 5 ms, 3.5%.
/// A member's reader posts about one notice per megabyte it reads, so 5 ms
/// of reads (about 25 at this machine's copy speed) is far from filling
/// the queue of a thousand.
const BACKGROUND_SHM_POLL: Duration = Duration::from_millis(5);

/// Moves the calling thread to `SCHED_IDLE` (after nice 19, which stays if
/// the kernel refuses): it gets a core almost only when the core would
/// otherwise idle, and loses it as soon as another thread wakes there, so
/// whatever it spins on costs no other thread its time. Failure only
/// leaves the priority.
fn idle_thread_priority() {
    lower_thread_priority();
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param that outlives the call;
    // pid 0 addresses the calling thread alone, whose policy is all that
    // changes.
    let failed = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0;
    if failed {
        tracing::debug!(err = %std::io::Error::last_os_error(), "cannot move a background thread to SCHED_IDLE");
    }
}

/// Lowers the calling thread's scheduling priority to nice 19 (background
/// work: it runs when a core is free). Failure only leaves the priority.
pub fn lower_thread_priority() {
    // SAFETY: gettid and setpriority take no pointers and only change the
    // scheduling priority of the calling thread (on Linux, PRIO_PROCESS
    // with a thread id addresses that thread alone).
    let failed = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) } != 0;
    if failed {
        tracing::debug!(err = %std::io::Error::last_os_error(), "cannot lower a background thread's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_the_environment_chose_is_left_alone() {
        let all = daemon_defaults_unset(|_| None);
        assert_eq!(all, DAEMON_PROVIDER_DEFAULTS.to_vec());
        let chosen = |name: &str| (name == RXM_MSG_RX_SIZE_ENV).then(|| "4096".into());
        assert_eq!(daemon_defaults_unset(chosen), vec![(RXM_CM_PROGRESS_ENV, "1000")]);
    }
}
