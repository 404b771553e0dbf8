//! Page tracking (`[client] page_tracking`, opt-in): which pages of the
//! checkpointed memory this process wrote since the last commit, so that
//! an incremental commit checksums only those instead of every byte.
//!
//! The kernel keeps the record. The labels' pages are registered with a
//! userfaultfd in asynchronous write-protect mode (`UFFD_FEATURE_WP_ASYNC`,
//! Linux 6.7): a write to a protected page is not delivered to anyone, the
//! kernel just lifts the protection and the page counts as *written*. At
//! each commit one `PAGEMAP_SCAN` ioctl on `/proc/self/pagemap` per tracked
//! range returns the written pages and protects them again, atomically
//! (`PM_SCAN_WP_MATCHING`), in well under a millisecond for 512 MiB. This is
//! the successor of the soft-dirty bits CRIU used, which this machine's
//! kernel does not build (`CONFIG_MEM_SOFT_DIRTY` unset).
//!
//! What it sees: every write the CPU makes to the pages, from any thread
//! of this process, and writes the kernel makes on the process's behalf
//! (`read(2)` into the memory, another process's `process_vm_writev`).
//! What it cannot see: memory a NIC writes by DMA into registered pages,
//! and pages that `madvise(MADV_DONTNEED)` drops (they read back as zeros
//! without a write). That is why checksum comparison stays the default
//! and a restore, which may arrive by DMA, makes the next commit compare
//! checksums again (`client::commit`).
//!
//! Architecture invariant: the tracker never reports fewer pages than
//! were written by the CPU since its previous report for the same ranges;
//! when it cannot be sure (ranges changed, memory replaced, a failed
//! ioctl) it answers [`Written::Everything`] or an error, and the caller
//! compares every byte.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use icheck_core::delta::merge_ranges;

/// Why page tracking cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum TrackingError {
    /// The kernel refused a step (no userfaultfd, no asynchronous
    /// write-protection, no `PAGEMAP_SCAN`, or memory it cannot track).
    #[error("page tracking: {step}: {source}")]
    Kernel {
        /// What was being done.
        step: String,
        /// The kernel's answer.
        source: io::Error,
    },
}

/// What [`PageTracker::take_written`] knows.
#[derive(Debug, PartialEq, Eq)]
pub enum Written {
    /// Every page counts as written: tracking (re)started for these
    /// ranges now, so nothing is known about what came before.
    Everything,
    /// The pages written since the previous call, as sorted, disjoint,
    /// page-aligned address ranges.
    Pages(Vec<Range<usize>>),
}

// The kernel ABI (include/uapi/linux/userfaultfd.h, include/uapi/linux/fs.h).
// Debian 12's headers predate PAGEMAP_SCAN, so it is spelled out here.
const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const PAGE_IS_WRITTEN: u64 = 1 << 1;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `_IOWR`/`_IOR` of asm-generic/ioctl.h.
const fn ioctl_number(dir: u64, kind: u8, nr: u8, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((kind as u64) << 8) | nr as u64
}
const READ_WRITE: u64 = 3;
const READ: u64 = 2;
const UFFDIO_API: u64 = ioctl_number(READ_WRITE, 0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioctl_number(READ_WRITE, 0xAA, 0x00, std::mem::size_of::<UffdioRegister>());
const UFFDIO_UNREGISTER: u64 = ioctl_number(READ, 0xAA, 0x01, std::mem::size_of::<UffdioRange>());
const UFFDIO_WRITEPROTECT: u64 = ioctl_number(READ_WRITE, 0xAA, 0x06, std::mem::size_of::<UffdioWriteprotect>());
const PAGEMAP_SCAN: u64 = ioctl_number(READ_WRITE, b'f', 16, std::mem::size_of::<PmScanArg>());

/// Regions one scan call can return before it is called again.
const REGIONS_PER_SCAN: usize = 512;

/// The kernel's record of which tracked pages were written (see the module
/// documentation). One per process that enables page tracking.
pub struct PageTracker {
    uffd: OwnedFd,
    pagemap: File,
    page: usize,
    /// Page-aligned, sorted, disjoint address ranges registered now.
    tracked: Vec<Range<usize>>,
}

impl std::fmt::Debug for PageTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTracker").field("tracked", &self.tracked).finish()
    }
}

fn kernel(step: impl Into<String>) -> impl FnOnce(io::Error) -> TrackingError {
    let step = step.into();
    move |source| TrackingError::Kernel { step, source }
}

