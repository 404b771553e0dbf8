//! Typed errors of the fabric layer; every message names the call, peer or
//! region at fault.

use std::time::Duration;

use super::endpoint::RmaKind;

/// Everything that can go wrong in the fabric layer.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// `fi_getinfo` found no provider that satisfies icheck's needs.
    #[error("no libfabric provider offers RMA on reliable-datagram endpoints for provider={requested} domain={domain}: {detail} (run `fi_info -t FI_EP_RDM -c FI_RMA` to see what this machine offers)")]
    NoProvider {
        /// The provider asked for (`auto` when none).
        requested: String,
        /// The domain (interface) asked for (`any` when none).
        domain: String,
        /// libfabric's explanation.
        detail: String,
    },
    /// A libfabric call returned an error code.
    #[error("{call} failed: {message} (libfabric error {code})")]
    Call {
        /// Name of the libfabric call.
        call: &'static str,
        /// Positive libfabric error number.
        code: i32,
        /// `fi_strerror` text.
        message: String,
    },
    /// An RMA operation completed with an error.
    #[error("{op} of {len} bytes at remote address {remote_addr:#x} (key {key:#x}) with peer {peer} failed: {message} (libfabric error {code}, provider error {prov_errno})")]
    Completion {
        /// Read or write.
        op: RmaKind,
        /// The peer's printable address.
        peer: String,
        /// Remote address the operation targeted.
        remote_addr: u64,
        /// Remote key the operation used.
        key: u64,
        /// Bytes in the failed operation.
        len: usize,
        /// Positive libfabric error number.
        code: i32,
        /// Provider-specific error number.
        prov_errno: i32,
        /// Provider's description of the error.
        message: String,
    },
    /// Posting an RMA operation was refused by the provider.
    #[error("posting {op} of {len} bytes to peer {peer} failed: {message} (libfabric error {code})")]
    Post {
        /// Read or write.
        op: RmaKind,
        /// The peer's printable address.
        peer: String,
        /// Bytes in the operation.
        len: usize,
        /// Positive libfabric error number.
        code: i32,
        /// `fi_strerror` text.
        message: String,
    },
    /// Operations got no completion within the timeout; the endpoint was
    /// closed so that no late completion can touch memory the caller reuses.
    #[error("{op} with peer {peer} timed out: {outstanding} operation(s) had no completion for {timeout:?}; the endpoint was given up (is the peer alive and polling its completion queue?)")]
    Timeout {
        /// Read or write.
        op: RmaKind,
        /// The peer's printable address.
        peer: String,
        /// Operations still outstanding.
        outstanding: usize,
        /// The progress timeout that expired.
        timeout: Duration,
    },
    /// A peer of the shm provider died with operations of a batch
    /// outstanding: shm reports nothing for a dead peer (tcp reports the
    /// lost connection), so the batch saw its process gone instead of
    /// waiting out its timeout. The endpoint was given up, as on a timeout.
    #[error("{op} with peer {peer}: its process ({pid}) has ended with {outstanding} operation(s) outstanding; the endpoint was given up")]
    PeerGone {
        /// Read or write.
        op: RmaKind,
        /// The peer's printable address.
        peer: String,
        /// The peer's process id.
        pid: u32,
        /// Operations still outstanding.
        outstanding: usize,
    },
    /// A requested range does not fit the region it refers to.
    #[error("{side} range [{offset}, {offset}+{len}) lies outside the region of {region_len} bytes")]
    OutOfRange {
        /// `local` or `remote`.
        side: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The endpoint was closed after an earlier timeout and cannot be used.
    #[error("the fabric endpoint was closed after an earlier timeout; open a new one")]
    Closed,
    /// A fabric address could not be decoded or inserted.
    #[error("invalid fabric address {address}: {reason}")]
    InvalidAddress {
        /// The address as given (hex).
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value is unusable.
    #[error("invalid fabric configuration: {0}")]
    Config(String),
}

impl FabricError {
    /// Builds a [`FabricError::Call`] from a negative libfabric return code.
    pub(crate) fn call(call: &'static str, ret: i64) -> Self {
        let code = ret.unsigned_abs() as i32;
        FabricError::Call { call, code, message: super::domain::strerror(code) }
    }
}
