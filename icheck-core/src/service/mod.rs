//! The service processes: controller, manager (with its agent threads), and
//! the client side of the control plane.
//!
//! Architecture invariant: tokio tasks here only move small control
//! messages; they never touch checkpoint bytes. Agent threads own their
//! fabric endpoints and drive their own progress.

pub mod agent;
pub mod control;
pub mod controller;
pub mod manager;
pub mod metrics;
pub mod monitor;
pub mod store;

/// Errors of the service processes.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Control-plane problem.
    #[error(transparent)]
    Protocol(#[from] crate::protocol::ProtocolError),
    /// Fabric problem.
    #[error(transparent)]
    Fabric(#[from] crate::fabric::FabricError),
    /// Socket or file problem, with what was being done.
    #[error("{what}: {error}")]
    Io {
        /// What failed.
        what: String,
        /// The error.
        error: std::io::Error,
    },
    /// The controller answered with an error.
    #[error("controller: {0}")]
    Remote(String),
}

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
