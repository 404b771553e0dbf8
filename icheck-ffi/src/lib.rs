//! C ABI of icheck (`libicheck.so`, `libicheck.a`): a thin translation of
//! `include/icheck.h` onto `icheck-lib`. The only crate in the workspace that
//! exports `extern "C"` functions.
//!
//! Architecture invariants:
//! * Every entry point checks its pointers and the call order, returns
//!   `ICHECK_SUCCESS` or a negative `ICHECK_ERR_*` code, and never unwinds:
//!   a Rust panic becomes `ICHECK_ERR_INTERNAL`.
//! * No MPI here: `icheck_init` lives in `c/icheck_mpi.c`, compiled with the
//!   application's `mpicc` into `libicheck_mpi.a` at install time, and
//!   reaches this library through `icheck_init_with_ops`.
//! * One library instance per process (the thesis API has no handle); a
//!   mutex serialises the entry points. Calls come from the thread that
//!   initialised MPI, as MPI itself requires at the default thread level.
//! * The detail of the last error (label, sizes, peer) is logged through
//!   `tracing` and kept for `icheck_last_error`.

use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Mutex;

use icheck_lib::{
    Attribute, DataKind, Error, GlobalLayout, Icheck, InitStatus, ProbeHints, ProcessorMapping, SingleProcess,
};

mod comm;
mod log;

/// Success.
pub const ICHECK_SUCCESS: c_int = 0;
/// A required pointer argument was NULL.
pub const ICHECK_ERR_NULL: c_int = -1;
/// A call came in the wrong order (e.g. commit before init, restore before restart).
pub const ICHECK_ERR_ORDER: c_int = -2;
/// An argument is invalid (unknown type or mode, bad UTF-8, bad label).
pub const ICHECK_ERR_ARG: c_int = -3;
/// The configuration file is missing or wrong.
pub const ICHECK_ERR_CONFIG: c_int = -4;
/// The controller is unreachable or refused.
pub const ICHECK_ERR_CONTROLLER: c_int = -5;
/// An agent is unreachable or failed.
pub const ICHECK_ERR_AGENT: c_int = -6;
/// The fabric failed on this process's side.
pub const ICHECK_ERR_FABRIC: c_int = -7;
/// The label is unknown.
pub const ICHECK_ERR_LABEL: c_int = -8;
/// The checkpointed size differs from the caller's.
pub const ICHECK_ERR_SIZE: c_int = -9;
/// The checkpointed element type differs from the caller's.
pub const ICHECK_ERR_TYPE: c_int = -10;
/// No complete checkpoint exists.
pub const ICHECK_ERR_NO_CHECKPOINT: c_int = -11;
/// Restored data fails its checksum.
pub const ICHECK_ERR_CORRUPT: c_int = -12;
/// Another process failed its part; the version was not recorded.
pub const ICHECK_ERR_INCOMPLETE: c_int = -13;
/// The checkpoint was written by another process count.
pub const ICHECK_ERR_RANKS: c_int = -14;
/// Not supported by this build or configuration.
pub const ICHECK_ERR_UNSUPPORTED: c_int = -15;
/// An internal error (a bug): the call was abandoned without side effects.
pub const ICHECK_ERR_INTERNAL: c_int = -16;
/// A malleable label (`icheck_add_adapt*`) cannot be stored or restored as
/// asked: a local part that does not fit its distribution, global sizes that
/// differ across ranks, a label added with plain `icheck_add`.
pub const ICHECK_ERR_ADAPT: c_int = -17;
/// The application's capability (the secret proving it owns its
/// checkpoints) could not be read or kept: a capability file others can
/// read, or a capability directory that cannot be written.
pub const ICHECK_ERR_ACCESS: c_int = -18;

/// Element types of `icheck_add` (`ICHECK_CHAR` ... `ICHECK_BINARY`).
fn kind_of(code: c_int) -> Option<DataKind> {
    Some(match code {
        1 => DataKind::Char,
        2 => DataKind::Int,
        3 => DataKind::Long,
        4 => DataKind::Float,
        5 => DataKind::Double,
        6 => DataKind::Binary,
        _ => return None,
    })
}

