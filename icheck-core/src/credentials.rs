//! Who may do what: the service's tokens, each application's capability,
//! and the client-side store that keeps capabilities between runs.
//!
//! * A **token** admits a peer to a port and says what it may ask: the
//!   client token lets an application register, the admin token adds the
//!   operators' commands, the node token admits managers and standby
//!   controllers. No token opens an application's data.
//! * A **capability** is a random secret the controller hands out when an
//!   application registers for the first time. Every later request about
//!   the application (restart, commit records, probes, finalize) and every
//!   agent session presents it. The service keeps only its
//!   [`Verifier`] (a SHA-256 digest), so neither the journal nor an agent
//!   holds the secret itself.
//! * The [`CapabilityStore`] keeps an application's capability in a file
//!   only its owner can read, so a restarted job proves it is the same owner.
//!
//! Every comparison of secrets is constant-time ([`subtle`]), over digests
//! of equal length, so neither content nor length leaks through timing.

#![forbid(unsafe_code)]

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Random bytes in a capability (128 bits).
pub const CAPABILITY_BYTES: usize = 16;

/// Token values that are placeholders, never secrets (the sample
/// configuration's `change-me`): daemons refuse them.
const PLACEHOLDERS: &[&str] = &["change-me", "changeme", "secret", "token"];

/// Errors of credentials and the capability store.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// The operating system's random source failed.
    #[error("cannot draw random bytes for a capability: {0}")]
    Random(String),
    /// A capability is not the hex text of at least 128 bits.
    #[error("{what} is not a capability (expected {} hex digits)", CAPABILITY_BYTES * 2)]
    Malformed {
        /// Where it came from.
        what: String,
    },
    /// A capability file or its directory could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A capability file others can read: it no longer proves anything.
    #[error(
        "{path} holds a capability but has mode {mode:o}: others can read it; `chmod 600` it if nobody did, \
         else ask an administrator to delete the application"
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

/// SHA-256 of `bytes` under a purpose label (so a digest made for one use
/// never matches one made for another).
fn digest(purpose: &[u8], bytes: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(purpose);
    hasher.update([0u8]);
    hasher.update(bytes);
    hasher.finalize().into()
}

/// Whether two secrets are equal, in time that depends on neither: both
/// are digested first, so even their lengths stay hidden.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    let (a, b) = (digest(b"icheck compare", a.as_bytes()), digest(b"icheck compare", b.as_bytes()));
    a.ct_eq(&b).into()
}

/// Why `token` cannot be used as the secret `key` (empty or a placeholder).
pub fn weak_token(token: &str) -> Option<&'static str> {
    let trimmed = token.trim();
    if trimmed.is_empty() {
        return Some("is empty");
    }
    if PLACEHOLDERS.iter().any(|p| trimmed.eq_ignore_ascii_case(p)) {
        return Some("is a placeholder, not a secret");
    }
    None
}

/// The effective Unix user id of this process (what a client reports
/// when it registers).
pub fn current_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Fresh random hex text of `bytes` bytes, from the operating system.
pub fn random_hex(bytes: usize) -> Result<String, CredentialError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| CredentialError::Random(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The secret that proves ownership of one application.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability(String);

impl fmt::Debug for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never in logs: debug output shows only that one is present.
        f.write_str("Capability(..)")
    }
}

impl Capability {
    /// A new capability, from the operating system's random source.
    pub fn generate() -> Result<Capability, CredentialError> {
        random_hex(CAPABILITY_BYTES).map(Capability)
    }

    /// Parses capability text (`what` names where it came from, for errors).
    pub fn parse(text: &str, what: &str) -> Result<Capability, CredentialError> {
        let text = text.trim();
        let hex = text.len().is_multiple_of(2) && text.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex || text.len() < CAPABILITY_BYTES * 2 || text.len() > 256 {
            return Err(CredentialError::Malformed { what: what.to_string() });
        }
        Ok(Capability(text.to_ascii_lowercase()))
    }

    /// The secret text (what is sent to the service).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What the service keeps to check it.
    pub fn verifier(&self) -> Verifier {
        Verifier::of(&self.0)
    }

    /// A 256-bit key for `purpose`, derived from the capability (the
    /// capability is 128 random bits; the purpose keeps keys apart).
    pub fn derive_key(&self, purpose: &str) -> [u8; 32] {
        digest(format!("icheck key {purpose}").as_bytes(), self.0.as_bytes())
    }
}

/// The digest of a capability: what the controller journals and agents
/// hold. It checks a presented capability and cannot be turned back into one.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verifier([u8; 32]);

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.0[..4].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "Verifier({head}..)")
    }
}

impl Verifier {
    fn of(capability: &str) -> Verifier {
        Verifier(digest(b"icheck capability", capability.as_bytes()))
    }

    /// Whether `presented` is the capability this verifier was made from
    /// (constant-time).
    pub fn admits(&self, presented: &str) -> bool {
        Verifier::of(presented.trim()).0.ct_eq(&self.0).into()
    }
}

/// Who owns an application: the digest of its capability and the Unix
/// user that registered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// Checks the capability.
    pub verifier: Verifier,
    /// The registering client's Unix user id.
    pub uid: u32,
}