/// `ioctl(fd, request, arg)`, its result or the errno.
///
/// # Safety
/// `arg` must point to the structure `request` reads and writes.
unsafe fn ioctl<T>(fd: &impl AsRawFd, request: u64, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: the caller matches `arg` to `request`; the fd is open.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

impl PageTracker {
    /// Opens a userfaultfd with asynchronous write-protection and this
    /// process's pagemap. Fails, saying which step, where the kernel lacks
    /// either (before Linux 6.7, or userfaultfd disabled).
    pub fn new() -> Result<PageTracker, TrackingError> {
        // User-mode faults only: allowed without privileges even where
        // vm.unprivileged_userfaultfd is 0, and all that tracking needs.
        // SAFETY: a plain system call with integer flags.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY) };
        if fd < 0 {
            return Err(kernel("userfaultfd()")(io::Error::last_os_error()));
        }
        // SAFETY: the system call returned a new descriptor that nothing
        // else owns.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let wanted = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
        let mut api = UffdioApi { api: UFFD_API, features: wanted, ioctls: 0 };
        // SAFETY: UFFDIO_API takes a struct uffdio_api.
        unsafe { ioctl(&uffd, UFFDIO_API, &mut api) }
            .map_err(kernel("UFFDIO_API with asynchronous write-protection (Linux 6.7 or later)"))?;
        if api.features & wanted != wanted {
            return Err(kernel("UFFDIO_API")(io::Error::other("the kernel lacks asynchronous write-protection")));
        }
        let pagemap = File::open("/proc/self/pagemap").map_err(kernel("opening /proc/self/pagemap"))?;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        Ok(PageTracker { uffd, pagemap, page, tracked: Vec::new() })
    }

    /// The pages of `ranges` (address ranges of any alignment, the
    /// labels' memory) written since the previous call. When `ranges`
    /// cover other pages than last time, tracking restarts on the new
    /// pages and the answer is [`Written::Everything`]. An error leaves the
    /// tracker so that the next call restarts tracking.
    pub fn take_written(&mut self, ranges: &[Range<usize>]) -> Result<Written, TrackingError> {
        let wanted = page_cover(ranges, self.page);
        if wanted != self.tracked {
            self.track(wanted)?;
            return Ok(Written::Everything);
        }
        let mut written = Vec::new();
        for range in self.tracked.clone() {
            if let Err(err) = self.scan(range, &mut written) {
                self.tracked.clear();
                return Err(err);
            }
        }
        Ok(Written::Pages(merge_ranges(written)))
    }

    /// Stops tracking the old ranges and protects the new ones.
    fn track(&mut self, wanted: Vec<Range<usize>>) -> Result<(), TrackingError> {
        for old in std::mem::take(&mut self.tracked) {
            let mut range = UffdioRange { start: old.start as u64, len: (old.end - old.start) as u64 };
            // Memory that was unmapped meanwhile has nothing to unregister;
            // the answer does not matter.
            // SAFETY: UFFDIO_UNREGISTER takes a struct uffdio_range.
            let _ = unsafe { ioctl(&self.uffd, UFFDIO_UNREGISTER, &mut range) };
        }
        for range in &wanted {
            let span = UffdioRange { start: range.start as u64, len: (range.end - range.start) as u64 };
            let mut register = UffdioRegister { range: span, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
            // SAFETY: UFFDIO_REGISTER takes a struct uffdio_register. Write
            // protection in asynchronous mode never blocks a thread: a
            // write only clears the page's protection.
            unsafe { ioctl(&self.uffd, UFFDIO_REGISTER, &mut register) }
                .map_err(kernel(format!("registering {:#x}..{:#x}", range.start, range.end)))?;
            let mut protect = UffdioWriteprotect { range: span, mode: UFFDIO_WRITEPROTECT_MODE_WP };
            // SAFETY: UFFDIO_WRITEPROTECT takes a struct uffdio_writeprotect.
            unsafe { ioctl(&self.uffd, UFFDIO_WRITEPROTECT, &mut protect) }
                .map_err(kernel(format!("write-protecting {:#x}..{:#x}", range.start, range.end)))?;
        }
        self.tracked = wanted;
        Ok(())
    }

    /// Appends the written pages of `range` to `written` and protects
    /// them again.
    fn scan(&self, range: Range<usize>, written: &mut Vec<Range<usize>>) -> Result<(), TrackingError> {
        let mut regions = vec![PageRegion::default(); REGIONS_PER_SCAN];
        let mut at = range.start;
        while at < range.end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                // Protect what is reported, and fail rather than report
                // nothing for pages that lost their registration (memory
                // unmapped and mapped anew at the same address).
                flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                start: at as u64,
                end: range.end as u64,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                category_mask: PAGE_IS_WRITTEN,
                return_mask: PAGE_IS_WRITTEN,
                ..PmScanArg::default()
            };
            // SAFETY: PAGEMAP_SCAN takes a struct pm_scan_arg whose `vec`
            // points to `vec_len` writable struct page_region, as here.
            let found = unsafe { ioctl(&self.pagemap, PAGEMAP_SCAN, &mut arg) }
                .map_err(kernel(format!("PAGEMAP_SCAN of {:#x}..{:#x}", range.start, range.end)))?;
            let found = usize::try_from(found).unwrap_or(0).min(regions.len());
            written.extend(regions[..found].iter().map(|r| r.start as usize..r.end as usize));
            let walked = arg.walk_end as usize;
            if walked <= at {
                return Err(kernel("PAGEMAP_SCAN")(io::Error::other(format!("made no progress at {at:#x}"))));
            }
            at = walked;
        }
        Ok(())
    }
}

