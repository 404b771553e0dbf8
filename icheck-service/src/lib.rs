//! icheck-service: the service processes (controller, manager with its
//! agent threads), the `icheck` command, the fabric self-test, and the kit
//! the multi-process tests and benchmarks start real services with.
//!
//! Architecture invariant: tokio tasks here only move small control
//! messages; they never touch checkpoint bytes. Agent threads own their
//! fabric endpoints and drive their own progress.

pub mod agent;
pub mod controller;
pub mod framing;
pub mod launcher;
pub mod manager;
pub mod metrics;
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
    let field = |name: &str| {
        text.lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemAvailable:"), field("MemTotal:"))
}
