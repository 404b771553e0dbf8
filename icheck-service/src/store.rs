//! Agent checkpoint memory: one memory-mapped file per rank and version,
//! outside the manager's heap (by default under /dev/shm), so a restarted
//! manager finds the data again.
//!
//! Layout under the node's store root:
//!
//! ```text
//! <root>/<app>/rank<R>/v<V>.data   the rank's bytes, labels back to back
//! <root>/<app>/rank<R>/v<V>.meta   its Manifest (bincode), written last via rename
//! <root>/<app>/pieces/v<V>.copy<R>.data|.meta         a copy of another node's rank
//! <root>/<app>/pieces/v<V>.parity<G>-<J>.data|.meta   parity shard J of group G
//! <root>/<app>/pieces/spare.<piece>.data              a dropped version's piece, reused
//! <root>/<app>/rank<R>/v<V>.map    an incremental version's BlockMap, written before its .meta
//! <root>/<app>/rank<R>/b<V>.data   a dropped version's data that newer versions still share
//! <root>/.warm/w<N>.data           a file with its pages backed, for any next new file (WarmPool)
//! ```
//!
//! Incremental versions (`icheck_core::delta`): `v<V>.data` holds only the
//! blocks that changed since the parent, packed, and `v<V>.map` says which
//! file holds every other block. [`Store::open`] composes such a version
//! into one contiguous read-only view, mapping each run of blocks from the
//! file that holds it, so every reader (restart, inventory, copies, parity)
//! sees the same bytes as for a whole version. When a version is dropped
//! while newer maps still use blocks of its data file, the file is kept as
//! `b<V>.data` with the unused blocks punched out; it goes when no map
//! uses it ([`Store::prune`], [`Store::remove_version`]).
//!
//! Architecture invariant: a version counts as stored only when its `.meta`
//! exists; the `.meta` is written after the data is complete and checksummed,
//! through a temporary file and an atomic rename. Whether a stored version is
//! *complete* (every rank stored) is the controller's record, not the store's.

#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use icheck_core::delta::{BlockMap, BLOCK_SIZE};
use icheck_core::fabric::StableBuffer;
use icheck_core::format::{self, check_app_name, FormatError, Manifest};
use icheck_core::handoff::FileExtent;
use icheck_core::pages::{self, PopulateError};
use icheck_core::protocol::{PieceMeta, StoredPiece, StoredVersion};
use icheck_core::redundancy::PieceId;

/// Name of a rank's reusable data file.
const SPARE: &str = "spare.data";
/// Name of a rank's data file prepared ahead of its next version (see
/// [`Store::reserve_prepared`]).
const PREPARED: &str = "prepared.data";
/// Directory of an application's pieces of redundancy (copies of other
/// nodes' ranks, parity shards), beside its `rank<R>` directories.
const PIECES: &str = "pieces";
/// Prefix of a piece's spare data file in the pieces directory.
const SPARE_PREFIX: &str = "spare.";
/// Directory under the root of the warm pool: files whose pages are
/// already backed, for any application's next new file
/// ([`Store::fill_warm`]). Never an application's directory: names cannot
/// start with a dot.
const WARM: &str = ".warm";

/// When (milliseconds since [`activity_epoch`]) this process last made or
/// reused a version's file, and the largest such file: the warm pool fills
/// only while the node is quiet, with files of the largest size it needed
/// (whole versions; an incremental version's file is smaller). One store
/// per manager process.
static LAST_VERSION_FILE_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static LARGEST_VERSION_FILE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn activity_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

/// Records that a version's file of `len` bytes is being made (or a spare
/// reused for one) now.
fn note_version_file(len: u64) {
    use std::sync::atomic::Ordering::Relaxed;
    let now = u64::try_from(activity_epoch().elapsed().as_millis()).unwrap_or(u64::MAX);
    LAST_VERSION_FILE_AT.store(now.max(1), Relaxed);
    LARGEST_VERSION_FILE.fetch_max(len, Relaxed);
}

/// Files below this size never come from the warm pool: their zeroing is
/// short, and cutting a large warm file down to them would waste it.
const WARM_MIN: u64 = 8 << 20;

/// How long ago this process last made or reused a version's file, and
/// the largest such file; `None` if it never did.
pub fn version_file_activity() -> Option<(std::time::Duration, u64)> {
    use std::sync::atomic::Ordering::Relaxed;
    let at = LAST_VERSION_FILE_AT.load(Relaxed);
    (at > 0).then(|| {
        let since = activity_epoch().elapsed().saturating_sub(std::time::Duration::from_millis(at));
        (since, LARGEST_VERSION_FILE.load(Relaxed))
    })
}

/// Why the store refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
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
    /// The application name cannot be a directory name.
    #[error(transparent)]
    BadName(#[from] FormatError),
    /// The piece of redundancy is not stored here.
    #[error("the {piece} for version {version} of {app:?} is not stored at this agent")]
    MissingPiece {
        /// Application.
        app: String,
        /// Version.
        version: u64,
        /// The piece.
        piece: PieceId,
    },
    /// The version is not stored here.
    #[error("version {version} of rank {rank} of {app:?} is not stored at this agent")]
    Missing {
        /// Application.
        app: String,
        /// Rank.
        rank: u32,
        /// Version.
        version: u64,
    },
    /// The store's file system cannot hold the version (checked before the
    /// file is mapped, so a full tmpfs is an error, not a SIGBUS).
    #[error(
        "the checkpoint store {path} has no room for {needed} more bytes ({available} bytes free on its file system)"
    )]
    NoSpace {
        /// The file that could not be given its space.
        path: PathBuf,
        /// Bytes asked for.
        needed: u64,
        /// Bytes the file system had free.
        available: u64,
    },
    /// The manifest file is damaged.
    #[error("manifest {path} is damaged: {reason}")]
    BadManifest {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

type Result<T> = std::result::Result<T, StoreError>;

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |error| StoreError::Io { what, path: path.to_path_buf(), error }
}

/// One version's mapping with several holders: the session that sealed
/// it, the agent's kept versions, and the fetches reading it. Dropping the
/// last holder unmaps it. It is registered only for remote reads.
#[derive(Clone)]
pub struct SharedMapping(std::sync::Arc<MappedFile>);

impl SharedMapping {
    /// Shares `file`.
    pub fn new(file: MappedFile) -> SharedMapping {
        SharedMapping(std::sync::Arc::new(file))
    }

    /// The version's bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// Bytes of the version's data.
    pub fn data_len(&self) -> usize {
        self.0.len
    }

    /// The mapping itself, if this is its last holder.
    pub fn into_inner(self) -> Option<MappedFile> {
        std::sync::Arc::into_inner(self.0)
    }
}

// SAFETY: the mapping stays at one address until its last holder drops it,
// and MappedFile never remaps it. Shared mappings are registered only for
// remote reads (Fetch, FetchPiece) and nothing writes through this pointer,
// so the shared references other holders read through are never aliased by
// a write.
unsafe impl StableBuffer for SharedMapping {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_slice().as_ptr().cast_mut()
    }
    fn len(&self) -> usize {
        StableBuffer::len(&*self.0)
    }
}

/// What tells one state of a data file from another without reading it:
/// its inode, length and change times. Writing, cutting or renaming the
/// file (or replacing it with another) changes at least one of them, so a
/// check of the data remembered with its identity holds while the
/// identity is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

impl FileIdentity {
    /// The identity of the file at `path` now (`None` where it cannot be
    /// read).
    pub fn of_path(path: &Path) -> Option<FileIdentity> {
        fs::metadata(path).ok().map(|meta| FileIdentity::of(&meta))
    }

    fn of(meta: &fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A version's data: its file mapped read-write, or (an incremental
/// version) a read-only view composed of blocks of several files. The
/// mapping never moves, so it can be registered for RMA.
pub struct MappedFile {
    mapping: Mapping,
    len: usize,
}

enum Mapping {
    File(MmapMut),
    Composed(ComposedView),
}

/// A read-only range of address space whose pages map blocks of several
/// data files (see [`Store::open`]); unmapped as a whole on drop.
struct ComposedView {
    base: std::ptr::NonNull<std::ffi::c_void>,
    mapped: usize,
}

// SAFETY: the view is plain shared-file memory owned by this value; nothing
// in it is tied to the thread that mapped it.
unsafe impl Send for ComposedView {}
// SAFETY: it is only read through shared references.
unsafe impl Sync for ComposedView {}

impl Drop for ComposedView {
    fn drop(&mut self) {
        // SAFETY: `base..base + mapped` was reserved by this view's
        // mmap_anonymous and only remapped inside; no slice of it outlives
        // `self` (they borrow the MappedFile).
        if let Err(errno) = unsafe { nix::sys::mman::munmap(self.base, self.mapped) } {
            tracing::warn!(%errno, bytes = self.mapped, "cannot unmap a composed version");
        }
    }
}

impl MappedFile {
    /// The data (the logical length, without the padding page of empty files).
    pub fn as_slice(&self) -> &[u8] {
        match &self.mapping {
            Mapping::File(map) => &map[..self.len],
            // SAFETY: the view maps `mapped >= len` readable bytes at `base`
            // for as long as `self` lives.
            Mapping::Composed(view) => unsafe { std::slice::from_raw_parts(view.base.as_ptr().cast::<u8>(), self.len) },
        }
    }

    /// The data, mutably (before the file is registered for RMA). Only a
    /// version's own file is writable: a composed view shares its blocks
    /// with other versions and is mapped read-only.
    ///
    /// # Panics
    /// On a composed view (an incremental version opened from the store).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.mapping {
            Mapping::File(map) => &mut map[..self.len],
            Mapping::Composed(_) => panic!("an incremental version's composed view is read-only"),
        }
    }

    /// Whether this is an incremental version composed of shared blocks.
    pub fn is_composed(&self) -> bool {
        matches!(self.mapping, Mapping::Composed(_))
    }

    /// Address and length of the whole mapping, padding page included.
    fn whole_range(&self) -> (usize, usize) {
        match &self.mapping {
            Mapping::File(map) => (map.as_ptr() as usize, map.len()),
            Mapping::Composed(view) => (view.base.as_ptr() as usize, view.mapped),
        }
    }
}

// SAFETY: the mapping stays at one address until the MappedFile is
// dropped, and MappedFile never remaps it. A composed view is registered
// only for remote reads (Fetch), never written through this pointer.
unsafe impl StableBuffer for MappedFile {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match &mut self.mapping {
            Mapping::File(map) => map.as_mut_ptr(),
            Mapping::Composed(view) => view.base.as_ptr().cast::<u8>(),
        }
    }
    fn len(&self) -> usize {
        match &self.mapping {
            Mapping::File(map) => map.len(),
            Mapping::Composed(view) => view.mapped,
        }
    }
}

/// What [`Store::prune`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Files removed (or kept as the spare).
    pub removed: usize,
    /// The version whose data file became the spare.
    pub spare: Option<u64>,
    /// Older versions kept because they were pinned.
    pub pinned: BTreeSet<u64>,
}

/// Size and free space of a store's file system, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Bytes the file system holds in all.
    pub total: u64,
    /// Bytes free for an unprivileged writer.
    pub available: u64,
}

/// What [`Store::inventory`] verified already, by manifest file.
#[derive(Debug, Default)]
pub struct InventoryCache {
    verified: std::collections::HashMap<PathBuf, ((u64, i64, i64), StoredVersion)>,
}

/// One node's checkpoint store.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
    /// Mappings of sealed pieces' data files, kept after their writer is
    /// done so that the file's next use as a spare skips mapping it again.
    kept: std::sync::Arc<std::sync::Mutex<Vec<KeptMapping>>>,
    /// Which session writes each rank's version here, shared by the node's
    /// agents (see [`crate::owners`]).
    writers: std::sync::Arc<crate::owners::Owners<VersionKey>>,
}

/// A rank's version in a store: (application, rank, version).
pub type VersionKey = (String, u32, u64);

/// A kept mapping of a piece's data file (see [`Store::keep_piece_mapping`]).
#[derive(Debug)]
struct KeptMapping {
    /// The file, open: a mapping whose file has been deleted must go, or
    /// it would hold the file's memory (see [`Store::sweep_kept`]).
    file: File,
    inode: u64,
    map: MmapMut,
}

