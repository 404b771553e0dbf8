//! A two-process RMA check: one process exposes a patterned buffer, the other
//! reads it, verifies every word, and writes a second pattern back, which the
//! first process verifies. `icheck fabric selftest` runs it as a demo; the
//! integration tests and the benchmark run its halves as separate processes.

use std::io::{BufRead, Write};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fabric::{
    Access, AlignedBuffer, Domain, Endpoint, FabricAddress, FabricConfig, ProgressMode, ProgressThread,
    RegisteredBuffer, RemoteRegion, RmaOp, TransferOptions, TransferStats,
};

/// What the target publishes out of band so that an initiator can reach it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TargetAnnouncement {
    /// Provider the target opened (e.g. `tcp;ofi_rxm`).
    pub provider: String,
    /// The target endpoint's address.
    pub address: FabricAddress,
    /// The exposed buffer.
    pub region: RemoteRegion,
}

/// The 64-bit word at `index` of the pattern named by `seed` (splitmix64).
pub fn pattern_word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern of `seed`: word `i` is `pattern_word(seed, i)`
/// in little-endian order, a trailing partial word is truncated.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let index = (buf.len() / 8) as u64;
    let mut words = buf.chunks_exact_mut(8);
    for (index, word) in (&mut words).enumerate() {
        word.copy_from_slice(&pattern_word(seed, index as u64).to_le_bytes());
    }
    let tail = words.into_remainder();
    let bytes = pattern_word(seed, index).to_le_bytes();
    let tail_len = tail.len();
    tail.copy_from_slice(&bytes[..tail_len]);
}

/// Checks `buf` against the pattern of `seed` word by word; on mismatch
/// names the first differing word and both values.
pub fn verify_pattern(buf: &[u8], seed: u64) -> Result<(), String> {
    let mut words = buf.chunks_exact(8);
    for (index, word) in (&mut words).enumerate() {
        let expected = pattern_word(seed, index as u64);
        let got = u64::from_le_bytes(word.try_into().expect("chunks_exact yields 8 bytes"));
        if got != expected {
            return Err(format!(
                "word {index} (byte offset {}): expected {expected:#018x}, found {got:#018x}",
                index * 8
            ));
        }
    }
    let tail = words.remainder();
    let index = buf.len() / 8;
    let expected = &pattern_word(seed, index as u64).to_le_bytes()[..tail.len()];
    if tail != expected {
        return Err(format!("trailing bytes at offset {}: expected {expected:02x?}, found {tail:02x?}", index * 8));
    }
    Ok(())
}

/// The exposing half: a registered, patterned buffer with a progress thread.
pub struct Target {
    buffer: RegisteredBuffer<AlignedBuffer>,
    progress: Option<ProgressThread>,
    endpoint: Endpoint,
}

impl Target {
    /// Opens an endpoint on `config`, registers `size` bytes filled with the
    /// pattern of `seed` for remote read and write, and starts progress.
    pub fn start(config: &FabricConfig, size: usize, seed: u64) -> crate::fabric::Result<Target> {
        let domain = Domain::open(config)?;
        let endpoint = Endpoint::new(&domain)?;
        let mut buffer = AlignedBuffer::zeroed(size);
        fill_pattern(buffer.as_mut_slice(), seed);
        let buffer = endpoint.register(buffer, Access::REMOTE_READ_WRITE)?;
        let progress = ProgressThread::spawn(&endpoint, ProgressMode::Spin)
            .map_err(|err| crate::fabric::FabricError::Config(format!("cannot start progress thread: {err}")))?;
        Ok(Target { buffer, progress: Some(progress), endpoint })
    }

    /// What an initiator needs.
    pub fn announcement(&self) -> TargetAnnouncement {
        TargetAnnouncement {
            provider: self.endpoint.provider().to_string(),
            address: self.endpoint.address().clone(),
            region: self.buffer.remote(),
        }
    }

    /// Verifies the buffer against the pattern of `seed`.
    pub fn verify(&self, seed: u64) -> Result<(), String> {
        verify_pattern(self.buffer.as_slice(), seed)
    }

    /// Serves the line protocol on stdin/stdout until `quit` or end of input:
    /// prints the announcement as one JSON line, then answers `verify SEED`
    /// with `ok` or `mismatch: ...`.
    pub fn serve(mut self, input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
        writeln!(output, "{}", serde_json::to_string(&self.announcement()).expect("announcement serializes"))?;
        output.flush()?;
        for line in input.lines() {
            let line = line?;
            let mut words = line.split_whitespace();
            match (words.next(), words.next().map(str::parse::<u64>)) {
                (Some("verify"), Some(Ok(seed))) => match self.verify(seed) {
                    Ok(()) => writeln!(output, "ok")?,
                    Err(reason) => writeln!(output, "mismatch: {reason}")?,
                },
                (Some("quit"), _) => break,
                _ => writeln!(output, "error: unknown command {line:?} (expected `verify SEED` or `quit`)")?,
            }
            output.flush()?;
        }
        if let Some(progress) = self.progress.take() {
            progress.stop();
        }
        Ok(())
    }
}

/// Why the initiating half failed.
#[derive(Debug, thiserror::Error)]
pub enum SelftestError {
    /// The fabric layer failed.
    #[error(transparent)]
    Fabric(#[from] crate::fabric::FabricError),
    /// The data read differs from the expected pattern.
    #[error("data read from {peer} is wrong: {reason}")]
    Mismatch {
        /// The target's printable address.
        peer: String,
        /// The first difference.
        reason: String,
    },
    /// The region does not fit this process's address space.
    #[error("the target region of {0} bytes does not fit this address space")]
    TooLarge(u64),
}

/// Result of the initiating half.
#[derive(Clone, Copy, Debug)]
pub struct InitiatorReport {
    /// The read of the whole region.
    pub read: TransferStats,
    /// The write of the whole region.
    pub write: TransferStats,
}

/// The initiating half: reads the target's whole region in chunks, verifies
/// it against `read_seed`, and writes the pattern of `write_seed` back.
pub fn run_initiator(
    config: &FabricConfig,
    target: &TargetAnnouncement,
    options: &TransferOptions,
    read_seed: u64,
    write_seed: u64,
) -> Result<InitiatorReport, SelftestError> {
    let domain = Domain::open(config)?;
    let endpoint = Endpoint::new(&domain)?;
    let peer = endpoint.insert_peer(&target.address)?;
    let len = usize::try_from(target.region.len).map_err(|_| SelftestError::TooLarge(target.region.len))?;
    let mut local = endpoint.register(AlignedBuffer::zeroed(len), Access::LOCAL)?;
    let whole = [RmaOp { local_offset: 0, remote: target.region, remote_offset: 0, len }];
    let read = endpoint.read(&peer, local.target(), &whole, options)?;
    verify_pattern(local.as_slice(), read_seed)
        .map_err(|reason| SelftestError::Mismatch { peer: peer.name().to_string(), reason })?;
    fill_pattern(local.as_mut_slice(), write_seed);
    let write = endpoint.write(&peer, local.source(), &whole, options)?;
    Ok(InitiatorReport { read, write })
}

/// Default progress timeout of the self-test.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
