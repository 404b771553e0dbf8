//! Raw, unsafe bindings to the libfabric installed on this machine.
//!
//! The bindings are generated at build time by `bindgen` from the headers that
//! `pkg-config libfabric` points at, so the same crate builds against
//! libfabric 1.17 (Debian 12) and 2.x. libfabric's `static inline` calls
//! (`fi_read`, `fi_cq_read`, `fi_mr_reg`, ...) have no symbol in the shared
//! library; `shim.c` gives each one a real symbol named `icheck_fi_*`.
//!
//! Nothing in icheck uses this crate directly except `icheck_core::fabric`,
//! the safe layer.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case)]
#![allow(missing_docs, clippy::all, clippy::undocumented_unsafe_blocks)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
