//! Endpoints, peers and batched RMA.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::raw::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use libfabric_sys as sys;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::domain::{process_gone, Domain, DomainInner};
use super::mr::{Access, LocalSource, LocalTarget, MemoryRegion, RegisteredBuffer, RemoteRegion, StableBuffer};
use super::{FabricError, Result};

/// The raw address of an endpoint (`fi_getname`), printed and parsed as hex.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct FabricAddress(pub Vec<u8>);

impl fmt::Display for FabricAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for FabricAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FabricAddress({self})")
    }
}

impl std::str::FromStr for FabricAddress {
    type Err = FabricError;

    fn from_str(text: &str) -> Result<Self> {
        let invalid = |reason: &str| FabricError::InvalidAddress { address: text.to_string(), reason: reason.into() };
        if text.is_empty() || !text.len().is_multiple_of(2) {
            return Err(invalid("expected a non-empty, even number of hex digits"));
        }
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(text.get(i..i + 2).unwrap_or("zz"), 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map(FabricAddress)
            .map_err(|_| invalid("not a hex string"))
    }
}

impl Serialize for FabricAddress {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for FabricAddress {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A peer inserted into an endpoint's address vector.
#[derive(Clone, Debug)]
pub struct Peer {
    fi_addr: sys::fi_addr_t,
    name: Arc<str>,
    /// An shm peer's process id, where that process was running in this
    /// process's pid namespace when it was inserted: its disappearance
    /// later means it ended (one in another namespace is never judged).
    local_pid: Option<u32>,
    /// A pidfd of that process, which becomes readable once it has ended
    /// (a zombie included): looked at before each operation posted to it.
    exit_watch: Option<Arc<OwnedFd>>,
}

impl Peer {
    /// The peer's printable address (provider format, e.g. `fi_sockaddr_in://127.0.0.1:40211`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this shm peer's process has ended, by its pidfd: one poll
    /// without waiting, well under a microsecond. Posting to a peer that
    /// died holding its region's lock spins in the provider forever
    /// (libfabric 1.17's shm takes the target region's spinlock to queue
    /// the command), which the batch's stall checks never get to see.
    fn has_ended(&self) -> bool {
        let Some(fd) = &self.exit_watch else { return false };
        let mut polled = [nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut polled, nix::poll::PollTimeout::ZERO).is_ok_and(|ready| ready > 0)
    }
}

/// A pidfd for process `pid` (`pidfd_open(2)`, Linux 5.3), or `None`
/// where the kernel has none or the process is gone.
fn open_pidfd(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; nothing else is read or written.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: `fd` was just returned by pidfd_open and is owned by no one else.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The direction of an RMA operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RmaKind {
    /// `fi_read`: remote memory into local memory.
    Read,
    /// `fi_write`: local memory into remote memory.
    Write,
}

impl fmt::Display for RmaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RmaKind::Read => "fi_read",
            RmaKind::Write => "fi_write",
        })
    }
}

/// One transfer of a batch: `len` bytes between `local_offset` of the local
/// buffer and `remote_offset` of `remote`. Long operations are split into
/// chunks of [`TransferOptions::chunk_size`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmaOp {
    /// Offset in the local buffer.
    pub local_offset: usize,
    /// The remote region.
    pub remote: RemoteRegion,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: usize,
}

/// One operation of a batch that reads from several peers at once
/// ([`Endpoint::read_observed_from`]).
#[derive(Clone, Copy, Debug)]
pub struct PeerOp<'p> {
    /// Whose memory `op.remote` is.
    pub peer: &'p Peer,
    /// The operation.
    pub op: RmaOp,
}

/// How a batch is cut and paced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferOptions {
    /// Largest single RMA operation (clamped to the provider's maximum).
    pub chunk_size: usize,
    /// Operations kept in flight at once.
    pub inflight: usize,
    /// How long the batch may go without any completion before it gives up.
    pub timeout: Duration,
    /// Ask writes to complete only once the data is in target memory
    /// (`FI_DELIVERY_COMPLETE`). Required for writes a version depends on.
    pub delivery_complete: bool,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions { chunk_size: 1 << 20, inflight: 8, timeout: Duration::from_secs(10), delivery_complete: true }
    }
}

/// What a batch moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Bytes transferred.
    pub bytes: u64,
    /// RMA operations posted (after chunking).
    pub operations: u64,
    /// Wall time of the batch.
    pub elapsed: Duration,
}

