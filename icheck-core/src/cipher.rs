//! Encrypted PFS copies (thesis §6.4.1 lists encryption among the agents'
//! services): AES-256-GCM over a rank file's stored bytes (after
//! compression), in segments, so neither writer nor reader holds a second
//! copy of a whole rank.
//!
//! ```text
//! stored file = segment 0 || segment 1 || ... || segment n-1
//! segment i   = AES-256-GCM(key, nonce = prefix(8) || i (u32 BE),
//!                           aad = "icheck pfs v1", app, version, rank, i, last?)
//!               (SEGMENT plaintext bytes, fewer in the last, + a 16-byte tag)
//! ```
//!
//! The nonce prefix is random per file, so no nonce repeats under one key
//! (files × 2^32 segments). The associated data binds every segment to its
//! application, version, rank and place, and marks the last one: segments
//! swapped, moved to another file, dropped from the end or appended are all
//! refused like flipped bits. A short key check (SHA-256 of the key under
//! its own label) tells a wrong key from tampering, so the error can say
//! which.
//!
//! The key belongs to the application: derived from its capability
//! (`Capability::derive_key` in the credentials module) or supplied by the user;
//! it is never written beside the data.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::fmt;
use std::io::Write;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Plaintext bytes per segment.
pub const SEGMENT: usize = 1 << 20;
/// Bytes of the authentication tag after each segment.
pub const TAG: usize = 16;

/// Why encrypted bytes cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CipherError {
    /// The file is encrypted and no key was given.
    #[error("it is encrypted (AES-256-GCM) and no key was given: the application's capability, or the key it was written with (ICHECK_ENCRYPTION_KEY), is needed")]
    NoKey,
    /// The key is not the one the file was written with.
    #[error("it was encrypted with another key")]
    WrongKey,
    /// A segment fails its authentication tag: changed, moved or cut.
    #[error("segment {segment} fails its authentication tag: the ciphertext was changed, moved or cut")]
    Tampered {
        /// The segment.
        segment: usize,
    },
    /// The stored length cannot be a sequence of segments.
    #[error("{0}")]
    Malformed(String),
    /// The operating system's random source failed.
    #[error("cannot draw a random nonce: {0}")]
    Random(String),
    /// The file has more segments than nonces allow.
    #[error("{0} segments are more than one file may hold")]
    TooLong(usize),
}

/// A 256-bit key for PFS copies. Never printed, never stored with the data.
#[derive(Clone, PartialEq, Eq)]
pub struct PfsKey([u8; 32]);

impl fmt::Debug for PfsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PfsKey(..)")
    }
}

impl PfsKey {
    /// A key from its bytes.
    pub fn new(bytes: [u8; 32]) -> PfsKey {
        PfsKey(bytes)
    }

    /// A key from 64 hex digits (`ICHECK_ENCRYPTION_KEY`).
    pub fn parse_hex(text: &str) -> Result<PfsKey, String> {
        let text = text.trim();
        if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("an encryption key is 64 hex digits (256 bits), e.g. from `openssl rand -hex 32`".into());
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(PfsKey(bytes))
    }

    /// The key's bytes.
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A short public fingerprint that tells this key from another (it
    /// reveals nothing usable of a 256-bit key).
    pub fn check(&self) -> [u8; 8] {
        let digest: [u8; 32] =
            Sha256::new().chain_update(b"icheck pfs key check\0").chain_update(self.0).finalize().into();
        let mut check = [0u8; 8];
        check.copy_from_slice(&digest[..8]);
        check
    }
}

/// How a rank file is encrypted: recorded in its entry in the MANIFEST.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Encryption {
    /// Random per file: the first 8 bytes of every segment's nonce.
    pub nonce_prefix: [u8; 8],
    /// Plaintext bytes per segment.
    pub segment: u32,
    /// [`PfsKey::check`] of the key it was written with.
    pub key_check: [u8; 8],
}

/// Where a file belongs: what every segment's associated data binds.
#[derive(Clone, Copy, Debug)]
pub struct Place<'a> {
    /// Application.
    pub app: &'a str,
    /// Version.
    pub version: u64,
    /// Rank (or SHMR node index).
    pub rank: u32,
}