/// The sorted, merged page-aligned cover of `ranges` (empty ones ignored).
fn page_cover(ranges: &[Range<usize>], page: usize) -> Vec<Range<usize>> {
    merge_ranges(
        ranges.iter().filter(|r| r.start < r.end).map(|r| r.start / page * page..r.end.div_ceil(page) * page).collect(),
    )
}

/// For each label (its address range), the byte ranges of it, relative to
/// its start, that lie in written pages (`pages` sorted and disjoint).
pub fn written_per_label(pages: &[Range<usize>], labels: &[Range<usize>]) -> Vec<Vec<Range<usize>>> {
    labels
        .iter()
        .map(|label| {
            let first = pages.partition_point(|p| p.end <= label.start);
            pages[first..]
                .iter()
                .take_while(|p| p.start < label.end)
                .map(|p| p.start.max(label.start) - label.start..p.end.min(label.end) - label.start)
                .filter(|r| r.start < r.end)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // Values from linux/userfaultfd.h and linux/fs.h (x86_64).
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(PAGEMAP_SCAN, 0xc060_6610);
    }

    #[test]
    fn covers_and_splits_ranges() {
        let cover = page_cover(&[5000..5001, 0..10, 8192..8193, 20000..20000], PAGE);
        assert_eq!(cover, vec![0..3 * PAGE]);
        let pages = vec![0..PAGE, 3 * PAGE..5 * PAGE];
        let labels = vec![100..200, PAGE - 10..4 * PAGE, 5 * PAGE..6 * PAGE];
        assert_eq!(
            written_per_label(&pages, &labels),
            vec![vec![0..100], vec![0..10, 2 * PAGE + 10..3 * PAGE + 10], vec![]]
        );
    }

    /// Anonymous memory of `len` bytes, unmapped on drop.
    struct Mapping {
        at: *mut u8,
        len: usize,
    }
    impl Mapping {
        fn new(len: usize) -> Mapping {
            // SAFETY: a fresh private anonymous mapping; no existing memory
            // is touched.
            let at = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(at, libc::MAP_FAILED);
            Mapping { at: at.cast(), len }
        }
        // A test helper over foreign memory, like a C label's pointer.
        #[allow(clippy::mut_from_ref)]
        fn bytes(&self) -> &mut [u8] {
            // SAFETY: the mapping is readable and writable for len bytes
            // while self lives; each test uses one view at a time.
            unsafe { std::slice::from_raw_parts_mut(self.at, self.len) }
        }
        fn range(&self) -> Range<usize> {
            self.at as usize..self.at as usize + self.len
        }
    }
    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly what new mapped.
            unsafe { libc::munmap(self.at.cast(), self.len) };
        }
    }

    fn pages_of(written: Written, base: usize) -> Vec<Range<usize>> {
        match written {
            Written::Pages(pages) => {
                pages.into_iter().map(|p| (p.start - base) / PAGE..(p.end - base) / PAGE).collect()
            }
            Written::Everything => panic!("expected pages"),
        }
    }

    #[test]
    fn reports_exactly_the_pages_written_since_the_last_call() {
        let mut tracker = PageTracker::new().expect("this kernel tracks pages");
        let memory = Mapping::new(64 << 20);
        memory.bytes()[..PAGE * 3].fill(1); // some pages populated before tracking
        let base = memory.range().start;
        assert_eq!(tracker.take_written(&[memory.range()]).unwrap(), Written::Everything);
        assert_eq!(pages_of(tracker.take_written(&[memory.range()]).unwrap(), base), vec![]);

        let bytes = memory.bytes();
        bytes[0] = 2; // populated page
        bytes[10 * PAGE + 7] = 3; // page never touched before
        bytes[20 * PAGE - 1..20 * PAGE + 1].fill(4); // across a page boundary
        bytes[1000 * PAGE..1003 * PAGE].fill(5); // a run
        let _ = std::hint::black_box(bytes[5000 * PAGE]); // a read is not a write
        assert_eq!(
            pages_of(tracker.take_written(&[memory.range()]).unwrap(), base),
            vec![0..1, 10..11, 19..21, 1000..1003]
        );
        assert_eq!(pages_of(tracker.take_written(&[memory.range()]).unwrap(), base), vec![], "protected again");

        // Another thread's writes, and the kernel's (read(2) into the memory).
        let at = base + 3000 * PAGE + 1;
        std::thread::spawn(move || {
            // SAFETY: inside the mapping, which outlives the joined thread;
            // this thread is the only one using it meanwhile.
            unsafe { *(at as *mut u8) = 6 }
        })
        .join()
        .unwrap();
        let mut file = tempfile();
        std::io::Write::write_all(&mut file, &[7u8; 3 * PAGE]).unwrap();
        std::io::Seek::rewind(&mut file).unwrap();
        std::io::Read::read_exact(&mut file, &mut memory.bytes()[4000 * PAGE..4003 * PAGE]).unwrap();
        assert_eq!(pages_of(tracker.take_written(&[memory.range()]).unwrap(), base), vec![3000..3001, 4000..4003]);
    }

    #[test]
    fn random_writes_are_never_missed() {
        let mut tracker = PageTracker::new().expect("this kernel tracks pages");
        let memory = Mapping::new(16 << 20);
        // Two labels inside the mapping, neither page-aligned, sharing a page.
        let base = memory.range().start;
        let labels = [base + 100..base + 5 * PAGE + 50, base + 5 * PAGE + 50..base + memory.len - 3];
        let mut copy = memory.bytes().to_vec();
        assert_eq!(tracker.take_written(&labels).unwrap(), Written::Everything);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..50 {
            let bytes = memory.bytes();
            for _ in 0..(next() % 40) {
                let at = (next() as usize) % memory.len;
                let len = ((next() as usize) % (3 * PAGE)).min(memory.len - at);
                bytes[at..at + len].fill(round as u8 + 1);
            }
            let Written::Pages(written) = tracker.take_written(&labels).unwrap() else { panic!("pages expected") };
            let written = written_per_label(&written, &labels);
            for (label, (range, written)) in labels.iter().zip(&written).enumerate() {
                let (from, to) = (range.start - base, range.end - base);
                let mut page = from;
                while page < to {
                    let end = ((page / PAGE + 1) * PAGE).min(to);
                    let changed = bytes[page..end] != copy[page..end];
                    let reported = written.iter().any(|w| w.start < end - from && page - from < w.end);
                    assert!(!changed || reported, "round {round}: label {label}: a change at {page} was not reported");
                    page = end;
                }
            }
            copy.copy_from_slice(bytes);
        }
    }

    #[test]
    fn changed_ranges_restart_tracking_and_replaced_memory_is_an_error() {
        let mut tracker = PageTracker::new().expect("this kernel tracks pages");
        let memory = Mapping::new(1 << 20);
        let range = memory.range();
        assert_eq!(tracker.take_written(std::slice::from_ref(&range)).unwrap(), Written::Everything);
        let shorter = range.start..range.end - PAGE;
        assert_eq!(tracker.take_written(std::slice::from_ref(&shorter)).unwrap(), Written::Everything);
        assert!(
            matches!(tracker.take_written(std::slice::from_ref(&shorter)).unwrap(), Written::Pages(p) if p.is_empty())
        );
        // The memory is replaced by a new mapping at the same address: its
        // pages are not registered, so the scan must fail, not say "clean".
        // SAFETY: MAP_FIXED over the test's own mapping, same length.
        let again = unsafe {
            libc::mmap(
                memory.at.cast(),
                memory.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(again.cast(), memory.at);
        memory.bytes()[0] = 1;
        assert!(tracker.take_written(std::slice::from_ref(&shorter)).is_err());
        assert_eq!(tracker.take_written(&[shorter]).unwrap(), Written::Everything, "then it starts again");
    }

    fn tempfile() -> File {
        let path = std::env::temp_dir().join(format!("icheck-tracking-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