impl TransferStats {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// The libfabric objects of one endpoint, guarded by the endpoint lock.
struct EpState {
    ep: *mut sys::fid_ep,
    cq: *mut sys::fid_cq,
    /// The address vector, under a lock of its own: a transfer holds the
    /// endpoint lock for its whole batch, which may wait for a silent peer
    /// up to its stall bound, and inserting another peer (an agent opening
    /// a new rank's session) must not wait for that. Lock order: the
    /// endpoint lock, then this one (closing takes both).
    addresses: Arc<Mutex<AddressBook>>,
    closed: bool,
    /// `closed`, readable without the lock (which a transfer holds for its
    /// whole batch): what `Endpoint::is_closed` answers from.
    closed_flag: Arc<AtomicBool>,
}

/// An endpoint's address vector and the peers inserted into it. `av` is
/// NULL until it is open and again once the endpoint is closed or
/// abandoned: the one thing `insert_peer` checks.
struct AddressBook {
    av: *mut sys::fid_av,
    peers: HashMap<Vec<u8>, Peer>,
}

// SAFETY: the AV belongs to an FI_THREAD_SAFE domain and is only used with
// the book's lock held (or, for closing, with both locks).
unsafe impl Send for AddressBook {}

/// [`AddressBook`] behind its lock (poisoning ignored, as for the endpoint
/// lock: a panic leaves the libfabric objects intact).
fn lock_book(book: &Mutex<AddressBook>) -> MutexGuard<'_, AddressBook> {
    book.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl EpState {
    /// Closes the endpoint, then its address vector and completion queue.
    /// Afterwards no operation can complete into local memory.
    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.closed_flag.store(true, Ordering::Release);
        // Held across the closes: no peer is inserted into a closing AV.
        let mut book = lock_book(&self.addresses);
        // SAFETY: each object was opened in Endpoint::new and is closed exactly
        // once (guarded by `closed`), the endpoint before what it is bound to.
        unsafe {
            if !self.ep.is_null() {
                sys::icheck_fi_close(&mut (*self.ep).fid);
            }
            if !book.av.is_null() {
                sys::icheck_fi_close(&mut (*book.av).fid);
                book.av = ptr::null_mut();
            }
            if !self.cq.is_null() {
                sys::icheck_fi_close(&mut (*self.cq).fid);
            }
        }
    }

    /// Gives the endpoint up while operations of `kind` are still
    /// outstanding on it.
    ///
    /// Reads under manual data progress leave the objects open and never
    /// used again instead of closing them: closing an endpoint in the middle
    /// of an RMA read's response frees the read's entry twice in libfabric
    /// 1.17's tcp provider (Debian 12's; fixed upstream by a74ea0f, in 1.18)
    /// and crashed the process, which is how a restart from an agent that
    /// stalled mid-transfer used to end. Leaving them is as safe as closing:
    /// with manual progress data moves only inside calls on this endpoint
    /// and its completion queue, and nobody makes one again (the closed flag
    /// refuses them), so no operation can write into local memory after the
    /// caller returns. The cost is the endpoint's socket and buffers for the
    /// rest of the process, once per abandoned endpoint. Writes have no such
    /// fault and are closed, as is everything under automatic progress,
    /// where only closing stops the provider.
    fn abandon(&mut self, kind: RmaKind, manual_progress: bool) {
        if self.closed || !manual_progress || kind != RmaKind::Read {
            self.close();
            return;
        }
        self.closed = true;
        self.closed_flag.store(true, Ordering::Release);
        self.ep = ptr::null_mut();
        lock_book(&self.addresses).av = ptr::null_mut();
        self.cq = ptr::null_mut();
    }
}

pub(crate) struct EndpointShared {
    // Declared before `domain` so that it is closed first.
    state: Mutex<EpState>,
    /// The AV and its peers (also reachable from `state`, which closes it):
    /// what `insert_peer` takes instead of the endpoint lock.
    addresses: Arc<Mutex<AddressBook>>,
    /// Set once the endpoint is closed (see `EpState::closed_flag`).
    closed: Arc<AtomicBool>,
    domain: Arc<DomainInner>,
    address: FabricAddress,
}

// SAFETY: all libfabric objects belong to an FI_THREAD_SAFE domain (which
// lets one thread insert into an AV while another posts or polls on the
// endpoint bound to it); every use of the endpoint and CQ goes through the
// `state` mutex, and every use of the AV through the address book's.
unsafe impl Send for EndpointShared {}
// SAFETY: see Send.
unsafe impl Sync for EndpointShared {}

impl Drop for EndpointShared {
    fn drop(&mut self) {
        self.state.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).close();
    }
}

impl EndpointShared {
    fn lock(&self) -> MutexGuard<'_, EpState> {
        // A panic while holding the lock leaves libfabric objects intact, so
        // the state is still usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A reliable-datagram endpoint with its completion queue and address vector.
/// Clones share the endpoint.
#[derive(Clone)]
pub struct Endpoint {
    shared: Arc<EndpointShared>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint").field("address", &self.shared.address).finish()
    }
}

/// Slot of one in-flight operation. `ctx` must be the first field: libfabric
/// returns its address as the completion's `op_context`.
#[repr(C)]
#[derive(Default)]
struct OpSlot {
    ctx: sys::fi_context2,
    /// Position of the operation in posting order.
    seq: u64,
    /// Index in the batch of the operation this chunk belongs to.
    op: usize,
    len: usize,
    remote_addr: u64,
    key: u64,
}

fn eagain() -> isize {
    // SAFETY: returns a constant.
    -(unsafe { sys::icheck_fi_eagain() } as isize)
}

fn eavail() -> isize {
    // SAFETY: returns a constant.
    -(unsafe { sys::icheck_fi_eavail() } as isize)
}

impl Endpoint {
    /// Opens an RDM endpoint on `domain`, binds a completion queue and an
    /// address vector, and enables it.
    pub fn new(domain: &Domain) -> Result<Endpoint> {
        Self::open_on(domain.inner.clone())
    }

    /// Opens another endpoint on this one's domain, with an address, queue
    /// and locks of its own. Memory registered through either is reachable
    /// through both where registrations are not bound to an endpoint
    /// ([`Endpoint::registrations_are_domain_wide`]).
    ///
    /// Why it exists: `shm` copies an RMA's bytes while holding a lock in
    /// the *target* endpoint's shared region, so two peers reading one
    /// endpoint at once take turns, the waiting one spinning on its core.
    /// Readers sent to endpoints of their own copy side by side.
    pub fn sibling(&self) -> Result<Endpoint> {
        Self::open_on(self.shared.domain.clone())
    }

