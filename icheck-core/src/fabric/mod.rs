//! The safe libfabric layer: the only code in icheck that calls into libfabric.
//!
//! # Types
//! * [`Domain`]: an opened fabric plus domain for one provider, with the
//!   memory-registration rules ([`MrMode`]) the provider asked for.
//! * [`Endpoint`]: a reliable-datagram (`FI_EP_RDM`) endpoint with its own
//!   completion queue and address vector. It registers memory and runs batched
//!   RMA reads and writes against peers.
//! * [`MemoryRegion`] / [`RegisteredBuffer`]: local memory the NIC may access.
//! * [`RemoteRegion`]: what a peer needs to reach a registered region (base
//!   address, key, length). It is plain data, serializable, so the control
//!   plane carries it.
//! * [`FabricAddress`] / [`Peer`]: an endpoint's raw address and a peer
//!   inserted into the local address vector.
//! * [`ProgressThread`]: polls an endpoint that is only a *target* of RMA.
//!
//! # Architecture invariants
//! * No libfabric type, pointer or constant leaves this module: callers see
//!   only the types above and [`FabricError`].
//! * Every `unsafe` block carries a `// SAFETY:` comment.
//! * **Who drives progress.** With `tcp`, `shm`, `net` and `rxd` an RMA
//!   completes only while *both* sides poll their completion queues.
//!   - The initiator of a batch drives progress itself: [`Endpoint::read`] and
//!     [`Endpoint::write`] hold the endpoint lock and poll until every
//!     operation of the batch has completed (or failed, or timed out).
//!   - The target of RMA must run a [`ProgressThread`] (the application while
//!     agents pull from it; the agent while the application pushes to it). The
//!     thread only polls while no batch holds the endpoint, so it never steals
//!     a batch's completions.
//! * A batch never returns while one of its operations may still touch local
//!   memory: it waits for every posted operation, and when a peer stops
//!   answering it closes the endpoint before returning [`FabricError::Timeout`].
//!   An shm peer that died is seen sooner: shm reports nothing for it, so a
//!   batch without completions for 100 ms looks whether the processes it
//!   waits for still run and gives the endpoint up the same way
//!   ([`FabricError::PeerGone`]) instead of spinning out its timeout.
//! * Writes a checkpoint version depends on use `FI_DELIVERY_COMPLETE`
//!   ([`TransferOptions::delivery_complete`]), because the default completion
//!   may be reported before the data reached target memory.

// Constants from the generated bindings change type between libfabric header
// versions (u32 in one, u64 in another), so explicit casts stay even where
// they are no-ops for the headers at hand.
#![allow(clippy::unnecessary_cast)]

mod choice;
mod crash_handlers;
mod domain;
mod endpoint;
mod error;
mod mr;
mod progress;
mod watchdog;

pub use choice::{choose_provider, ProviderChoice, Reach};
pub use crash_handlers::{disarm_provider_crash_handlers, NO_BACKTRACE_ENV};
pub use domain::{
    check_provider, libfabric_version, list_providers, reclaim_dead_processes_shm_regions, remove_dead_peer_region,
    remove_shm_regions_of, shm_region_of, Domain, FabricConfig, LibfabricVersion, MrMode, ProviderInfo,
};
pub use endpoint::{Endpoint, FabricAddress, Peer, PeerOp, RmaKind, RmaOp, TransferOptions, TransferStats};
pub use error::FabricError;
pub use mr::{
    Access, AlignedBuffer, LocalSource, LocalTarget, MemoryRegion, RegisteredBuffer, RemoteRegion, StableBuffer,
};
pub use progress::{
    lower_thread_priority, set_daemon_provider_defaults, ProgressMode, ProgressThread, DAEMON_PROVIDER_DEFAULTS,
    RXM_CM_PROGRESS_ENV, RXM_MSG_RX_SIZE_ENV,
};
pub use watchdog::{wedge_next_call, WedgeWatch, WedgedCall};

/// Result type of the fabric layer.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;
