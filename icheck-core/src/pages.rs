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

/// `MADV_POPULATE_READ` (Linux 5.14): map the range's existing pages (and
/// back a tmpfs file's holes) as a read of each page would, without reading.
const MADV_POPULATE_READ: libc::c_int = 22;

/// Bytes [`populate_read`] asks for per call. A read populate holds the
/// process's memory-map lock for the whole call, as `MAP_POPULATE` does:
/// measured on this project's VM, while 1 GiB of a tmpfs file was mapped so,
/// another thread's `mmap` of 1 MiB waited 0.9-1.15 s (a spawned thread or
/// a large allocation waits the same way: a manager's heartbeats stopped
/// for seconds); in 8 MiB calls it waited at most 92-117 ms, and the whole
/// range took as long (0.91-0.98 s against 0.86-0.94 s).
const POPULATE_READ_CHUNK: usize = 8 << 20;

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

/// Maps the existing pages of `[addr, addr + len)`, a mapping of a file,
/// now instead of at first access: what `MAP_POPULATE` does to a shared
/// mapping, in 8 MiB steps so that the process's other threads are not
/// held up meanwhile. `addr` must be page-aligned.
///
/// # Errors
/// As [`populate_write`]; the pages populated before the error stay mapped.
pub fn populate_read(addr: usize, len: usize) -> Result<(), PopulateError> {
    let mut done = 0;
    while done < len {
        let step = POPULATE_READ_CHUNK.min(len - done);
        // SAFETY: as in `populate_write`: populating for reading maps pages
        // and never changes what a byte reads as; a range that is not
        // mapped is an error, not undefined behaviour.
        if unsafe { libc::madvise((addr + done) as *mut libc::c_void, step, MADV_POPULATE_READ) } != 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::EFAULT | libc::ENOMEM) => PopulateError::NoSpace(err),
                _ => PopulateError::Unsupported(err),
            });
        }
        done += step;
    }
    Ok(())
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

/// Whether new pages of files under a directory come as 2 MiB huge pages.
///
/// A fresh page of a tmpfs file costs its allocation and zeroing at first
/// touch. With 4 KiB pages that is one fault per page; with huge pages one
/// per 2 MiB. Which is cheaper depends on where the memory comes from: on
/// this project's VM, populating 1 GiB took 0.04 s with huge pages against
/// 0.57-0.66 s with 4 KiB ones when the memory had just been freed, but
/// 1.35-2.3 s against 0.6 s after a few idle seconds, once the balloon
/// driver had reported the free 2 MiB blocks to the host (each must be
/// faulted in from the host again). tmpfs decides per mount (`huge=`), and
/// the kernel's `shmem_enabled` switch can force or deny it everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// The directory is on a tmpfs whose files get huge pages (`always`,
    /// `within_size`; `advise` when the mapping asks, as the store's do).
    Yes {
        /// Where the tmpfs is mounted.
        mount_point: std::path::PathBuf,
        /// The mount's `huge=` value, or `force` from `shmem_enabled`.
        policy: String,
    },
    /// Files there get 4 KiB pages; why, in words for an operator.
    No(String),
}

impl std::fmt::Display for HugePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HugePages::Yes { mount_point, policy } => {
                write!(f, "2 MiB huge pages (tmpfs at {} with huge={policy})", mount_point.display())
            }
            HugePages::No(reason) => write!(f, "4 KiB pages ({reason})"),
        }
    }
}

/// Where the kernel says whether shmem and tmpfs use huge pages.
const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// How files created under `dir` (or, before it exists, under its nearest
/// existing ancestor) get their pages, from `/proc/self/mountinfo` and the
/// kernel's `shmem_enabled` switch.
#[must_use]
pub fn huge_pages_under(dir: &std::path::Path) -> HugePages {
    let existing = dir.ancestors().find(|a| a.exists()).unwrap_or(dir);
    let resolved = existing.canonicalize().unwrap_or_else(|_| existing.to_path_buf());
    match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(mountinfo) => {
            let switch = std::fs::read_to_string(SHMEM_ENABLED).unwrap_or_default();
            huge_pages_from(&mountinfo, &switch, &resolved)
        }
        Err(err) => HugePages::No(format!("cannot read /proc/self/mountinfo: {err}")),
    }
}

/// [`huge_pages_under`] for an absolute, resolved `path`, given the text of
/// `/proc/self/mountinfo` and of `shmem_enabled` (its selected value is the
/// one in brackets, e.g. `always within_size advise [never] deny force`).
#[must_use]
pub fn huge_pages_from(mountinfo: &str, shmem_enabled: &str, path: &std::path::Path) -> HugePages {
    // The mount whose point is the longest ancestor of the path; of mounts
    // stacked on one point, the last listed is the one on top.
    let mount = mountinfo.lines().filter_map(parse_mount).filter(|m| path.starts_with(&m.point)).fold(
        None::<Mount>,
        |best, m| match &best {
            Some(b) if b.point.as_os_str().len() > m.point.as_os_str().len() => best,
            _ => Some(m),
        },
    );
    let Some(mount) = mount else {
        return HugePages::No(format!("no mount of {} found in /proc/self/mountinfo", path.display()));
    };
    let switch = shmem_enabled.split_whitespace().find_map(|w| w.strip_prefix('[')?.strip_suffix(']'));
    if mount.fs_type != "tmpfs" {
        return HugePages::No(format!("{} is {}, not tmpfs", mount.point.display(), mount.fs_type));
    }
    match switch {
        Some("deny") => return HugePages::No(format!("{SHMEM_ENABLED} is deny")),
        Some("force") => return HugePages::Yes { mount_point: mount.point, policy: "force".into() },
        _ => {}
    }
    let policy = mount.options.split(',').find_map(|o| o.strip_prefix("huge=")).unwrap_or("never");
    match policy {
        "always" | "within_size" | "advise" => HugePages::Yes { mount_point: mount.point, policy: policy.into() },
        _ => HugePages::No(format!(
            "{} is tmpfs with huge={policy}; mount the store on a tmpfs with -o huge=within_size",
            mount.point.display()
        )),
    }
}