    /// Whether `other` is a handle on this same endpoint.
    pub fn same_as(&self, other: &Endpoint) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Whether a key registered through this endpoint is valid on every
    /// endpoint of its domain (no `FI_MR_ENDPOINT` binding).
    pub fn registrations_are_domain_wide(&self) -> bool {
        !self.shared.domain.mr_mode.endpoint
    }

    fn open_on(dom: Arc<DomainInner>) -> Result<Endpoint> {
        let mut state = EpState {
            ep: ptr::null_mut(),
            cq: ptr::null_mut(),
            addresses: Arc::new(Mutex::new(AddressBook { av: ptr::null_mut(), peers: HashMap::new() })),
            closed: false,
            closed_flag: Arc::new(AtomicBool::new(false)),
        };
        let tx_size = dom.description.tx_size.max(64);
        let mut cq_attr = sys::fi_cq_attr {
            size: tx_size * 2,
            format: sys::fi_cq_format_FI_CQ_FORMAT_CONTEXT,
            wait_obj: sys::fi_wait_obj_FI_WAIT_NONE,
            ..Default::default()
        };
        let mut av_attr = sys::fi_av_attr { type_: sys::fi_av_type_FI_AV_TABLE, ..Default::default() };
        if let Err(err) = open_endpoint(&dom, &mut state, &mut cq_attr, &mut av_attr) {
            state.close();
            return Err(err);
        }
        let address = match get_name(state.ep) {
            Ok(address) => address,
            Err(err) => {
                state.close();
                return Err(err);
            }
        };
        let closed = state.closed_flag.clone();
        let addresses = state.addresses.clone();
        Ok(Endpoint {
            shared: Arc::new(EndpointShared { state: Mutex::new(state), addresses, closed, domain: dom, address }),
        })
    }

    /// This endpoint's address, for peers to insert.
    pub fn address(&self) -> &FabricAddress {
        &self.shared.address
    }

    /// The provider this endpoint runs on.
    pub fn provider(&self) -> &str {
        &self.shared.domain.description.provider
    }

    /// Inserts a peer's address into the address vector (once; later calls
    /// with the same address return the same peer).
    pub fn insert_peer(&self, address: &FabricAddress) -> Result<Peer> {
        // Not the endpoint lock: a batch may hold that for seconds. (Closing
        // and abandoning set `av` to NULL under this lock.)
        let mut state = lock_book(&self.shared.addresses);
        if state.av.is_null() {
            return Err(FabricError::Closed);
        }
        if let Some(peer) = state.peers.get(&address.0) {
            return Ok(peer.clone());
        }
        let mut fi_addr: sys::fi_addr_t = 0;
        // SAFETY: the AV is open (not NULL, checked above, its lock held); the
        // address buffer is valid for its length, which the provider reads.
        let inserted = unsafe {
            sys::icheck_fi_av_insert(state.av, address.0.as_ptr().cast(), 1, &mut fi_addr, 0, ptr::null_mut())
        };
        if inserted != 1 {
            return Err(FabricError::InvalidAddress {
                address: address.to_string(),
                reason: format!(
                    "fi_av_insert accepted {inserted} of 1 addresses on provider {} (is it an address of the same provider?)",
                    self.provider()
                ),
            });
        }
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: the AV is open; buf is writable for `len` bytes and the
        // address readable; the result is NUL-terminated within buf or truncated.
        let name = unsafe {
            sys::icheck_fi_av_straddr(state.av, address.0.as_ptr().cast(), buf.as_mut_ptr().cast(), &mut len);
            std::ffi::CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
        };
        let name = if name.is_empty() { address.to_string() } else { name };
        let local_pid = super::domain::shm_region_of(&name).map(|(pid, _)| pid).filter(|pid| !process_gone(*pid));
        let exit_watch = local_pid.and_then(open_pidfd).map(Arc::new);
        let peer = Peer { fi_addr, name: name.into(), local_pid, exit_watch };
        // Each watched peer holds a descriptor: peers whose process ended
        // and that no caller still holds are forgotten, so a long-lived
        // agent does not gather one per rank that ever restored from it.
        state.peers.retain(|_, known| {
            let unused = known.exit_watch.as_ref().is_some_and(|watch| Arc::strong_count(watch) == 1);
            !(unused && known.has_ended())
        });
        state.peers.insert(address.0.clone(), peer.clone());
        Ok(peer)
    }