/// The `ICHECK_*` type code of a kind (inverse of [`kind_of`]).
fn code_of(kind: DataKind) -> c_int {
    match kind {
        DataKind::Char => 1,
        DataKind::Int => 2,
        DataKind::Long => 3,
        DataKind::Float => 4,
        DataKind::Double => 5,
        DataKind::Binary => 6,
    }
}

/// `icheck_init`'s status: no checkpoint exists.
pub const ICHECK_FRESH: c_int = 0;
/// `icheck_init`'s status: a complete checkpoint exists.
pub const ICHECK_RESTART: c_int = 1;
/// `icheck_finalize` mode: delete the checkpoints.
pub const IC_CLEANUP: c_int = 0;
/// `icheck_finalize` mode: keep the checkpoints in agent memory.
pub const IC_PERSIST: c_int = 1;

/// Hints for `icheck_probe_agents` (C layout of `icheck_hints`).
#[repr(C)]
pub struct IcheckHints {
    /// Commits the application still expects to make (0 = unknown).
    pub remaining_commits: c_int,
}

struct Instance(Option<Icheck>);

// SAFETY: the instance is only used under the INSTANCE mutex, one call at a
// time; the MPI communicator inside is used from whichever thread calls,
// which the C API documents must be allowed by the MPI thread level (the
// thread that initialised MPI, by default).
unsafe impl Send for Instance {}

static INSTANCE: Mutex<Instance> = Mutex::new(Instance(None));
static LAST_ERROR: Mutex<Option<CString>> = Mutex::new(None);

/// What went wrong, as a code and a message.
struct Failure {
    code: c_int,
    message: String,
}

impl Failure {
    fn new(code: c_int, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }
}

impl From<Error> for Failure {
    fn from(err: Error) -> Failure {
        let code = match &err {
            Error::Config(_) => ICHECK_ERR_CONFIG,
            Error::Controller { .. } => ICHECK_ERR_CONTROLLER,
            Error::Agent { .. } => ICHECK_ERR_AGENT,
            Error::Fabric(_) => ICHECK_ERR_FABRIC,
            Error::Credentials(_) => ICHECK_ERR_ACCESS,
            Error::UnknownLabel { .. } => ICHECK_ERR_LABEL,
            Error::BadLabel(_) => ICHECK_ERR_ARG,
            Error::SizeMismatch { .. } => ICHECK_ERR_SIZE,
            Error::KindMismatch { .. } => ICHECK_ERR_TYPE,
            Error::Order(_) => ICHECK_ERR_ORDER,
            Error::NoCheckpoint(_) => ICHECK_ERR_NO_CHECKPOINT,
            Error::Corrupt { .. } => ICHECK_ERR_CORRUPT,
            Error::Incomplete { .. } => ICHECK_ERR_INCOMPLETE,
            Error::RankCount { .. } => ICHECK_ERR_RANKS,
            Error::Unsupported(_) => ICHECK_ERR_UNSUPPORTED,
            Error::Adapt { .. } => ICHECK_ERR_ADAPT,
            Error::Distribution { .. } => ICHECK_ERR_RANKS,
        };
        Failure { code, message: err.to_string() }
    }
}

type Outcome = Result<c_int, Failure>;

/// Runs an entry point: no unwinding across the ABI, errors become codes
/// and the last error's detail is kept and logged.
fn entry(name: &str, body: impl FnOnce(&mut Instance) -> Outcome) -> c_int {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut instance = INSTANCE.lock().unwrap_or_else(|p| p.into_inner());
        body(&mut instance)
    }));
    let failure = match result {
        Ok(Ok(code)) => return code,
        Ok(Err(failure)) => failure,
        Err(_) => Failure::new(ICHECK_ERR_INTERNAL, "internal error (a panic was caught); please report it"),
    };
    tracing::error!(call = name, code = failure.code, "{}", failure.message);
    let text = CString::new(format!("{name}: {}", failure.message).replace('\0', " "))
        .unwrap_or_else(|_| CString::new("error").expect("no NUL"));
    *LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
    failure.code
}

