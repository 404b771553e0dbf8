//! The PFS level's on-disk format: one format for version copies written by
//! agents and for versions the library writes directly when the service is
//! unreachable (issue 6 builds the writers on it).
//!
//! ```text
//! <pfs_dir>/<app>/v<V>.partial/       a version being written (never read)
//! <pfs_dir>/<app>/v<V>/rank<R>.data   one process's (MR) or node's (SHMR) bytes, raw or zstd,
//!                                     then encrypted when the store has a key (see `cipher`)
//! <pfs_dir>/<app>/v<V>/MANIFEST       PfsManifest (bincode, with the mode that decides the
//!                                     files' layout), written last
//! <pfs_dir>/<app>/OWNER               who owns the application (its capability's verifier
//!                                     and uid, never the capability), mode 0600
//! ```
//!
//! Architecture invariant: a version directory without the `.partial`
//! suffix always holds its MANIFEST, because the MANIFEST is written (and
//! synced) inside `v<V>.partial`, which is then renamed as a whole. Readers
//! only look at renamed directories, so a half-written version is never
//! taken for a complete one; every byte read back is checked against the
//! stored checksums, and every error names the file.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cipher::{self, CipherError, Encryption, PfsKey, Place, Sealer};
use crate::credentials::Owner;
use crate::format::{self, check_app_name, FormatError, Manifest, TransferMode, VersionRecord};

/// Complete versions kept per application: the newest, and the one before
/// it, so a restart survives a newest version damaged on disk.
pub const KEEP_VERSIONS: usize = 2;

/// Name of the file that makes a version directory complete.
pub const MANIFEST: &str = "MANIFEST";
/// Name of the file recording an application's owner.
pub const OWNER: &str = "OWNER";

/// How a rank's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    /// As they are.
    None,
    /// zstd at this level.
    Zstd {
        /// Compression level (1 fast ... 19 small).
        level: i32,
    },
}

/// When agents compress an application's PFS copies (per application, from
/// its `[client] compression` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompressionPolicy {
    /// Never: copies are stored raw.
    Never,
    /// Every copy, with zstd at this level.
    Always {
        /// zstd level.
        level: i32,
    },
    /// Versions of at least the service's `max_cp_size` bytes (the thesis's
    /// MAX_CP_SIZE), with zstd at this level; smaller ones are stored raw.
    Large {
        /// zstd level.
        level: i32,
    },
}

impl CompressionPolicy {
    /// How to store a version of `bytes` (over all ranks) when the service
    /// compresses from `max_cp_size` bytes on.
    pub fn for_version(self, bytes: u64, max_cp_size: u64) -> Compression {
        match self {
            CompressionPolicy::Never => Compression::None,
            CompressionPolicy::Always { level } => Compression::Zstd { level },
            CompressionPolicy::Large { level } if bytes >= max_cp_size => Compression::Zstd { level },
            CompressionPolicy::Large { .. } => Compression::None,
        }
    }
}

/// One rank's (or node's) file in a version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    /// The rank's manifest: labels, types, sizes, per-label checksums.
    pub manifest: Manifest,
    /// File name inside the version directory.
    pub file: String,
    /// Bytes in the file (compressed size when compressed).
    pub stored_len: u64,
    /// How the bytes are stored.
    pub compression: Compression,
    /// crc32c of the file's bytes as stored.
    pub file_crc: u32,
    /// How the stored bytes are encrypted (after compression), if they are.
    pub encryption: Option<Encryption>,
}

/// A complete version on the PFS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PfsManifest {
    /// Application name.
    pub app: String,
    /// Version number.
    pub version: u64,
    /// Process count the version was written with.
    pub ranks: u32,
    /// Who wrote it ("agents" or "library").
    pub writer: String,
    /// One entry per file.
    pub entries: Vec<RankEntry>,
    /// How the files divide the version: one per process (MR) or one per
    /// node, holding its processes' labels as `<rank>/<label>` (SHMR). A
    /// run restores only a version of its own mode. `None`: written by
    /// agents before the manifest recorded it (2026-12-04), not known.
    pub mode: Option<TransferMode>,
}

/// [`PfsManifest`] as written before it recorded the mode: read so that
/// older copies still restart.
#[derive(Deserialize)]
struct PfsManifestWithoutMode {
    app: String,
    version: u64,
    ranks: u32,
    writer: String,
    entries: Vec<RankEntry>,
}

impl From<PfsManifestWithoutMode> for PfsManifest {
    fn from(old: PfsManifestWithoutMode) -> PfsManifest {
        // The library's writer kept one file per process in either mode.
        let mode = (old.writer == "library").then_some(TransferMode::Mr);
        PfsManifest {
            app: old.app,
            version: old.version,
            ranks: old.ranks,
            writer: old.writer,
            entries: old.entries,
            mode,
        }
    }
}

/// What writing one rank cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WriteStats {
    /// Bytes before compression.
    pub raw: u64,
    /// Bytes written.
    pub stored: u64,
    /// Time spent compressing.
    pub compress: Duration,
    /// Time spent writing and syncing.
    pub write: Duration,
}

impl WriteStats {
    /// raw / stored (1.0 when nothing was written).
    pub fn ratio(&self) -> f64 {
        compression_ratio(self.raw, self.stored)
    }
}

/// Raw bytes per stored byte; 1.0 when nothing was stored.
pub fn compression_ratio(raw: u64, stored: u64) -> f64 {
    if stored == 0 {
        1.0
    } else {
        raw as f64 / stored as f64
    }
}