/// Whether `path` is itself a mount point (of anything).
#[must_use]
pub fn is_mount_point(path: &std::path::Path) -> bool {
    let resolved = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    std::fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|text| text.lines().filter_map(parse_mount).any(|m| m.point == resolved))
}

/// One line of `/proc/self/mountinfo`: where, what kind, and the file
/// system's own options (after the ` - ` separator).
struct Mount {
    point: std::path::PathBuf,
    fs_type: String,
    options: String,
}

fn parse_mount(line: &str) -> Option<Mount> {
    let (before, after) = line.split_once(" - ")?;
    let point = before.split(' ').nth(4)?;
    let mut after = after.split(' ');
    let fs_type = after.next()?.to_string();
    let options = after.nth(1).unwrap_or("").to_string();
    Some(Mount { point: unescape_octal(point).into(), fs_type, options })
}

/// Mount points in mountinfo write space, tab, newline and backslash as
/// `\ooo` octal escapes.
fn unescape_octal(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match escape {
            Some(d) => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Asks for huge pages on `[addr, addr + len)` (`MADV_HUGEPAGE`): a file
/// mapping on a tmpfs mounted `huge=advise` then gets them; elsewhere it
/// changes nothing that matters here. Errors are ignored: it is advice.
pub fn advise_huge(addr: usize, len: usize) {
    // SAFETY: the advice changes only how later faults are backed, never
    // what a byte reads as; a range that is not mapped is an error, ignored.
    let _ = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
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

    const MOUNTINFO: &str = "\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
25 22 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683652k
31 25 0:40 / /dev/shm/icheck-a rw,relatime - tmpfs tmpfs rw,size=1048576k,huge=within_size
32 22 0:41 / /scratch\\040dir rw - tmpfs tmpfs rw,huge=advise
33 25 0:42 / /dev/shm/icheck-b rw - tmpfs tmpfs rw,huge=never
34 33 0:43 / /dev/shm/icheck-b rw - tmpfs tmpfs rw,huge=always
";
    const NEVER: &str = "always within_size advise [never] deny force";

    #[test]
    fn the_innermost_and_topmost_mount_decides_whether_pages_are_huge() {
        let at = |path: &str, switch: &str| huge_pages_from(MOUNTINFO, switch, std::path::Path::new(path));
        let yes = |point: &str, policy: &str| HugePages::Yes { mount_point: point.into(), policy: policy.into() };
        assert_eq!(at("/dev/shm/icheck-a/local-1", NEVER), yes("/dev/shm/icheck-a", "within_size"));
        // Stacked on one point: the one listed last is on top.
        assert_eq!(at("/dev/shm/icheck-b", NEVER), yes("/dev/shm/icheck-b", "always"));
        assert_eq!(at("/scratch dir/store", NEVER), yes("/scratch dir", "advise"));
        // A sibling whose name extends a mount point's is not under it.
        let plain = at("/dev/shm/icheck-ab", NEVER);
        assert!(matches!(&plain, HugePages::No(why) if why.contains("/dev/shm is tmpfs with huge=never")), "{plain}");
        assert!(matches!(at("/home/x", NEVER), HugePages::No(why) if why.contains("ext4, not tmpfs")));
        // The kernel's switch overrides every tmpfs mount.
        assert_eq!(at("/dev/shm/x", "always within_size advise never deny [force]"), yes("/dev/shm", "force"));
        assert!(matches!(at("/dev/shm/icheck-a", "always within_size advise never [deny] force"), HugePages::No(_)));
        assert!(matches!(huge_pages_from("garbage\n", NEVER, std::path::Path::new("/x")), HugePages::No(_)));
    }

    #[test]
    fn populating_a_file_for_reading_maps_every_page_in_steps_and_keeps_every_byte() {
        // Over two steps and a short third, of a file with data and a hole.
        let len = 2 * POPULATE_READ_CHUNK + 3 * page_size();
        let mut file = tempfile_in_shm();
        let data: Vec<u8> = (0..len / 2).map(|i| (i % 253) as u8).collect();
        std::io::Write::write_all(&mut file, &data).unwrap();
        file.set_len(len as u64).unwrap();
        // SAFETY: the test's own file, not truncated while mapped.
        let memory = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.unwrap();
        let start = memory.as_ptr() as usize;
        // mincore tells a file's pages in memory: the hole has none yet.
        assert!(resident_pages(start, len) < len / page_size(), "the hole starts without pages");
        populate_read(start, len).unwrap();
        assert_eq!(resident_pages(start, len), len / page_size(), "every page, the hole's too, is backed");
        assert_eq!(&memory[..len / 2], &data[..]);
        assert!(memory[len / 2..].iter().all(|&b| b == 0));
        drop(memory);
        assert!(populate_read(start, len).is_err(), "an unmapped range is an error");
    }

    /// An unlinked file on /dev/shm (tmpfs, as the store's), or in the
    /// temporary directory where there is none.
    fn tempfile_in_shm() -> std::fs::File {
        let dir = ["/dev/shm", &std::env::temp_dir().to_string_lossy()].map(std::path::PathBuf::from);
        let dir = dir.into_iter().find(|d| d.is_dir()).unwrap();
        let path = dir.join(format!("icheck-pages-test-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
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
