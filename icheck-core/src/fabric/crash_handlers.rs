//! Signal handlers that libfabric's dependencies install behind our back.
//!
//! Debian's libfabric links libpsm_infinipath (PSM) and libpsm2. Their
//! library constructors run before `main` and, unless `IPATH_NO_BACKTRACE`
//! (PSM) or `HFI_NO_BACKTRACE` (PSM2) is set, install handlers for SIGSEGV,
//! SIGBUS, SIGILL, SIGABRT, SIGINT and SIGTERM that print a backtrace (and
//! write crash files into the working directory) and exit. In a daemon that
//! does not even use those providers this is harmful: a crash report lands
//! in whatever directory the daemon was started from, and because tokio's
//! signal handling chains to the previous handler, a SIGTERM meant for a
//! graceful stop ran PSM's handler too.

/// Environment variables that keep the PSM libraries from installing their
/// handlers; `icheck up` starts its daemons with them set.
pub const NO_BACKTRACE_ENV: [(&str, &str); 2] = [("IPATH_NO_BACKTRACE", "1"), ("HFI_NO_BACKTRACE", "1")];

/// The signals those libraries take over.
const TAKEN: [libc::c_int; 6] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGABRT, libc::SIGINT, libc::SIGTERM];

/// Whether `signal` has a handler (neither default nor ignored).
fn handled(signal: libc::c_int) -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a NULL new
    // action only queries the current one.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction != libc::SIG_DFL
            && current.sa_sigaction != libc::SIG_IGN
    }
}

/// Restores the default action of the signals the PSM libraries took, if
/// they took them (SIGILL handled at start-up is their mark: neither Rust's
/// runtime nor icheck handles it). Call first thing in `main`, before any
/// thread starts or any handler of our own is installed. Returns whether
/// anything was reset.
pub fn disarm_provider_crash_handlers() -> bool {
    if !handled(libc::SIGILL) {
        return false;
    }
    for signal in TAKEN {
        // SAFETY: called before other threads exist (see above); SIG_DFL
        // is always a valid disposition for these signals.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
    true
}
