//! icheck client library: what applications link to commit and restart checkpoints.
//!
//! The client API (init, add, commit, restart, restore, probe, finalize) is not
//! implemented yet; see ARCHITECTURE.md for the plan. Today this crate only
//! re-exports the fabric layer it will be built on.

pub use icheck_core::fabric;
