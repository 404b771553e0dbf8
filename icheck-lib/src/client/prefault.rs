//! Faulting in a restore's destination ahead of the transfer.
//!
//! A restarted application restores into memory it has just allocated:
//! every page is first touched by the restore itself. On this project's
//! machine a first touch costs about as much as the transfer (1 GiB of 4 KiB
//! pages: 540-660 ms, against ~200 ms for `fi_read` into touched memory),
//! and over the fabric it happens inside the copy (the shm peer's
//! `process_vm_writev`, the tcp progress thread's `recv`), one page after
//! the other. A helper thread walks the destination ahead of the transfer
//! and asks the kernel to populate it (`MADV_POPULATE_WRITE`, Linux 5.14),
//! so the faults run beside the copy instead of inside it: a 1 GiB restore
//! into fresh memory over shm took 750-830 ms without and 390-410 ms with.
//!
//! Memory already present costs one `mincore` per step (about 0.6 ms per
//! GiB) and is left alone. Populating changes no byte the application could
//! see: a populated anonymous page reads as zero, as it did unpopulated, a
//! private file page as the file, and every byte is overwritten by the
//! restore anyway.
//!
//! Architecture invariant: the helper never reads or writes the
//! destination from user space; it only asks the kernel to map it, so it
//! may run while the transfer writes the same pages.

use std::sync::atomic::{AtomicBool, Ordering};

use icheck_core::pages::{page_size, populate_write};

/// Bytes the helper populates per call: small enough that it stops soon
/// after the transfer ends, large enough that calls are few.
const STEP: usize = 16 << 20;

/// Destinations smaller than this are restored without a helper: their
/// faults cost less than starting a thread.
const MIN_BYTES: usize = 32 << 20;

/// Runs `transfer(out)` while a helper thread populates `out`'s pages
/// ahead of it (when `enabled` and `out` is large enough), and stops the
/// helper when `transfer` returns.
pub(super) fn ahead_of<R>(out: &mut [u8], enabled: bool, transfer: impl FnOnce(&mut [u8]) -> R) -> R {
    if !enabled || out.len() < MIN_BYTES {
        return transfer(out);
    }
    let (start, end) = whole_pages(out.as_ptr() as usize, out.len());
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let done = &done;
        scope.spawn(move || populate(start, end, done));
        let result = transfer(out);
        done.store(true, Ordering::Relaxed);
        result
    })
}

/// The page-aligned part `[start, end)` of `len` bytes at `addr` (the
/// partial pages at either edge are left to the transfer).
fn whole_pages(addr: usize, len: usize) -> (usize, usize) {
    let page = page_size();
    let start = addr.next_multiple_of(page);
    let end = ((addr + len) / page * page).max(start);
    (start, end)
}

/// Populates `[start, end)` step by step until done or `done` is set,
/// skipping steps whose pages are all present. Gives up quietly where the
/// kernel cannot (before 5.14, device memory): the transfer then faults as
/// it always did.
fn populate(start: usize, end: usize, done: &AtomicBool) {
    let page = page_size();
    let mut residency = vec![0u8; STEP / page];
    let mut at = start;
    let started = std::time::Instant::now();
    let mut populated = 0usize;
    while at < end && !done.load(Ordering::Relaxed) {
        let len = STEP.min(end - at);
        let pages = len.div_ceil(page);
        // SAFETY: `at` is page-aligned and `[at, at + len)` lies in the
        // caller's destination, a live mapping for the whole call
        // (`ahead_of` joins this thread before returning); `residency`
        // has a byte per page of the step.
        let present = unsafe { libc::mincore(at as *mut libc::c_void, len, residency.as_mut_ptr()) } == 0
            && residency[..pages].iter().all(|r| r & 1 == 1);
        if !present {
            if let Err(err) = populate_write(at, len) {
                tracing::debug!(%err, "cannot populate the restore's destination");
                return;
            }
            populated += len;
        }
        at += len;
    }
    tracing::debug!(populated, ms = started.elapsed().as_secs_f64() * 1e3, "populated the restore's destination");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_leaves_partial_edge_pages_out() {
        let page = page_size();
        assert_eq!(whole_pages(page, 3 * page), (page, 4 * page));
        assert_eq!(whole_pages(page + 1, 3 * page), (2 * page, 4 * page));
        assert_eq!(whole_pages(page + 1, 10), (2 * page, 2 * page), "no whole page: nothing to populate");
    }

    fn resident_pages(start: usize, end: usize) -> usize {
        let page = page_size();
        let mut residency = vec![0u8; (end - start) / page];
        // SAFETY: [start, end) is a live page-aligned mapping of the test's.
        assert_eq!(unsafe { libc::mincore(start as *mut libc::c_void, end - start, residency.as_mut_ptr()) }, 0);
        residency.iter().filter(|&&r| r & 1 == 1).count()
    }

    #[test]
    fn populating_maps_fresh_pages_and_keeps_every_byte() {
        // Fresh anonymous memory, its first half written: populating must
        // map the untouched half and keep both halves' bytes.
        let len = 64 << 20;
        let mut out = memmap2::MmapMut::map_anon(len).unwrap();
        out[..len / 2].iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
        let (start, end) = whole_pages(out.as_ptr() as usize, len);
        let pages = (end - start) / page_size();
        assert!(resident_pages(start, end) < pages, "the second half starts unmapped");
        populate(start, end, &AtomicBool::new(false));
        assert_eq!(resident_pages(start, end), pages, "every page is mapped after populating");
        assert!(out[..len / 2].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert!(out[len / 2..].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_transfer_runs_once_and_its_result_comes_back() {
        let mut out = vec![0u8; MIN_BYTES];
        let mut runs = 0;
        let written = ahead_of(&mut out, true, |out| {
            runs += 1;
            out.fill(7);
            out.len()
        });
        assert_eq!((runs, written), (1, MIN_BYTES));
        assert!(out.iter().all(|&b| b == 7));
    }
}
