//! Shared pieces of the example applications: the deterministic contents
//! they checkpoint, so a restarted run can check every restored byte, and
//! their log set-up.

/// A word of the pattern for (rank, step, index): splitmix64 of the three.
pub fn pattern_word(rank: u32, step: u64, index: u64) -> u64 {
    let mut z = (u64::from(rank) << 48 ^ step << 32 ^ index).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills bytes with the pattern of (rank, step).
pub fn fill_bytes(out: &mut [u8], rank: u32, step: u64) {
    for (index, chunk) in out.chunks_mut(8).enumerate() {
        let word = pattern_word(rank, step, index as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Index of the first byte that differs from the pattern of (rank, step).
pub fn first_mismatch(data: &[u8], rank: u32, step: u64) -> Option<usize> {
    data.chunks(8).enumerate().find_map(|(index, chunk)| {
        let word = pattern_word(rank, step, index as u64).to_le_bytes();
        let bad = chunk.iter().zip(word).position(|(a, b)| *a != b)?;
        Some(index * 8 + bad)
    })
}

/// Sends this process's `tracing` log to stderr, filtered by `ICHECK_LOG`
/// as the daemons' is; without it, by `default`, or not at all when that
/// is `None` (a benchmark rank, whose stderr the benchmark reads).
pub fn log_to_stderr(default: Option<&str>) {
    let Some(filter) = std::env::var("ICHECK_LOG").ok().or_else(|| default.map(str::to_string)) else {
        return;
    };
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_differs_between_steps() {
        let mut data = vec![0u8; 1001];
        fill_bytes(&mut data, 3, 7);
        assert_eq!(first_mismatch(&data, 3, 7), None);
        assert!(first_mismatch(&data, 3, 8).is_some());
        data[1000] ^= 1;
        assert_eq!(first_mismatch(&data, 3, 7), Some(1000));
    }
}
