//! Deterministic byte patterns: what agents expose in their probe regions
//! (so a client can check it reached the right agent) and what the fabric
//! self-test and benchmarks move and verify word by word.

#![forbid(unsafe_code)]

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