/// At most this many piece mappings are kept per store: a node holds a
/// spare of each of its pieces, and few applications protect at once.
const MAX_KEPT_MAPPINGS: usize = 64;

impl Store {
    /// A store rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Store {
        Store { root: root.into(), kept: std::sync::Arc::default(), writers: std::sync::Arc::default() }
    }

    /// Who writes each rank's version in this store: a session claims its
    /// version before it makes the file, and seals or discards it only
    /// while it still owns it (an agent stopped late must not delete the
    /// file of the agent that replaced it on the same node).
    pub fn writers(&self) -> &crate::owners::Owners<VersionKey> {
        &self.writers
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn rank_dir(&self, app: &str, rank: u32) -> Result<PathBuf> {
        check_app_name(app)?;
        Ok(self.root.join(app).join(format!("rank{rank}")))
    }

    fn paths(&self, app: &str, rank: u32, version: u64) -> Result<(PathBuf, PathBuf)> {
        let dir = self.rank_dir(app, rank)?;
        Ok((dir.join(format!("v{version}.data")), dir.join(format!("v{version}.meta"))))
    }

    /// Creates the data file of a version being written and maps it: `len`
    /// bytes, a whole version's or (incremental) its changed blocks'. The
    /// rank's spare file (a pruned version's memory) or prepared file is
    /// reused, cut or grown to `len`, when there is one: its pages are
    /// already allocated, so writing into it costs no page allocation on the
    /// transfer path. A mapping of either that the caller holds must not be
    /// used afterwards (the file may have been cut).
    pub fn create(&self, app: &str, rank: u32, version: u64, len: u64) -> Result<MappedFile> {
        let (dir, data) = self.new_data_path(app, rank, version)?;
        // A spare's or a prepared file's pages are kept: it is not
        // truncated. One reusable file is enough; a second one would only
        // hold memory, so it goes.
        let mut reused = false;
        for name in [SPARE, PREPARED] {
            let reusable = dir.join(name);
            if !reusable.exists() {
                continue;
            }
            if reused {
                remove_if_present(&reusable)?;
            } else {
                fs::rename(&reusable, &data).map_err(io("cannot reuse", &reusable))?;
                reused = true;
            }
        }
        // Reused or not, a version's file is being written: the node is busy.
        note_version_file(len);
        if !reused {
            self.take_warm(&data, len)?;
        }
        self.create_mapped(&data, len, false)
    }

    /// [`Store::create`] without touching the rank's spare or prepared
    /// file: for a version's file made while another thread is still
    /// preparing the next one (its file must stay where that thread put it).
    pub fn create_new(&self, app: &str, rank: u32, version: u64, len: u64) -> Result<MappedFile> {
        let (_, data) = self.new_data_path(app, rank, version)?;
        note_version_file(len);
        // A warm file replaces whatever an interrupted run left there.
        let warm = self.take_warm(&data, len)?;
        self.create_mapped(&data, len, !warm)
    }

    /// The rank's directory (made if missing) and the data file path of a
    /// version about to be written; an old manifest of the same number
    /// belongs to an interrupted run and goes.
    fn new_data_path(&self, app: &str, rank: u32, version: u64) -> Result<(PathBuf, PathBuf)> {
        let dir = self.rank_dir(app, rank)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let (data, meta) = self.paths(app, rank, version)?;
        let _ = fs::remove_file(&meta);
        Ok((dir, data))
    }

    /// Creates the rank's prepared file with `len` bytes, its pages not yet
    /// backed: a file of the next version's size that counts against the
    /// node's memory from here on ([`Store::bytes_held`] counts lengths),
    /// so the caller reserves it under the same lock as a version's file.
    /// [`Store::map_prepared`] then backs and maps it, outside that lock.
    /// True if the file came from the warm pool, its pages already backed.
    pub fn reserve_prepared(&self, app: &str, rank: u32, len: u64) -> Result<bool> {
        let dir = self.rank_dir(app, rank)?;
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let path = dir.join(PREPARED);
        note_version_file(len);
        let warm = !path.exists() && self.take_warm(&path, len)?;
        let file = OpenOptions::new().write(true).create(true).truncate(false).open(&path);
        file.and_then(|f| f.set_len(len.max(4096))).map_err(io("cannot size", &path))?;
        Ok(warm)
    }

    /// Backs every page of the rank's prepared file and maps it: the slow
    /// part of a new version's file (tmpfs allocates and zeroes each page),
    /// done while the application computes instead of inside its commit.
    pub fn map_prepared(&self, app: &str, rank: u32, len: u64) -> Result<MappedFile> {
        let path = self.rank_dir(app, rank)?.join(PREPARED);
        self.create_mapped(&path, len, false)
    }

    /// Makes the rank's prepared file the data file of `version`, for a
    /// caller holding its mapping. False if there is none of that size.
    pub fn reuse_prepared(&self, app: &str, rank: u32, version: u64, len: u64) -> Result<bool> {
        self.reuse_named(PREPARED, app, rank, version, len)
    }

    /// Deletes the rank's prepared file (unneeded: a spare took its place).
    pub fn discard_prepared(&self, app: &str, rank: u32) -> Result<bool> {
        remove_if_present(&self.rank_dir(app, rank)?.join(PREPARED))
    }

    /// The block map of a sealed version: its map file, or (a whole
    /// version) the identity. `None` if the version is not sealed here.
    pub fn block_map(&self, app: &str, rank: u32, version: u64) -> Result<Option<BlockMap>> {
        let (data, meta) = self.paths(app, rank, version)?;
        let Ok(bytes) = fs::read(&meta) else { return Ok(None) };
        let manifest: Manifest = format::decode_stored(&bytes)
            .map_err(|e| StoreError::BadManifest { path: meta.clone(), reason: e.to_string() })?;
        let data_len = fs::metadata(&data).map_or(0, |m| m.len());
        let map = read_block_map(&data, version, manifest.total_len, data_len)?;
        Ok(Some(map.unwrap_or_else(|| BlockMap::whole(version, manifest.total_len))))
    }

    /// Seals an incremental version: its block map first, then (the commit
    /// point, as for every version) its manifest.
    pub fn seal_delta(&self, manifest: &Manifest, map: &BlockMap) -> Result<()> {
        let (data, _) = self.paths(&manifest.app, manifest.rank, manifest.version)?;
        let map_path = data.with_extension("map");
        let bytes = format::encode_stored(map)
            .map_err(|e| StoreError::BadManifest { path: map_path.clone(), reason: e.to_string() })?;
        let tmp = map_path.with_extension("map.tmp");
        fs::write(&tmp, bytes).map_err(io("cannot write", &tmp))?;
        fs::rename(&tmp, &map_path).map_err(io("cannot rename into", &map_path))?;
        self.publish(manifest)
    }

    /// Keeps what sealed versions' maps still use (`used`, from
    /// [`blocks_in_use`]) of dropped versions' data (`b<V>.data`) and frees
    /// the rest: files no map uses are deleted, blocks no map uses are
    /// punched out (tmpfs gives their pages back).
    fn collect_shared_blocks(&self, dir: &Path, used: &BlockUse) -> Result<()> {
        let Ok(entries) = fs::read_dir(dir) else { return Ok(()) };
        for entry in entries.filter_map(|e| e.ok()) {
            let Some(version) = shared_version(&entry) else { continue };
            let path = entry.path();
            let Some(blocks) = used.get(&version) else {
                remove_if_present(&path)?;
                continue;
            };
            let file = OpenOptions::new().write(true).open(&path).map_err(io("cannot open", &path))?;
            let len = file.metadata().map_err(io("cannot stat", &path))?.len();
            let mut start = 0u64;
            for end in blocks.iter().copied().chain(std::iter::once(len.div_ceil(BLOCK_SIZE))) {
                if end > start {
                    punch(&file, &path, start * BLOCK_SIZE, (end * BLOCK_SIZE).min(len))?;
                }
                start = end + 1;
            }
        }
        Ok(())
    }

    /// Opens (creating it) the data file `data`, gives it `len` bytes with
    /// every page backed now, and maps them.
    fn create_mapped(&self, data: &Path, len: u64, truncate: bool) -> Result<MappedFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(truncate)
            .open(data)
            .map_err(io("cannot create", data))?;
        self.size_back_and_map(&file, data, len, true)
    }

    /// Gives `file` (at `path`) `len` bytes, every page backed now, and maps
    /// them; on failure the file is removed. An empty mapping is not
    /// allowed: empty versions get one page.
    ///
    /// The mapping is populated by up to four threads
    /// ([`pages::populate_write_parallel`]), which for a fresh file both
    /// allocates and zeroes its pages: on this machine kind a fresh 1 GiB
    /// took 530-600 ms as `fallocate` (allocation, one thread, holding the
    /// inode's lock) then a populated mapping (zeroing), and 330-400 ms
    /// populated by two threads. A file already backed (a warm one) only
    /// has its pages mapped: 170-190 ms per GiB on one thread. On kernels
    /// without `MADV_POPULATE_WRITE` it falls back to the older way.
    ///
    /// With `release_warm`, a file system too full for the file first gets
    /// the warm pool's memory back; the pool's own files never do that.
    fn size_back_and_map(&self, file: &File, path: &Path, len: u64, release_warm: bool) -> Result<MappedFile> {
        let size = len.max(4096);
        if let Err(err) = file.set_len(size) {
            let _ = fs::remove_file(path);
            return Err(StoreError::Io { what: "cannot size", path: path.to_path_buf(), error: err });
        }
        let mapped = map(file, path, len, false)?;
        let (addr, bytes) = mapped.whole_range();
        let mut populated = pages::populate_write_parallel(addr, bytes);
        // The warm pool gives its memory back before a version goes short.
        if matches!(populated, Err(PopulateError::NoSpace(_))) && release_warm && self.release_warm(size) > 0 {
            populated = pages::populate_write_parallel(addr, bytes);
        }
        match populated {
            Ok(()) => Ok(mapped),
            Err(PopulateError::Unsupported(_)) => {
                drop(mapped);
                self.reserve(file, path, size, release_warm)?;
                map(file, path, len, true)
            }
            Err(PopulateError::NoSpace(err)) => {
                drop(mapped);
                let _ = fs::remove_file(path);
                let available = self.capacity().map_or(0, |c| c.available);
                tracing::debug!(path = %path.display(), %err, "cannot back every page");
                Err(StoreError::NoSpace { path: path.to_path_buf(), needed: size, available })
            }
        }
    }

    /// Flushes the data file `data` and writes `value` (a manifest or a
    /// piece's description) beside it as `meta`'s temporary file. Returns
    /// that file: renamed onto `meta`, it makes the data count as stored.
    fn write_description<T: serde::Serialize>(data: &Path, meta: &Path, value: &T) -> Result<PathBuf> {
        File::open(data).and_then(|f| f.sync_data()).map_err(io("cannot flush", data))?;
        let bytes = format::encode_stored(value)
            .map_err(|e| StoreError::BadManifest { path: meta.to_path_buf(), reason: e.to_string() })?;
        let tmp = meta.with_extension("meta.tmp");
        fs::write(&tmp, bytes).map_err(io("cannot write", &tmp))?;
        Ok(tmp)
    }

    /// Gives every page of `file` its backing now. A page of a mapped file
    /// that the file system cannot back is a SIGBUS at the first write, which
    /// for a store on a full tmpfs used to kill the manager (inside
    /// libfabric's copy); reserved up front, a full store is an error here
    /// (after the warm pool's memory is given back, with `release_warm`).
    fn reserve(&self, file: &File, path: &Path, size: u64, release_warm: bool) -> Result<()> {
        if is_backed(file, size) {
            return Ok(());
        }
        let len = i64::try_from(size).unwrap_or(i64::MAX);
        let mut allocated = nix::fcntl::posix_fallocate(file, 0, len);
        // The warm pool gives its memory back before a version goes short.
        if allocated == Err(nix::errno::Errno::ENOSPC) && release_warm && self.release_warm(size) > 0 {
            allocated = nix::fcntl::posix_fallocate(file, 0, len);
        }
        match allocated {
            Ok(()) => Ok(()),
            Err(errno) => {
                let available = self.capacity().map_or(0, |c| c.available);
                let _ = fs::remove_file(path);
                if errno == nix::errno::Errno::ENOSPC {
                    return Err(StoreError::NoSpace { path: path.to_path_buf(), needed: size, available });
                }
                Err(StoreError::Io { what: "cannot reserve space for", path: path.to_path_buf(), error: errno.into() })
            }
        }
    }

    /// The warm pool's files with their sizes (half-made ones excluded).
    fn warm_files(&self) -> Vec<(PathBuf, u64)> {
        let entries = fs::read_dir(self.root.join(WARM)).into_iter().flatten().filter_map(|e| e.ok());
        entries
            .filter(|e| e.file_name().to_string_lossy().ends_with(".data"))
            .filter_map(|e| Some((e.path(), e.metadata().ok()?.len())))
            .collect()
    }

    /// Bytes in the warm pool (not counted by [`Store::bytes_held`]: they
    /// hold no version and are given back on demand).
    pub fn warm_bytes(&self) -> u64 {
        self.warm_files().iter().map(|(_, len)| len).sum()
    }

    /// Adds a file of `len` bytes with every page backed to the warm pool
    /// (the slow part of a new file: tmpfs allocates and zeroes each page).
    /// It is made under a temporary name and appears whole.
    pub fn fill_warm(&self, len: u64) -> Result<()> {
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let dir = self.root.join(WARM);
        fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
        let name = format!("w{}-{}", std::process::id(), MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(format!("{name}.data")));
        let file =
            OpenOptions::new().read(true).write(true).create_new(true).open(&tmp).map_err(io("cannot create", &tmp))?;
        // Zeroed as well as allocated (on failure the file has been
        // removed): a version's file taken from the pool then only maps it.
        drop(self.size_back_and_map(&file, &tmp, len, false)?);
        fs::rename(&tmp, &path).map_err(io("cannot rename into", &path))
    }

    /// Moves the warm file that best fits `len` bytes (the smallest one at
    /// least that large, else the largest) to `dest`, for the caller to cut
    /// or grow; only files of half to twice `len`, and only for `len` of
    /// [`WARM_MIN`] or more, so that little of a file's zeroing is wasted.
    /// False when none fits. Agents of several applications take from it at
    /// once: a file another one took first is skipped.
    fn take_warm(&self, dest: &Path, len: u64) -> Result<bool> {
        if len < WARM_MIN {
            return Ok(false);
        }
        let mut files = self.warm_files();
        files.retain(|(_, size)| *size >= len / 2 && *size <= len.saturating_mul(2));
        // Fitting ones first, smallest first; then the rest, largest first.
        files.sort_by_key(|(_, size)| if *size >= len { (0, *size) } else { (1, u64::MAX - size) });
        for (path, _) in files {
            match fs::rename(&path, dest) {
                Ok(()) => return Ok(true),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                Err(err) => return Err(StoreError::Io { what: "cannot take", path, error: err }),
            }
        }
        Ok(false)
    }

    /// Deletes warm files until at least `bytes` are freed or none is left;
    /// the bytes freed.
    pub fn release_warm(&self, bytes: u64) -> u64 {
        let mut freed = 0;
        for (path, len) in self.warm_files() {
            if freed >= bytes {
                break;
            }
            if fs::remove_file(&path).is_ok() {
                freed += len;
            }
        }
        freed
    }

    /// Size and free space of the file system the store lives on (of its
    /// nearest existing ancestor before the store is created).
    pub fn capacity(&self) -> Result<Capacity> {
        let mut dir = self.root.as_path();
        while !dir.exists() {
            dir = dir.parent().unwrap_or(Path::new("/"));
        }
        let stat = nix::sys::statvfs::statvfs(dir).map_err(|errno| StoreError::Io {
            what: "cannot stat the file system of",
            path: dir.into(),
            error: errno.into(),
        })?;
        let fragment = stat.fragment_size() as u64;
        Ok(Capacity { total: stat.blocks() as u64 * fragment, available: stat.blocks_available() as u64 * fragment })
    }

    /// Deletes what a manager that died mid-commit left behind: data files
    /// without a manifest and half-written manifests. Only for a manager
    /// starting up, when none of its agents can be writing. Returns the files
    /// and bytes removed.
    pub fn sweep_unsealed(&self) -> (usize, u64) {
        let mut removed = (0, 0);
        // A warm file the dying manager was still making.
        for entry in fs::read_dir(self.root.join(WARM)).into_iter().flatten().filter_map(|e| e.ok()) {
            if entry.file_name().to_string_lossy().ends_with(".tmp") {
                let bytes = entry.metadata().map_or(0, |m| m.len());
                if fs::remove_file(entry.path()).is_ok() {
                    removed.0 += 1;
                    removed.1 += bytes;
                }
            }
        }
        let Ok(apps) = fs::read_dir(&self.root) else { return removed };
        for rank_dir in apps.filter_map(|e| e.ok()).filter_map(|app| fs::read_dir(app.path()).ok()).flatten() {
            let Ok(rank_dir) = rank_dir else { continue };
            let Ok(files) = fs::read_dir(rank_dir.path()) else { continue };
            for file in files.filter_map(|e| e.ok()) {
                let name = file.file_name().to_string_lossy().into_owned();
                let stale = match name.strip_suffix(".data").or_else(|| name.strip_suffix(".map")) {
                    Some(stem) if stem.starts_with('v') => !rank_dir.path().join(format!("{stem}.meta")).exists(),
                    _ => name.ends_with(".meta.tmp") || name.ends_with(".map.tmp"),
                };
                if stale {
                    let bytes = file.metadata().map_or(0, |m| m.len());
                    if fs::remove_file(file.path()).is_ok() {
                        removed.0 += 1;
                        removed.1 += bytes;
                    }
                }
            }
        }
        removed
    }

    /// Makes the rank's spare file the data file of `version` without
    /// mapping it, for a caller that still holds the spare's mapping (the
    /// mapping follows the file through the rename). False if there is no spare.
    pub fn reuse_spare(&self, app: &str, rank: u32, version: u64, len: u64) -> Result<bool> {
        self.reuse_named(SPARE, app, rank, version, len)
    }

    /// Renames the rank's file `name` to the data file of `version` if it
    /// has the version's size.
    fn reuse_named(&self, name: &str, app: &str, rank: u32, version: u64, len: u64) -> Result<bool> {
        note_version_file(len);
        let dir = self.rank_dir(app, rank)?;
        let spare = dir.join(name);
        let on_disk = fs::metadata(&spare).map(|m| m.len()).ok();
        if on_disk != Some(len.max(4096)) {
            return Ok(false);
        }
        let (data, meta) = self.paths(app, rank, version)?;
        let _ = fs::remove_file(&meta);
        fs::rename(&spare, &data).map_err(io("cannot reuse", &spare))?;
        Ok(true)
    }

    /// Writes the manifest of a version whose data is complete (atomically).
    pub fn seal(&self, manifest: &Manifest) -> Result<()> {
        let (data, _) = self.paths(&manifest.app, manifest.rank, manifest.version)?;
        // A whole version: a block map left by an earlier version of the
        // same number (an interrupted run's) must not describe it.
        remove_if_present(&data.with_extension("map"))?;
        self.publish(manifest)
    }

    /// Renames the manifest into place: the moment the version is stored.
    fn publish(&self, manifest: &Manifest) -> Result<()> {
        let (data, meta) = self.paths(&manifest.app, manifest.rank, manifest.version)?;
        let tmp = Self::write_description(&data, &meta, manifest)?;
        // A crash here leaves data and a temporary manifest: never served.
        icheck_core::failpoint::hit("store.before_manifest_rename");
        fs::rename(&tmp, &meta).map_err(io("cannot rename into", &meta))
    }

    /// Deletes the data file of a version that was never sealed (its rank
    /// went away mid-commit). A sealed version is left alone. True if a
    /// file was deleted.
    pub fn discard_unsealed(&self, app: &str, rank: u32, version: u64) -> Result<bool> {
        if self.is_sealed(app, rank, version) {
            return Ok(false);
        }
        remove_if_present(&self.paths(app, rank, version)?.0)
    }

    /// Deletes one stored version (manifest first, so it can no longer be
    /// opened), e.g. because its data was found damaged.
    pub fn remove_version(&self, app: &str, rank: u32, version: u64) -> Result<()> {
        let (data, meta) = self.paths(app, rank, version)?;
        remove_if_present(&meta)?;
        remove_if_present(&data.with_extension("map"))?;
        // Newer incremental versions may share its blocks: kept (or freed)
        // by what their maps use.
        let shared = data.with_file_name(format!("b{version}.data"));
        match fs::rename(&data, &shared) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::Io { what: "cannot remove", path: data, error })
            }
            _ => {}
        }
        let dir = self.rank_dir(app, rank)?;
        self.collect_shared_blocks(&dir, &blocks_in_use(&dir)?)
    }

    /// A stored version's manifest, checked to describe that version.
    pub fn manifest(&self, app: &str, rank: u32, version: u64) -> Result<Manifest> {
        let (_, meta) = self.paths(app, rank, version)?;
        let bytes = fs::read(&meta).map_err(|_| StoreError::Missing { app: app.to_string(), rank, version })?;
        let manifest: Manifest = format::decode_stored(&bytes)
            .map_err(|e| StoreError::BadManifest { path: meta.clone(), reason: e.to_string() })?;
        if manifest.app != app || manifest.rank != rank || manifest.version != version {
            return Err(StoreError::BadManifest { path: meta, reason: "it describes another version".into() });
        }
        manifest.validate().map_err(|e| StoreError::BadManifest { path: meta.clone(), reason: e.to_string() })?;
        Ok(manifest)
    }

    /// The path of a version's data file.
    pub fn data_path(&self, app: &str, rank: u32, version: u64) -> Result<PathBuf> {
        Ok(self.paths(app, rank, version)?.0)
    }

    /// The identity of a sealed version's data file as it is now: a
    /// rewrite, a cut, a rename or a removal changes it (see
    /// [`FileIdentity`]).
    pub fn data_identity(&self, app: &str, rank: u32, version: u64) -> Result<FileIdentity> {
        let (data, _) = self.paths(app, rank, version)?;
        let meta = fs::metadata(&data).map_err(|_| StoreError::Missing { app: app.to_string(), rank, version })?;
        Ok(FileIdentity::of(&meta))
    }

    /// A sealed version's bytes as read-only files for a reader on this
    /// host ([`icheck_core::handoff`]): its own data file, and for an
    /// incremental version every file holding its blocks, with where each
    /// range of the version lies in them; and its own data file's identity
    /// as opened (taken from the open file, so it describes exactly what
    /// the reader reads).
    pub fn open_read_only(
        &self,
        app: &str,
        rank: u32,
        version: u64,
    ) -> Result<(Vec<File>, Vec<FileExtent>, FileIdentity)> {
        let manifest = self.manifest(app, rank, version)?;
        let (data, _) = self.paths(app, rank, version)?;
        let missing = || StoreError::Missing { app: app.to_string(), rank, version };
        let own = File::open(&data).map_err(|_| missing())?;
        let meta = own.metadata().map_err(|_| missing())?;
        let identity = FileIdentity::of(&meta);
        let Some(blocks) = read_block_map(&data, version, manifest.total_len, meta.len())? else {
            holds_whole(&data, meta.len(), &manifest)?;
            let whole = (manifest.total_len > 0).then_some(FileExtent {
                offset: 0,
                len: manifest.total_len,
                file: 0,
                file_offset: 0,
            });
            return Ok((vec![own], whole.into_iter().collect(), identity));
        };
        let (mut files, extents) = block_files(&data, &blocks)?;
        // An empty version holds no block: its own file goes all the same.
        if files.is_empty() {
            files.push(own);
        }
        Ok((files, extents, identity))
    }

    /// Opens a stored version: its manifest and its mapped data.
    pub fn open(&self, app: &str, rank: u32, version: u64) -> Result<(Manifest, MappedFile)> {
        let manifest = self.manifest(app, rank, version)?;
        let (data, meta) = self.paths(app, rank, version)?;
        let missing = || StoreError::Missing { app: app.to_string(), rank, version };
        let file = OpenOptions::new().read(true).write(true).open(&data).map_err(|_| missing())?;
        let on_disk = file.metadata().map_err(io("cannot stat", &data))?.len();
        if let Some(blocks) = read_block_map(&data, version, manifest.total_len, on_disk)? {
            let view = self.compose(&data, &blocks)?;
            return Ok((manifest, view));
        }
        holds_whole(&meta, on_disk, &manifest)?;
        let mapped = map(&file, &data, manifest.total_len, true)?;
        Ok((manifest, mapped))
    }

    /// Maps an incremental version's blocks, each from the file holding
    /// it, into one read-only range of address space.
    fn compose(&self, data: &Path, blocks: &BlockMap) -> Result<MappedFile> {
        use nix::sys::mman::{mmap, mmap_anonymous, MapFlags, ProtFlags};
        use std::num::NonZeroUsize;
        let len = usize::try_from(blocks.total_len).unwrap_or(usize::MAX);
        let page = 4096usize;
        let mapped = NonZeroUsize::new(len.next_multiple_of(page).max(page)).expect("at least a page");
        let failed =
            |errno: nix::errno::Errno| StoreError::Io { what: "cannot map", path: data.into(), error: errno.into() };
        // SAFETY: a fresh private range chosen by the kernel; nothing else
        // refers to it. PROT_NONE until the blocks are mapped over it.
        let base = unsafe {
            mmap_anonymous(None, mapped, ProtFlags::PROT_NONE, MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE)
        }
        .map_err(failed)?;
        // Owned from here: an error below unmaps the whole range.
        let view = ComposedView { base, mapped: mapped.get() };
        let (files, extents) = block_files(data, blocks)?;
        for extent in &extents {
            let start = usize::try_from(extent.offset).unwrap_or(usize::MAX);
            let Some(length) = NonZeroUsize::new(usize::try_from(extent.len).unwrap_or(usize::MAX)) else { continue };
            let at = NonZeroUsize::new(view.base.as_ptr() as usize + start).expect("inside a non-null range");
            // SAFETY: `at..at + length` lies inside the range `view` owns
            // (an extent ends at or before `len <= mapped`); MAP_FIXED
            // replaces only that part of it. The files are the store's own,
            // never truncated while sealed, and `block_files` checked that
            // each extent lies inside its file's pages.
            unsafe {
                mmap(
                    Some(at),
                    length,
                    ProtFlags::PROT_READ,
                    MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                    &files[extent.file as usize],
                    i64::try_from(extent.file_offset).unwrap_or(i64::MAX),
                )
            }
            .map_err(failed)?;
            // Not MAP_POPULATE: that holds the process's memory-map lock
            // while it maps the whole extent (see `pages::populate_read`).
            // Populating is only to save faults later; where it fails, the
            // pages fault in when read.
            let _ = pages::populate_read(at.get(), length.get());
        }
        Ok(MappedFile { mapping: Mapping::Composed(view), len })
    }

    /// Whether `version` of a rank is sealed (its manifest is in place).
    pub fn is_sealed(&self, app: &str, rank: u32, version: u64) -> bool {
        self.paths(app, rank, version).is_ok_and(|(_, meta)| meta.exists())
    }

    /// Versions of a rank that have a manifest, ascending.
    pub fn sealed_versions(&self, app: &str, rank: u32) -> Result<Vec<u64>> {
        let dir = self.rank_dir(app, rank)?;
        let mut versions: Vec<u64> = match fs::read_dir(&dir) {
            Ok(entries) => entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    name.strip_prefix('v')?.strip_suffix(".meta")?.parse().ok()
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        versions.sort_unstable();
        Ok(versions)
    }

    /// Drops every version older than `keep_from` (retention: the newest
    /// complete version and anything newer stay) except the `pinned` ones
    /// (a PFS copy still reads them). Manifests go first, so a dropped
    /// version can never be opened; the newest dropped data file becomes the
    /// rank's spare for the next version, the rest are deleted.
    pub fn prune(&self, app: &str, rank: u32, keep_from: u64, pinned: &BTreeSet<u64>) -> Result<Pruned> {
        let dir = self.rank_dir(app, rank)?;
        let mut pruned = Pruned::default();
        let Ok(entries) = fs::read_dir(&dir) else { return Ok(pruned) };
        let mut data_files = Vec::new();
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((number, kind)) = name.strip_prefix('v').and_then(|rest| rest.split_once('.')) else { continue };
            let Some(version) = number.parse::<u64>().ok().filter(|v| *v < keep_from) else { continue };
            if pinned.contains(&version) {
                pruned.pinned.insert(version);
                continue;
            }
            if kind == "data" {
                data_files.push((version, entry.path()));
            } else {
                fs::remove_file(entry.path()).map_err(io("cannot remove", &entry.path()))?;
            }
            pruned.removed += 1;
        }
        data_files.sort();
        // Data that retained incremental versions still share is kept as
        // shared blocks, never reused as the spare.
        let used = blocks_in_use(&dir)?;
        let (shared, mut data_files): (Vec<_>, Vec<_>) =
            data_files.into_iter().partition(|(version, _)| used.contains_key(version));
        for (version, path) in &shared {
            let kept = dir.join(format!("b{version}.data"));
            fs::rename(path, &kept).map_err(io("cannot keep the shared blocks of", path))?;
        }
        self.collect_shared_blocks(&dir, &used)?;
        if let Some((version, newest)) = data_files.pop() {
            let spare = dir.join(SPARE);
            fs::rename(&newest, &spare).map_err(io("cannot keep as spare", &newest))?;
            pruned.spare = Some(version);
        }
        for (_, path) in data_files {
            fs::remove_file(&path).map_err(io("cannot remove", &path))?;
        }
        Ok(pruned)
    }

    /// Deletes all versions of one rank of an application (the rank moved
    /// to an agent on another node).
    pub fn remove_rank(&self, app: &str, rank: u32) -> Result<()> {
        let dir = self.rank_dir(app, rank)?;
        match fs::remove_dir_all(&dir) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(StoreError::Io { what: "cannot remove", path: dir, error })
            }
            _ => Ok(()),
        }
    }

    /// Deletes all checkpoints of an application.
    pub fn remove_app(&self, app: &str) -> Result<()> {
        check_app_name(app)?;
        let dir = self.root.join(app);
        let removed = match fs::remove_dir_all(&dir) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(StoreError::Io { what: "cannot remove", path: dir, error })
            }
            _ => Ok(()),
        };
        self.sweep_kept();
        removed
    }

    fn piece_paths(&self, app: &str, version: u64, piece: PieceId) -> Result<(PathBuf, PathBuf)> {
        check_app_name(app)?;
        let dir = self.root.join(app).join(PIECES);
        let stem = format!("v{version}.{}", piece_name(piece));
        Ok((dir.join(format!("{stem}.data")), dir.join(format!("{stem}.meta"))))
    }

    /// The spare data file of `piece`: an older version's piece, kept when
    /// it was dropped so that the next version's piece reuses its pages.
    fn piece_spare(&self, app: &str, piece: PieceId) -> Result<PathBuf> {
        check_app_name(app)?;
        Ok(self.root.join(app).join(PIECES).join(format!("{SPARE_PREFIX}{}.data", piece_name(piece))))
    }

    /// Creates the data file of a piece of redundancy and maps it. The
    /// piece's spare file (the same piece of a dropped version) is reused
    /// when there is one: allocating and zeroing a fresh file's pages is
    /// most of what building a copy costs on a busy node.
    pub fn create_piece(&self, app: &str, version: u64, piece: PieceId, len: u64) -> Result<MappedFile> {
        let (data, meta) = self.piece_paths(app, version, piece)?;
        let dir = data.parent().expect("a piece's file is inside the pieces directory");
        fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        let _ = fs::remove_file(&meta);
        let spare = self.piece_spare(app, piece)?;
        let reused = fs::rename(&spare, &data).is_ok();
        self.sweep_kept();
        if reused {
            if let Some(file) = self.take_kept(&data, len) {
                return Ok(file);
            }
        }
        // A reused file keeps its pages (it is not truncated; set_len
        // gives it the new length).
        self.create_mapped(&data, len, !reused)
    }

    /// Keeps `file`, the mapping of version `version`'s sealed `piece`, so
    /// that when the piece is dropped and becomes the next version's spare,
    /// [`Store::create_piece`] takes the mapping as it is. Mapping a reused
    /// 256 MiB piece again cost 50-200 ms of a protection on a busy node
    /// (every page's entry made anew), about a fifth of its time. A kept
    /// mapping never outlives its file's last name (swept at every drop
    /// or discard of a piece), so it holds no memory a deleted file would
    /// have given back.
    pub fn keep_piece_mapping(&self, app: &str, version: u64, piece: PieceId, file: MappedFile) {
        if let Ok((data, _)) = self.piece_paths(app, version, piece) {
            self.keep_mapping(&data, file);
        }
    }

    /// Keeps `file`, a mapping of the file at `path` (see
    /// [`Store::keep_piece_mapping`]).
    fn keep_mapping(&self, path: &Path, file: MappedFile) {
        let Mapping::File(map) = file.mapping else { return };
        let Ok(opened) = File::open(path) else { return };
        let Ok(inode) = opened.metadata().map(|m| m.ino()) else { return };
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.retain(|k| k.inode != inode);
        if kept.len() >= MAX_KEPT_MAPPINGS {
            kept.remove(0);
        }
        kept.push(KeptMapping { file: opened, inode, map });
    }

    /// The kept mapping of the file at `path`, if it has `len` bytes (at
    /// least a page) mapped.
    fn take_kept(&self, path: &Path, len: u64) -> Option<MappedFile> {
        let inode = fs::metadata(path).ok()?.ino();
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let at = kept.iter().position(|k| k.inode == inode)?;
        let found = kept.swap_remove(at);
        let whole = usize::try_from(len.max(4096)).ok()?;
        (found.map.len() == whole && found.file.metadata().is_ok_and(|m| m.len() == len.max(4096)))
            .then(|| MappedFile { mapping: Mapping::File(found.map), len: usize::try_from(len).unwrap_or(usize::MAX) })
    }

    /// Lets go of kept mappings whose file no longer has a name.
    fn sweep_kept(&self) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.retain(|k| k.file.metadata().is_ok_and(|m| m.nlink() > 0));
    }

    /// How many piece mappings are kept (for tests).
    #[cfg(test)]
    fn kept_mappings(&self) -> usize {
        self.sweep_kept();
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Gives `piece` a spare file now, the length of version `version`'s
    /// piece, when it has none: the first two versions of a protected
    /// application found no dropped piece to reuse, and allocating a fresh
    /// file was most of their protection (256 MiB shards: 1.3-2.0 s of a
    /// 2.2-3.1 s protection, against about 60 ms with a spare). The file is
    /// allocated and its pages zeroed under a temporary name, and linked
    /// into place only if no spare appeared meanwhile, so a piece being created never sees a
    /// half-made spare. False when the piece already had one.
    pub fn prepare_piece_spare(&self, app: &str, version: u64, piece: PieceId) -> Result<bool> {
        if !self.needs_piece_spare(app, version, piece)? {
            return Ok(false);
        }
        let spare = self.piece_spare(app, piece)?;
        let (data, _) = self.piece_paths(app, version, piece)?;
        let len = fs::metadata(&data).map_err(io("cannot read", &data))?.len();
        let making = spare.with_extension("data.new");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&making)
            .map_err(io("cannot create", &making))?;
        // Backed and zeroed now (tmpfs zeroes a page only when it is first
        // mapped): that is what makes the spare cheap to take (the second
        // version's shard still took 0.54 s when it was only allocated).
        // On failure (a full store) the file has been removed.
        let mapped = self.size_back_and_map(&file, &making, len, true)?;
        let linked = fs::hard_link(&making, &spare);
        remove_if_present(&making)?;
        match linked {
            Ok(()) => {
                self.keep_mapping(&spare, mapped);
                Ok(true)
            }
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(err) => Err(StoreError::Io { what: "cannot link", path: spare, error: err }),
        }
    }

    /// Whether `piece` of version `version` lacks a spare for the next
    /// version: it has none, and no older version's piece will become one
    /// when it is dropped.
    pub fn needs_piece_spare(&self, app: &str, version: u64, piece: PieceId) -> Result<bool> {
        Ok(!self.piece_spare(app, piece)?.exists() && !self.has_older_piece(app, version, piece)?)
    }

    /// Whether a version older than `version` has a data file of `piece`.
    fn has_older_piece(&self, app: &str, version: u64, piece: PieceId) -> Result<bool> {
        let (data, _) = self.piece_paths(app, version, piece)?;
        let dir = data.parent().expect("a piece's file is inside the pieces directory");
        let suffix = format!(".{}.data", piece_name(piece));
        let older = |name: &str| {
            name.strip_prefix('v')
                .and_then(|rest| rest.strip_suffix(&suffix))
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v < version)
        };
        Ok(fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .any(|e| older(&e.file_name().to_string_lossy())))
    }

    /// Deletes a piece's data file that was never sealed (its writer went
    /// away or wrote bytes that fail their checksums).
    pub fn discard_piece(&self, app: &str, version: u64, piece: PieceId) -> Result<()> {
        let (data, meta) = self.piece_paths(app, version, piece)?;
        if !meta.exists() {
            remove_if_present(&data)?;
        }
        self.sweep_kept();
        Ok(())
    }

    /// Writes the description of a piece whose data is complete (atomically,
    /// as [`seal`](Self::seal) does for versions).
    pub fn seal_piece(&self, app: &str, version: u64, piece: PieceId, meta: &PieceMeta) -> Result<()> {
        let (data, path) = self.piece_paths(app, version, piece)?;
        let tmp = Self::write_description(&data, &path, meta)?;
        fs::rename(&tmp, &path).map_err(io("cannot rename into", &path))
    }

    /// Opens a sealed piece: its description (checked) and its mapped data.
    pub fn open_piece(&self, app: &str, version: u64, piece: PieceId) -> Result<(PieceMeta, MappedFile)> {
        let (data, path) = self.piece_paths(app, version, piece)?;
        let missing = || StoreError::MissingPiece { app: app.to_string(), version, piece };
        let bytes = fs::read(&path).map_err(|_| missing())?;
        let bad = |reason: String| StoreError::BadManifest { path: path.clone(), reason };
        let meta: PieceMeta = format::decode_stored(&bytes).map_err(|e| bad(e.to_string()))?;
        let len = meta.check(app, version, piece).map_err(bad)?;
        let file = OpenOptions::new().read(true).write(true).open(&data).map_err(|_| missing())?;
        let on_disk = file.metadata().map_err(io("cannot stat", &data))?.len();
        if on_disk < len {
            return Err(bad(format!("data file holds {on_disk} bytes, the description says {len}")));
        }
        let mapped = map(&file, &data, len, true)?;
        Ok((meta, mapped))
    }

    /// Deletes every rank's versions `above + 1 ..= through` (manifests
    /// first): the controller fell back to `above` after a node loss took
    /// them, and the application writes those numbers again. Pieces stay.
    /// Returns how many files went.
    pub fn drop_newer(&self, app: &str, above: u64, through: u64) -> Result<usize> {
        check_app_name(app)?;
        let mut removed = 0;
        let ranks = fs::read_dir(self.root.join(app)).into_iter().flatten().filter_map(|e| e.ok());
        for rank in ranks.filter(|e| e.file_name().to_string_lossy().starts_with("rank")) {
            let mut newer: Vec<(u8, PathBuf)> = Vec::new();
            for entry in fs::read_dir(rank.path()).into_iter().flatten().filter_map(|e| e.ok()) {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some((version, kind)) = name.strip_prefix('v').and_then(|rest| rest.split_once('.')) else {
                    continue;
                };
                if version.parse::<u64>().is_ok_and(|v| v > above && v <= through) {
                    // Manifests first: a version half removed can never be opened.
                    newer.push((u8::from(kind != "meta"), entry.path()));
                }
            }
            newer.sort();
            for (_, path) in newer {
                if remove_if_present(&path)? {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Deletes the application's pieces of versions older than `below`,
    /// keeping the newest data file of each piece as its spare (see
    /// [`create_piece`](Self::create_piece)). Returns how many files went.
    pub fn drop_pieces_below(&self, app: &str, below: u64) -> Result<usize> {
        check_app_name(app)?;
        let dir = self.root.join(app).join(PIECES);
        let mut dropped: Vec<(u64, PathBuf, String)> = Vec::new();
        for entry in fs::read_dir(&dir).into_iter().flatten().filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((version, rest)) = name.strip_prefix('v').and_then(|rest| rest.split_once('.')) else { continue };
            let Ok(version) = version.parse::<u64>() else { continue };
            if version < below {
                dropped.push((version, entry.path(), rest.to_string()));
            }
        }
        // Newest first: the first data file of each piece becomes its spare.
        dropped.sort_by_key(|d| std::cmp::Reverse(d.0));
        let mut removed = 0;
        for (_, path, rest) in dropped {
            if let Some(stem) = rest.strip_suffix(".data") {
                let spare = dir.join(format!("{SPARE_PREFIX}{stem}.data"));
                if !spare.exists() {
                    fs::rename(&path, &spare).map_err(io("cannot keep as spare", &path))?;
                    removed += 1;
                    continue;
                }
            }
            if remove_if_present(&path)? {
                removed += 1;
            }
        }
        self.sweep_kept();
        Ok(removed)
    }

    /// Every sealed version in the store, each verified against its
    /// manifest's checksums (what a manager announces to the controller).
    /// Sealed files never change, so `cache` remembers what was verified
    /// (by manifest file identity) and only new versions are read.
    pub fn inventory(&self, cache: &mut InventoryCache) -> Vec<StoredVersion> {
        use std::os::unix::fs::MetadataExt;
        let mut found = Vec::new();
        let mut seen = BTreeSet::new();
        for (app, app_dir) in self.app_dirs() {
            let ranks = fs::read_dir(app_dir).into_iter().flatten().filter_map(|e| e.ok());
            for rank_entry in ranks {
                let name = rank_entry.file_name();
                let Some(rank) = name.to_str().and_then(|n| n.strip_prefix("rank")).and_then(|r| r.parse().ok()) else {
                    continue;
                };
                for version in self.sealed_versions(&app, rank).unwrap_or_default() {
                    let Ok((_, meta)) = self.paths(&app, rank, version) else { continue };
                    let Ok(stat) = fs::metadata(&meta) else { continue };
                    let identity = (stat.ino(), stat.mtime(), stat.mtime_nsec());
                    seen.insert(meta.clone());
                    if let Some((known, stored)) = cache.verified.get(&meta) {
                        if *known == identity {
                            found.push(stored.clone());
                            continue;
                        }
                    }
                    let stored = self.verify_version(&app, rank, version, &meta);
                    cache.verified.insert(meta, (identity, stored.clone()));
                    found.push(stored);
                }
            }
        }
        cache.verified.retain(|path, _| seen.contains(path));
        found
    }

    /// Each application directory under the root with a valid name: (name,
    /// path). Others (the warm pool's, strays) are skipped.
    fn app_dirs(&self) -> impl Iterator<Item = (String, PathBuf)> {
        let entries = fs::read_dir(&self.root).into_iter().flatten().filter_map(|e| e.ok());
        entries.filter_map(|entry| {
            let app = entry.file_name().into_string().ok().filter(|app| check_app_name(app).is_ok())?;
            Some((app, entry.path()))
        })
    }

    /// Deletes `app`'s pieces of `version` other than `keep` (data and
    /// description files, sealed or not): no record places them here any
    /// more (the version was protected under a new plan and these belonged
    /// to the old one, or this node was away while a rebuild made them
    /// elsewhere). Other versions' pieces and the spares stay. Returns how
    /// many files went.
    pub fn drop_stale_pieces(&self, app: &str, version: u64, keep: &[PieceId]) -> Result<usize> {
        check_app_name(app)?;
        let dir = self.root.join(app).join(PIECES);
        let mut removed = 0;
        for entry in fs::read_dir(&dir).into_iter().flatten().filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".data").or_else(|| name.strip_suffix(".meta"));
            let stale =
                stem.and_then(parse_piece_file_name).is_some_and(|(v, piece)| v == version && !keep.contains(&piece));
            if stale && remove_if_present(&entry.path())? {
                removed += 1;
            }
        }
        self.sweep_kept();
        Ok(removed)
    }

    /// Every sealed piece of redundancy in the store whose description
    /// checks and whose data file is as long as it says (what a manager
    /// announces beside its versions). The data is not read: a rebuild
    /// checks what it reads.
    pub fn piece_inventory(&self) -> Vec<StoredPiece> {
        let mut found = Vec::new();
        for (app, app_dir) in self.app_dirs() {
            let files = fs::read_dir(app_dir.join(PIECES)).into_iter().flatten().filter_map(|e| e.ok());
            for file in files {
                let name = file.file_name();
                let Some((version, piece)) = name.to_str().and_then(parse_piece_meta_name) else { continue };
                if self.open_piece(&app, version, piece).is_ok() {
                    found.push(StoredPiece { app: app.clone(), version, piece });
                }
            }
        }
        found.sort_by(|a, b| (&a.app, a.version, a.piece).cmp(&(&b.app, b.version, b.piece)));
        found
    }

    /// Reads one sealed version and checks its data against its manifest.
    fn verify_version(&self, app: &str, rank: u32, version: u64, meta: &Path) -> StoredVersion {
        let manifest_crc = fs::read(meta).map_or(0, |bytes| crc32c::crc32c(&bytes));
        let mut stored = StoredVersion { app: app.to_string(), rank, version, writers: 0, manifest_crc, damage: None };
        match self.open(app, rank, version) {
            Ok((manifest, data)) => {
                stored.writers = manifest.ranks;
                stored.damage = manifest.verify(data.as_slice()).err().map(|e| e.to_string());
            }
            Err(err) => stored.damage = Some(err.to_string()),
        }
        stored
    }

    /// Bytes of data files under the root.
    pub fn bytes_held(&self) -> u64 {
        fn walk(dir: &Path) -> u64 {
            fs::read_dir(dir).map_or(0, |entries| {
                entries
                    .filter_map(|e| e.ok())
                    .filter(|e| e.file_name() != WARM)
                    .map(|e| match e.file_type() {
                        Ok(t) if t.is_dir() => walk(&e.path()),
                        // Shared blocks hold only what was not punched out.
                        _ if shared_version(&e).is_some() => e.metadata().map_or(0, |m| m.blocks().saturating_mul(512)),
                        _ => e.metadata().map_or(0, |m| m.len()),
                    })
                    .sum()
            })
        }
        walk(&self.root)
    }
}

