//! Registered memory: local regions the provider may access, and the
//! descriptors a peer needs to reach them.

use std::alloc::{self, Layout};
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::ptr::NonNull;

use libfabric_sys as sys;
use serde::{Deserialize, Serialize};

use super::endpoint::EndpointShared;
use super::{FabricError, Result};
use std::sync::Arc;

/// What peers may do with a registered region. Local use as the source or
/// target of this process's own RMA is always allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Peers may `fi_read` from the region.
    pub remote_read: bool,
    /// Peers may `fi_write` into the region.
    pub remote_write: bool,
}

impl Access {
    /// Only local use.
    pub const LOCAL: Access = Access { remote_read: false, remote_write: false };
    /// Peers may read.
    pub const REMOTE_READ: Access = Access { remote_read: true, remote_write: false };
    /// Peers may write.
    pub const REMOTE_WRITE: Access = Access { remote_read: false, remote_write: true };
    /// Peers may read and write.
    pub const REMOTE_READ_WRITE: Access = Access { remote_read: true, remote_write: true };

    pub(crate) fn bits(self) -> u64 {
        let mut bits = (sys::FI_READ | sys::FI_WRITE) as u64;
        if self.remote_read {
            bits |= sys::FI_REMOTE_READ as u64;
        }
        if self.remote_write {
            bits |= sys::FI_REMOTE_WRITE as u64;
        }
        bits
    }
}

/// What a peer needs to address a registered region: plain data that the
/// control plane carries between processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Remote address of byte 0: the virtual address under `FI_MR_VIRT_ADDR`,
    /// otherwise 0 (addresses are offsets).
    pub addr: u64,
    /// Remote protection key.
    pub key: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// Checks that `[offset, offset + len)` lies inside the region and returns
    /// the remote address of `offset`.
    pub fn address_of(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(FabricError::OutOfRange { side: "remote", offset, len, region_len: self.len }),
        }
    }
}

/// Memory whose address does not change when its owner moves, so that it can
/// stay registered while the owning value is passed around.
///
/// # Safety
/// `as_mut_ptr` must return the same pointer for the whole life of the value
/// (moves included), valid for `len()` bytes of reads and writes.
pub unsafe trait StableBuffer: Send {
    /// Start of the memory.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the buffer is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a Vec's heap buffer does not move when the Vec moves, and the Vec is
// never resized while registered (RegisteredBuffer owns it and never exposes it mutably).
unsafe impl StableBuffer for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: a boxed slice's heap memory does not move when the box moves.
unsafe impl StableBuffer for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut().as_mut_ptr()
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

/// A zero-initialised, page-aligned buffer. Small ones come from the heap;
/// large ones are anonymous mappings, so allocating 1 GiB costs nothing
/// until touched. (No MADV_HUGEPAGE: on a fragmented host, faulting huge
/// pages stalled in compaction, 1.2 s for 256 MiB in our measurements.)
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    mapped: bool,
}

// SAFETY: AlignedBuffer uniquely owns its allocation, like a Box<[u8]>.
unsafe impl Send for AlignedBuffer {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    const ALIGN: usize = 4096;
    /// Buffers at least this large are mapped rather than heap-allocated.
    const MAP_THRESHOLD: usize = 4 << 20;

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), Self::ALIGN).expect("buffer length overflows a Layout")
    }

    /// Allocates `len` zeroed bytes aligned to a page.
    pub fn zeroed(len: usize) -> AlignedBuffer {
        if len >= Self::MAP_THRESHOLD {
            if let Some(buffer) = Self::map(len) {
                return buffer;
            }
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuffer { ptr, len, mapped: false }
    }

    fn map(len: usize) -> Option<AlignedBuffer> {
        use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
        let size = std::num::NonZeroUsize::new(len)?;
        // SAFETY: a fresh private anonymous mapping aliases nothing; it is
        // zero-filled by the kernel and unmapped exactly once, in Drop.
        let ptr = unsafe {
            mmap_anonymous(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_PRIVATE).ok()?
        };
        Some(AlignedBuffer { ptr: ptr.cast(), len, mapped: true })
    }

    /// Backs every page of the buffer now, so that the first writes into
    /// it do not fault page by page. A mapped buffer asks the kernel to
    /// populate it in one call (`MADV_POPULATE_WRITE`, Linux 5.14); where
    /// that is refused, one byte per page is written. The contents stay
    /// zero. Heap buffers (under 4 MiB) are left as they are.
    pub fn prefault(&mut self) {
        if !self.mapped {
            return;
        }
        // Not `pages::populate_write`: `fabric` is a leaf layer and may not
        // import `pages` (tests/layering.rs).
        // SAFETY: the range is this buffer's own mapping, readable and
        // writable; populating it allocates pages and changes no byte.
        let populated = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_POPULATE_WRITE) } == 0;
        if !populated {
            self.touch_each_page();
        }
    }

    /// [`prefault`](Self::prefault) without the kernel's help: one write
    /// per page.
    fn touch_each_page(&mut self) {
        for page in self.as_mut_slice().chunks_mut(Self::ALIGN) {
            // A volatile write of the byte already there, so that the
            // compiler keeps it: the write is what faults the page in.
            let first = page.as_mut_ptr();
            // SAFETY: `first` points at the first byte of a non-empty chunk
            // of this buffer, exclusively borrowed here.
            unsafe { std::ptr::write_volatile(first, std::ptr::read_volatile(first)) };
        }
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `map` with this address and length.
            let _ = unsafe { nix::sys::mman::munmap(self.ptr.cast(), self.len) };
        } else {
            // SAFETY: allocated in `zeroed` with the same layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
        }
    }
}