fn initialised(instance: &mut Instance) -> Result<&mut Icheck, Failure> {
    instance
        .0
        .as_mut()
        .ok_or_else(|| Failure::new(ICHECK_ERR_ORDER, "icheck_init was not called (or icheck_finalize was)"))
}

/// Reads a C string argument that must not be NULL.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string.
unsafe fn text<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::new(ICHECK_ERR_NULL, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| Failure::new(ICHECK_ERR_ARG, format!("{what} is not valid UTF-8")))
}

/// # Safety
/// `config` must be NULL or a NUL-terminated string.
unsafe fn config_arg<'a>(config: *const c_char) -> Result<Option<&'a Path>, Failure> {
    if config.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    Ok(Some(Path::new(unsafe { text(config, "config") }?)))
}

fn start(
    instance: &mut Instance,
    status: *mut c_int,
    init: impl FnOnce() -> Result<(Icheck, InitStatus), Error>,
) -> Outcome {
    if status.is_null() {
        return Err(Failure::new(ICHECK_ERR_NULL, "status is NULL"));
    }
    if instance.0.is_some() {
        return Err(Failure::new(ICHECK_ERR_ORDER, "icheck_init was already called; call icheck_finalize first"));
    }
    let (icheck, found) = init()?;
    let code = match found {
        InitStatus::Fresh => ICHECK_FRESH,
        InitStatus::Restart { .. } => ICHECK_RESTART,
    };
    // SAFETY: checked non-NULL above; the caller passes a writable int.
    unsafe { *status = code };
    instance.0 = Some(icheck);
    Ok(ICHECK_SUCCESS)
}

fn init_logging() {
    // Honour ICHECK_LOG like the Rust binaries; ignore a subscriber the
    // application (a Rust one) installed already.
    log::init_from_env();
}

/// Starts icheck in an MPI application: called by `icheck_init` in
/// `icheck_mpi.c` (compiled with the application's `mpicc`), which passes the
/// collectives as a table. Takes ownership of `ops->ctx` (destroyed through
/// `ops->destroy`), also on failure.
///
/// # Safety
/// `config` and `app_name` must be NULL or NUL-terminated strings, `status`
/// NULL or writable, `ops` NULL or a valid table whose functions stay
/// callable until icheck_finalize.
#[no_mangle]
pub unsafe extern "C" fn icheck_init_with_ops(
    config: *const c_char,
    app_name: *const c_char,
    ops: *const comm::IcheckCommOps,
    status: *mut c_int,
) -> c_int {
    init_logging();
    // SAFETY: NULL or valid per the contract; copied before anything can fail.
    let ops = unsafe { ops.as_ref() }.copied();
    entry("icheck_init", |instance| {
        let comm = ops.ok_or_else(|| Failure::new(ICHECK_ERR_NULL, "ops is NULL")).and_then(|ops| {
            comm::CallbackComm::new(ops).ok_or_else(|| Failure::new(ICHECK_ERR_ARG, "incomplete MPI operations table"))
        })?;
        // SAFETY: forwarded contracts.
        let (config, app) = unsafe { (config_arg(config)?, text(app_name, "app_name")?) };
        start(instance, status, || Icheck::init(config, app, comm))
    })
}

/// Starts icheck in a non-MPI application.
///
/// # Safety
/// `config` and `app_name` must be NULL or NUL-terminated strings, `status`
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn icheck_init_serial(
    config: *const c_char,
    app_name: *const c_char,
    status: *mut c_int,
) -> c_int {
    init_logging();
    entry("icheck_init_serial", |instance| {
        // SAFETY: forwarded contracts.
        let (config, app) = unsafe { (config_arg(config)?, text(app_name, "app_name")?) };
        start(instance, status, || Icheck::init(config, app, SingleProcess))
    })
}

fn byte_len(count: usize, kind: DataKind, label: &str) -> Result<usize, Failure> {
    count
        .checked_mul(kind.size())
        .ok_or_else(|| Failure::new(ICHECK_ERR_ARG, format!("label {label:?}: count {count} overflows")))
}