/// Why the PFS level failed; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum PfsError {
    /// A file operation failed.
    #[error("{what} {path}: {error}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
    /// A file's contents are not what its manifest says.
    #[error("{path} is damaged: {reason}")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The application name cannot be a directory name.
    #[error(transparent)]
    Name(#[from] FormatError),
    /// An encrypted file cannot be decrypted: no key, another key, or
    /// ciphertext that was changed.
    #[error("{path}: {source}")]
    Encrypted {
        /// The file.
        path: PathBuf,
        /// Why.
        source: CipherError,
    },
    /// The version has no file for this rank.
    #[error("version {version} in {dir} has no data for rank {rank}")]
    MissingRank {
        /// The version directory.
        dir: PathBuf,
        /// Version.
        version: u64,
        /// Rank.
        rank: u32,
    },
}

type Result<T> = std::result::Result<T, PfsError>;

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PfsError + 'a {
    move |error| PfsError::Io { what, path: path.to_path_buf(), error }
}

/// One rank's data file being written piece by piece (see
/// [`PfsStore::create_spill`]); [`SpillFile::finish`] makes it part of the
/// partial version.
#[derive(Debug)]
pub struct SpillFile {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
    entry: PathBuf,
    /// Encrypts the finished file (pieces arrive at any offset, so the
    /// file is sealed in one pass at the end).
    key: Option<PfsKey>,
}

impl SpillFile {
    /// Writes `bytes` at `offset`.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(bytes, offset).map_err(io("cannot write", &self.tmp))
    }

    /// Syncs the file, checksums it as stored, and leaves it and its entry
    /// in the partial version; returns the entry.
    pub fn finish(self, manifest: &Manifest) -> Result<RankEntry> {
        self.file.sync_all().map_err(io("cannot sync", &self.tmp))?;
        // Pieces may arrive in any order: the file checksum is taken from
        // what is on disk (still in the page cache), in one pass.
        let mut crc = 0u32;
        let mut reader =
            std::io::BufReader::with_capacity(4 << 20, File::open(&self.tmp).map_err(io("cannot read", &self.tmp))?);
        let mut len = 0u64;
        loop {
            let buf = std::io::BufRead::fill_buf(&mut reader).map_err(io("cannot read", &self.tmp))?;
            if buf.is_empty() {
                break;
            }
            crc = crc32c::crc32c_append(crc, buf);
            let n = buf.len();
            len += n as u64;
            std::io::BufRead::consume(&mut reader, n);
        }
        if len != manifest.total_len {
            return Err(PfsError::Damaged {
                path: self.tmp.clone(),
                reason: format!("{len} bytes, the manifest says {}", manifest.total_len),
            });
        }
        let file = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let Some(key) = &self.key else {
            fs::rename(&self.tmp, &self.path).map_err(io("cannot rename into", &self.path))?;
            return record_raw_entry(&self.entry, manifest, file, len, crc, None);
        };
        // Sealed into a second file in one streaming pass, then the plain one goes.
        let place = Place { app: &manifest.app, version: manifest.version, rank: manifest.rank };
        let sealing = self.tmp.with_extension("sealing");
        let mut reader =
            std::io::BufReader::with_capacity(4 << 20, File::open(&self.tmp).map_err(io("cannot read", &self.tmp))?);
        let mut out = Counted::new(std::io::BufWriter::with_capacity(
            4 << 20,
            File::create(&sealing).map_err(io("cannot create", &sealing))?,
        ));
        let mut sealer =
            Sealer::new(key, place).map_err(|e| PfsError::Encrypted { path: sealing.clone(), source: e })?;
        loop {
            let buf = std::io::BufRead::fill_buf(&mut reader).map_err(io("cannot read", &self.tmp))?;
            if buf.is_empty() {
                break;
            }
            sealer.push(buf, &mut out).map_err(io("cannot write", &sealing))?;
            let n = buf.len();
            std::io::BufRead::consume(&mut reader, n);
        }
        let encryption = sealer.finish(&mut out).map_err(io("cannot write", &sealing))?;
        let (stored_len, stored_crc) = out.close(&sealing)?;
        fs::rename(&sealing, &self.path).map_err(io("cannot rename into", &self.path))?;
        let _ = fs::remove_file(&self.tmp);
        record_raw_entry(&self.entry, manifest, file, stored_len, stored_crc, Some(encryption))
    }
}

/// A writer that counts and checksums what passes through it.
struct Counted<W: Write> {
    inner: W,
    crc: u32,
    len: u64,
}

impl<W: Write> Counted<W> {
    fn new(inner: W) -> Counted<W> {
        Counted { inner, crc: 0, len: 0 }
    }
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl Counted<std::io::BufWriter<File>> {
    /// Flushes and syncs the file at `path`; its length and checksum.
    fn close(self, path: &Path) -> Result<(u64, u32)> {
        let (len, crc) = (self.len, self.crc);
        let file = self.inner.into_inner().map_err(|e| PfsError::Io {
            what: "cannot write",
            path: path.to_path_buf(),
            error: e.into_error(),
        })?;
        file.sync_all().map_err(io("cannot sync", path))?;
        Ok((len, crc))
    }
}

/// A PFS directory holding applications' versions.
#[derive(Clone, Debug)]
pub struct PfsStore {
    root: PathBuf,
    /// Encrypts what this store writes and decrypts what it reads (an
    /// application's key; never stored).
    key: Option<PfsKey>,
}

impl PfsStore {
    /// The PFS level under `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> PfsStore {
        PfsStore { root: root.into(), key: None }
    }

    /// The same level, writing encrypted copies with `key` (and reading
    /// them back with it); `None`: plain copies, and encrypted ones refused.
    pub fn with_key(mut self, key: Option<PfsKey>) -> PfsStore {
        self.key = key;
        self
    }

