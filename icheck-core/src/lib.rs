//! icheck-core: the checkpoint service and the layers it is built on.
//!
//! * [`fabric`] is the only safe door to libfabric: domains, endpoints,
//!   memory regions and batched RMA. Every checkpoint byte moves through it.
//! * [`selftest`] is the two-process RMA check behind `icheck fabric selftest`.
//! * [`units`] parses and prints byte sizes the way operators write them.
//!
//! See ARCHITECTURE.md at the repository root for the bird's-eye view.

pub mod config;
pub mod decide;
pub mod distribution;
pub mod fabric;
pub mod failpoint;
pub mod format;
pub mod pattern;
pub mod pfs;
pub mod protocol;
pub mod selftest;
pub mod service;
#[doc(hidden)]
pub mod testkit;
pub mod units;