/// Adds (or replaces) a labelled region of `count` elements of `type`.
///
/// # Safety
/// `label` must be NULL or a NUL-terminated string; `data` must stay valid
/// for reads and writes of `count` elements until the label is replaced or
/// icheck finalized.
#[no_mangle]
pub unsafe extern "C" fn icheck_add(
    label: *const c_char,
    data: *mut std::ffi::c_void,
    count: usize,
    r#type: c_int,
) -> c_int {
    entry("icheck_add", |instance| {
        // SAFETY: forwarded contract.
        let label = unsafe { text(label, "label") }?;
        let kind = kind_of(r#type).ok_or_else(|| {
            Failure::new(ICHECK_ERR_ARG, format!("label {label:?}: unknown type {type}", type = r#type))
        })?;
        let len = byte_len(count, kind, label)?;
        if data.is_null() && len > 0 {
            return Err(Failure::new(ICHECK_ERR_NULL, format!("label {label:?}: data is NULL")));
        }
        let icheck = initialised(instance)?;
        // SAFETY: the caller keeps `data` valid for `len` bytes while added.
        unsafe { icheck.add_raw(label, data.cast(), len, kind) }?;
        Ok(ICHECK_SUCCESS)
    })
}

/// `icheck_add_adapt` attributes.
pub const ICHECK_CONSTANT: c_int = 1;
/// Restored as the current process count.
pub const ICHECK_SIZE: c_int = 2;
/// Restored as the current rank.
pub const ICHECK_RANK: c_int = 3;
/// Restored as the default value.
pub const ICHECK_DEFAULT: c_int = 4;
/// The default value for joining processes only.
pub const ICHECK_DEFAULT_JOINING: c_int = 5;
/// Recalculated by a callback.
pub const ICHECK_VOLATILE: c_int = 6;
/// `icheck_add_adapt_global` distributions.
pub const ICHECK_BLOCK: c_int = 1;
/// Block-cyclic with a width.
pub const ICHECK_CYCLIC: c_int = 2;
/// 2-D grids from an `icheck_pmap`.
pub const ICHECK_PREDEFINED: c_int = 3;
/// The whole array to one root.
pub const ICHECK_MANUAL: c_int = 4;

/// A VOLATILE label's recalculation (C: `icheck_recalc_fn`).
pub type IcheckRecalcFn = unsafe extern "C" fn(
    data: *mut std::ffi::c_void,
    count: usize,
    old_size: c_int,
    size: c_int,
    rank: c_int,
    arg: *mut std::ffi::c_void,
);

/// Checks a label, its type and its memory as `icheck_add` does.
///
/// # Safety
/// `label` must be NULL or a NUL-terminated string.
unsafe fn region_args<'a>(
    label: *const c_char,
    data: *mut std::ffi::c_void,
    count: usize,
    r#type: c_int,
) -> Result<(&'a str, DataKind, usize), Failure> {
    // SAFETY: forwarded contract.
    let label = unsafe { text(label, "label") }?;
    let kind = kind_of(r#type)
        .ok_or_else(|| Failure::new(ICHECK_ERR_ARG, format!("label {label:?}: unknown type {type}", type = r#type)))?;
    let len = byte_len(count, kind, label)?;
    if data.is_null() && len > 0 {
        return Err(Failure::new(ICHECK_ERR_NULL, format!("label {label:?}: data is NULL")));
    }
    Ok((label, kind, len))
}

/// Adds replicated data with a malleability attribute (`ICHECK_CONSTANT`
/// ... `ICHECK_VOLATILE`).
///
/// # Safety
/// As `icheck_add`; `default_value` must point to one element of `type`
/// for `ICHECK_DEFAULT*`; `recalc` must be callable with `arg` until the
/// label is replaced or icheck finalized.
#[no_mangle]
pub unsafe extern "C" fn icheck_add_adapt(
    label: *const c_char,
    data: *mut std::ffi::c_void,
    count: usize,
    r#type: c_int,
    attribute: c_int,
    default_value: *const std::ffi::c_void,
    recalc: Option<IcheckRecalcFn>,
    arg: *mut std::ffi::c_void,
) -> c_int {
    entry("icheck_add_adapt", |instance| {
        // SAFETY: forwarded contract.
        let (label, kind, len) = unsafe { region_args(label, data, count, r#type) }?;
        let default = |joining_only: bool| -> Result<Attribute, Failure> {
            if default_value.is_null() {
                return Err(Failure::new(ICHECK_ERR_NULL, format!("label {label:?}: default_value is NULL")));
            }
            // SAFETY: the caller passes one element of `type`.
            let value = unsafe { std::slice::from_raw_parts(default_value.cast::<u8>(), kind.size()) }.to_vec();
            Ok(Attribute::Default { value, joining_only })
        };
        let attribute = match attribute {
            ICHECK_CONSTANT => Attribute::Constant,
            ICHECK_SIZE => Attribute::Size,
            ICHECK_RANK => Attribute::Rank,
            ICHECK_DEFAULT => default(false)?,
            ICHECK_DEFAULT_JOINING => default(true)?,
            ICHECK_VOLATILE => Attribute::Volatile,
            other => return Err(Failure::new(ICHECK_ERR_ARG, format!("label {label:?}: unknown attribute {other}"))),
        };
        let recalc: Option<icheck_lib::Recalc> = match (&attribute, recalc) {
            (Attribute::Volatile, Some(function)) => {
                // The pointer is the application's; it travels as an integer.
                let arg = arg as usize;
                Some(Box::new(move |bytes: &mut [u8], resize: icheck_lib::Resize| {
                    let count = bytes.len() / kind.size();
                    // SAFETY: the caller's contract: `function` stays callable
                    // with `arg`; `bytes` is the label's memory.
                    unsafe {
                        function(
                            bytes.as_mut_ptr().cast(),
                            count,
                            resize.old_size as c_int,
                            resize.size as c_int,
                            resize.rank as c_int,
                            arg as *mut std::ffi::c_void,
                        )
                    }
                }))
            }
            _ => None,
        };
        let icheck = initialised(instance)?;
        // SAFETY: the caller keeps `data` valid for `len` bytes while added.
        unsafe { icheck.add_adapt_raw(label, data.cast(), len, kind, attribute, recalc) }?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Creates an empty processor mapping of a `rows × cols` array.
#[no_mangle]
pub extern "C" fn icheck_pmap_create(rows: i64, cols: i64) -> *mut ProcessorMapping {
    if rows < 0 || cols < 0 {
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(ProcessorMapping::new(rows as u64, cols as u64)))
}

/// Frees a processor mapping (NULL is ignored).
///
/// # Safety
/// `pmap` must be NULL or come from `icheck_pmap_create`, freed once.
#[no_mangle]
pub unsafe extern "C" fn icheck_pmap_free(pmap: *mut ProcessorMapping) {
    if !pmap.is_null() {
        // SAFETY: created by icheck_pmap_create, freed once per the contract.
        drop(unsafe { Box::from_raw(pmap) });
    }
}

/// Adds the grid `dims[0] × dims[1]` for `num_procs` processes.
///
/// # Safety
/// `dims` must be NULL or point to two ints; `pmap` NULL or from
/// `icheck_pmap_create`.
#[no_mangle]
pub unsafe extern "C" fn icheck_add_processor_mapping(
    num_procs: c_int,
    dims: *const c_int,
    global_count: i64,
    pmap: *mut ProcessorMapping,
) -> c_int {
    entry("icheck_add_processor_mapping", |_| {
        // SAFETY: NULL or a valid mapping per the contract.
        let mapping = unsafe { pmap.as_mut() }.ok_or_else(|| Failure::new(ICHECK_ERR_NULL, "pmap is NULL"))?;
        if dims.is_null() {
            return Err(Failure::new(ICHECK_ERR_NULL, "dims is NULL"));
        }
        // SAFETY: two ints per the contract.
        let (d0, d1) = unsafe { (*dims, *dims.add(1)) };
        if num_procs <= 0 || d0 <= 0 || d1 <= 0 || global_count < 0 {
            return Err(Failure::new(
                ICHECK_ERR_ARG,
                format!("processor mapping: {num_procs} processes, grid {d0}x{d1}, {global_count} elements"),
            ));
        }
        mapping
            .add(num_procs as u32, [d0 as u32, d1 as u32], global_count as u64)
            .map_err(|e| Failure::new(ICHECK_ERR_ARG, e.to_string()))?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Adds this process's part of a distributed 1-D array.
///
/// # Safety
/// As `icheck_add`; `pmap` NULL or from `icheck_pmap_create`.
#[no_mangle]
pub unsafe extern "C" fn icheck_add_adapt_global(
    label: *const c_char,
    local: *mut std::ffi::c_void,
    local_count: usize,
    r#type: c_int,
    global_count: i64,
    distribution: c_int,
    param: i64,
    pmap: *const ProcessorMapping,
) -> c_int {
    entry("icheck_add_adapt_global", |instance| {
        // SAFETY: forwarded contract.
        let (label, kind, _) = unsafe { region_args(label, local, local_count, r#type) }?;
        if global_count < 0 {
            return Err(Failure::new(ICHECK_ERR_ARG, format!("label {label:?}: global_count {global_count}")));
        }
        let layout = match distribution {
            ICHECK_BLOCK => GlobalLayout::Block,
            ICHECK_CYCLIC if param > 0 => GlobalLayout::Cyclic { width: param as u64 },
            ICHECK_MANUAL if param >= 0 => GlobalLayout::Manual { root: param as u32 },
            // SAFETY: NULL or a valid mapping per the contract.
            ICHECK_PREDEFINED => match unsafe { pmap.as_ref() } {
                Some(mapping) => GlobalLayout::Predefined(mapping.clone()),
                None => return Err(Failure::new(ICHECK_ERR_NULL, format!("label {label:?}: PREDEFINED needs a pmap"))),
            },
            other => {
                return Err(Failure::new(
                    ICHECK_ERR_ARG,
                    format!("label {label:?}: distribution {other} with param {param} (CYCLIC needs a width > 0, MANUAL a root >= 0)"),
                ))
            }
        };
        let icheck = initialised(instance)?;
        // SAFETY: the caller keeps `local` valid while added.
        unsafe {
            icheck.add_adapt_global_raw(label, local.cast(), local_count as u64, kind, global_count as u64, layout)
        }?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Elements of `label` this process receives from the restarted version,
/// or a negative error code.
///
/// # Safety
/// `label` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn icheck_local_count(label: *const c_char) -> i64 {
    let mut count = 0i64;
    let code = entry("icheck_local_count", |instance| {
        // SAFETY: forwarded contract.
        let label = unsafe { text(label, "label") }?;
        count = initialised(instance)?.local_count(label)? as i64;
        Ok(ICHECK_SUCCESS)
    });
    if code < 0 {
        i64::from(code)
    } else {
        count
    }
}

/// The element type (`ICHECK_CHAR` ... `ICHECK_BINARY`) `label` has in
/// the restarted version, or a negative error code: lets bindings that
/// cannot see the C declarations size a restore target safely.
///
/// # Safety
/// `label` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn icheck_label_type(label: *const c_char) -> c_int {
    let mut kind = 0;
    let code = entry("icheck_label_type", |instance| {
        // SAFETY: forwarded contract.
        let label = unsafe { text(label, "label") }?;
        let icheck = initialised(instance)?;
        if !icheck.has_restarted() {
            return Err(Failure::new(ICHECK_ERR_ORDER, "icheck_label_type needs icheck_restart first"));
        }
        kind = code_of(icheck.restored_kind(label)?);
        Ok(ICHECK_SUCCESS)
    });
    if code < 0 {
        code
    } else {
        kind
    }
}

/// Restarts if needed (collective) and restores `label` into `data`
/// (`count` elements) after the process count changed.
///
/// # Safety
/// As `icheck_restore`.
#[no_mangle]
pub unsafe extern "C" fn icheck_redistribute(label: *const c_char, data: *mut std::ffi::c_void, count: usize) -> c_int {
    let prepared = entry("icheck_redistribute", |instance| {
        let icheck = initialised(instance)?;
        if !icheck.has_restarted() {
            icheck.restart()?;
        }
        Ok(ICHECK_SUCCESS)
    });
    if prepared < 0 {
        return prepared;
    }
    // SAFETY: forwarded contract.
    unsafe { icheck_restore(label, data, count) }
}

/// Checkpoints every added label as the next version (collective).
#[no_mangle]
pub extern "C" fn icheck_commit() -> c_int {
    entry("icheck_commit", |instance| {
        initialised(instance)?.commit()?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Non-zero: commits return once the data is staged (`icheck_wait` completes them).
#[no_mangle]
pub extern "C" fn icheck_enable_asynchronous(flag: c_int) -> c_int {
    entry("icheck_enable_asynchronous", |instance| {
        initialised(instance)?.set_async(flag != 0);
        Ok(ICHECK_SUCCESS)
    })
}

/// Waits for an asynchronous commit and completes its version (collective).
#[no_mangle]
pub extern "C" fn icheck_wait() -> c_int {
    entry("icheck_wait", |instance| {
        initialised(instance)?.wait()?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Prepares the restart from the newest complete version (collective).
#[no_mangle]
pub extern "C" fn icheck_restart() -> c_int {
    entry("icheck_restart", |instance| {
        initialised(instance)?.restart()?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Restores label `label` into `data` (`count` elements of the label's type).
///
/// # Safety
/// `label` must be NULL or a NUL-terminated string; `data` must be valid for
/// writes of `count` elements of the label's type.
#[no_mangle]
pub unsafe extern "C" fn icheck_restore(label: *const c_char, data: *mut std::ffi::c_void, count: usize) -> c_int {
    entry("icheck_restore", |instance| {
        // SAFETY: forwarded contract.
        let label = unsafe { text(label, "label") }?;
        let icheck = initialised(instance)?;
        if !icheck.has_restarted() {
            return Err(Failure::new(ICHECK_ERR_ORDER, "icheck_restore needs icheck_restart first"));
        }
        let kind = icheck.restored_kind(label)?;
        let len = byte_len(count, kind, label)?;
        if data.is_null() && len > 0 {
            return Err(Failure::new(ICHECK_ERR_NULL, format!("label {label:?}: data is NULL")));
        }
        // SAFETY: the caller guarantees `data` for `len` bytes.
        unsafe { icheck.restore_raw(label, data.cast(), len, kind) }?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Restarts (if not done yet) and restores every added label (collective).
#[no_mangle]
pub extern "C" fn icheck_restart_all() -> c_int {
    entry("icheck_restart_all", |instance| {
        let icheck = initialised(instance)?;
        if !icheck.has_restarted() {
            icheck.restart()?;
        }
        icheck.restore_all()?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Asks whether the agents changed and moves to new ones (collective).
/// Returns ICHECK_SUCCESS (0) when nothing changed, the new agent count
/// (> 0) after a move, or an error code (< 0).
///
/// # Safety
/// `hints` must be NULL or point to an `icheck_hints`.
#[no_mangle]
pub unsafe extern "C" fn icheck_probe_agents(hints: *const IcheckHints) -> c_int {
    entry("icheck_probe_agents", |instance| {
        // SAFETY: NULL or a valid icheck_hints per the contract.
        let remaining = unsafe { hints.as_ref() }.map_or(0, |h| h.remaining_commits.max(0) as u32);
        let outcome = initialised(instance)?.probe_agents(ProbeHints { remaining_commits: remaining })?;
        match outcome {
            icheck_lib::ProbeOutcome::Unchanged => Ok(ICHECK_SUCCESS),
            icheck_lib::ProbeOutcome::Reconnected { agents } => {
                tracing::info!(agents, "icheck_probe_agents: moved to new agents");
                Ok(c_int::try_from(agents).unwrap_or(c_int::MAX))
            }
        }
    })
}

/// The newest version whose redundancy across checkpoint nodes is in place
/// (collective): written to `*version` (0: none yet). Returns ICHECK_SUCCESS.
///
/// # Safety
/// `version` must point to an `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn icheck_protected_version(version: *mut i64) -> c_int {
    entry("icheck_protected_version", |instance| {
        if version.is_null() {
            return Err(Failure::new(ICHECK_ERR_NULL, "icheck_protected_version: version is NULL"));
        }
        let protected = initialised(instance)?.protection()?.protected.unwrap_or(0);
        // SAFETY: non-NULL and pointing to an int64_t per the contract.
        unsafe { version.write(i64::try_from(protected).unwrap_or(i64::MAX)) };
        Ok(ICHECK_SUCCESS)
    })
}

/// Waits until `version` (or a newer one) is protected, at most
/// `timeout_secs` seconds (collective). An error says why it is not.
#[no_mangle]
pub extern "C" fn icheck_wait_protected(version: i64, timeout_secs: f64) -> c_int {
    entry("icheck_wait_protected", |instance| {
        if version < 1 || !(timeout_secs.is_finite() && timeout_secs >= 0.0) {
            return Err(Failure::new(
                ICHECK_ERR_ARG,
                format!("icheck_wait_protected: version {version} or timeout {timeout_secs} s is out of range"),
            ));
        }
        let timeout = std::time::Duration::from_secs_f64(timeout_secs);
        initialised(instance)?.wait_protected(version as u64, timeout)?;
        Ok(ICHECK_SUCCESS)
    })
}

/// Ends icheck in this process (collective): `IC_PERSIST` keeps the
/// checkpoints in agent memory, `IC_CLEANUP` deletes them.
#[no_mangle]
pub extern "C" fn icheck_finalize(mode: c_int) -> c_int {
    entry("icheck_finalize", |instance| {
        let persist = match mode {
            IC_PERSIST => true,
            IC_CLEANUP => false,
            other => {
                return Err(Failure::new(
                    ICHECK_ERR_ARG,
                    format!("unknown finalize mode {other} (IC_PERSIST or IC_CLEANUP)"),
                ))
            }
        };
        let mut icheck = instance
            .0
            .take()
            .ok_or_else(|| Failure::new(ICHECK_ERR_ORDER, "icheck_finalize without icheck_init (or called twice)"))?;
        icheck.finalize(persist)?;
        Ok(ICHECK_SUCCESS)
    })
}

/// A static description of `code`.
#[no_mangle]
pub extern "C" fn icheck_strerror(code: c_int) -> *const c_char {
    let text: &'static CStr = match code {
        ICHECK_SUCCESS => c"success",
        ICHECK_ERR_NULL => c"a required pointer argument is NULL",
        ICHECK_ERR_ORDER => c"call out of order (init first; restart before restore; nothing after finalize)",
        ICHECK_ERR_ARG => c"invalid argument (type, mode, label or text)",
        ICHECK_ERR_CONFIG => c"configuration file missing or invalid",
        ICHECK_ERR_CONTROLLER => c"controller unreachable or refused the request",
        ICHECK_ERR_AGENT => c"agent unreachable or failed the request",
        ICHECK_ERR_FABRIC => c"fabric (libfabric) failure",
        ICHECK_ERR_LABEL => c"unknown label",
        ICHECK_ERR_SIZE => c"size differs from the checkpointed size",
        ICHECK_ERR_TYPE => c"element type differs from the checkpointed type",
        ICHECK_ERR_NO_CHECKPOINT => c"no complete checkpoint exists",
        ICHECK_ERR_CORRUPT => c"restored data fails its checksum",
        ICHECK_ERR_INCOMPLETE => c"another process failed; the version is not complete",
        ICHECK_ERR_RANKS => c"checkpoint written by a different number of processes",
        ICHECK_ERR_UNSUPPORTED => c"not supported",
        ICHECK_ERR_INTERNAL => c"internal error",
        ICHECK_ERR_ADAPT => c"malleable label cannot be stored or restored as declared",
        ICHECK_ERR_ACCESS => c"the application's capability cannot be read or kept",
        _ => c"unknown icheck error code",
    };
    text.as_ptr()
}

/// The detail of the last error in this process (NULL if none), valid until
/// the next failing call.
#[no_mangle]
pub extern "C" fn icheck_last_error() -> *const c_char {
    LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(std::ptr::null(), |text| text.as_ptr())
}

/// Version of the icheck C ABI, as `MAJOR * 10000 + MINOR * 100 + PATCH`.
/// 0.2.0 added `icheck_label_type`; 0.1.0 programs run unchanged.
#[no_mangle]
pub extern "C" fn icheck_abi_version() -> c_int {
    200
}