/// A piece's name in its files' names (after `v<version>.` or `spare.`).
fn piece_name(piece: PieceId) -> String {
    match piece {
        PieceId::Copy { rank } => format!("copy{rank}"),
        PieceId::Parity { group, index } => format!("parity{group}-{index}"),
        PieceId::Slice { group, index } => format!("slice{group}-{index}"),
    }
}

/// The version and piece of a sealed piece's description file's name,
/// `v<V>.<piece>.meta` ([`piece_name`]); `None` for any other name.
fn parse_piece_meta_name(name: &str) -> Option<(u64, PieceId)> {
    parse_piece_file_name(name.strip_suffix(".meta")?)
}

/// The version and piece of a piece's file name without its extension,
/// `v<V>.<piece>`; `None` for any other name (a spare's included).
fn parse_piece_file_name(stem: &str) -> Option<(u64, PieceId)> {
    let (version, piece) = stem.strip_prefix('v')?.split_once('.')?;
    let group_and_index = |rest: &str| -> Option<(u32, u8)> {
        let (group, index) = rest.split_once('-')?;
        Some((group.parse().ok()?, index.parse().ok()?))
    };
    let piece = if let Some(rank) = piece.strip_prefix("copy") {
        PieceId::Copy { rank: rank.parse().ok()? }
    } else if let Some(rest) = piece.strip_prefix("parity") {
        let (group, index) = group_and_index(rest)?;
        PieceId::Parity { group, index }
    } else {
        let (group, index) = group_and_index(piece.strip_prefix("slice")?)?;
        PieceId::Slice { group, index }
    };
    Some((version.parse().ok()?, piece))
}

