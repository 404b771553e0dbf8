//! The library's error type: what failed, and the file, peer, agent or
//! label at fault.

use super::*;

/// What the controller said, without the "controller: " a refusal carries
/// on its own (the library's message names the controller already).
fn controller_said(error: &ServiceError) -> String {
    match error {
        ServiceError::Remote(message) => message.clone(),
        other => other.to_string(),
    }
}

/// Everything a library call can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file is missing or wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The controller could not be reached or refused.
    #[error("controller at {peer}: {}", controller_said(error))]
    Controller {
        /// Its address.
        peer: String,
        /// What happened.
        error: ServiceError,
    },
    /// An agent could not be reached or failed a request.
    #[error("agent {agent} on node {node} ({peer}): {message}")]
    Agent {
        /// Agent id.
        agent: u64,
        /// Its node.
        node: String,
        /// Its command channel.
        peer: String,
        /// What happened.
        message: String,
        /// The agent could not be reached, its connection broke, or it did
        /// not answer in time (rather than answering with an error): the
        /// controller hears of it with the next probe, and moves the
        /// agent if its node still heartbeats.
        unreachable: bool,
    },
    /// The application's capability could not be read or kept.
    #[error("capability store: {0}")]
    Credentials(#[from] icheck_core::credentials::CredentialError),
    /// Fabric failure on this process's side.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// The label was never added (or is not in the checkpoint).
    #[error("unknown label {label:?}: {detail}")]
    UnknownLabel {
        /// The label.
        label: String,
        /// Where it is missing.
        detail: &'static str,
    },
    /// A label name is unusable.
    #[error("invalid label {0:?}: labels are 1 to 255 bytes")]
    BadLabel(String),
    /// The checkpointed data and the caller's memory differ in size.
    #[error("label {label:?}: the checkpoint holds {stored} bytes, the region given has {given} bytes")]
    SizeMismatch {
        /// The label.
        label: String,
        /// Bytes in the checkpoint.
        stored: u64,
        /// Bytes in the caller's region.
        given: u64,
    },
    /// The checkpointed data has another element type.
    #[error("label {label:?}: the checkpoint holds {stored:?} elements, the region holds {given:?}")]
    KindMismatch {
        /// The label.
        label: String,
        /// Kind in the checkpoint.
        stored: DataKind,
        /// Kind of the caller's region.
        given: DataKind,
    },
    /// A call came in the wrong order.
    #[error("{0}")]
    Order(&'static str),
    /// No complete checkpoint exists.
    #[error("no complete checkpoint of {0:?} exists")]
    NoCheckpoint(String),
    /// Restored bytes fail their checksum.
    #[error("version {version} of rank {rank}: bytes {start}..{end} (labels {labels}) fail their crc32c checksum")]
    Corrupt {
        /// Version.
        version: u64,
        /// Rank.
        rank: u32,
        /// First byte of the bad chunk.
        start: u64,
        /// End of the bad chunk.
        end: u64,
        /// Labels overlapping the damaged chunk.
        labels: String,
    },
    /// Another rank failed its part; the version was not recorded.
    #[error("version {version} is incomplete: {detail}; {previous} stays the newest complete version")]
    Incomplete {
        /// The version.
        version: u64,
        /// What failed where.
        detail: String,
        /// What a restart would get.
        previous: String,
    },
    /// The checkpoint was written with another process count, and this
    /// mode cannot restore it (SHMR keeps one file per node).
    #[error("version {version} was written by {written} processes, this run has {now}: a restart with another process count needs MR mode (mode = \"mr\")")]
    RankCount {
        /// Version.
        version: u64,
        /// Processes when written.
        written: u32,
        /// Processes now.
        now: u32,
    },
    /// A configuration value is not supported (yet).
    #[error("{0}")]
    Unsupported(String),
    /// A label added for malleability (`add_adapt`, `add_adapt_global`)
    /// cannot be stored or restored as asked.
    #[error("label {label:?}: {detail}")]
    Adapt {
        /// The label.
        label: String,
        /// What is wrong.
        detail: String,
    },
    /// A distributed array has no layout for the process count.
    #[error("label {label:?}: {error}")]
    Distribution {
        /// The label.
        label: String,
        /// Why.
        error: icheck_core::distribution::DistributionError,
    },
}

impl Error {
    /// The agent this error says could not be reached or did not answer in
    /// time, if it says so.
    pub fn unreached_agent(&self) -> Option<u64> {
        match self {
            Error::Agent { agent, unreachable: true, .. } => Some(*agent),
            _ => None,
        }
    }
}

/// The result of a library call.
pub(crate) type Result<T> = std::result::Result<T, Error>;
