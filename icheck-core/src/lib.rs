//! icheck-core: what the client library and the service share.
//!
//! * [`fabric`] is the only safe door to libfabric: domains, endpoints,
//!   memory regions and batched RMA. Every checkpoint byte moves through it.
//! * [`format`](mod@format) is the stored format (manifests, checksums, names), a leaf.
//! * [`verified`] reads a rank's bytes over the fabric, checking each chunk
//!   as it arrives.
//! * [`protocol`] is the control plane's messages and framing; [`control`]
//!   its blocking client side.
//! * [`pfs`] is the PFS level's on-disk format (its copies encrypted by
//!   [`cipher`] where the application asks), read by restarting
//!   applications and written by agents and the library's fallback.
//! * [`handoff`] gives a restarting rank on its agent's own host the
//!   version's file (a descriptor over a Unix socket) instead of the fabric.
//! * [`credentials`] is who may do what: tokens, per-application
//!   capabilities and the client's capability store.
//! * [`config`], [`decide`], [`distribution`], [`monitor`] and [`units`] are
//!   configuration and pure logic.
//!
//! Architecture invariant: this crate runs no async runtime and parses no
//! command line: it carries neither tokio, clap, anyhow nor
//! tracing-subscriber, so linking the client library does not carry the
//! service (which lives in `icheck-service`).
//!
//! See ARCHITECTURE.md at the repository root for the bird's-eye view.

pub mod cipher;
pub mod config;
pub mod control;
pub mod credentials;
pub mod decide;
pub mod delta;
pub mod distribution;
pub mod fabric;
pub mod failpoint;
pub mod format;
pub mod handoff;
pub mod kernel_copy;
pub mod monitor;
pub mod pages;
pub mod pattern;
pub mod pfs;
pub mod protocol;
pub mod redundancy;
pub mod scaling;
pub mod units;
pub mod verified;
