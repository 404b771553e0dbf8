//! Reading files into memory at the speed the kernel's copy allows.
//!
//! A `pread` copies from the page cache into the caller's memory with the
//! kernel's `copy_to_user`, which on CPUs with fast short string moves is a
//! single `rep movsb`. On some of them (this project's AMD EPYC hosts) that
//! instruction runs at a third of its speed when the destination lies 1 to
//! 31 bytes past the source's place in a page ([`is_slow`] has the
//! figures). A large `malloc` (a `Vec`, a C or Fortran array) starts 16 bytes
//! past a page boundary, so reading a page-aligned part of a file into one
//! is exactly the slow case. [`PlacedBuffer`] is memory that can always be
//! placed like the source; the bytes are then copied out with `memcpy`,
//! which aligns its own stores.
//!
//! On a CPU without the weakness a placed read only costs one extra copy
//! out of the cache, so whether this CPU has it is measured once per
//! process ([`copies_slowly_behind_the_source`]): the same `pread` into
//! memory placed like its source and 16 bytes past that. On the AMD host
//! 256 MiB in 4 MiB steps took 75–96 ms through a placed buffer, 62–83 ms
//! straight into page-aligned memory and 160–210 ms straight into memory
//! 16 bytes past a page; on an Intel Xeon with fast short `rep movsb`
//! (2026-11-28) `fi_read` over shm moved 3.7–4.1 GB/s into memory 16 bytes
//! past a page and 3.9–4.1 GB/s into page-aligned memory.
//!
//! Architecture invariant: nothing here changes what is read, only through
//! which memory it passes.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// Whether the kernel's copy of file bytes at `src_offset` into memory at
/// `dst` is the slow case described in the module documentation: the
/// destination 1 to 31 bytes past the source's place in a page. Measured
/// here, 64 MiB in 4 MiB `pread`s: 1.39–1.55 GB/s at every lag from 1 to
/// 31 bytes, 3.9–5.2 GB/s at 0, 32, 36, 40, 48, 56, 63, 64 and 4095.
pub fn is_slow(dst: *const u8, src_offset: u64) -> bool {
    let lag = (dst as u64).wrapping_sub(src_offset) % PAGE;
    (1..32).contains(&lag)
}

const PAGE: u64 = 4096;

/// The size of the steps a placed read is made in (one checksum chunk).
pub const PLACED_STEP: usize = 4 << 20;

/// Whether reading `len` bytes from file offset `src_offset` into `dst` is
/// worth a [`PlacedBuffer`]: the copy is slow ([`is_slow`]) on this CPU
/// ([`copies_slowly_behind_the_source`]) and the read spans at least two
/// [`PLACED_STEP`]s. A placed buffer's first touch costs about what the
/// slow copy loses on one step (fresh pages: ~0.7 ms per MB here, against
/// ~0.45 ms per MB lost), so shorter reads go directly.
pub fn worth_placing(dst: *const u8, src_offset: u64, len: usize) -> bool {
    worth_placing_on_a_slow_cpu(dst, src_offset, len) && copies_slowly_behind_the_source()
}

/// [`worth_placing`] on a CPU with the weakness, whichever this one is:
/// the addresses and the length alone. For a caller that places for
/// reasons of its own as well (the client's staged shm pulls), and for
/// tests of the placed reads.
pub fn worth_placing_on_a_slow_cpu(dst: *const u8, src_offset: u64, len: usize) -> bool {
    len >= 2 * PLACED_STEP && is_slow(dst, src_offset)
}

/// The environment variable that overrides the measurement of
/// [`copies_slowly_behind_the_source`]: `always` places every slow-case
/// read, `never` none; anything else (or unset) measures.
pub const PLACED_READS_ENV: &str = "ICHECK_PLACED_READS";

