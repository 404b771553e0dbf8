//! Backing memory pages before they are used.
//!
//! On this project's machine kind a first touch of a 4 KiB page costs about
//! 2 µs (1 GiB of fresh pages: 540-660 ms), most of it in the kernel's
//! fault path, not in zeroing: two threads populating halves of the same
//! range take half the time. Both ends of a transfer meet it: a restore
//! writes into memory the restarted application has just allocated, and an
//! agent's new version file on tmpfs is allocated and zeroed page by page.
//! This module asks the kernel to populate a range (`MADV_POPULATE_WRITE`,
//! Linux 5.14) without writing a byte, on one thread or several.
//!
//! Architecture invariant: nothing here reads or writes the range from user
//! space. Populating maps pages as a write fault would, so every byte keeps
//! what it reads as (zero for fresh anonymous memory, the file's contents
//! for a file), and it may run while another thread writes the same pages.

/// `MADV_POPULATE_WRITE` (Linux 5.14; not in every `libc` release): fault
/// the range in writable, as a write to each page would, without writing.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Below this many bytes per thread, another thread costs more than the
/// faults it would take over.
const MIN_BYTES_PER_THREAD: usize = 32 << 20;

/// More threads than this gain nothing measurable: the fault path then
/// waits on the memory and the allocator's locks.
const MAX_THREADS: usize = 4;

/// Why a range could not be populated.
#[derive(Debug, thiserror::Error)]
pub enum PopulateError {
    /// The kernel has no `MADV_POPULATE_WRITE` (before 5.14), or the range
    /// cannot be populated that way (device memory): the caller falls back
    /// to faulting the pages as before.
    #[error("this kernel cannot populate the range ({0})")]
    Unsupported(std::io::Error),
    /// A page could not be backed: a write to it would have raised SIGBUS
    /// (a full tmpfs) or run out of memory.
    #[error("no memory or space to back every page ({0})")]
    NoSpace(std::io::Error),
}

/// The system's page size.
#[must_use]
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// Populates the pages of `[addr, addr + len)` for writing, on this thread.
/// `addr` must be page-aligned.
///
/// # Errors
/// [`PopulateError::Unsupported`] where the kernel cannot,
/// [`PopulateError::NoSpace`] where a page cannot be backed (and for a range
/// that is not wholly mapped: the kernel answers `ENOMEM` to both).
pub fn populate_write(addr: usize, len: usize) -> Result<(), PopulateError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: madvise only asks the kernel to map pages; populating for
    // writing never changes what a byte reads as (the module's invariant),
    // and a range that is not mapped is an error, not undefined behaviour.
    if unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        // EFAULT: a page would have raised SIGBUS; ENOMEM: out of memory,
        // or a hole in the range.
        Some(libc::EFAULT | libc::ENOMEM) => Err(PopulateError::NoSpace(err)),
        _ => Err(PopulateError::Unsupported(err)),
    }
}

/// [`populate_write`] of `[addr, addr + len)` split over up to four threads
/// (as many as the machine has cores, and at least 32 MiB each); the
/// threads inherit the caller's scheduling priority. The first error is
/// returned after every thread has finished.
///
/// # Errors
/// As [`populate_write`].
pub fn populate_write_parallel(addr: usize, len: usize) -> Result<(), PopulateError> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = cores.min(MAX_THREADS).min(len / MIN_BYTES_PER_THREAD).max(1);
    if threads == 1 {
        return populate_write(addr, len);
    }
    let page = page_size();
    let share = (len / threads).next_multiple_of(page);
    std::thread::scope(|scope| {
        let parts: Vec<_> = (0..threads)
            .map(|i| (i * share, ((i + 1) * share).min(len)))
            .filter(|(start, end)| start < end)
            .map(|(start, end)| scope.spawn(move || populate_write(addr + start, end - start)))
            .collect();
        // A thread that panicked populated an unknown part: reported as
        // unsupported, so that the caller backs the range its older way.
        let panicked = || PopulateError::Unsupported(std::io::Error::other("a populating thread panicked"));
        parts.into_iter().map(|part| part.join().unwrap_or_else(|_| Err(panicked()))).fold(Ok(()), Result::and)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `[start, start + len)` the process has mapped.
    fn resident_pages(start: usize, len: usize) -> usize {
        let mut residency = vec![0u8; len.div_ceil(page_size())];
        // SAFETY: the range is a live page-aligned mapping of the test's.
        assert_eq!(unsafe { libc::mincore(start as *mut libc::c_void, len, residency.as_mut_ptr()) }, 0);
        residency.iter().filter(|&&r| r & 1 == 1).count()
    }

    #[test]
    fn populating_in_parallel_maps_every_page_and_keeps_every_byte() {
        // Odd-sized so that the last thread's share is short.
        let len = 100 * MIN_BYTES_PER_THREAD / 33 / page_size() * page_size();
        let mut memory = memmap2::MmapMut::map_anon(len).unwrap();
        memory[..len / 3].iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
        let start = memory.as_ptr() as usize;
        assert!(resident_pages(start, len) < len / page_size(), "most pages start unmapped");
        populate_write_parallel(start, len).unwrap();
        assert_eq!(resident_pages(start, len), len / page_size(), "every page is mapped");
        assert!(memory[..len / 3].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert!(memory[len / 3..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_range_that_is_not_mapped_is_an_error_not_a_crash() {
        let len = 4 * page_size();
        let memory = memmap2::MmapMut::map_anon(len).unwrap();
        let start = memory.as_ptr() as usize;
        drop(memory);
        assert!(populate_write(start, len).is_err());
        assert!(populate_write(start, 0).is_ok(), "nothing to populate");
    }
}