    /// Whether this store encrypts what it writes.
    pub fn encrypts(&self) -> bool {
        self.key.is_some()
    }

    /// The directory the level lives in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn app_dir(&self, app: &str) -> Result<PathBuf> {
        check_app_name(app)?;
        Ok(self.root.join(app))
    }

    /// Directory of a complete version.
    pub fn version_dir(&self, app: &str, version: u64) -> Result<PathBuf> {
        Ok(self.app_dir(app)?.join(format!("v{version}")))
    }

    fn partial_dir(&self, app: &str, version: u64) -> Result<PathBuf> {
        Ok(self.app_dir(app)?.join(format!("v{version}.partial")))
    }

    /// Writes one rank's bytes into the partial version (creating it);
    /// `data` is the rank's whole data, `manifest` describes it.
    pub fn write_rank(
        &self,
        manifest: &Manifest,
        data: &[u8],
        compression: Compression,
    ) -> Result<(RankEntry, WriteStats)> {
        let dir = self.partial_dir(&manifest.app, manifest.version)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let file = format!("rank{}.data", manifest.rank);
        let path = dir.join(&file);
        let started = Instant::now();
        let compressed;
        let stored: &[u8] = match compression {
            Compression::None => data,
            Compression::Zstd { level } => {
                compressed = zstd::bulk::compress(data, level).map_err(io("cannot compress for", &path))?;
                &compressed
            }
        };
        let sealed;
        let (stored, encryption): (&[u8], _) = match &self.key {
            None => (stored, None),
            Some(key) => {
                let place = Place { app: &manifest.app, version: manifest.version, rank: manifest.rank };
                let (bytes, encryption) = cipher::encrypt(key, place, stored)
                    .map_err(|e| PfsError::Encrypted { path: path.clone(), source: e })?;
                sealed = bytes;
                (&sealed, Some(encryption))
            }
        };
        let compress = started.elapsed();
        let started = Instant::now();
        let tmp = dir.join(format!("{file}.tmp"));
        let mut out = File::create(&tmp).map_err(io("cannot create", &tmp))?;
        out.write_all(stored).and_then(|_| out.sync_all()).map_err(io("cannot write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io("cannot rename into", &path))?;
        let stats =
            WriteStats { raw: data.len() as u64, stored: stored.len() as u64, compress, write: started.elapsed() };
        let entry = RankEntry {
            manifest: manifest.clone(),
            file,
            stored_len: stored.len() as u64,
            compression,
            file_crc: crate::format::crc32c(stored),
            encryption,
        };
        Ok((entry, stats))
    }

    /// Writes one rank's labels (`parts`, back to back, uncompressed) into
    /// the partial version without joining them in memory first, plus the
    /// rank's entry file, so whoever completes the version can collect the
    /// entries from the file system (the library's fallback writers).
    pub fn write_rank_parts(&self, manifest: &Manifest, parts: &[&[u8]]) -> Result<(RankEntry, WriteStats)> {
        let dir = self.partial_dir(&manifest.app, manifest.version)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let file = format!("rank{}.data", manifest.rank);
        let path = dir.join(&file);
        let started = Instant::now();
        let tmp = dir.join(format!("{file}.tmp"));
        let mut out = Counted::new(std::io::BufWriter::with_capacity(
            4 << 20,
            File::create(&tmp).map_err(io("cannot create", &tmp))?,
        ));
        let raw: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let encryption = match &self.key {
            None => {
                for part in parts {
                    out.write_all(part).map_err(io("cannot write", &tmp))?;
                }
                None
            }
            Some(key) => {
                let place = Place { app: &manifest.app, version: manifest.version, rank: manifest.rank };
                let mut sealer =
                    Sealer::new(key, place).map_err(|e| PfsError::Encrypted { path: tmp.clone(), source: e })?;
                for part in parts {
                    sealer.push(part, &mut out).map_err(io("cannot write", &tmp))?;
                }
                Some(sealer.finish(&mut out).map_err(io("cannot write", &tmp))?)
            }
        };
        let (len, crc) = out.close(&tmp)?;
        fs::rename(&tmp, &path).map_err(io("cannot rename into", &path))?;
        let entry_path = dir.join(format!("rank{}.entry", manifest.rank));
        let entry = record_raw_entry(&entry_path, manifest, file, len, crc, encryption)?;
        let stats = WriteStats { raw, stored: len, compress: Duration::ZERO, write: started.elapsed() };
        Ok((entry, stats))
    }

    /// Starts one rank's file in the partial version for bytes that arrive
    /// piece by piece, at any offset (an agent spilling a version it cannot
    /// hold in memory).
    pub fn create_spill(&self, app: &str, version: u64, rank: u32, len: u64) -> Result<SpillFile> {
        let dir = self.partial_dir(app, version)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let path = dir.join(format!("rank{rank}.data"));
        let tmp = dir.join(format!("rank{rank}.data.tmp"));
        let file = File::create(&tmp).map_err(io("cannot create", &tmp))?;
        file.set_len(len).map_err(io("cannot size", &tmp))?;
        Ok(SpillFile { file, tmp, path, entry: dir.join(format!("rank{rank}.entry")), key: self.key.clone() })
    }

    /// A rank's entry left in a partial version (by a spilling agent or a
    /// fallback writer), if there is one; the entry file is consumed.
    pub fn take_partial_entry(&self, app: &str, version: u64, rank: u32) -> Result<Option<RankEntry>> {
        let path = self.partial_dir(app, version)?.join(format!("rank{rank}.entry"));
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(PfsError::Io { what: "cannot read", path, error }),
        };
        let entry = decode_entry(&path, &bytes)?;
        let _ = fs::remove_file(&path);
        Ok(Some(entry))
    }

    /// Reads and verifies one rank of a version that is not complete yet
    /// (its entry still in the partial directory): a restart right after a
    /// spilled commit, before the other agents' copies completed it.
    pub fn read_partial_rank(&self, app: &str, version: u64, rank: u32) -> Result<(Manifest, Vec<u8>)> {
        let dir = self.partial_dir(app, version)?;
        let path = dir.join(format!("rank{rank}.entry"));
        let bytes = fs::read(&path).map_err(io("cannot read", &path))?;
        read_entry(&dir, &decode_entry(&path, &bytes)?, self.key.as_ref())
    }

    /// The entries `write_rank_parts` left for ranks `0..ranks` of a partial version.
    pub fn partial_entries(&self, app: &str, version: u64, ranks: u32) -> Result<Vec<RankEntry>> {
        let dir = self.partial_dir(app, version)?;
        (0..ranks)
            .map(|rank| {
                let path = dir.join(format!("rank{rank}.entry"));
                let bytes = fs::read(&path).map_err(io("cannot read", &path))?;
                let entry = decode_entry(&path, &bytes)?;
                let _ = fs::remove_file(&path);
                Ok(entry)
            })
            .collect()
    }

    /// Completes a version whose ranks are all written: the MANIFEST goes
    /// in last, then the directory is renamed into place, then complete
    /// versions older than the newest [`KEEP_VERSIONS`] are deleted (the new
    /// one replaces them only now). A version older than the newest complete
    /// one is dropped instead. `ranks` is the process count that wrote it,
    /// `mode` how its `entries` divide it (see [`PfsManifest::mode`]).
    pub fn complete(
        &self,
        app: &str,
        version: u64,
        ranks: u32,
        writer: &str,
        mode: TransferMode,
        entries: Vec<RankEntry>,
    ) -> Result<()> {
        let partial = self.partial_dir(app, version)?;
        if self.latest(app)?.is_some_and(|newest| newest > version) {
            // A newer version completed first: this one is already superseded.
            let _ = fs::remove_dir_all(&partial);
            return Ok(());
        }
        let manifest =
            PfsManifest { app: app.to_string(), version, ranks, writer: writer.to_string(), entries, mode: Some(mode) };
        let bytes = bincode_encode(&manifest, &partial)?;
        let tmp = partial.join(format!("{MANIFEST}.tmp"));
        let mut out = File::create(&tmp).map_err(io("cannot create", &tmp))?;
        out.write_all(&bytes).and_then(|_| out.sync_all()).map_err(io("cannot write", &tmp))?;
        // A crash at either failpoint leaves a partial directory: never
        // served, and completed again by the next copy of the version.
        crate::failpoint::hit("pfs.before_manifest_rename");
        fs::rename(&tmp, partial.join(MANIFEST)).map_err(io("cannot rename into", &partial))?;
        let done = self.version_dir(app, version)?;
        let _ = fs::remove_dir_all(&done);
        crate::failpoint::hit("pfs.before_dir_rename");
        fs::rename(&partial, &done).map_err(io("cannot rename into place", &done))?;
        if let Ok(dir) = File::open(self.app_dir(app)?) {
            let _ = dir.sync_all();
        }
        let versions = self.versions(app)?;
        let keep_from = versions.len().saturating_sub(KEEP_VERSIONS);
        for old in versions[..keep_from].iter().copied().filter(|v| *v < version) {
            let dir = self.version_dir(app, old)?;
            fs::remove_dir_all(&dir).map_err(io("cannot remove", &dir))?;
        }
        Ok(())
    }

    /// Deletes partial versions of `app` older than `below` that no writer
    /// is still filling (`in_flight`): a version older than a complete one
    /// can never complete (see [`complete`](Self::complete)), so what a
    /// crashed or failed writer left there, `.tmp` files included, only takes
    /// space. Returns how many partial versions went.
    pub fn remove_stale_partials(&self, app: &str, below: u64, in_flight: &BTreeSet<u64>) -> Result<usize> {
        let dir = self.app_dir(app)?;
        let Ok(entries) = fs::read_dir(&dir) else { return Ok(0) };
        let mut removed = 0;
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(version) = name.strip_prefix('v').and_then(|n| n.strip_suffix(".partial")) else { continue };
            let Ok(version) = version.parse::<u64>() else { continue };
            if version < below && !in_flight.contains(&version) {
                fs::remove_dir_all(entry.path()).map_err(io("cannot remove", &entry.path()))?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Complete versions of `app`, ascending.
    pub fn versions(&self, app: &str) -> Result<Vec<u64>> {
        let dir = self.app_dir(app)?;
        let mut versions: Vec<u64> = match fs::read_dir(&dir) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .filter(|e| e.path().join(MANIFEST).is_file())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix('v')?.parse().ok())
                .collect(),
            Err(_) => Vec::new(),
        };
        versions.sort_unstable();
        Ok(versions)
    }

    /// The newest complete version of `app`.
    pub fn latest(&self, app: &str) -> Result<Option<u64>> {
        Ok(self.versions(app)?.pop())
    }

    /// The newest complete version of `app` whose MANIFEST is readable, as
    /// a version record (what a controller or a library without a controller
    /// restarts from). A damaged MANIFEST is never taken for "no version":
    /// the previous complete version is used, with a warning naming the
    /// damaged file; if none is readable, the first damage is the error.
    pub fn latest_record(&self, app: &str) -> Result<Option<VersionRecord>> {
        Ok(self.latest_manifest(app)?.map(|manifest| Self::record(&manifest)))
    }

    /// The MANIFEST of the newest complete version of `app` that has a
    /// readable one, as [`latest_record`](Self::latest_record) chooses it.
    pub fn latest_manifest(&self, app: &str) -> Result<Option<PfsManifest>> {
        let mut damage: Option<PfsError> = None;
        for version in self.versions(app)?.into_iter().rev() {
            match self.manifest(app, version) {
                Ok(manifest) => {
                    if let Some(err) = &damage {
                        tracing::warn!(app, version, damaged = %err, "newest PFS version unusable; using version {version}");
                    }
                    return Ok(Some(manifest));
                }
                Err(err) => {
                    tracing::warn!(app, version, %err, "PFS version unusable");
                    damage.get_or_insert(err);
                }
            }
        }
        damage.map_or(Ok(None), Err)
    }

    /// The version record a restart from `manifest`'s version starts from.
    pub fn record(manifest: &PfsManifest) -> VersionRecord {
        VersionRecord {
            version: manifest.version,
            ranks: manifest.ranks,
            epoch: manifest.entries.first().map_or(0, |e| e.manifest.epoch),
            bytes: manifest.entries.iter().map(|e| e.manifest.total_len).sum(),
            commit_secs: 0.0,
            completed_unix_ms: 0,
        }
    }

    /// Reads a complete version's MANIFEST.
    pub fn manifest(&self, app: &str, version: u64) -> Result<PfsManifest> {
        let path = self.version_dir(app, version)?.join(MANIFEST);
        let bytes = fs::read(&path).map_err(io("cannot read", &path))?;
        let manifest: PfsManifest = format::decode_stored(&bytes)
            .or_else(|err| {
                format::decode_stored::<PfsManifestWithoutMode>(&bytes).map(PfsManifest::from).map_err(|_| err)
            })
            .map_err(|e| PfsError::Damaged { path: path.clone(), reason: e.to_string() })?;
        if manifest.app != app || manifest.version != version {
            return Err(PfsError::Damaged { path, reason: "it describes another version".into() });
        }
        for entry in &manifest.entries {
            check_entry(entry, app, version).map_err(|reason| PfsError::Damaged { path: path.clone(), reason })?;
        }
        Ok(manifest)
    }

    /// Reads and verifies one rank's data: the stored file's checksum, its
    /// decompressed length, and every label's chunk checksums.
    pub fn read_rank(&self, manifest: &PfsManifest, rank: u32) -> Result<(Manifest, Vec<u8>)> {
        let dir = self.version_dir(&manifest.app, manifest.version)?;
        let entry = manifest.entries.iter().find(|e| e.manifest.rank == rank).ok_or(PfsError::MissingRank {
            dir: dir.clone(),
            version: manifest.version,
            rank,
        })?;
        read_entry(&dir, entry, self.key.as_ref())
    }

    /// Who owns `app`'s copies, if the controller recorded it: so that a
    /// controller that forgot the application (a new journal) still admits
    /// only its owner to them, and the owner keeps its capability (and the
    /// key of its encrypted copies, derived from it).
    pub fn owner(&self, app: &str) -> Result<Option<Owner>> {
        let path = self.app_dir(app)?.join(OWNER);
        match fs::read(&path) {
            Ok(bytes) => {
                format::decode_stored(&bytes).map(Some).map_err(|e| PfsError::Damaged { path, reason: e.to_string() })
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(io("cannot read", &path)(err)),
        }
    }

    /// Records `app`'s owner beside its versions (mode 0600).
    pub fn set_owner(&self, app: &str, owner: &Owner) -> Result<()> {
        let dir = self.app_dir(app)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let path = dir.join(OWNER);
        let bytes = format::encode_stored(owner)
            .map_err(|e| PfsError::Damaged { path: path.clone(), reason: format!("cannot encode: {e}") })?;
        crate::credentials::write_private(&path, &bytes)
            .map_err(|e| PfsError::Damaged { path: path.clone(), reason: e.to_string() })
    }

    /// Removes `app`'s owner record (nothing of it is left on the PFS),
    /// so the name is free for anyone.
    pub fn release_owner(&self, app: &str) -> Result<()> {
        let path = self.app_dir(app)?.join(OWNER);
        match fs::remove_file(&path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(io("cannot remove", &path)(err)),
            _ => {
                // The application's directory, if it holds nothing else now.
                let _ = fs::remove_dir(self.app_dir(app)?);
                Ok(())
            }
        }
    }

    /// Deletes every version of `app`.
    pub fn remove_app(&self, app: &str) -> Result<()> {
        let dir = self.app_dir(app)?;
        match fs::remove_dir_all(&dir) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(PfsError::Io { what: "cannot remove", path: dir, error })
            }
            _ => Ok(()),
        }
    }
}

