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
//! On a CPU without the weakness a placed read costs one extra copy out of
//! the cache: 256 MiB in 4 MiB steps took 75–96 ms through a placed buffer
//! against 62–83 ms straight into page-aligned memory here, and 160–210 ms
//! straight into memory 16 bytes past a page.
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
/// worth a [`PlacedBuffer`]: the copy is slow ([`is_slow`]) and the read
/// spans at least two [`PLACED_STEP`]s. A placed buffer's first touch costs
/// about what the slow copy loses on one step (fresh pages: ~0.7 ms per MB
/// here, against ~0.45 ms per MB lost), so shorter reads go directly.
pub fn worth_placing(dst: *const u8, src_offset: u64, len: usize) -> bool {
    len >= 2 * PLACED_STEP && is_slow(dst, src_offset)
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