/// Checks [`PLACED_READS_ENV`]: unset or one of `auto`, `always`, `never`.
/// The error names the variable and the value, for a process to refuse to
/// start on (the client's `init`, the `icheck` command).
pub fn check_placed_reads_env() -> Result<(), String> {
    match std::env::var(PLACED_READS_ENV) {
        Ok(text) if !["auto", "always", "never"].contains(&text.as_str()) => {
            Err(format!("environment variable {PLACED_READS_ENV}: {text:?} is not one of auto, always, never"))
        }
        _ => Ok(()),
    }
}

/// Whether this CPU's kernel copy is the slow case of [`is_slow`]: measured
/// once per process (a few milliseconds, [`measure_lag_penalty`]) unless
/// [`PLACED_READS_ENV`] says `always` or `never`. Call it early from a
/// thread of its own to keep the measurement off a restore's path.
pub fn copies_slowly_behind_the_source() -> bool {
    static SLOW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SLOW.get_or_init(|| placing_decision(std::env::var(PLACED_READS_ENV).ok().as_deref(), measure_lag_penalty))
}

/// Whether to place slow-case reads, given [`PLACED_READS_ENV`]'s value and
/// a way to measure the penalty (called only when the variable does not
/// decide). A failed measurement places: placing is never wrong, only
/// sometimes slower.
fn placing_decision(forced: Option<&str>, measure: impl FnOnce() -> std::io::Result<f64>) -> bool {
    match forced {
        Some("always") => true,
        Some("never") => false,
        _ => match measure() {
            Ok(penalty) => {
                let slow = penalty > SLOW_PENALTY;
                tracing::debug!(penalty, slow, "measured the kernel copy 16 bytes past its source's place");
                slow
            }
            Err(err) => {
                tracing::debug!(%err, "could not measure the kernel copy; placing reads");
                true
            }
        },
    }
}

/// [`measure_lag_penalty`] above which a CPU counts as having the weakness:
/// the AMD hosts measured about 3, the Intel ones about 1.
const SLOW_PENALTY: f64 = 1.5;