    /// Registers raw memory for RMA.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the
    /// returned region is dropped, and must not be freed or unmapped before.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        let dom = &self.shared.domain;
        let mode = dom.mr_mode;
        let requested_key = if mode.prov_key { 0 } else { dom.unique_key() };
        let mut mr: *mut sys::fid_mr = ptr::null_mut();
        // SAFETY: the caller guarantees the memory; the domain is open.
        let ret = unsafe {
            sys::icheck_fi_mr_reg(
                dom.domain,
                ptr as *const c_void,
                len,
                access.bits(),
                0,
                requested_key,
                0,
                &mut mr,
                ptr::null_mut(),
            )
        };
        if ret != 0 {
            return Err(FabricError::call("fi_mr_reg", ret.into()));
        }
        let region = MemoryRegion {
            mr,
            ptr,
            len,
            desc: ptr::null_mut(),
            remote: RemoteRegion { addr: 0, key: 0, len: len as u64 },
            _endpoint: self.shared.clone(),
        };
        if mode.endpoint {
            let state = self.shared.lock();
            if state.closed {
                return Err(FabricError::Closed);
            }
            // SAFETY: mr and ep are open; binding and enabling are required
            // under FI_MR_ENDPOINT before the key is valid. `region` closes the
            // MR if either call fails.
            unsafe {
                let ep = state.ep;
                let ret = sys::icheck_fi_mr_bind(mr, std::ptr::addr_of_mut!((*ep).fid), 0);
                if ret != 0 {
                    return Err(FabricError::call("fi_mr_bind", ret.into()));
                }
                let ret = sys::icheck_fi_mr_enable(mr);
                if ret != 0 {
                    return Err(FabricError::call("fi_mr_enable", ret.into()));
                }
            }
        }
        let mut region = region;
        // SAFETY: mr is open and enabled.
        let (key, desc) = unsafe { (sys::icheck_fi_mr_key(mr), sys::icheck_fi_mr_desc(mr)) };
        region.desc = desc;
        region.remote = RemoteRegion { addr: if mode.virt_addr { ptr as u64 } else { 0 }, key, len: len as u64 };
        Ok(region)
    }

    /// Registers an owned buffer.
    pub fn register<B: StableBuffer>(&self, mut buffer: B, access: Access) -> Result<RegisteredBuffer<B>> {
        let ptr = buffer.as_mut_ptr();
        let len = buffer.len();
        // SAFETY: the StableBuffer contract keeps `ptr` valid and in place for
        // as long as `buffer` lives, and RegisteredBuffer drops the region
        // before the buffer.
        let region = unsafe { self.register_raw(ptr, len, access)? };
        Ok(RegisteredBuffer::from_parts(region, buffer))
    }

    /// Reads remote memory into `local` (at each op's local offset).
    pub fn read(
        &self,
        peer: &Peer,
        local: LocalTarget<'_>,
        ops: &[RmaOp],
        options: &TransferOptions,
    ) -> Result<TransferStats> {
        self.transfer(RmaKind::Read, &with_peer(peer, ops), local.ptr, local.len, local.desc, options, &mut |_| {})
    }

    /// Like [`read`](Self::read), calling `on_progress(bytes)` whenever the
    /// first `bytes` of the batch (its ops in order, each from its start)
    /// have all arrived: a consumer can use that prefix while the rest is
    /// still in flight, with the pipeline kept full instead of drained
    /// between steps. Runs on the calling thread, inside the batch, with
    /// the operations in flight still moving: it must take less time than
    /// they do (a checksum of what arrived, not a write to disk).
    pub fn read_observed(
        &self,
        peer: &Peer,
        local: LocalTarget<'_>,
        ops: &[RmaOp],
        options: &TransferOptions,
        on_progress: &mut dyn FnMut(usize),
    ) -> Result<TransferStats> {
        self.transfer(RmaKind::Read, &with_peer(peer, ops), local.ptr, local.len, local.desc, options, on_progress)
    }

    /// Like [`read_observed`](Self::read_observed), each operation from its
    /// own peer: one batch that keeps several peers' reads in flight at
    /// once (a process restoring several old ranks held by different
    /// agents), with one completion queue and one pipeline.
    pub fn read_observed_from(
        &self,
        local: LocalTarget<'_>,
        ops: &[PeerOp<'_>],
        options: &TransferOptions,
        on_progress: &mut dyn FnMut(usize),
    ) -> Result<TransferStats> {
        self.transfer(RmaKind::Read, ops, local.ptr, local.len, local.desc, options, on_progress)
    }

    /// Writes `local` (at each op's local offset) into remote memory.
    pub fn write(
        &self,
        peer: &Peer,
        local: LocalSource<'_>,
        ops: &[RmaOp],
        options: &TransferOptions,
    ) -> Result<TransferStats> {
        self.transfer(RmaKind::Write, &with_peer(peer, ops), local.ptr, local.len, local.desc, options, &mut |_| {})
    }

    /// Reads `reads` into `into` and writes `from` by `writes` in one batch:
    /// one pipeline and one completion queue for both directions, so a
    /// thread that receives some peers' bytes while it sends others its own
    /// keeps both in flight instead of draining one before the other (the
    /// endpoint runs one batch at a time). Reads are posted first.
    pub fn read_and_write(
        &self,
        (into, reads): (LocalTarget<'_>, &[PeerOp<'_>]),
        (from, writes): (LocalSource<'_>, &[PeerOp<'_>]),
        options: &TransferOptions,
    ) -> Result<TransferStats> {
        let read = Local { kind: RmaKind::Read, ptr: into.ptr, len: into.len, desc: into.desc };
        let write = Local { kind: RmaKind::Write, ptr: from.ptr, len: from.len, desc: from.desc };
        let mut ops = batch_ops(read, reads);
        ops.extend(batch_ops(write, writes));
        self.run_batch(&ops, options, &mut |_| {})
    }

    /// Whether the provider copies the bytes of a write that asks for
    /// delivery completion on the *target's* side: libfabric's shm provider
    /// does (the target's poll reads them from the writer's memory with
    /// `process_vm_readv`), so the writing thread only posts and waits.
    /// Over tcp the writer's own polls move the bytes.
    pub fn writes_copied_by_target(&self) -> bool {
        self.provider() == "shm"
    }

    /// Polls the completion queue once if no batch is running, which drives
    /// the provider's progress for peers that access this endpoint's memory.
    /// Returns false if the endpoint is busy or closed.
    pub fn progress(&self) -> bool {
        let Ok(mut state) = self.shared.state.try_lock() else {
            return false;
        };
        if state.closed {
            return false;
        }
        let mut entries = [sys::fi_cq_entry::default(); 8];
        let cq = state.cq;
        // Watched: shm can spin here for ever on a dead process's lock.
        let ret = super::watchdog::watched(|| {
            // SAFETY: the CQ is open (not closed, lock held by the caller
            // for the whole call) and `entries` has room for 8.
            unsafe { sys::icheck_fi_cq_read(cq, entries.as_mut_ptr().cast(), entries.len()) }
        });
        if ret > 0 {
            tracing::warn!(count = ret, "progress found completions outside any batch; ignored");
        } else if ret == eavail() {
            let mut err = sys::fi_cq_err_entry::default();
            // SAFETY: CQ open; err is a valid, zeroed error entry.
            unsafe { sys::icheck_fi_cq_readerr(state.cq, &mut err, 0) };
            tracing::warn!(err = err.err, "progress found an error completion outside any batch");
        } else if ret != eagain() && ret < 0 {
            tracing::error!(code = ret, "fi_cq_read failed during progress; closing endpoint");
            state.close();
        }
        true
    }

    /// Closes the endpoint now; later operations fail with [`FabricError::Closed`].
    pub fn close(&self) {
        self.shared.lock().close();
    }

    /// Whether the endpoint has been closed.
    ///
    /// Never waits for the endpoint lock: an agent's accept loop asks this
    /// every turn, and must not stall behind a transfer to a dead peer
    /// (which holds the lock until its no-progress bound).
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        kind: RmaKind,
        ops: &[PeerOp<'_>],
        local_ptr: *mut u8,
        local_len: usize,
        desc: *mut c_void,
        options: &TransferOptions,
        on_progress: &mut dyn FnMut(usize),
    ) -> Result<TransferStats> {
        let local = Local { kind, ptr: local_ptr, len: local_len, desc };
        self.run_batch(&batch_ops(local, ops), options, on_progress)
    }

    /// Runs one batch: every operation cut into chunks, `options.inflight`
    /// of them in flight, until all completed (or the first error, once
    /// those in flight are back).
    fn run_batch(
        &self,
        ops: &[BatchOp<'_>],
        options: &TransferOptions,
        on_progress: &mut dyn FnMut(usize),
    ) -> Result<TransferStats> {
        let started = Instant::now();
        // Validate every op before posting anything.
        for BatchOp { op, local, .. } in ops {
            if op.local_offset.checked_add(op.len).is_none_or(|end| end > local.len) {
                return Err(FabricError::OutOfRange {
                    side: "local",
                    offset: op.local_offset as u64,
                    len: op.len as u64,
                    region_len: local.len as u64,
                });
            }
            op.remote.address_of(op.remote_offset, op.len as u64)?;
        }
        if options.chunk_size == 0 {
            return Err(FabricError::Config("chunk_size must be at least 1 byte".into()));
        }
        let max_msg = usize::try_from(self.shared.domain.description.max_msg_size).unwrap_or(usize::MAX).max(1);
        let chunk = options.chunk_size.min(max_msg);
        let inflight = options.inflight.max(1);
        let flags_of = |kind: RmaKind| {
            let delivery = kind == RmaKind::Write && options.delivery_complete;
            sys::FI_COMPLETION as u64 | if delivery { sys::FI_DELIVERY_COMPLETE as u64 } else { 0 }
        };
        // What the batch is called in errors and logs, and how it is given
        // up: a batch with reads in flight is abandoned as a read is.
        let kind = if ops.iter().any(|op| op.local.kind == RmaKind::Read) { RmaKind::Read } else { RmaKind::Write };
        // Writes the target copies (shm, delivery completion: the target's
        // poll copies each one out of this process's memory) leave this
        // thread nothing to do between completions: it sleeps when idle
        // instead of yielding (`TARGET_COPY_POLL`).
        let target_copies = kind == RmaKind::Write && options.delivery_complete && self.writes_copied_by_target();

        let manual_progress = self.shared.domain.description.manual_progress;
        let mut state = self.shared.lock();
        if state.closed {
            return Err(FabricError::Closed);
        }
        let mut slots: Box<[OpSlot]> = (0..inflight).map(|_| OpSlot::default()).collect();
        let slot_base = slots.as_mut_ptr() as usize;
        let mut free: Vec<usize> = (0..inflight).rev().collect();
        let mut outstanding = 0usize;
        let mut stats = TransferStats::default();
        let mut first_error: Option<FabricError> = None;
        // Cursor over (op, offset within op).
        let (mut op_index, mut op_done) = (0usize, 0usize);
        let mut last_progress = Instant::now();
        let mut entries = [sys::fi_cq_entry::default(); 16];
        let mut idle_polls = 0u32;
        let mut dead_peer_check = DeadPeerCheck::default();
        let mut exit_check = ExitCheck::default();
        // Posted operations not yet part of the in-order prefix: (length,
        // completed), the front being operation number `prefix_seq`.
        let mut unordered: std::collections::VecDeque<(usize, bool)> = std::collections::VecDeque::new();
        let (mut posted_seq, mut prefix_seq, mut prefix_bytes) = (0u64, 0u64, 0usize);

        loop {
            // Post as many chunks as slots allow.
            while first_error.is_none() && op_index < ops.len() {
                let BatchOp { peer, op, local } = &ops[op_index];
                if exit_check.due() && peer.has_ended() {
                    // Given up at once, as a stalled batch's dead peer is:
                    // the post itself could spin on the region it left.
                    let (peer, pid) = (peer.name().to_string(), peer.local_pid.unwrap_or_default());
                    tracing::warn!(op = %kind, %peer, pid, outstanding, "the RMA peer's process has ended; giving the endpoint up");
                    state.abandon(kind, manual_progress);
                    abandon_contexts(slots, outstanding);
                    return Err(FabricError::PeerGone { op: kind, peer, pid, outstanding });
                }
                if op_done >= op.len {
                    op_index += 1;
                    op_done = 0;
                    continue;
                }
                let Some(&slot_index) = free.last() else {
                    break;
                };
                let len = chunk.min(op.len - op_done);
                let remote_addr = op.remote.addr + op.remote_offset + op_done as u64;
                let slot = &mut slots[slot_index];
                slot.len = len;
                slot.seq = posted_seq;
                slot.op = op_index;
                slot.remote_addr = remote_addr;
                slot.key = op.remote.key;
                // SAFETY: local.ptr + local_offset + op_done .. + len lies in
                // the op's local buffer (validated above), which the caller's
                // LocalSource/LocalTarget borrow keeps alive until we return;
                // we return only after this op completed or the endpoint was
                // closed. The iov, desc and rma_iov structs only need to live
                // for the duration of the call. The context points into
                // `slots`, which outlives every outstanding op. Watched: shm
                // can spin in a post for ever on a dead process's lock.
                let ret = super::watchdog::watched(|| unsafe {
                    let mut iov =
                        sys::iovec { iov_base: local.ptr.add(op.local_offset + op_done).cast(), iov_len: len };
                    let mut descs = [local.desc];
                    let mut rma_iov = sys::fi_rma_iov { addr: remote_addr, len, key: op.remote.key };
                    let msg = sys::fi_msg_rma {
                        msg_iov: &mut iov,
                        desc: descs.as_mut_ptr(),
                        iov_count: 1,
                        addr: peer.fi_addr,
                        rma_iov: &mut rma_iov,
                        rma_iov_count: 1,
                        context: (&mut slot.ctx as *mut sys::fi_context2).cast(),
                        data: 0,
                    };
                    match local.kind {
                        RmaKind::Read => sys::icheck_fi_readmsg(state.ep, &msg, flags_of(RmaKind::Read)),
                        RmaKind::Write => sys::icheck_fi_writemsg(state.ep, &msg, flags_of(RmaKind::Write)),
                    }
                });
                if ret == 0 {
                    free.pop();
                    outstanding += 1;
                    stats.operations += 1;
                    op_done += len;
                    unordered.push_back((len, false));
                    posted_seq += 1;
                } else if ret == eagain() {
                    break; // Queue full: reap completions, then retry.
                } else {
                    first_error = Some(FabricError::Post {
                        op: local.kind,
                        peer: peer.name.to_string(),
                        len,
                        code: ret.unsigned_abs() as i32,
                        message: super::domain::strerror(ret.unsigned_abs() as i32),
                    });
                }
            }
            let all_posted = op_index >= ops.len() || first_error.is_some();
            if outstanding == 0 && all_posted {
                break;
            }

            // Reap completions (this also drives the provider's progress).
            let cq = state.cq;
            let ret = super::watchdog::watched(|| {
                // SAFETY: the CQ is open (lock held, not closed) and
                // `entries` has room for entries.len() context-format entries.
                unsafe { sys::icheck_fi_cq_read(cq, entries.as_mut_ptr().cast(), entries.len()) }
            });
            if ret > 0 {
                for entry in &entries[..ret as usize] {
                    let index = (entry.op_context as usize - slot_base) / std::mem::size_of::<OpSlot>();
                    stats.bytes += slots[index].len as u64;
                    if let Some(op) = unordered.get_mut((slots[index].seq - prefix_seq) as usize) {
                        op.1 = true;
                    }
                    free.push(index);
                    outstanding -= 1;
                }
                let before = prefix_bytes;
                while let Some((len, true)) = unordered.front().copied() {
                    unordered.pop_front();
                    prefix_seq += 1;
                    prefix_bytes += len;
                }
                if prefix_bytes > before {
                    on_progress(prefix_bytes);
                }
                last_progress = Instant::now();
                idle_polls = 0;
            } else if ret == eavail() {
                let mut err = sys::fi_cq_err_entry::default();
                // SAFETY: CQ open; `err` is a zeroed entry with err_data_size
                // 0, so the provider points err_data at its own buffer.
                let got = unsafe { sys::icheck_fi_cq_readerr(state.cq, &mut err, 0) };
                if got == 1 && !err.op_context.is_null() {
                    let index = (err.op_context as usize - slot_base) / std::mem::size_of::<OpSlot>();
                    let slot = &slots[index];
                    let BatchOp { peer, local, .. } = ops[slot.op];
                    let mut text = vec![0u8; 256];
                    // SAFETY: CQ open; err_data belongs to the provider and is
                    // valid until the next CQ call; text has room for len bytes.
                    let message = unsafe {
                        let ptr = sys::icheck_fi_cq_strerror(
                            state.cq,
                            err.prov_errno,
                            err.err_data,
                            text.as_mut_ptr().cast(),
                            text.len(),
                        );
                        if ptr.is_null() {
                            super::domain::strerror(err.err)
                        } else {
                            std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned()
                        }
                    };
                    if first_error.is_none() {
                        first_error = Some(FabricError::Completion {
                            op: local.kind,
                            peer: peer.name.to_string(),
                            remote_addr: slot.remote_addr,
                            key: slot.key,
                            len: slot.len,
                            code: err.err,
                            prov_errno: err.prov_errno,
                            message,
                        });
                    }
                    free.push(index);
                    outstanding -= 1;
                    last_progress = Instant::now();
                }
            } else if ret != eagain() {
                // The completion queue itself failed: nothing can be trusted.
                state.abandon(kind, manual_progress);
                abandon_contexts(slots, outstanding);
                return Err(FabricError::call("fi_cq_read", ret as i64));
            } else if let Some((peer, pid)) = dead_peer_check
                .due(last_progress)
                .then(|| {
                    // A stalled batch whose shm peer died: nothing would ever
                    // complete (nor would a full queue to it drain), and
                    // waiting out the timeout spins a core.
                    waited_on(&slots, &free, ops, op_index)
                        .find_map(|peer| Some((peer.name(), peer.local_pid.filter(|pid| process_gone(*pid))?)))
                })
                .flatten()
            {
                tracing::warn!(op = %kind, %peer, pid, outstanding, "the RMA peer's process has ended; giving the endpoint up");
                let peer = peer.to_string();
                state.abandon(kind, manual_progress);
                abandon_contexts(slots, outstanding);
                return Err(FabricError::PeerGone { op: kind, peer, pid, outstanding });
            } else if last_progress.elapsed() > options.timeout {
                // The peers whose operations never completed, or whose
                // queue never took the next one.
                let mut stalled: Vec<&str> = waited_on(&slots, &free, ops, op_index).map(Peer::name).collect();
                stalled.sort_unstable();
                stalled.dedup();
                let peer = stalled.join(", ");
                tracing::warn!(op = %kind, %peer, outstanding, "RMA batch timed out; giving the endpoint up");
                state.abandon(kind, manual_progress);
                abandon_contexts(slots, outstanding);
                return Err(FabricError::Timeout {
                    op: kind,
                    peer,
                    outstanding: outstanding.max(1),
                    timeout: options.timeout,
                });
            } else {
                idle_polls += 1;
                if last_progress.elapsed() > STALLED_AFTER {
                    // A peer stopped (SIGSTOP, a debugger) or cut off: look
                    // once a millisecond rather than spin a core until the
                    // timeout; the first completion restores spinning.
                    std::thread::sleep(STALLED_POLL);
                } else if idle_polls > 4 {
                    if target_copies {
                        std::thread::sleep(TARGET_COPY_POLL);
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        drop(state);
        stats.elapsed = started.elapsed();
        match first_error {
            Some(err) => Err(err),
            None => Ok(stats),
        }
    }
}

/// The peers a batch waits for: those of its operations in flight, and
/// the one its next operation goes to (a post refused with `EAGAIN`, the
/// peer's queue full, waits for that peer too).
fn waited_on<'a>(
    slots: &'a [OpSlot],
    free: &'a [usize],
    ops: &'a [BatchOp<'a>],
    next_op: usize,
) -> impl Iterator<Item = &'a Peer> + 'a {
    let in_flight = (0..slots.len()).filter(|i| !free.contains(i)).map(|i| ops[slots[i].op].peer);
    in_flight.chain(ops.get(next_op).map(|op| op.peer))
}

/// When a batch next looks whether the shm peer it posts to has ended
/// ([`Peer::has_ended`]): before its first post, then at most every
/// [`EXIT_CHECK_EVERY`]. A look per post cost 64 KiB shm writes a quarter
/// of their rate; a peer that dies holding its region's lock is caught
/// unless the next post follows its death within that interval.
#[derive(Default)]
struct ExitCheck {
    last: Option<Instant>,
}

/// See [`ExitCheck`].
const EXIT_CHECK_EVERY: Duration = Duration::from_micros(200);

impl ExitCheck {
    fn due(&mut self) -> bool {
        let now = Instant::now();
        let due = self.last.is_none_or(|last| now.duration_since(last) >= EXIT_CHECK_EVERY);
        if due {
            self.last = Some(now);
        }
        due
    }
}

/// How often a batch without completions looks whether an shm peer it
/// waits for has died, and how long it waits before the first look: a
/// live peer answers within microseconds, and the look reads `/proc`.
const DEAD_PEER_CHECK: Duration = Duration::from_millis(100);

/// How long a batch goes without a completion before it counts as stalled
/// and polls every [`STALLED_POLL`] instead of spinning: a transfer that
/// moves completes an operation (at most a few MiB) every few
/// milliseconds, even on a loaded machine.
const STALLED_AFTER: Duration = Duration::from_millis(100);

/// How often a stalled batch polls (and drives the provider's progress).
const STALLED_POLL: Duration = Duration::from_millis(1);

/// How long a batch of writes that the target copies
/// ([`Endpoint::writes_copied_by_target`]) sleeps between polls that find
/// nothing (after a few that do not sleep), instead of yielding. A
/// yielding thread still competes for a core on every poll, and on a node
/// with few cores the threads that do the work need it: `perf` over one
/// rank's 256 MiB push over shm on two cores had the waiting rank thread
/// on 40% of the samples, the rank's checksum thread squeezed beside it,
/// and the agent's copying thread 18% in `__schedule`, switched out for
/// them. A completion is at most this (plus timer slack) late; the target
/// has `inflight` chunks queued meanwhile (8 MiB by default, more than a
/// millisecond of copying). Blocking pushes of 256 MiB, one rank, three
/// alternated runs of nine: 3.35–3.60 → 4.07–4.37 GB/s.
const TARGET_COPY_POLL: Duration = Duration::from_micros(20);

/// When a stalled batch next looks for dead shm peers.
#[derive(Default)]
struct DeadPeerCheck {
    last: Option<Instant>,
}

impl DeadPeerCheck {
    /// Whether a look is due now, for a batch whose last completion was
    /// at `last_progress`.
    fn due(&mut self, last_progress: Instant) -> bool {
        let since = self.last.map_or(last_progress, |last| last.max(last_progress));
        if since.elapsed() < DEAD_PEER_CHECK {
            return false;
        }
        self.last = Some(Instant::now());
        true
    }
}

/// `ops`, all from `peer`.
fn with_peer<'p>(peer: &'p Peer, ops: &[RmaOp]) -> Vec<PeerOp<'p>> {
    ops.iter().map(|op| PeerOp { peer, op: *op }).collect()
}