/// Opens the data file holding `holder`'s blocks, beside `data`: its
/// version file while it is stored, its shared-blocks file once it was
/// dropped. Tried in that order, so a prune renaming one into the other
/// meanwhile is no error.
fn open_holder(data: &Path, holder: u64) -> Result<(File, PathBuf)> {
    let own = data.with_file_name(format!("v{holder}.data"));
    match File::open(&own) {
        Ok(file) => Ok((file, own)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let shared = data.with_file_name(format!("b{holder}.data"));
            let file = File::open(&shared).map_err(io("cannot open the blocks of", &shared))?;
            Ok((file, shared))
        }
        Err(error) => Err(StoreError::Io { what: "cannot open the blocks of", path: own, error }),
    }
}

/// Refuses a version stored whole whose data file (`on_disk` bytes) is
/// shorter than its manifest says, naming `path`.
fn holds_whole(path: &Path, on_disk: u64, manifest: &Manifest) -> Result<()> {
    if on_disk < manifest.total_len {
        return Err(StoreError::BadManifest {
            path: path.to_path_buf(),
            reason: format!("data file holds {on_disk} bytes, manifest says {}", manifest.total_len),
        });
    }
    Ok(())
}

/// The files holding an incremental version's blocks (`data` is the
/// version's own data file), each opened read-only once, in the order the
/// version first uses them, and where each of its extents lies in them: one
/// reading for [`Store::open`]'s composed mapping and for the files
/// [`Store::open_read_only`] hands over. Refuses an extent past its file's
/// last page (mapped, it would fault with SIGBUS when read).
fn block_files(data: &Path, blocks: &BlockMap) -> Result<(Vec<File>, Vec<FileExtent>)> {
    const PAGE: u64 = 4096;
    let mut files: Vec<File> = Vec::new();
    let mut sizes: Vec<(u64, PathBuf)> = Vec::new();
    let mut holders: std::collections::HashMap<u64, u32> = Default::default();
    let mut extents = Vec::new();
    for extent in blocks.extents() {
        let offset = extent.first * BLOCK_SIZE;
        let len = (extent.count * BLOCK_SIZE).min(blocks.total_len.saturating_sub(offset));
        let holder = extent.source.version;
        let file = match holders.get(&holder) {
            Some(index) => *index,
            None => {
                let (file, path) = open_holder(data, holder)?;
                let on_disk = file.metadata().map_err(io("cannot stat", &path))?.len();
                files.push(file);
                sizes.push((on_disk, path));
                let index = u32::try_from(files.len() - 1).unwrap_or(u32::MAX);
                holders.insert(holder, index);
                index
            }
        };
        let file_offset = extent.source.index * BLOCK_SIZE;
        let (on_disk, path) = &sizes[file as usize];
        if file_offset + len > on_disk.next_multiple_of(PAGE) {
            return Err(StoreError::BadManifest {
                path: path.clone(),
                reason: format!("holds {on_disk} bytes; block {} is past its end", extent.source.index),
            });
        }
        extents.push(FileExtent { offset, len, file, file_offset });
    }
    Ok((files, extents))
}