impl Place<'_> {
    fn aad(&self, index: u32, last: bool) -> Vec<u8> {
        let mut aad = b"icheck pfs v1\0".to_vec();
        aad.extend_from_slice(self.app.as_bytes());
        aad.push(0);
        aad.extend_from_slice(&self.version.to_le_bytes());
        aad.extend_from_slice(&self.rank.to_le_bytes());
        aad.extend_from_slice(&index.to_le_bytes());
        aad.push(u8::from(last));
        aad
    }
}

fn nonce(prefix: &[u8; 8], index: u32) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[..8].copy_from_slice(prefix);
    nonce[8..].copy_from_slice(&index.to_be_bytes());
    nonce
}

/// Encrypts a stream of bytes segment by segment into a writer. A full
/// segment is encrypted only once the next byte (or [`finish`](Self::finish))
/// says whether it is the last.
pub struct Sealer<'a> {
    cipher: Aes256Gcm,
    place: Place<'a>,
    encryption: Encryption,
    index: u32,
    pending: Vec<u8>,
}

impl<'a> Sealer<'a> {
    /// A sealer for the file at `place`, with a fresh random nonce prefix.
    pub fn new(key: &PfsKey, place: Place<'a>) -> Result<Sealer<'a>, CipherError> {
        let mut nonce_prefix = [0u8; 8];
        getrandom::fill(&mut nonce_prefix).map_err(|e| CipherError::Random(e.to_string()))?;
        let segment = u32::try_from(SEGMENT).expect("a segment fits u32");
        let encryption = Encryption { nonce_prefix, segment, key_check: key.check() };
        let cipher = Aes256Gcm::new_from_slice(key.bytes()).expect("a 32-byte key");
        Ok(Sealer { cipher, place, encryption, index: 0, pending: Vec::with_capacity(SEGMENT) })
    }

    /// How the file is encrypted (for its entry).
    pub fn encryption(&self) -> Encryption {
        self.encryption
    }

    /// Adds plaintext; writes every segment known not to be the last.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut impl Write) -> Result<(), std::io::Error> {
        while !bytes.is_empty() {
            if self.pending.len() == SEGMENT {
                self.seal_pending(false, out)?;
            }
            let take = (SEGMENT - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
        Ok(())
    }

    /// Writes the last segment (possibly empty); returns the encryption record.
    pub fn finish(mut self, out: &mut impl Write) -> Result<Encryption, std::io::Error> {
        self.seal_pending(true, out)?;
        Ok(self.encryption)
    }

    fn seal_pending(&mut self, last: bool, out: &mut impl Write) -> Result<(), std::io::Error> {
        let aad = self.place.aad(self.index, last);
        let nonce = nonce(&self.encryption.nonce_prefix, self.index);
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: &self.pending, aad: &aad })
            .map_err(|_| std::io::Error::other("AES-GCM refused to encrypt a segment"))?;
        out.write_all(&sealed)?;
        self.pending.clear();
        self.index = self.index.checked_add(1).ok_or_else(|| std::io::Error::other("too many segments"))?;
        Ok(())
    }
}

/// Encrypts a whole buffer.
pub fn encrypt(key: &PfsKey, place: Place<'_>, plain: &[u8]) -> Result<(Vec<u8>, Encryption), CipherError> {
    let mut out = Vec::with_capacity(plain.len() + (plain.len() / SEGMENT + 1) * TAG);
    let mut sealer = Sealer::new(key, place)?;
    sealer.push(plain, &mut out).map_err(|e| CipherError::Malformed(e.to_string()))?;
    let encryption = sealer.finish(&mut out).map_err(|e| CipherError::Malformed(e.to_string()))?;
    Ok((out, encryption))
}