// SAFETY: the allocation never moves and is freed only on drop.
unsafe impl StableBuffer for AlignedBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A registration of local memory with an endpoint's domain. Closing it (on
/// drop) revokes remote access.
pub struct MemoryRegion {
    pub(crate) mr: *mut sys::fid_mr,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) desc: *mut c_void,
    pub(crate) remote: RemoteRegion,
    /// Keeps the endpoint (for FI_MR_ENDPOINT) and domain open while registered.
    pub(crate) _endpoint: Arc<EndpointShared>,
}

// SAFETY: the domain is FI_THREAD_SAFE, so the fid_mr may be used and closed
// from any thread; the memory it covers is owned elsewhere per the contract of
// Endpoint::register_raw.
unsafe impl Send for MemoryRegion {}
// SAFETY: &MemoryRegion only reads immutable fields.
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("len", &self.len).field("remote", &self.remote).finish()
    }
}

impl MemoryRegion {
    /// What a peer needs to reach this region.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This region as the source of local writes.
    pub fn source(&self) -> LocalSource<'_> {
        LocalSource { ptr: self.ptr, len: self.len, desc: self.desc, _borrow: PhantomData }
    }

    /// This region as the destination of local reads.
    ///
    /// # Safety
    /// Nothing else may read or write the memory while the returned value is
    /// in use by a transfer (the registration contract only covers validity).
    pub unsafe fn target_unchecked(&self) -> LocalTarget<'_> {
        LocalTarget { ptr: self.ptr, len: self.len, desc: self.desc, _borrow: PhantomData }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: `mr` was opened by fi_mr_reg and is closed exactly once; the
        // endpoint it may be bound to is still open (we hold an Arc to it).
        unsafe { sys::icheck_fi_close(&mut (*self.mr).fid) };
    }
}

/// Local memory a write reads from.
#[derive(Clone, Copy)]
pub struct LocalSource<'a> {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) desc: *mut c_void,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a LocalSource stands for a shared borrow of registered memory,
// which may be read from any thread like a `&[u8]`.
unsafe impl Send for LocalSource<'_> {}
// SAFETY: see Send.
unsafe impl Sync for LocalSource<'_> {}

/// Local memory a read writes into.
pub struct LocalTarget<'a> {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) desc: *mut c_void,
    _borrow: PhantomData<&'a mut [u8]>,
}

/// An owned buffer together with its registration.
///
/// While the buffer is exposed for remote writes, peers may change its bytes
/// at any time; icheck's protocol reads it only after the writer reported the
/// transfer complete.
pub struct RegisteredBuffer<B: StableBuffer = AlignedBuffer> {
    // Declared first so that it is dropped (deregistered) before the memory.
    region: MemoryRegion,
    buffer: B,
}

impl<B: StableBuffer> RegisteredBuffer<B> {
    pub(crate) fn from_parts(region: MemoryRegion, buffer: B) -> Self {
        RegisteredBuffer { region, buffer }
    }

    /// The registration (for its [`RemoteRegion`]).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// What a peer needs to reach this buffer.
    pub fn remote(&self) -> RemoteRegion {
        self.region.remote
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the pointer and length come from the owned StableBuffer,
        // which stays alive and in place while `self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.region.ptr, self.region.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; &mut self excludes every local transfer.
        unsafe { std::slice::from_raw_parts_mut(self.region.ptr, self.region.len) }
    }

    /// The buffer as the source of a write batch.
    pub fn source(&self) -> LocalSource<'_> {
        self.region.source()
    }

    /// The buffer as the destination of a read batch.
    pub fn target(&mut self) -> LocalTarget<'_> {
        // SAFETY: &mut self guarantees that nothing else in this process
        // touches the buffer while the target is in use.
        unsafe { self.region.target_unchecked() }
    }

    /// Deregisters the memory and hands the buffer back.
    pub fn into_inner(self) -> B {
        let RegisteredBuffer { region, buffer } = self;
        drop(region);
        buffer
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedBuffer;

    /// Pages of `buffer` the kernel has backed (`mincore`).
    fn resident_pages(buffer: &AlignedBuffer) -> usize {
        let pages = buffer.len.div_ceil(AlignedBuffer::ALIGN);
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is the buffer's own page-aligned mapping, and
        // `resident` has one byte per page of it.
        let ret = unsafe { libc::mincore(buffer.ptr.as_ptr().cast(), buffer.len, resident.as_mut_ptr()) };
        assert_eq!(ret, 0, "mincore: {}", std::io::Error::last_os_error());
        resident.iter().filter(|page| **page & 1 == 1).count()
    }

    #[test]
    fn a_prefaulted_buffer_is_backed_and_still_zero() {
        let len = 8 << 20;
        let prefaults: [fn(&mut AlignedBuffer); 2] = [AlignedBuffer::prefault, AlignedBuffer::touch_each_page];
        for prefault in prefaults {
            let mut buffer = AlignedBuffer::zeroed(len);
            assert!(buffer.mapped, "8 MiB is mapped, not taken from the heap");
            assert_eq!(resident_pages(&buffer), 0, "a fresh mapping has no pages yet");
            prefault(&mut buffer);
            assert_eq!(resident_pages(&buffer), len / AlignedBuffer::ALIGN);
            assert!(buffer.as_slice().iter().all(|byte| *byte == 0));
        }
    }
}