/// The entry of an uncompressed rank file of `len` bytes with file
/// checksum `crc`, written to `path` (`rank<R>.entry`) for whoever
/// completes the version.
fn record_raw_entry(
    path: &Path,
    manifest: &Manifest,
    file: String,
    len: u64,
    crc: u32,
    encryption: Option<Encryption>,
) -> Result<RankEntry> {
    let entry = RankEntry {
        manifest: manifest.clone(),
        file,
        stored_len: len,
        compression: Compression::None,
        file_crc: crc,
        encryption,
    };
    let bytes = format::encode_stored(&entry)
        .map_err(|e| PfsError::Damaged { path: path.to_path_buf(), reason: format!("cannot encode: {e}") })?;
    fs::write(path, bytes).map_err(io("cannot write", path))?;
    Ok(entry)
}

/// Decodes the bytes of the entry file at `path` and checks it.
fn decode_entry(path: &Path, bytes: &[u8]) -> Result<RankEntry> {
    let damaged = |reason: String| PfsError::Damaged { path: path.to_path_buf(), reason };
    let entry: RankEntry = format::decode_stored(bytes).map_err(|e| damaged(e.to_string()))?;
    let (app, version) = (entry.manifest.app.clone(), entry.manifest.version);
    check_entry(&entry, &app, version).map_err(damaged)?;
    Ok(entry)
}