/// Decrypts a whole stored file written by a [`Sealer`] at `place`.
pub fn decrypt(
    key: Option<&PfsKey>,
    place: Place<'_>,
    encryption: &Encryption,
    stored: &[u8],
) -> Result<Vec<u8>, CipherError> {
    let key = key.ok_or(CipherError::NoKey)?;
    if key.check() != encryption.key_check {
        return Err(CipherError::WrongKey);
    }
    let segment = usize::try_from(encryption.segment).unwrap_or(0);
    if segment == 0 || segment > 64 << 20 {
        return Err(CipherError::Malformed(format!("a segment of {} bytes", encryption.segment)));
    }
    let step = segment + TAG;
    let count = stored.len().div_ceil(step).max(1);
    if stored.len() < TAG || (!stored.len().is_multiple_of(step) && stored.len() % step < TAG) {
        return Err(CipherError::Malformed(format!("{} bytes cannot be whole segments", stored.len())));
    }
    if u32::try_from(count).is_err() {
        return Err(CipherError::TooLong(count));
    }
    let cipher = Aes256Gcm::new_from_slice(key.bytes()).expect("a 32-byte key");
    let mut plain = Vec::with_capacity(stored.len() - count * TAG);
    for (index, sealed) in stored.chunks(step).enumerate() {
        let index32 = u32::try_from(index).map_err(|_| CipherError::TooLong(count))?;
        let aad = place.aad(index32, index + 1 == count);
        let nonce = nonce(&encryption.nonce_prefix, index32);
        let opened = cipher
            .decrypt(Nonce::from_slice(&nonce), Payload { msg: sealed, aad: &aad })
            .map_err(|_| CipherError::Tampered { segment: index })?;
        plain.extend_from_slice(&opened);
    }
    Ok(plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> PfsKey {
        PfsKey::new([byte; 32])
    }

    const PLACE: Place<'static> = Place { app: "app", version: 3, rank: 1 };

    #[test]
    fn round_trips_empty_small_and_multi_segment_data() {
        for len in [0, 1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 2 * SEGMENT + 7] {
            let plain: Vec<u8> = (0..len).map(|i| u8::try_from(i % 251).expect("below 251")).collect();
            let (stored, encryption) = encrypt(&key(1), PLACE, &plain).unwrap();
            assert_eq!(stored.len(), len + len.div_ceil(SEGMENT).max(1) * TAG, "len {len}");
            assert_eq!(decrypt(Some(&key(1)), PLACE, &encryption, &stored).unwrap(), plain, "len {len}");
        }
    }

    #[test]
    fn a_wrong_key_a_missing_key_and_changed_bytes_are_refused_by_name() {
        let plain = vec![42u8; SEGMENT + 100];
        let (stored, encryption) = encrypt(&key(1), PLACE, &plain).unwrap();
        assert_eq!(decrypt(Some(&key(2)), PLACE, &encryption, &stored), Err(CipherError::WrongKey));
        assert_eq!(decrypt(None, PLACE, &encryption, &stored), Err(CipherError::NoKey));
        let mut flipped = stored.clone();
        flipped[SEGMENT + TAG + 5] ^= 1;
        assert_eq!(decrypt(Some(&key(1)), PLACE, &encryption, &flipped), Err(CipherError::Tampered { segment: 1 }));
        // Another place (a rank file copied into another rank's name).
        let other = Place { rank: 2, ..PLACE };
        assert_eq!(decrypt(Some(&key(1)), other, &encryption, &stored), Err(CipherError::Tampered { segment: 0 }));
        // Cut at a segment boundary: the first segment was not the last.
        let cut = &stored[..SEGMENT + TAG];
        assert_eq!(decrypt(Some(&key(1)), PLACE, &encryption, cut), Err(CipherError::Tampered { segment: 0 }));
        // Segments swapped.
        let (a, b) = stored.split_at(SEGMENT + TAG);
        let swapped = [b, a].concat();
        assert!(decrypt(Some(&key(1)), PLACE, &encryption, &swapped).is_err());
        assert!(matches!(decrypt(Some(&key(1)), PLACE, &encryption, &stored[..3]), Err(CipherError::Malformed(_))));
    }

    #[test]
    fn every_file_gets_its_own_nonces() {
        let (a, ea) = encrypt(&key(1), PLACE, b"same bytes").unwrap();
        let (b, eb) = encrypt(&key(1), PLACE, b"same bytes").unwrap();
        assert_ne!(ea.nonce_prefix, eb.nonce_prefix);
        assert_ne!(a, b);
    }

    #[test]
    fn hex_keys_are_checked() {
        assert!(PfsKey::parse_hex(&"ab".repeat(32)).is_ok());
        assert!(PfsKey::parse_hex("abcd").is_err());
        assert!(PfsKey::parse_hex(&"zz".repeat(32)).is_err());
        assert_eq!(format!("{:?}", key(1)), "PfsKey(..)");
    }
}
