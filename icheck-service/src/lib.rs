//! icheck-service: the service processes (controller, manager with its
//! agent threads), the `icheck` command, the fabric self-test, and the kit
//! the multi-process tests and benchmarks start real services with.
//!
//! Architecture invariant: tokio tasks here only move small control
//! messages; they never touch checkpoint bytes. Agent threads own their
//! fabric endpoints and drive their own progress.

mod accept;
pub mod agent;
pub mod controller;
pub mod framing;
pub mod launcher;
pub mod manager;
pub mod metrics;
pub mod owners;
pub mod peercred;
pub mod selftest;
pub mod store;
#[doc(hidden)]
pub mod testkit;
pub mod wedge;

pub use icheck_core::control::ServiceError;

/// Reads MemAvailable and MemTotal from /proc/meminfo, in bytes.
pub fn read_meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    (kib_field(&text, "MemAvailable:"), kib_field(&text, "MemTotal:"))
}

/// This process's resident memory that no file backs (`RssAnon` in
/// /proc/self/status), in bytes: its heap and stacks, libfabric's buffers
/// among them. A manager's agents keep versions in files, so this is the
/// manager's own cost beside them. 0 where the kernel does not say.
pub fn read_own_anonymous_memory() -> u64 {
    kib_field(&std::fs::read_to_string("/proc/self/status").unwrap_or_default(), "RssAnon:")
}

/// The figure after `name` (`"MemTotal:"`, `"RssAnon:"`, ...) on its line of
/// a /proc file's `text` (`/proc/meminfo`, `/proc/PID/status`), given there
/// in kB, in bytes (0 if absent).
pub fn kib_field(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn proc_fields_are_read_in_bytes_and_a_missing_one_is_zero() {
        let text = "MemTotal:       24576000 kB\nRssAnon:\t    1928 kB\nThreads:\t7\n";
        assert_eq!(super::kib_field(text, "MemTotal:"), 24_576_000 * 1024);
        assert_eq!(super::kib_field(text, "RssAnon:"), 1928 * 1024);
        assert_eq!(super::kib_field(text, "MemAvailable:"), 0);
        assert!(super::read_own_anonymous_memory() > 0, "this test process has a heap");
    }
}