/// What a reader relies on in a rank's entry: its manifest is valid and
/// belongs to `app`'s `version`, and its file name stays inside the
/// version's directory.
fn check_entry(entry: &RankEntry, app: &str, version: u64) -> std::result::Result<(), String> {
    entry.manifest.validate().map_err(|e| e.to_string())?;
    if entry.manifest.app != app || entry.manifest.version != version {
        return Err(format!("rank {}'s entry describes another version", entry.manifest.rank));
    }
    if !format::is_plain_name(&entry.file) {
        return Err(format!("rank {}'s file name {:?} is not a plain file name", entry.manifest.rank, entry.file));
    }
    Ok(())
}

/// Reads and verifies the file of `entry` in `dir`: the stored checksum,
/// the authentication tags of an encrypted file (with `key`), the
/// decompressed length, and every label's chunk checksums.
fn read_entry(dir: &Path, entry: &RankEntry, key: Option<&PfsKey>) -> Result<(Manifest, Vec<u8>)> {
    let path = dir.join(&entry.file);
    let damaged = |reason: String| PfsError::Damaged { path: path.clone(), reason };
    // Sizes come from the manifest, which a damaged file may contradict:
    // nothing is allocated from them up front, reads stop one byte past them.
    let stored = File::open(&path)
        .and_then(|f| crate::kernel_copy::read_to_vec(&f, entry.stored_len.saturating_add(1)))
        .map_err(io("cannot read", &path))?;
    if stored.len() as u64 != entry.stored_len {
        return Err(damaged(format!("{} bytes, the manifest says {}", stored.len(), entry.stored_len)));
    }
    if crate::format::crc32c(&stored) != entry.file_crc {
        return Err(damaged("its checksum does not match the manifest".into()));
    }
    let stored = match &entry.encryption {
        None => stored,
        Some(encryption) => {
            let m = &entry.manifest;
            let place = Place { app: &m.app, version: m.version, rank: m.rank };
            cipher::decrypt(key, place, encryption, &stored)
                .map_err(|source| PfsError::Encrypted { path: path.clone(), source })?
        }
    };
    let total = entry.manifest.total_len;
    let data = match entry.compression {
        Compression::None => stored,
        Compression::Zstd { .. } => {
            let mut data = Vec::new();
            zstd::stream::read::Decoder::new(stored.as_slice())
                .and_then(|d| d.take(total.saturating_add(1)).read_to_end(&mut data))
                .map_err(|e| damaged(format!("cannot decompress: {e}")))?;
            data
        }
    };
    if data.len() as u64 != total {
        return Err(damaged(format!("{} bytes of data, the manifest says {total}", data.len())));
    }
    entry.manifest.verify(&data).map_err(|e| damaged(e.to_string()))?;
    Ok((entry.manifest.clone(), data))
}