/// The time the kernel takes to copy 1 MiB of page cache into memory 16
/// bytes past the source's place in a page, over the time into memory
/// placed like the source: the fastest of five alternated `pread`s each,
/// so that a busy core slows both sides rather than one.
pub fn measure_lag_penalty() -> std::io::Result<f64> {
    const LEN: usize = 1 << 20;
    const LAG: usize = 16;
    let file = File::from(nix::sys::memfd::memfd_create(c"icheck-copy-probe", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?);
    file.write_all_at(&vec![0x5au8; LEN], 0)?;
    let mut buffer = PlacedBuffer::new(LEN + LAG);
    // Touched, so the timed reads fault in no pages.
    buffer.placed(0, LEN + LAG).fill(1);
    let mut fastest = [std::time::Duration::MAX; 2];
    for _ in 0..5 {
        for (lag, best) in [0, LAG].into_iter().zip(fastest.iter_mut()) {
            let dst = &mut buffer.placed(0, LEN + LAG)[lag..lag + LEN];
            let started = std::time::Instant::now();
            file.read_exact_at(dst, 0)?;
            *best = (*best).min(started.elapsed());
        }
    }
    Ok(fastest[1].as_secs_f64() / fastest[0].as_secs_f64().max(1e-9))
}

/// A buffer of up to `capacity` bytes that [`placed`](Self::placed) hands
/// out at the same offset within a page as the file bytes about to be read
/// into it, so the kernel copies at full speed.
pub struct PlacedBuffer {
    bytes: Vec<u8>,
    capacity: usize,
}

impl PlacedBuffer {
    /// A buffer for reads of up to `capacity` bytes (its pages are touched
    /// only as reads use them).
    pub fn new(capacity: usize) -> PlacedBuffer {
        PlacedBuffer { bytes: vec![0u8; capacity + PAGE as usize], capacity }
    }

    /// `len` bytes (at most the capacity) placed for a read from file
    /// offset `src_offset`.
    pub fn placed(&mut self, src_offset: u64, len: usize) -> &mut [u8] {
        assert!(len <= self.capacity, "a placed read of {len} bytes into a buffer of {}", self.capacity);
        let start = (src_offset.wrapping_sub(self.bytes.as_ptr() as u64) % PAGE) as usize;
        &mut self.bytes[start..start + len]
    }
}

/// The bytes of `file` from its start up to its end or `limit` bytes,
/// whichever comes first (a reader that trusts no size it was told: the
/// allocation follows the file's real length). Long files are read
/// through a [`PlacedBuffer`] when reading straight into the vector would
/// be the slow copy.
pub fn read_to_vec(file: &File, limit: u64) -> std::io::Result<Vec<u8>> {
    const STEP: usize = PLACED_STEP;
    let expected = usize::try_from(file.metadata()?.len().min(limit)).map_err(std::io::Error::other)?;
    // Zeroed by the allocator's fresh pages, which the reads touch first.
    let mut out = vec![0u8; expected];
    let mut bounce = worth_placing(out.as_ptr(), 0, expected).then(|| PlacedBuffer::new(STEP));
    let mut filled = 0usize;
    while (filled as u64) < limit {
        let at = filled as u64;
        // Past the length the file had: look for more a page at a time
        // (nothing, unless it grew meanwhile).
        let want = if filled < expected { (expected - filled).min(STEP) } else { (limit - at).min(PAGE) as usize };
        if filled + want > out.len() {
            out.resize(filled + want, 0);
        }
        let read = match bounce.as_mut() {
            Some(bounce) => {
                let buf = bounce.placed(at, want);
                let read = read_some_at(file, buf, at)?;
                out[filled..filled + read].copy_from_slice(&buf[..read]);
                read
            }
            None => read_some_at(file, &mut out[filled..filled + want], at)?,
        };
        if read == 0 {
            break;
        }
        filled += read;
    }
    out.truncate(filled);
    Ok(out)
}

/// Whether [`evict_from_caches`] can evict on this CPU (x86-64 with
/// `CLFLUSHOPT`, CPUID leaf 7, EBX bit 23).
pub fn can_evict_from_caches() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *CAN.get_or_init(|| {
            // Leaf 7 is read only where the highest leaf (leaf 0's EAX)
            // says it exists.
            let highest = std::arch::x86_64::__cpuid(0).eax;
            highest >= 7 && std::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 23) != 0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Writes back and drops `bytes`' cache lines from every cache
/// (`CLFLUSHOPT` each line, then a fence), so that the next writer of this
/// memory finds no copy of it in another core's cache to invalidate. What
/// the memory holds does not change. Does nothing where
/// [`can_evict_from_caches`] is false.
///
/// Why: a reader thread that writes a staging slot which a checking thread
/// on the other core has just read must first take those lines back from
/// the other core's cache. On this project's virtual machines that costs
/// little at times and at other times makes the reader's copy three times
/// slower, for minutes on end, presumably as the host places the two
/// virtual CPUs near or far from each other (the journal, "Why a pulled
/// restore over shm was sometimes three times slower"). The checker, which has
/// time to spare, evicting the lines itself takes that cost off the reader.
pub fn evict_from_caches(bytes: &[u8]) {
    if !can_evict_from_caches() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let start = bytes.as_ptr() as usize & !(LINE - 1);
        for line in (start..bytes.as_ptr() as usize + bytes.len()).step_by(LINE) {
            // SAFETY: CLFLUSHOPT is supported (checked above); it only
            // writes back and invalidates the cache line holding `line`, an
            // address inside (or in the first line of) `bytes`, which is
            // mapped and borrowed for the call. Memory contents are unchanged.
            unsafe { std::arch::asm!("clflushopt [{}]", in(reg) line, options(nostack, preserves_flags)) };
        }
        // SAFETY: SFENCE orders the flushes before later stores (the slot's
        // hand-back); it touches no memory.
        unsafe { std::arch::asm!("sfence", options(nostack, preserves_flags)) };
    }
}

/// One `pread`, retried when a signal interrupts it.
fn read_some_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<usize> {
    loop {
        match file.read_at(buf, at) {
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// An unlinked file holding `bytes`, for tests that read files.
#[cfg(test)]
pub(crate) fn unlinked_file_with(bytes: &[u8]) -> File {
    use std::io::Write;
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("icheck-core-test-file-{}-{n}", std::process::id()));
    let mut file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file.write_all(bytes).unwrap();
    file
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_destination_just_past_the_source_in_its_page_is_slow() {
        let page = 4096 * 1000;
        assert!(!is_slow(page as *const u8, 0));
        assert!(is_slow((page + 16) as *const u8, 0));
        assert!(is_slow((page + 100) as *const u8, 90));
        assert!(!is_slow((page + 64) as *const u8, 0));
        assert!(is_slow((page + 31) as *const u8, 0));
        assert!(!is_slow((page + 32) as *const u8, 0));
        assert!(!is_slow((page + 16) as *const u8, 32), "a destination before the source");
        assert!(is_slow((page + 16) as *const u8, 4096 * 7));
    }

    #[test]
    fn the_environment_decides_before_any_measurement_and_a_failed_one_places() {
        let unmeasured = || -> std::io::Result<f64> { panic!("measured although the environment decided") };
        assert!(placing_decision(Some("always"), unmeasured));
        assert!(!placing_decision(Some("never"), unmeasured));
        assert!(placing_decision(Some("auto"), || Ok(3.1)), "the AMD hosts' penalty");
        assert!(!placing_decision(None, || Ok(1.02)), "no penalty");
        assert!(placing_decision(None, || Err(std::io::Error::other("no memfd"))));
    }

    #[test]
    fn the_lag_penalty_is_measured_as_a_finite_positive_ratio() {
        let penalty = measure_lag_penalty().unwrap();
        assert!(penalty.is_finite() && penalty > 0.0, "{penalty}");
        eprintln!("the kernel copy 16 bytes past its source here: {penalty:.2}x the placed one");
    }

    #[test]
    fn evicting_from_the_caches_leaves_the_bytes_as_they_were() {
        // Odd lengths and a start inside a cache line: every line is
        // flushed, none past the end is touched, the contents stay.
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 253) as u8).collect();
        for (start, end) in [(0, data.len()), (3, 67), (64, 64), (5, 100_001)] {
            evict_from_caches(&data[start..end]);
        }
        assert!(data.iter().enumerate().all(|(i, b)| *b == (i as u32 * 7 % 253) as u8));
        eprintln!("this CPU can evict from its caches: {}", can_evict_from_caches());
    }

    #[test]
    fn a_placed_buffer_sits_like_its_source_whatever_the_offset() {
        let mut buffer = PlacedBuffer::new(10_000);
        for offset in [0u64, 16, 4095, 4096 + 17, 1 << 40] {
            let placed = buffer.placed(offset, 10_000);
            assert_eq!(placed.len(), 10_000);
            assert_eq!(placed.as_ptr() as u64 % 4096, offset % 4096, "{offset}");
            assert!(!is_slow(placed.as_ptr(), offset));
        }
    }

    #[test]
    fn a_file_is_read_whole_or_up_to_the_limit_however_it_is_copied() {
        for len in [0usize, 5, (4 << 20) - 3, (9 << 20) + 11] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
            let file = unlinked_file_with(&data);
            assert!(read_to_vec(&file, u64::MAX).unwrap() == data, "{len} bytes, no limit");
            assert!(read_to_vec(&file, len as u64 + 1).unwrap() == data, "{len} bytes, limit one past");
            let cut = len / 2;
            assert!(read_to_vec(&file, cut as u64).unwrap() == data[..cut], "{len} bytes, limit {cut}");
        }
    }
}