/// The local side of a batch's operations: which way they move bytes, and
/// the registered memory their local offsets are in.
#[derive(Clone, Copy)]
struct Local {
    kind: RmaKind,
    ptr: *mut u8,
    len: usize,
    desc: *mut c_void,
}

/// One operation of a batch, with its peer and local side.
#[derive(Clone, Copy)]
struct BatchOp<'p> {
    peer: &'p Peer,
    op: RmaOp,
    local: Local,
}

/// `ops`, each moving bytes of `local`.
fn batch_ops<'p>(local: Local, ops: &[PeerOp<'p>]) -> Vec<BatchOp<'p>> {
    ops.iter().map(|&PeerOp { peer, op }| BatchOp { peer, op, local }).collect()
}

/// Keeps the contexts of operations that never completed alive for the rest
/// of the process. The endpoint was just closed with them outstanding, and
/// a provider may still touch an operation's context after that (rxm's
/// connection handling reports or cancels entries of a peer that went away
/// from its own progress paths); freeing them would let it write into freed
/// memory. The leak is bounded: it happens only when an endpoint is
/// abandoned, at most `inflight` slots of a few dozen bytes each.
fn abandon_contexts(slots: Box<[OpSlot]>, outstanding: usize) {
    if outstanding > 0 {
        Box::leak(slots);
    }
}