/// The version whose shared blocks a directory entry holds, if it is such
/// a file (`b<V>.data`).
fn shared_version(entry: &fs::DirEntry) -> Option<u64> {
    let name = entry.file_name();
    let name = name.to_string_lossy();
    name.strip_prefix('b')?.strip_suffix(".data")?.parse().ok()
}

/// Blocks of dropped or older versions' data files, by version, that some
/// sealed version's map uses.
type BlockUse = std::collections::BTreeMap<u64, BTreeSet<u64>>;

/// What the maps of the sealed versions in `dir` use of other versions'
/// data. An unreadable map is an error, never an empty answer: freeing on
/// a guess could destroy a version that is still served.
fn blocks_in_use(dir: &Path) -> Result<BlockUse> {
    let mut used = BlockUse::new();
    let Ok(entries) = fs::read_dir(dir) else { return Ok(used) };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".map").filter(|stem| stem.starts_with('v')) else { continue };
        if !dir.join(format!("{stem}.meta")).exists() {
            continue;
        }
        for (version, blocks) in read_map(&entry.path())?.borrowed() {
            used.entry(version).or_default().extend(blocks);
        }
    }
    Ok(used)
}

/// The block map beside the data file `data` of `version` (`total_len`
/// bytes; the data file holds `data_len`), validated; `None` when the
/// version is whole (it has no map).
fn read_block_map(data: &Path, version: u64, total_len: u64, data_len: u64) -> Result<Option<BlockMap>> {
    let path = data.with_extension("map");
    if !path.exists() {
        return Ok(None);
    }
    let map = read_map(&path)?;
    map.validate(version, total_len, data_len.div_ceil(BLOCK_SIZE))
        .map_err(|reason| StoreError::BadManifest { path, reason })?;
    Ok(Some(map))
}

