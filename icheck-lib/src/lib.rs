//! icheck client library: what applications link to checkpoint their
//! memory into the agents of an icheck service and restart from it.
//!
//! The calls follow thesis §6.1.3: [`Icheck::init`], [`Icheck::add`],
//! [`Icheck::commit`], [`Icheck::restart`], [`Icheck::restore`],
//! [`Icheck::probe_agents`] and [`Icheck::finalize`]. Calls marked
//! *collective* must be made by every process of the communicator, in the
//! same order (as with MPI collectives).
//!
//! ```no_run
//! use icheck_lib::{Icheck, InitStatus, Region, SingleProcess};
//! let temperature = Region::<f64>::zeroed(1 << 20);
//! let (mut ic, status) = Icheck::init(None, "heat2d", SingleProcess).unwrap();
//! ic.add("temperature", &temperature).unwrap();
//! if let InitStatus::Restart { .. } = status {
//!     ic.restart().unwrap();
//!     ic.restore_all().unwrap();
//! }
//! for step in 0..100 {
//!     temperature.write()[0] = step as f64;
//!     if step % 10 == 0 {
//!         ic.commit().unwrap();
//!     }
//! }
//! ic.finalize(false).unwrap();
//! ```
//!
//! Architecture invariant: a version is complete only after every rank's
//! agent sealed it *and* rank 0 recorded it at the controller; until then the
//! previous complete version is what a restart gets.

mod client;
mod comm;
mod region;
mod segment;
mod tracking;

pub use client::{
    CommitStats, Error, Global, Icheck, InitStatus, ProbeHints, ProbeOutcome, Protection, Recalc, Recalculate,
    Replicated, Resize,
};
#[cfg(feature = "mpi")]
pub use comm::MpiComm;
pub use comm::{Communicator, SingleProcess};
/// Stored malleability metadata and the PREDEFINED processor mappings.
pub use icheck_core::distribution::{Attribute, GlobalLayout, ProcessorMapping};
pub use icheck_core::protocol::DataKind;
/// How commits move their bytes ([`Icheck::transfer`]).
pub use icheck_core::protocol::{AutoTransfer, TransferReport};
pub use region::{Element, Region};

/// The fabric layer, for applications that want to measure it.
pub use icheck_core::fabric;