fn bincode_encode(manifest: &PfsManifest, dir: &Path) -> Result<Vec<u8>> {
    format::encode_stored(manifest)
        .map_err(|e| PfsError::Damaged { path: dir.join(MANIFEST), reason: format!("cannot encode: {e}") })
}

#[cfg(test)]
// Fixtures cut counters into bytes on purpose.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use crate::format::{label_crcs, CHUNK_SIZE};
    use crate::format::{DataKind, LabelLayout};

    fn manifest(app: &str, version: u64, rank: u32, data: &[u8]) -> Manifest {
        let half = data.len() / 2;
        let labels = vec![
            LabelLayout { label: "a".into(), kind: DataKind::Binary, offset: 0, len: half as u64, adapt: None },
            LabelLayout {
                label: "b".into(),
                kind: DataKind::Double,
                offset: half as u64,
                len: (data.len() - half) as u64,
                adapt: Some(crate::distribution::Adapt::Global {
                    global: 1000,
                    layout: crate::distribution::GlobalLayout::Cyclic { width: 3 },
                }),
            },
        ];
        Manifest {
            app: app.into(),
            rank,
            ranks: 2,
            epoch: 3,
            version,
            crcs: label_crcs(&[&data[..half], &data[half..]]),
            labels,
            total_len: data.len() as u64,
            chunk_size: CHUNK_SIZE,
            sealed_unix_ms: 0,
        }
    }

    /// A PFS directory of the test's own under `TMPDIR`, removed when the
    /// guard drops: after the test, and also when an assertion fails.
    fn scratch(name: &str) -> (PfsStore, RemovedOnDrop) {
        let root = std::env::temp_dir().join(format!("icheck-pfs-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        (PfsStore::new(root.clone()), RemovedOnDrop(root))
    }

    struct RemovedOnDrop(std::path::PathBuf);

    impl Drop for RemovedOnDrop {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Each damaged manifest, put in a complete version's MANIFEST as rank
    /// 1's entry, makes reading that version a typed error naming the file.
    #[test]
    fn damaged_manifests_in_a_pfs_version_are_typed_errors() {
        let (pfs, _dir) = scratch("damaged-manifests");
        let data: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| i as u8).collect();
        write_version(&pfs, 3, &[&data, &data], Compression::None);
        let path = pfs.version_dir("app", 3).unwrap().join(MANIFEST);
        let pristine: PfsManifest = format::decode_stored(&fs::read(&path).unwrap()).unwrap();
        let mut cases = crate::format::samples::damaged_manifests(&data);
        cases.push(("file name escaping the version", pristine.entries[1].manifest.clone()));
        for (index, (what, damaged)) in cases.into_iter().enumerate() {
            let mut version = pristine.clone();
            version.entries[1].manifest = Manifest { app: "app".into(), version: 3, ..damaged };
            if what.starts_with("name escaping") {
                version.entries[1].manifest.app = "../x".into();
            }
            if what.starts_with("file name") {
                version.entries[1].file = format!("../../{index}");
            }
            fs::write(&path, format::encode_stored(&version).unwrap()).unwrap();
            let err = pfs.manifest("app", 3).expect_err(what);
            assert!(matches!(&err, PfsError::Damaged { path: p, .. } if p == &path), "{what}: {err}");
            assert!(pfs.latest_record("app").is_err(), "{what}");
        }
    }

    fn write_version(pfs: &PfsStore, version: u64, data: &[&[u8]], compression: Compression) -> Vec<WriteStats> {
        let mut entries = Vec::new();
        let mut stats = Vec::new();
        for (rank, bytes) in data.iter().enumerate() {
            let (entry, s) = pfs.write_rank(&manifest("app", version, rank as u32, bytes), bytes, compression).unwrap();
            entries.push(entry);
            stats.push(s);
        }
        pfs.complete("app", version, data.len() as u32, "test", TransferMode::Mr, entries).unwrap();
        stats
    }

    #[test]
    fn round_trip_raw_and_compressed_and_only_the_newest_two_stay() {
        let (pfs, _dir) = scratch("roundtrip");
        let compressible = vec![7u8; 1 << 20];
        let mut noise = vec![0u8; 1 << 20];
        let mut x = 0x1234_5678_9abc_def0u64;
        for byte in &mut noise {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *byte = x as u8;
        }
        write_version(&pfs, 1, &[&noise, &compressible], Compression::None);
        let stats = write_version(&pfs, 2, &[&noise, &compressible], Compression::Zstd { level: 3 });
        assert!(stats[1].ratio() > 100.0, "zeros-like data compresses: {}", stats[1].ratio());
        assert!(stats[0].ratio() < 1.01, "noise does not: {}", stats[0].ratio());
        assert_eq!(pfs.versions("app").unwrap(), vec![1, 2], "the previous version stays as a spare");
        write_version(&pfs, 3, &[&noise, &compressible], Compression::None);
        assert_eq!(pfs.versions("app").unwrap(), vec![2, 3], "version 3 replaced version 1");
        let manifest = pfs.manifest("app", 2).unwrap();
        assert_eq!(manifest.entries[1].compression, Compression::Zstd { level: 3 });
        assert_eq!(pfs.read_rank(&manifest, 0).unwrap().1, noise);
        assert_eq!(pfs.read_rank(&manifest, 1).unwrap().1, compressible);
        assert!(matches!(pfs.read_rank(&manifest, 5), Err(PfsError::MissingRank { rank: 5, .. })));
        pfs.remove_app("app").unwrap();
        assert_eq!(pfs.latest("app").unwrap(), None);
    }

    /// Every writer (an agent's copy, the library's parts, a spill)
    /// encrypts with the store's key; reading needs the same key, and
    /// changed ciphertext is refused even when the MANIFEST's file
    /// checksum was fixed to match.
    #[test]
    fn encrypted_copies_read_back_only_with_their_key_and_refuse_changed_ciphertext() {
        let key = PfsKey::new([5; 32]);
        let (pfs, _dir) = scratch("encrypted");
        let pfs = pfs.with_key(Some(key.clone()));
        let data: Vec<u8> = (0..(3u32 << 20) + 11).map(|i| (i % 251) as u8).collect();
        let (a, _) = pfs.write_rank(&manifest("app", 1, 0, &data), &data, Compression::Zstd { level: 1 }).unwrap();
        let (b, _) = pfs.write_rank_parts(&manifest("app", 1, 1, &data), &[&data[..1000], &data[1000..]]).unwrap();
        pfs.complete("app", 1, 2, "test", TransferMode::Mr, vec![a, b]).unwrap();
        let spill = pfs.create_spill("app", 2, 0, data.len() as u64).unwrap();
        spill.write_at(1000, &data[1000..]).unwrap();
        spill.write_at(0, &data[..1000]).unwrap();
        let spilled = spill.finish(&manifest("app", 2, 0, &data)).unwrap();
        pfs.complete("app", 2, 1, "test", TransferMode::Mr, vec![spilled]).unwrap();
        for (version, ranks) in [(1, 2), (2, 1)] {
            let manifest = pfs.manifest("app", version).unwrap();
            for rank in 0..ranks {
                assert!(manifest.entries[rank as usize].encryption.is_some());
                assert_eq!(pfs.read_rank(&manifest, rank).unwrap().1, data, "version {version} rank {rank}");
            }
            // The stored bytes are not the data.
            let file = pfs.version_dir("app", version).unwrap().join(&manifest.entries[0].file);
            let stored = fs::read(&file).unwrap();
            assert!(!stored.windows(64).any(|w| w == &data[4096..4160]), "plaintext on the PFS");
        }
        let manifest = pfs.manifest("app", 1).unwrap();
        let err = |store: &PfsStore| store.read_rank(&manifest, 0).unwrap_err().to_string();
        let plain = PfsStore::new(pfs.root());
        assert!(err(&plain).contains("no key was given"), "{}", err(&plain));
        let other = PfsStore::new(pfs.root()).with_key(Some(PfsKey::new([6; 32])));
        assert!(err(&other).contains("another key"), "{}", err(&other));
        // A tamperer who flips a bit and fixes the file checksum in the MANIFEST.
        let dir = pfs.version_dir("app", 1).unwrap();
        let file = dir.join(&manifest.entries[0].file);
        let mut stored = fs::read(&file).unwrap();
        stored[100] ^= 0x20;
        fs::write(&file, &stored).unwrap();
        let mut forged = manifest.clone();
        forged.entries[0].file_crc = crc32c::crc32c(&stored);
        fs::write(dir.join(MANIFEST), format::encode_stored(&forged).unwrap()).unwrap();
        let forged = pfs.manifest("app", 1).unwrap();
        let refused = pfs.read_rank(&forged, 0).unwrap_err().to_string();
        assert!(refused.contains("authentication tag"), "{refused}");
    }

    #[test]
    fn a_version_completed_after_a_newer_one_is_dropped() {
        let (pfs, _dir) = scratch("stale");
        let data = vec![1u8; 1000];
        let (old, _) = pfs.write_rank(&manifest("app", 1, 0, &data), &data, Compression::None).unwrap();
        write_version(&pfs, 2, &[&data], Compression::None);
        pfs.complete("app", 1, 1, "test", TransferMode::Mr, vec![old]).unwrap();
        assert_eq!(pfs.versions("app").unwrap(), vec![2]);
        assert!(!pfs.partial_dir("app", 1).unwrap().exists());
    }

    #[test]
    fn parts_written_by_several_writers_complete_one_version() {
        let (pfs, _dir) = scratch("parts");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for rank in 0..3 {
            let (a, b) = data.split_at(data.len() / 2);
            pfs.write_rank_parts(&manifest("app", 4, rank, &data), &[a, b]).unwrap();
        }
        let entries = pfs.partial_entries("app", 4, 3).unwrap();
        pfs.complete("app", 4, 3, "library", TransferMode::Mr, entries).unwrap();
        let manifest = pfs.manifest("app", 4).unwrap();
        for rank in 0..3 {
            assert_eq!(pfs.read_rank(&manifest, rank).unwrap().1, data);
        }
    }

    #[test]
    fn the_manifest_records_the_mode_and_manifests_written_before_it_still_read() {
        let (pfs, _dir) = scratch("mode");
        let data = vec![7u8; 5_000];
        let (entry, _) = pfs.write_rank(&manifest("app", 1, 0, &data), &data, Compression::None).unwrap();
        pfs.complete("app", 1, 2, "agents", TransferMode::Shmr, vec![entry]).unwrap();
        let written = pfs.manifest("app", 1).unwrap();
        assert_eq!(written.mode, Some(TransferMode::Shmr));
        assert_eq!(pfs.latest_manifest("app").unwrap().map(|m| m.mode), Some(Some(TransferMode::Shmr)));
        assert_eq!(pfs.latest_record("app").unwrap().map(|r| (r.version, r.ranks)), Some((1, 2)));
        // The same manifest as an older release wrote it: no mode at the end.
        #[derive(Serialize)]
        struct Before<'a>(&'a str, u64, u32, &'a str, &'a [RankEntry]);
        let path = pfs.version_dir("app", 1).unwrap().join(MANIFEST);
        for (writer, mode) in [("agents", None), ("library", Some(TransferMode::Mr))] {
            let before = Before("app", 1, 2, writer, &written.entries);
            fs::write(&path, format::encode_stored(&before).unwrap()).unwrap();
            let read = pfs.manifest("app", 1).unwrap();
            assert_eq!((read.mode, read.writer.as_str(), &read.entries), (mode, writer, &written.entries));
            assert_eq!(pfs.read_rank(&read, 0).unwrap().1, data);
        }
        // Damage is still damage, named by its file.
        fs::write(&path, b"not a manifest").unwrap();
        let err = pfs.manifest("app", 1).unwrap_err().to_string();
        assert!(err.contains("v1/MANIFEST"), "{err}");
    }

    #[test]
    fn partial_versions_are_invisible_and_damage_names_the_file() {
        let (pfs, _dir) = scratch("damage");
        let data = vec![3u8; 10_000];
        write_version(&pfs, 1, &[&data], Compression::None);
        // A version whose manifest never got written is not a version.
        pfs.write_rank(&manifest("app", 2, 0, &data), &data, Compression::None).unwrap();
        assert_eq!(pfs.latest("app").unwrap(), Some(1));

        let file = pfs.version_dir("app", 1).unwrap().join("rank0.data");
        let manifest = pfs.manifest("app", 1).unwrap();
        let mut bytes = fs::read(&file).unwrap();
        bytes[5000] ^= 1;
        fs::write(&file, &bytes).unwrap();
        let err = pfs.read_rank(&manifest, 0).unwrap_err().to_string();
        assert!(err.contains("rank0.data") && err.contains("checksum"), "{err}");
        fs::write(&file, &bytes[..100]).unwrap();
        let err = pfs.read_rank(&manifest, 0).unwrap_err().to_string();
        assert!(err.contains("rank0.data") && err.contains("100 bytes"), "{err}");
        fs::remove_file(pfs.version_dir("app", 1).unwrap().join(MANIFEST)).unwrap();
        assert_eq!(pfs.latest("app").unwrap(), None, "a version without its manifest is not complete");
    }
}