/// Reads and decodes a block map file (validated by the caller, who knows
/// the version's length).
fn read_map(path: &Path) -> Result<BlockMap> {
    let bytes = fs::read(path).map_err(io("cannot read", path))?;
    format::decode_stored(&bytes).map_err(|e| StoreError::BadManifest { path: path.into(), reason: e.to_string() })
}

/// Gives the pages of `start..end` of a file back to its file system,
/// keeping its length.
fn punch(file: &File, path: &Path, start: u64, end: u64) -> Result<()> {
    use nix::fcntl::{fallocate, FallocateFlags};
    let (offset, len) = (i64::try_from(start).unwrap_or(i64::MAX), i64::try_from(end - start).unwrap_or(i64::MAX));
    fallocate(file, FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE, offset, len).map_err(
        |errno| StoreError::Io { what: "cannot free unused blocks of", path: path.into(), error: errno.into() },
    )
}

/// Deletes a file; one that is already gone is not an error. True if it
/// was there.
fn remove_if_present(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(StoreError::Io { what: "cannot remove", path: path.to_path_buf(), error }),
    }
}

/// Whether every page of `file`'s first `size` bytes has its backing (a
/// reused spare): walking its pages again costs tens of milliseconds per
/// 256 MiB on tmpfs, on the path of every commit and copy.
fn is_backed(file: &File, size: u64) -> bool {
    file.metadata().is_ok_and(|m| m.blocks().saturating_mul(512) >= size)
}

/// Maps all of `file` at `path`, its first `len` bytes being the data;
/// with `populate`, its existing pages are mapped now.
fn map(file: &File, path: &Path, len: u64, populate: bool) -> Result<MappedFile> {
    // SAFETY: the file is private to this store (created under the agent's
    // root); nobody truncates it while mapped, which is memmap2's contract.
    let map = unsafe { memmap2::MmapOptions::new().map_mut(file) }.map_err(io("cannot map", path))?;
    if populate {
        // The file's existing pages are mapped now instead of faulted in one
        // by one during the transfer; in steps, not with MAP_POPULATE, which
        // holds every other thread's mmap (see `pages::populate_read`). A
        // failure only leaves the pages to fault in when used.
        let _ = pages::populate_read(map.as_ptr() as usize, map.len());
    } else {
        // On a tmpfs mounted `huge=advise`, pages not yet backed come as
        // 2 MiB huge pages, as the operator chose by mounting it so (see
        // `pages::HugePages` for when that is cheaper).
        pages::advise_huge(map.as_ptr() as usize, map.len());
    }
    let len = usize::try_from(len).unwrap_or(usize::MAX).min(map.len());
    Ok(MappedFile { mapping: Mapping::File(map), len })
}