/// A short name for the service a client talks to, derived from its client
/// token: capabilities of different services (or of tests running side by
/// side) never share a file.
fn service_key(client_token: &str) -> String {
    digest(b"icheck service", client_token.as_bytes())[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to `path` so that only its owner can read it (mode
/// 0600 from creation on, never wider), replacing it atomically.
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), CredentialError> {
    let io = |action, source| CredentialError::Io { action, path: path.to_path_buf(), source };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io("cannot create", e))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| io("cannot write", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("cannot rename into place", e))
}

/// Where applications keep their capabilities for one service: a
/// directory per service (named after its client token) under the
/// capability directory, a file per application, readable by their owner only.
#[derive(Clone, Debug)]
pub struct CapabilityStore {
    dir: PathBuf,
}

impl CapabilityStore {
    /// The store of the service admitting `client_token`, under `base`.
    pub fn for_service(base: impl Into<PathBuf>, client_token: &str) -> CapabilityStore {
        CapabilityStore { dir: base.into().join(service_key(client_token)) }
    }

    /// The default directory: `$HOME/.icheck/capabilities`, or
    /// `.icheck/capabilities` in the working directory without a home.
    pub fn default_dir() -> PathBuf {
        let base = std::env::var_os("HOME").filter(|h| !h.is_empty()).map_or_else(|| PathBuf::from("."), PathBuf::from);
        base.join(".icheck").join("capabilities")
    }

    /// The service's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `app`'s capability.
    pub fn path(&self, app: &str) -> PathBuf {
        self.dir.join(format!("{app}.capability"))
    }

    /// `app`'s capability, if one was saved. A file others can read is
    /// refused: it no longer proves ownership.
    pub fn load(&self, app: &str) -> Result<Option<Capability>, CredentialError> {
        let path = self.path(app);
        let io = |action, source| CredentialError::Io { action, path: path.clone(), source };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(io("cannot read", err)),
        };
        let mode = std::fs::metadata(&path).map_err(|e| io("cannot inspect", e))?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(CredentialError::Exposed { path, mode: mode & 0o777 });
        }
        Capability::parse(&text, &path.display().to_string()).map(Some)
    }

    /// Saves `app`'s capability (directories 0700, the file 0600).
    pub fn save(&self, app: &str, capability: &Capability) -> Result<PathBuf, CredentialError> {
        let path = self.path(app);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|source| CredentialError::Io { action: "cannot create", path: self.dir.clone(), source })?;
        write_private(&path, format!("{}\n", capability.expose()).as_bytes())?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capability_is_128_random_bits_and_only_its_own_verifier_admits_it() {
        let a = Capability::generate().unwrap();
        let b = Capability::generate().unwrap();
        assert_eq!(a.expose().len(), CAPABILITY_BYTES * 2);
        assert_ne!(a, b);
        assert!(a.verifier().admits(a.expose()));
        assert!(!a.verifier().admits(b.expose()));
        assert!(!a.verifier().admits(""));
        assert!(!a.verifier().admits(&a.expose()[..31]));
        assert_eq!(format!("{a:?}"), "Capability(..)", "never printed");
    }

    #[test]
    fn capability_text_is_checked() {
        assert!(Capability::parse("00112233445566778899aabbccddeeff\n", "f").is_ok());
        assert!(Capability::parse("0011", "f").is_err(), "too short");
        assert!(Capability::parse("zz112233445566778899aabbccddeeff", "f").is_err(), "not hex");
        assert!(Capability::parse(&"a".repeat(300), "f").is_err(), "too long");
    }

    #[test]
    fn secrets_compare_by_content_only() {
        assert!(secrets_equal("s3cret", "s3cret"));
        assert!(!secrets_equal("s3cret", "s3cret1"));
        assert!(!secrets_equal("", "x"));
    }

    #[test]
    fn placeholders_and_empty_tokens_are_weak() {
        assert!(weak_token("").is_some());
        assert!(weak_token("  ").is_some());
        assert!(weak_token("change-me").is_some());
        assert!(weak_token("CHANGE-ME").is_some());
        assert!(weak_token("5f0c2a").is_none());
    }

    #[test]
    fn the_store_keeps_capabilities_private_and_refuses_exposed_ones() {
        let dir = std::env::temp_dir().join(format!("icheck-cap-test-{}", std::process::id()));
        let store = CapabilityStore::for_service(&dir, "token");
        assert!(store.load("app").unwrap().is_none());
        let cap = Capability::generate().unwrap();
        let path = store.save("app", &cap).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(store.load("app").unwrap(), Some(cap.clone()));
        let other = CapabilityStore::for_service(&dir, "other");
        assert!(other.load("app").unwrap().is_none(), "per service");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = store.load("app").unwrap_err().to_string();
        assert!(err.contains("others can read") && err.contains("app.capability"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn derived_keys_differ_by_purpose_and_capability() {
        let a = Capability::generate().unwrap();
        let b = Capability::generate().unwrap();
        assert_ne!(a.derive_key("pfs"), a.derive_key("other"));
        assert_ne!(a.derive_key("pfs"), b.derive_key("pfs"));
        assert_eq!(a.derive_key("pfs"), a.derive_key("pfs"));
    }
}
