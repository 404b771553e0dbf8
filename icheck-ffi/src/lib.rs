//! C ABI of icheck (`libicheck.so`, `libicheck.a`): a thin translation over
//! `icheck-lib`. The only crate in the workspace that exports `extern "C"`.
//!
//! The entry points of `include/icheck.h` arrive with the client library; until
//! then the ABI only reports its version.

/// Version of the icheck C ABI, as `MAJOR * 10000 + MINOR * 100 + PATCH`.
#[no_mangle]
pub extern "C" fn icheck_abi_version() -> i32 {
    100
}