/// Opens the completion queue, address vector and endpoint into `state`,
/// binds them and enables the endpoint. On error, `state` holds whatever was
/// opened so far, for the caller to close.
fn open_endpoint(
    dom: &DomainInner,
    state: &mut EpState,
    cq_attr: &mut sys::fi_cq_attr,
    av_attr: &mut sys::fi_av_attr,
) -> Result<()> {
    // SAFETY: the domain and its info are open for the life of `dom`; each
    // out-pointer receives a new object that the caller closes through
    // `state` (EpState::close skips the ones still NULL).
    unsafe {
        let ret = sys::icheck_fi_cq_open(dom.domain, cq_attr, &mut state.cq, ptr::null_mut());
        if ret != 0 {
            state.cq = ptr::null_mut();
            return Err(FabricError::call("fi_cq_open", ret.into()));
        }
        let mut book = lock_book(&state.addresses);
        let ret = sys::icheck_fi_av_open(dom.domain, av_attr, &mut book.av, ptr::null_mut());
        if ret != 0 {
            book.av = ptr::null_mut();
            return Err(FabricError::call("fi_av_open", ret.into()));
        }
        let av = book.av;
        drop(book);
        let ret = sys::icheck_fi_endpoint(dom.domain, dom.info, &mut state.ep, ptr::null_mut());
        if ret != 0 {
            state.ep = ptr::null_mut();
            return Err(FabricError::call("fi_endpoint", ret.into()));
        }
        let ret = sys::icheck_fi_ep_bind(state.ep, &mut (*state.cq).fid, (sys::FI_TRANSMIT | sys::FI_RECV) as u64);
        if ret != 0 {
            return Err(FabricError::call("fi_ep_bind(cq)", ret.into()));
        }
        let ret = sys::icheck_fi_ep_bind(state.ep, &mut (*av).fid, 0);
        if ret != 0 {
            return Err(FabricError::call("fi_ep_bind(av)", ret.into()));
        }
        let ret = sys::icheck_fi_enable(state.ep);
        if ret != 0 {
            return Err(FabricError::call("fi_enable", ret.into()));
        }
    }
    Ok(())
}

/// Reads an enabled endpoint's address.
fn get_name(ep: *mut sys::fid_ep) -> Result<FabricAddress> {
    let mut buf = vec![0u8; 64];
    loop {
        let mut len = buf.len();
        // SAFETY: ep is an enabled endpoint; buf is writable for `len` bytes;
        // on -FI_ETOOSMALL the provider stores the needed size in `len`.
        let ret = unsafe { sys::icheck_fi_getname(&mut (*ep).fid, buf.as_mut_ptr().cast(), &mut len) };
        if ret == 0 {
            buf.truncate(len);
            return Ok(FabricAddress(buf));
        }
        if ret == -(sys::FI_ETOOSMALL as i32) && len > buf.len() {
            buf.resize(len, 0);
            continue;
        }
        return Err(FabricError::call("fi_getname", ret.into()));
    }
}