#[cfg(test)]
// Fixtures cut counters into bytes on purpose.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use icheck_core::delta::BlockRun;
    use icheck_core::format::samples::single_label as manifest;
    use icheck_core::format::{chunk_crcs, first_bad_chunk, CHUNK_SIZE};

    /// Stores version `version` of rank 0 of "app" as the blocks of `runs`
    /// of `data` over `parent`'s map (whole when `parent` is `None`).
    fn store_blocks(
        store: &Store,
        version: u64,
        data: &[u8],
        parent: Option<&BlockMap>,
        runs: &[BlockRun],
    ) -> BlockMap {
        let total = data.len() as u64;
        let Some(parent) = parent else {
            let mut file = store.create("app", 0, version, total).unwrap();
            file.as_mut_slice().copy_from_slice(data);
            store.seal(&manifest("app", 0, version, data)).unwrap();
            return BlockMap::whole(version, total);
        };
        let written = icheck_core::delta::check_runs(runs, total).unwrap();
        let mut file = store.create("app", 0, version, written).unwrap();
        let mut at = 0;
        for run in runs {
            let (start, end) = (run.first * BLOCK_SIZE, ((run.first + run.count) * BLOCK_SIZE).min(total));
            let len = (end - start) as usize;
            file.as_mut_slice()[at..at + len].copy_from_slice(&data[start as usize..end as usize]);
            at += len;
        }
        let map = parent.next(version, runs);
        store.seal_delta(&manifest("app", 0, version, data), &map).unwrap();
        map
    }

    #[test]
    fn incremental_versions_share_blocks_until_no_version_uses_them() {
        use icheck_core::delta::{BlockRun, BLOCK_BYTES};
        let root = std::env::temp_dir().join(format!("icheck-store-delta-{}", std::process::id()));
        let store = Store::new(&root);
        let dir = root.join("app/rank0");
        let run = |first, count| BlockRun { first, count };
        let mut data: Vec<u8> = (0..4 * BLOCK_BYTES + 100).map(|i| (i % 253) as u8).collect();
        let v1 = store_blocks(&store, 1, &data, None, &[]);
        data[BLOCK_BYTES + 5] = 1;
        let v2 = store_blocks(&store, 2, &data, Some(&v1), &[run(1, 1)]);
        data[4 * BLOCK_BYTES + 7] = 2;
        let v3 = store_blocks(&store, 3, &data, Some(&v2), &[run(4, 1)]);
        let held_before = store.bytes_held();

        // Every version reads back as the bytes it was sealed with.
        let (manifest, view) = store.open("app", 0, 3).unwrap();
        assert!(view.is_composed());
        assert_eq!(view.as_slice(), &data[..]);
        manifest.verify(view.as_slice()).unwrap();
        drop(view);
        assert_eq!(store.block_map("app", 0, 3).unwrap(), Some(v3.clone()));
        assert_eq!(store.block_map("app", 0, 1).unwrap(), Some(v1));
        assert_eq!(store.block_map("app", 0, 9).unwrap(), None);

        // Dropping 1 and 2 keeps what version 3 uses of them, as shared
        // blocks: never the spare, with version 1's unused block punched.
        let pruned = store.prune("app", 0, 3, &BTreeSet::new()).unwrap();
        assert_eq!(pruned.spare, None, "shared data never becomes the spare");
        assert!(!dir.join("v1.meta").exists() && dir.join("b1.data").exists() && dir.join("b2.data").exists());
        let b1 = fs::metadata(dir.join("b1.data")).unwrap();
        assert!(b1.blocks() * 512 <= 3 * BLOCK_SIZE + 4096, "block 1 and 4 of version 1 are freed");
        assert!(store.bytes_held() < held_before);
        let (_, view) = store.open("app", 0, 3).unwrap();
        assert_eq!(view.as_slice(), &data[..], "intact after the prune");
        drop(view);

        // A manager starting up sweeps a half-written map, not shared blocks.
        fs::write(dir.join("v7.map"), b"half").unwrap();
        fs::write(dir.join("v8.map.tmp"), b"half").unwrap();
        store.sweep_unsealed();
        assert!(!dir.join("v7.map").exists() && !dir.join("v8.map.tmp").exists());
        assert!(dir.join("b1.data").exists());

        // Version 4 rewrites everything whole; once 3 goes, nothing is shared.
        data.fill(9);
        store_blocks(&store, 4, &data, None, &[]);
        store.prune("app", 0, 4, &BTreeSet::new()).unwrap();
        let left: BTreeSet<String> =
            fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(left, ["v4.data", "v4.meta", "spare.data"].map(String::from).into_iter().collect());

        // A damaged version removed while a newer one shares its blocks:
        // the blocks stay until the newer version goes too.
        data[0] = 3;
        let v5 = store_blocks(&store, 5, &data, Some(&BlockMap::whole(4, data.len() as u64)), &[run(0, 1)]);
        store.remove_version("app", 0, 4).unwrap();
        assert!(dir.join("b4.data").exists());
        assert_eq!(store.open("app", 0, 5).unwrap().1.as_slice(), &data[..]);
        assert_eq!(v5.borrowed().keys().copied().collect::<Vec<_>>(), vec![4]);
        store.remove_version("app", 0, 5).unwrap();
        assert!(!dir.join("b4.data").exists() && !dir.join("b5.data").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    /// After a fall back to version 2, the newer versions (whole or
    /// incremental, every rank) go, and version 2 still reads back.
    #[test]
    fn versions_newer_than_a_fall_back_are_dropped_and_older_ones_kept() {
        let root = std::env::temp_dir().join(format!("icheck-store-newer-{}", std::process::id()));
        let store = Store::new(&root);
        let mut data = vec![1u8; 3 * 1024 * 1024];
        let v1 = store_blocks(&store, 1, &data, None, &[]);
        data[0] = 2;
        let v2 = store_blocks(&store, 2, &data, Some(&v1), &[BlockRun { first: 0, count: 1 }]);
        let kept = data.clone();
        data[0] = 3;
        store_blocks(&store, 3, &data, Some(&v2), &[BlockRun { first: 0, count: 1 }]);
        store.create("app", 1, 3, 8).unwrap();
        store.seal(&manifest("app", 1, 3, &[0u8; 8])).unwrap();
        store.create("app", 1, 4, 8).unwrap();
        store.seal(&manifest("app", 1, 4, &[0u8; 8])).unwrap();
        assert_eq!(store.drop_newer("app", 2, 3).unwrap(), 5, "rank 0's data, map and manifest; rank 1's two files");
        assert_eq!(store.sealed_versions("app", 0).unwrap(), vec![1, 2]);
        assert_eq!(store.sealed_versions("app", 1).unwrap(), vec![4], "a version newer than the lost ones stays");
        assert_eq!(store.open("app", 0, 2).unwrap().1.as_slice(), &kept[..]);
        assert_eq!(store.drop_newer("app", 2, 3).unwrap(), 0);
        assert!(store.drop_newer("../x", 2, 3).is_err(), "a bad application name is refused");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_whole_version_never_inherits_the_block_map_of_an_earlier_one_of_its_number() {
        let root = std::env::temp_dir().join(format!("icheck-store-staleamp-{}", std::process::id()));
        let store = Store::new(&root);
        let mut data = vec![5u8; 3 * 1024 * 1024];
        let v1 = store_blocks(&store, 1, &data, None, &[]);
        store_blocks(&store, 2, &data, Some(&v1), &[BlockRun { first: 0, count: 1 }]);
        // An interrupted run's version 2 is written again, whole.
        data.fill(6);
        store_blocks(&store, 2, &data, None, &[]);
        let (_, view) = store.open("app", 0, 2).unwrap();
        assert!(!view.is_composed());
        assert_eq!(view.as_slice(), &data[..]);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_damaged_block_map_is_a_typed_error_naming_the_file() {
        let root = std::env::temp_dir().join(format!("icheck-store-badmap-{}", std::process::id()));
        let store = Store::new(&root);
        let data = vec![5u8; 3 * 1024 * 1024];
        let v1 = store_blocks(&store, 1, &data, None, &[]);
        store_blocks(&store, 2, &data, Some(&v1), &[icheck_core::delta::BlockRun { first: 0, count: 1 }]);
        let map = root.join("app/rank0/v2.map");
        let mut bytes = fs::read(&map).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff; // the last reference's index
        fs::write(&map, &bytes).unwrap();
        let err = store.open("app", 0, 2).err().expect("a damaged map is refused").to_string();
        assert!(err.contains("v2.map"), "{err}");
        fs::write(&map, b"garbage").unwrap();
        let err = store.open("app", 0, 2).err().expect("garbage is refused").to_string();
        assert!(err.contains("v2.map"), "{err}");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn version_is_stored_only_after_seal_and_prune_keeps_newer() {
        let dir = std::env::temp_dir().join(format!("icheck-store-test-{}", std::process::id()));
        let store = Store::new(&dir);
        for version in 1..=3u64 {
            let mut file = store.create("app", 0, version, 10).unwrap();
            // SAFETY: test-only write through the stable pointer; nothing else maps it.
            unsafe { std::ptr::write_bytes(file.as_mut_ptr(), version as u8, 10) };
            assert!(store.open("app", 0, version).is_err(), "unsealed version must not open");
            store.seal(&manifest("app", 0, version, file.as_slice())).unwrap();
        }
        assert_eq!(store.sealed_versions("app", 0).unwrap(), vec![1, 2, 3]);
        // Version 1 is pinned (its PFS copy runs): it stays, and 2 is the spare.
        let pruned = store.prune("app", 0, 3, &BTreeSet::from([1])).unwrap();
        assert_eq!((pruned.removed, pruned.spare, pruned.pinned), (2, Some(2), BTreeSet::from([1])));
        assert!(store.open("app", 0, 1).is_ok(), "a pinned version stays readable");
        let pruned = store.prune("app", 0, 3, &BTreeSet::new()).unwrap();
        assert_eq!((pruned.removed, pruned.spare), (2, Some(1)));
        assert!(dir.join("app/rank0").join(SPARE).exists(), "the newest pruned data file is kept as spare");
        let reused = store.create("app", 0, 4, 3).unwrap();
        assert_eq!(reused.as_slice().len(), 3);
        assert!(!dir.join("app/rank0").join(SPARE).exists());
        let (m, data) = store.open("app", 0, 3).unwrap();
        assert_eq!(data.as_slice(), &[3u8; 10]);
        assert_eq!(first_bad_chunk(data.as_slice(), &m.crcs[0]), None);
        assert!(matches!(store.open("app", 0, 2), Err(StoreError::Missing { version: 2, .. })));
        store.remove_app("app").unwrap();
        assert!(store.sealed_versions("app", 0).unwrap().is_empty());
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_prepared_file_counts_as_held_becomes_the_next_version_and_is_never_a_version() {
        let dir = std::env::temp_dir().join(format!("icheck-store-prepared-{}", std::process::id()));
        let store = Store::new(&dir);
        let len = 3 * 4096u64;
        store.reserve_prepared("app", 0, len).unwrap();
        assert_eq!(store.bytes_held(), len, "reserved: counted before its pages are backed");
        let mut prepared = store.map_prepared("app", 0, len).unwrap();
        assert_eq!(prepared.as_slice().len(), len as usize);
        assert!(store.sealed_versions("app", 0).unwrap().is_empty(), "a prepared file is no version");
        assert_eq!(store.sweep_unsealed(), (0, 0), "a starting manager keeps it");
        assert!(!store.reuse_prepared("app", 0, 1, len + 1).unwrap(), "another size is not taken");
        assert!(store.reuse_prepared("app", 0, 1, len).unwrap());
        // SAFETY: test-only write through the stable pointer; nothing else maps it.
        unsafe { std::ptr::write_bytes(prepared.as_mut_ptr(), 7, len as usize) };
        store.seal(&manifest("app", 0, 1, prepared.as_slice())).unwrap();
        assert_eq!(store.open("app", 0, 1).unwrap().1.as_slice(), vec![7u8; len as usize]);
        assert!(!store.reuse_prepared("app", 0, 2, len).unwrap(), "it was used up");

        // With a spare and a prepared file both on the store, a new version
        // takes the spare and the surplus prepared file goes.
        store.create("app", 0, 2, len).unwrap();
        store.seal(&manifest("app", 0, 2, &vec![0u8; len as usize])).unwrap();
        let pruned = store.prune("app", 0, 2, &BTreeSet::new()).unwrap();
        assert_eq!(pruned.spare, Some(1));
        store.reserve_prepared("app", 0, len).unwrap();
        store.create("app", 0, 3, len).unwrap();
        let rank_dir = dir.join("app/rank0");
        assert!(!rank_dir.join(SPARE).exists() && !rank_dir.join(PREPARED).exists());
        assert!(store.discard_prepared("app", 0).is_ok_and(|removed| !removed));

        // `create_new` leaves a prepared file (still being made by another
        // thread) where it is, and makes a file of its own.
        store.reserve_prepared("app", 0, len).unwrap();
        let fresh = store.create_new("app", 0, 4, 4096).unwrap();
        assert_eq!(fresh.as_slice(), vec![0u8; 4096]);
        assert_eq!(fs::metadata(rank_dir.join(PREPARED)).unwrap().len(), len);
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn warm_files_become_new_files_best_fit_first_hold_no_version_and_are_given_back() {
        let dir = std::env::temp_dir().join(format!("icheck-store-warm-{}", std::process::id()));
        let store = Store::new(&dir);
        // Units of 4 MiB: every size here is at least WARM_MIN.
        let page = 4u64 << 20;
        let backed = |path: &Path| fs::metadata(path).unwrap().blocks() * 512;
        for pages in [8, 2, 4] {
            store.fill_warm(pages * page).unwrap();
        }
        assert_eq!(store.warm_bytes(), 14 * page);
        assert_eq!(store.bytes_held(), 0, "the pool holds no version");
        assert!(store.inventory(&mut InventoryCache::default()).is_empty());

        // Three pages: the smallest file that fits (four) is cut to size;
        // its pages were backed by the pool, not by this call.
        let file = store.create("app", 0, 1, 3 * page).unwrap();
        assert_eq!((file.as_slice().len() as u64, store.warm_bytes()), (3 * page, 10 * page));
        assert!(file.as_slice().iter().all(|b| *b == 0), "a warm file holds nothing of anyone");
        // A prepared file is backed as soon as it is reserved: eight pages for six.
        assert!(store.reserve_prepared("app", 1, 6 * page).unwrap(), "taken from the pool");
        assert_eq!(store.warm_bytes(), 2 * page);
        assert!(backed(&dir.join("app/rank1").join(PREPARED)) >= 6 * page);
        assert_eq!(store.bytes_held(), 9 * page, "taken files count as the ranks'");
        // Nothing reaches three pages: the largest of half its size or more
        // is taken and grown.
        store.create_new("app", 2, 1, 3 * page).unwrap();
        assert_eq!(store.warm_bytes(), 0);
        assert!(store.create("app", 3, 1, page).is_ok(), "an empty pool: a file of its own");
        // Neither a file of less than half the size nor a small file takes one.
        store.fill_warm(2 * page).unwrap();
        store.create("app", 4, 1, 5 * page).unwrap();
        store.create("app", 5, 1, 4096).unwrap();
        assert_eq!(store.warm_bytes(), 2 * page);
        assert_eq!(store.release_warm(1), 2 * page);

        // Given back on demand, whole files at a time.
        store.fill_warm(page).unwrap();
        store.fill_warm(page).unwrap();
        assert_eq!(store.release_warm(1), page);
        assert_eq!(store.warm_bytes(), page);
        // A starting manager sweeps a half-made warm file and keeps whole ones.
        fs::write(dir.join(WARM).join("w0-9.tmp"), b"half").unwrap();
        assert_eq!(store.sweep_unsealed().0, 6, "the .tmp and the five unsealed version files");
        assert!(!dir.join(WARM).join("w0-9.tmp").exists());
        assert_eq!(store.warm_bytes(), page);
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_starting_manager_sweeps_unsealed_files_and_keeps_sealed_ones() {
        let dir = std::env::temp_dir().join(format!("icheck-store-sweep-{}", std::process::id()));
        let store = Store::new(&dir);
        let file = store.create("app", 0, 1, 10).unwrap();
        store.seal(&manifest("app", 0, 1, file.as_slice())).unwrap();
        drop(store.create("app", 0, 2, 8192).unwrap());
        drop(store.create("app", 1, 5, 10).unwrap());
        fs::write(dir.join("app/rank0/v3.meta.tmp"), b"half").unwrap();
        assert_eq!(store.sweep_unsealed(), (3, 4096 + 8192 + 4));
        assert_eq!(store.sealed_versions("app", 0).unwrap(), vec![1]);
        assert!(store.open("app", 0, 1).is_ok());
        assert!(!store.discard_unsealed("app", 0, 1).unwrap(), "a sealed version is never discarded");
        assert!(store.capacity().unwrap().total > 0);
        let _ = fs::remove_dir_all(dir);
    }

    /// Each damaged manifest written as a version's `.meta` makes opening
    /// that version a typed error naming the file, never a panic or an
    /// out-of-bounds mapping.
    #[test]
    fn damaged_manifests_in_the_store_are_typed_errors() {
        let dir = std::env::temp_dir().join(format!("icheck-store-damaged-{}", std::process::id()));
        let store = Store::new(&dir);
        let data: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| i as u8).collect();
        for (what, damaged) in icheck_core::format::samples::damaged_manifests(&data) {
            // The name and the position are the file's own, so only the
            // contents lie.
            let damaged = Manifest { app: "app".into(), rank: 1, version: 3, ..damaged };
            let mut file = store.create("app", 1, 3, data.len() as u64).unwrap();
            file.as_mut_slice().copy_from_slice(&data);
            let meta = dir.join("app/rank1/v3.meta");
            fs::write(&meta, icheck_core::format::encode_stored(&damaged).unwrap()).unwrap();
            match store.open("app", 1, 3) {
                Err(StoreError::BadManifest { path, .. }) => assert_eq!(path, meta, "{what}"),
                Err(other) => panic!("{what}: {other}"),
                Ok(_) => {
                    // A name problem the file's own path already rules out.
                    assert!(what.contains("name"), "{what} opened");
                }
            }
        }
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_piece_gets_a_spare_before_any_version_is_dropped() {
        let dir = std::env::temp_dir().join(format!("icheck-store-piece-spare-{}", std::process::id()));
        let store = Store::new(&dir);
        let shard = PieceId::Copy { rank: 0 };
        let mut file = store.create_piece("app", 1, shard, 3 * 4096 + 5).unwrap();
        file.as_mut_slice().fill(1);
        store.seal_piece("app", 1, shard, &PieceMeta::Copy(manifest("app", 0, 1, file.as_slice()))).unwrap();
        drop(file);
        assert!(store.prepare_piece_spare("app", 1, shard).unwrap(), "no spare yet: one is made");
        let spare = dir.join("app/pieces/spare.copy0.data");
        assert_eq!(fs::metadata(&spare).unwrap().len(), 3 * 4096 + 5, "the sealed piece's length");
        assert!(fs::metadata(&spare).unwrap().blocks() * 512 >= 3 * 4096, "its pages are allocated");
        assert!(!store.prepare_piece_spare("app", 1, shard).unwrap(), "one spare per piece");
        let names: BTreeSet<String> = fs::read_dir(dir.join("app/pieces"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".new")), "no file left half-made: {names:?}");
        // Version 2 takes the spare; version 1's piece is untouched.
        let mut file = store.create_piece("app", 2, shard, 3 * 4096 + 5).unwrap();
        assert!(!spare.exists(), "the spare became version 2's piece");
        file.as_mut_slice().fill(2);
        store.seal_piece("app", 2, shard, &PieceMeta::Copy(manifest("app", 0, 2, file.as_slice()))).unwrap();
        assert!(store.open_piece("app", 1, shard).unwrap().1.as_slice().iter().all(|&b| b == 1));
        // Version 1's piece becomes the spare when it is dropped: none is made.
        assert!(!store.prepare_piece_spare("app", 2, shard).unwrap());
        assert!(!spare.exists());
        store.drop_pieces_below("app", 2).unwrap();
        assert!(spare.exists(), "the dropped piece is the spare");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_kept_piece_mapping_is_reused_by_the_next_version_and_never_outlives_its_file() {
        let dir = std::env::temp_dir().join(format!("icheck-store-piece-kept-{}", std::process::id()));
        let store = Store::new(&dir);
        let (copy, len) = (PieceId::Copy { rank: 0 }, 5 * 4096 + 3);
        let seal = |version: u64, fill: u8| {
            let mut file = store.create_piece("app", version, copy, len).unwrap();
            file.as_mut_slice().fill(fill);
            store
                .seal_piece("app", version, copy, &PieceMeta::Copy(manifest("app", 0, version, file.as_slice())))
                .unwrap();
            let at = file.as_slice().as_ptr() as usize;
            store.keep_piece_mapping("app", version, copy, file);
            at
        };
        let first = seal(1, 1);
        let second = seal(2, 2);
        assert_ne!(first, second, "version 2 had no spare: a mapping of its own");
        assert_eq!(store.kept_mappings(), 2, "both sealed pieces' mappings are kept");
        // Version 1's piece is dropped and becomes the spare: version 3
        // takes its kept mapping as it is, and writes through it.
        store.drop_pieces_below("app", 2).unwrap();
        assert_eq!(seal(3, 3), first, "the spare's mapping was reused");
        assert!(store.open_piece("app", 3, copy).unwrap().1.as_slice().iter().all(|&b| b == 3));
        assert!(store.open_piece("app", 2, copy).unwrap().1.as_slice().iter().all(|&b| b == 2), "untouched");
        // A piece deleted (not kept as the spare: one exists) takes its
        // mapping with it, and so does the application's removal.
        store.discard_piece("app", 9, copy).unwrap();
        fs::copy(dir.join("app/pieces/v3.copy0.data"), dir.join("app/pieces/spare.copy0.data")).unwrap();
        store.drop_pieces_below("app", 3).unwrap();
        assert_eq!(store.kept_mappings(), 1, "version 2's piece was deleted: only version 3's is kept");
        store.remove_app("app").unwrap();
        assert_eq!(store.kept_mappings(), 0);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn piece_file_names_parse_back() {
        for piece in
            [PieceId::Copy { rank: 12 }, PieceId::Parity { group: 3, index: 1 }, PieceId::Slice { group: 2, index: 3 }]
        {
            let name = format!("v77.{}.meta", piece_name(piece));
            assert_eq!(parse_piece_meta_name(&name), Some((77, piece)), "{name}");
        }
        for other in [
            "v7.copy1.data",
            "spare.copy1.data",
            "v7.copy.meta",
            "v7.parity1.meta",
            "v7.slice1.meta",
            "vx.copy1.meta",
            "v7.meta",
        ] {
            assert_eq!(parse_piece_meta_name(other), None, "{other}");
        }
    }

    /// The names of the files in `dir`, sorted.
    fn sorted_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_replanned_versions_old_pieces_go_and_everything_else_stays() {
        let dir = std::env::temp_dir().join(format!("icheck-store-stale-{}", std::process::id()));
        let store = Store::new(&dir);
        let (old, new) = (PieceId::Parity { group: 0, index: 1 }, PieceId::Parity { group: 2, index: 1 });
        let copy = PieceId::Copy { rank: 1 };
        for (version, piece) in [(3, old), (3, new), (3, copy), (2, old)] {
            let file = store.create_piece("app", version, piece, 10).unwrap();
            if piece != new {
                store
                    .seal_piece("app", version, piece, &PieceMeta::Copy(manifest("app", 1, version, file.as_slice())))
                    .unwrap();
            }
        }
        // An unsealed stale piece (its protection was cut short) goes too.
        let unsealed = PieceId::Slice { group: 1, index: 2 };
        drop(store.create_piece("app", 3, unsealed, 10).unwrap());
        fs::write(dir.join("app/pieces/spare.parity0-1.data"), b"spare").unwrap();
        // Version 3's old parity (data and description) and the unsealed slice.
        assert_eq!(store.drop_stale_pieces("app", 3, &[new, copy]).unwrap(), 3);
        let left = sorted_names(&dir.join("app/pieces"));
        let expected = [
            "spare.parity0-1.data",
            "v2.parity0-1.data",
            "v2.parity0-1.meta",
            "v3.copy1.data",
            "v3.copy1.meta",
            "v3.parity2-1.data",
        ];
        assert_eq!(left, expected);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn pieces_are_kept_apart_from_ranks_and_dropped_by_version() {
        let dir = std::env::temp_dir().join(format!("icheck-store-pieces-{}", std::process::id()));
        let store = Store::new(&dir);
        let copy = PieceId::Copy { rank: 3 };
        for version in [4u64, 5] {
            let mut file = store.create_piece("app", version, copy, 10).unwrap();
            file.as_mut_slice().fill(version as u8);
            assert!(store.open_piece("app", version, copy).is_err(), "an unsealed piece must not open");
            let meta = PieceMeta::Copy(manifest("app", 3, version, file.as_slice()));
            store.seal_piece("app", version, copy, &meta).unwrap();
        }
        let (meta, data) = store.open_piece("app", 5, copy).unwrap();
        assert!(matches!(meta, PieceMeta::Copy(ref m) if m.rank == 3 && m.version == 5));
        assert_eq!(data.as_slice(), &[5u8; 10]);
        // Another piece's description under this name is refused.
        let other = PieceId::Copy { rank: 4 };
        std::fs::copy(dir.join("app/pieces/v5.copy3.meta"), dir.join("app/pieces/v5.copy4.meta")).unwrap();
        std::fs::copy(dir.join("app/pieces/v5.copy3.data"), dir.join("app/pieces/v5.copy4.data")).unwrap();
        let Err(err) = store.open_piece("app", 5, other) else { panic!("another piece's description was accepted") };
        let err = err.to_string();
        assert!(err.contains("another piece"), "{err}");
        // Pieces are not ranks: the inventory a manager reports ignores them.
        assert!(store.inventory(&mut InventoryCache::default()).is_empty());
        // The pieces' own inventory lists the sealed ones whose description
        // checks: not the copy under another piece's name, nor a spare.
        let stored = |version, piece| StoredPiece { app: "app".into(), version, piece };
        assert_eq!(store.piece_inventory(), [stored(4, copy), stored(5, copy)]);
        assert_eq!(store.drop_pieces_below("app", 5).unwrap(), 2, "version 4's data and description");
        assert!(store.open_piece("app", 4, copy).is_err());
        assert!(store.open_piece("app", 5, copy).is_ok());
        // Version 4's data became the piece's spare, and version 6 reuses it
        // (and only it: version 5's piece stays intact).
        assert!(dir.join("app/pieces/spare.copy3.data").exists(), "the dropped piece's file is kept as spare");
        let mut file = store.create_piece("app", 6, copy, 12).unwrap();
        assert_eq!(&file.as_slice()[..10], &[4u8; 10], "the spare's pages are reused, not reallocated");
        file.as_mut_slice().fill(6);
        assert!(!dir.join("app/pieces/spare.copy3.data").exists());
        assert_eq!(store.open_piece("app", 5, copy).unwrap().1.as_slice(), &[5u8; 10]);
        // With a spare already kept, older versions' files are deleted.
        store.seal_piece("app", 6, copy, &PieceMeta::Copy(manifest("app", 3, 6, file.as_slice()))).unwrap();
        // Versions 5 (copies of ranks 3 and 4) and 6 (rank 3): 6 files.
        assert_eq!(store.drop_pieces_below("app", 7).unwrap(), 6);
        let left = sorted_names(&dir.join("app/pieces"));
        assert_eq!(left, ["spare.copy3.data", "spare.copy4.data"], "one spare per piece is left");
        let mut file = store.create_piece("app", 7, copy, 12).unwrap();
        assert_eq!(file.as_mut_slice(), &[6u8; 12], "the newest dropped piece is the one kept");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn names_that_escape_the_root_are_refused() {
        for bad in ["", "..", "../x", "a/b", ".hidden", "x\0y"] {
            assert!(check_app_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_app_name("heat2d_v1.2-test").is_ok());
    }

    #[test]
    fn checksums_find_the_damaged_chunk() {
        let mut data = vec![7u8; (CHUNK_SIZE as usize) * 2 + 5];
        let crcs = chunk_crcs(&data);
        assert_eq!(crcs.len(), 3);
        data[CHUNK_SIZE as usize + 1] ^= 1;
        assert_eq!(first_bad_chunk(&data, &crcs), Some(1));
        assert_eq!(first_bad_chunk(&data[..10], &crcs), Some(1));
    }
}
