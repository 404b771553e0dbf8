//! Each rank's newest sealed version, kept mapped for the agents and
//! restarts that read it, with the result of checking it.
//!
//! Serving a version used to map its file again for every Fetch (a
//! page-table entry per page: ~20 ms per 256 MiB on tmpfs, and ~13 ms more
//! to unmap it afterwards) and check every byte of it against the manifest
//! (~15 ms more), while the reader waited: a restarting rank, or the agent
//! building a copy or a parity shard right after the commit. Instead the
//! mapping the version was written into is shared from `Seal` on: the
//! session holds it (to reuse it as the spare), this table holds it, and a
//! Fetch registers it for reading. The first Fetch that checks it records
//! the result (a Fetch whose reader checks every chunk itself, an agent
//! copying or encoding the version, neither checks nor records, and leaves
//! a background check under way running); when the rank's own session
//! ends an unchecked version is checked in the background at low
//! priority, ready for the restart that usually follows (not when another
//! agent's session ends: a copier or encoder reads every version while
//! the application runs, and a check after each read every version again,
//! 140-220 ms per 256 MiB rank per version here). An incremental version
//! (its own file holds only its changed blocks) is not kept from `Seal`:
//! when the rank's own session ends it is composed in the background from
//! the files holding its blocks (mapped, not read), then checked there
//! like a whole one, reading those files. A version is served unchecked
//! again only while its file's [`FileIdentity`] (inode, length, change
//! times) is unchanged. The reader still checks every chunk it reads, so
//! damage that happens in memory after the check is still caught, by the
//! reader instead of the agent.
//!
//! Architecture invariant: the background check reads the version's files
//! (its data file, and an incremental version's block-holding files, with
//! `pread`), never the mapping (a file cut under a mapping faults the
//! reader with SIGBUS: the first version of this module lost its manager
//! when a test rewrote a version's file during the check), and its answer
//! counts only if the file's identity held throughout. The store cuts a
//! file only when it reuses a pruned version's file for a new one, or when
//! a version number is begun again; so a rank's kept version is forgotten
//! (its check stopped and joined first) when a newer version of the rank
//! completes, and when a version at or below it is begun. At most one
//! version per rank is kept.

use super::*;
use crate::store::{FileIdentity, SharedMapping};
use icheck_core::handoff::VersionFiles;
use std::sync::atomic::AtomicBool;

/// The versions kept for an application's ranks, one per rank at most.
#[derive(Default)]
pub(super) struct KeptVersions {
    by_rank: Mutex<std::collections::HashMap<u32, Kept>>,
}

struct Kept {
    version: u64,
    manifest: Manifest,
    identity: FileIdentity,
    file: SharedMapping,
    check: Check,
}

/// Whether a kept version's bytes match its manifest.
enum Check {
    /// Nobody has checked it yet.
    Unchecked,
    /// Being checked on a low-priority thread; `stop` ends it early (the
    /// thread then answers `false`: not known to be intact).
    Running { stop: Arc<AtomicBool>, thread: JoinHandle<bool> },
    /// Checked: `true` when every chunk matched.
    Done(bool),
}

impl Check {
    /// Whether the version is known to be intact, stopping a check that
    /// still runs (a reader that needs the answer now checks at full
    /// speed rather than wait for a low-priority thread).
    fn finish(self) -> bool {
        match self {
            Check::Unchecked => false,
            Check::Done(intact) => intact,
            Check::Running { stop, thread } => {
                stop.store(true, Ordering::Relaxed);
                thread.join().unwrap_or(false)
            }
        }
    }
}

/// A kept version shared with a Fetch.
pub(super) struct SharedVersion {
    pub manifest: Manifest,
    pub file: SharedMapping,
    pub identity: FileIdentity,
    /// Every chunk matched the manifest, and the file has not changed since.
    pub intact: bool,
}

impl KeptVersions {
    /// Keeps `file`, the mapping the version `manifest` describes was just
    /// sealed in, unchecked; unless a newer version of the rank is kept. An
    /// incremental version's own file holds only its changed blocks: it is
    /// kept once a Fetch has composed the version ([`keep_intact`]).
    ///
    /// [`keep_intact`]: KeptVersions::keep_intact
    pub(super) fn keep_sealed(&self, store: &Store, manifest: &Manifest, file: SharedMapping) {
        let Ok(identity) = store.data_identity(&manifest.app, manifest.rank, manifest.version) else {
            // Removed meanwhile: nothing worth keeping.
            return;
        };
        let kept =
            Kept { version: manifest.version, manifest: manifest.clone(), identity, file, check: Check::Unchecked };
        self.insert(manifest.rank, kept);
    }

    /// Keeps `file`, a mapping of the version `manifest` describes, which
    /// matched it while its file had `identity`. Already kept, it is only
    /// marked intact.
    pub(super) fn keep_intact(&self, manifest: &Manifest, identity: FileIdentity, file: &SharedMapping) {
        let (rank, version) = (manifest.rank, manifest.version);
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kept) = by_rank.get_mut(&rank).filter(|k| k.version == version && k.identity == identity) {
            let old = std::mem::replace(&mut kept.check, Check::Done(true));
            drop(by_rank);
            old.finish();
            return;
        }
        drop(by_rank);
        let kept = Kept { version, manifest: manifest.clone(), identity, file: file.clone(), check: Check::Done(true) };
        self.insert(rank, kept);
    }

    fn insert(&self, rank: u32, kept: Kept) {
        // A shorter mapping is an incremental version's packed changed
        // blocks (all of them in order, when every block changed, is the
        // whole version): not the version's bytes.
        if kept.manifest.total_len > kept.file.data_len() as u64 {
            return;
        }
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        if by_rank.get(&rank).is_some_and(|old| old.version > kept.version) {
            return;
        }
        let replaced = by_rank.insert(rank, kept);
        drop(by_rank);
        if let Some(old) = replaced {
            old.check.finish();
        }
    }

    /// Starts checking `rank`'s kept version in the background if nobody
    /// has: its session ended, and a restart may follow.
    pub(super) fn check_later(&self, store: &Store, app: &str, rank: u32) {
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kept) = by_rank.get_mut(&rank).filter(|k| matches!(k.check, Check::Unchecked)) {
            kept.check = check_in_background(store, app, &kept.manifest, kept.identity);
        }
    }

    /// Composes `rank`'s incremental `version` (its blocks mapped from the
    /// files holding them, [`Store::open`]) on a low-priority thread and
    /// keeps the view unchecked, unless the rank has a version kept by
    /// then: the restart that usually follows a session's end then skips
    /// the composition (22 ms of the first restart's 32 ms Fetch for
    /// 256 MiB here), and checks the bytes itself. Composing maps but never
    /// reads, so a file cut meanwhile cannot fault it; what it keeps is
    /// served only while the version's own file keeps its identity, and is
    /// forgotten like any kept version before a newer one's prune.
    pub(super) fn compose_later(self: &Arc<Self>, store: &Store, app: &str, rank: u32, version: u64) {
        self.compose_in_background(store, app, (rank, version), false);
    }

    /// [`compose_later`], then checks the composed version in the
    /// background like a whole one ([`check_in_background`] reads the
    /// files holding its blocks, not the view): the rank's own session
    /// ended, and its restart then also skips the check (the other 10 ms of
    /// that Fetch).
    ///
    /// [`compose_later`]: KeptVersions::compose_later
    pub(super) fn compose_and_check_later(self: &Arc<Self>, store: &Store, app: &str, rank: u32, version: u64) {
        self.compose_in_background(store, app, (rank, version), true);
    }

    fn compose_in_background(self: &Arc<Self>, store: &Store, app: &str, (rank, version): (u32, u64), check: bool) {
        if self.by_rank.lock().unwrap_or_else(|p| p.into_inner()).get(&rank).is_some_and(|k| k.version >= version) {
            return;
        }
        let (kept, store, app) = (self.clone(), store.clone(), app.to_string());
        let spawned = std::thread::Builder::new().name("icheck-kept-view".into()).spawn(move || {
            crate::manager::lower_thread_priority();
            let started = Instant::now();
            let Ok(identity) = store.data_identity(&app, rank, version) else { return };
            let Ok((manifest, file)) = store.open(&app, rank, version) else { return };
            if store.data_identity(&app, rank, version).ok() != Some(identity) {
                return;
            }
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let file = SharedMapping::new(file);
            let check = if check { check_in_background(&store, &app, &manifest, identity) } else { Check::Unchecked };
            kept.insert(rank, Kept { version, manifest, identity, file, check });
            tracing::debug!(version, rank, ms, "incremental version composed for the next Fetch");
        });
        if let Err(err) = spawned {
            tracing::warn!(%err, "cannot start composing a kept version");
        }
    }

    /// `rank`'s kept `version` for a Fetch, if it is kept and its file is
    /// unchanged (a changed one is forgotten). A Fetch that checks the
    /// version unless it is known intact needs the answer now
    /// (`need_answer`: a check under way is stopped, and the Fetch checks
    /// at full speed); one whose reader checks every chunk itself (an
    /// encoder or a copier) does not, and a background check under way
    /// goes on, its answer kept for the restart it was started for.
    pub(super) fn share(
        &self,
        store: &Store,
        app: &str,
        (rank, version): (u32, u64),
        need_answer: bool,
    ) -> Option<SharedVersion> {
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        let kept = by_rank.get_mut(&rank).filter(|k| k.version == version)?;
        if store.data_identity(app, rank, version).ok() != Some(kept.identity) {
            let stale = by_rank.remove(&rank);
            drop(by_rank);
            stale.map(|k| k.check.finish());
            tracing::debug!(version, rank, "kept version's file changed since it was kept: opening it again");
            return None;
        }
        let check = std::mem::replace(&mut kept.check, Check::Unchecked);
        let intact = match check {
            Check::Running { thread, .. } if thread.is_finished() => thread.join().unwrap_or(false),
            running @ Check::Running { .. } if !need_answer => {
                kept.check = running;
                false
            }
            other => other.finish(),
        };
        if intact {
            kept.check = Check::Done(true);
        }
        Some(SharedVersion {
            manifest: kept.manifest.clone(),
            file: kept.file.clone(),
            identity: kept.identity,
            intact,
        })
    }

    /// Forgets every rank's kept version that `stale(version)` says is
    /// stale (before their files go).
    pub(super) fn forget_all_if(&self, stale: impl Fn(u64) -> bool) {
        let forgotten: Vec<Kept> = {
            let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
            let ranks: Vec<u32> = by_rank.iter().filter(|(_, kept)| stale(kept.version)).map(|(r, _)| *r).collect();
            ranks.into_iter().filter_map(|rank| by_rank.remove(&rank)).collect()
        };
        for kept in forgotten {
            kept.check.finish();
        }
    }

    /// Forgets `rank`'s kept version if `stale(version)` says so: before
    /// its file can be cut (see the module's invariant).
    pub(super) fn forget_if(&self, rank: u32, stale: impl FnOnce(u64) -> bool) {
        let forgotten = {
            let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
            match by_rank.get(&rank) {
                Some(kept) if stale(kept.version) => by_rank.remove(&rank),
                _ => None,
            }
        };
        if let Some(kept) = forgotten {
            kept.check.finish();
        }
    }

    /// Waits for every background check to end on its own.
    #[cfg(test)]
    fn wait_for_checks(&self) {
        for kept in self.by_rank.lock().unwrap().values_mut() {
            if let Check::Running { thread, .. } = std::mem::replace(&mut kept.check, Check::Unchecked) {
                kept.check = Check::Done(thread.join().unwrap());
            }
        }
    }

    /// Stops every background check and lets go of every kept version.
    pub(super) fn clear(&self) {
        let all: Vec<Kept> = self.by_rank.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, k)| k).collect();
        for kept in all {
            kept.check.finish();
        }
    }
}

impl Drop for KeptVersions {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Starts checking `rank`'s `version` against `manifest` on a low-priority
/// thread, a chunk at a time so a stop is seen at once. It reads the
/// version's files (`pread`: its data file, or an incremental version's
/// block-holding files, [`Store::open_read_only`]), not the mapping: a file
/// someone else cuts meanwhile makes a short read, where a mapping would
/// fault (SIGBUS) and take the manager down. The answer holds only if the
/// data file's identity is `identity` both when the files are opened and at
/// the end.
fn check_in_background(store: &Store, app: &str, manifest: &Manifest, identity: FileIdentity) -> Check {
    let stop = Arc::new(AtomicBool::new(false));
    let (store, app, manifest, stopped) = (store.clone(), app.to_string(), manifest.clone(), stop.clone());
    let spawned = std::thread::Builder::new().name("icheck-kept-check".into()).spawn(move || {
        crate::manager::lower_thread_priority();
        let (rank, version) = (manifest.rank, manifest.version);
        let started = Instant::now();
        let intact = store
            .open_read_only(&app, rank, version)
            .ok()
            .filter(|(_, _, opened)| *opened == identity)
            .and_then(|(files, extents, _)| VersionFiles::new(files, extents, manifest.total_len).ok())
            .and_then(|files| check_file(&manifest, &files, &stopped))
            .filter(|_| store.data_identity(&app, rank, version).ok() == Some(identity));
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match intact {
            Some(true) => tracing::debug!(version, rank, ms, "kept version checked"),
            Some(false) => {
                tracing::warn!(version, rank, "kept version does not match its checksums (a Fetch will say where)")
            }
            None => tracing::debug!(version, rank, ms, "kept version's check stopped or could not read it"),
        }
        intact == Some(true)
    });
    match spawned {
        Ok(thread) => Check::Running { stop, thread },
        Err(err) => {
            tracing::warn!(%err, "cannot start checking a kept version");
            Check::Unchecked
        }
    }
}

/// Every label of the version in `files` against `manifest`'s chunk
/// checksums, a chunk at a time: `Some(intact)`, or `None` when `stop` was
/// raised first or the files could not be read whole.
fn check_file(manifest: &Manifest, files: &VersionFiles, stop: &AtomicBool) -> Option<bool> {
    if manifest.validate().is_err() || manifest.chunk_size == 0 {
        return Some(false);
    }
    let chunk = usize::try_from(manifest.chunk_size).ok()?;
    // Placed like each chunk's file offset: labels lie anywhere in the
    // file, and a chunk just behind its buffer's place in a page is the
    // kernel's slow copy (`icheck_core::kernel_copy`).
    let mut buffer = icheck_core::kernel_copy::PlacedBuffer::new(chunk);
    for (label, crcs) in manifest.labels.iter().zip(&manifest.crcs) {
        for (index, crc) in crcs.iter().enumerate() {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            let at = (index * chunk) as u64;
            let len = usize::try_from(label.len.saturating_sub(at)).ok()?.min(chunk);
            let bytes = buffer.placed(label.offset + at, len);
            files.read_exact_at(bytes, label.offset + at).ok()?;
            if first_bad_chunk(bytes, std::slice::from_ref(crc)).is_some() {
                return Some(false);
            }
        }
    }
    Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::format::chunk_crcs;
    use icheck_core::handoff::FileExtent;

    /// A store under the temporary directory holding version `version` of
    /// rank 0 of "app" (20 MiB, sealed), that version's mapping and manifest.
    fn stored(name: &str, version: u64) -> (Store, std::path::PathBuf, MappedFile, Manifest) {
        let root = std::env::temp_dir().join(format!("icheck-kept-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = Store::new(&root);
        let data: Vec<u8> = (0..20u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let mut file = store.create("app", 0, version, data.len() as u64).unwrap();
        file.as_mut_slice()[..data.len()].copy_from_slice(&data);
        let manifest = icheck_core::format::samples::single_label("app", 0, version, &data);
        store.seal(&manifest).unwrap();
        (store, root, file, manifest)
    }

    #[test]
    fn a_sealed_version_is_checked_once_and_served_while_its_file_is_unchanged() {
        let (store, root, file, manifest) = stored("served", 3);
        let kept = KeptVersions::default();
        kept.keep_sealed(&store, &manifest, SharedMapping::new(file));
        // Another version, or another rank, is not served from it.
        assert!(kept.share(&store, "app", (0, 2), true).is_none());
        assert!(kept.share(&store, "app", (1, 3), true).is_none());
        let first = kept.share(&store, "app", (0, 3), true).expect("kept");
        assert!(!first.intact, "nobody has checked it yet");
        // The Fetch checked it: later ones need not.
        kept.keep_intact(&first.manifest, first.identity, &first.file);
        assert!(kept.share(&store, "app", (0, 3), true).expect("still kept").intact);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_version_left_by_its_session_is_checked_in_the_background() {
        let (store, root, file, manifest) = stored("background", 6);
        let kept = KeptVersions::default();
        kept.keep_sealed(&store, &manifest, SharedMapping::new(file));
        kept.check_later(&store, "app", 0);
        kept.wait_for_checks();
        assert!(kept.share(&store, "app", (0, 6), true).expect("kept").intact);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_reader_that_checks_for_itself_leaves_a_background_check_running() {
        let (store, root, file, manifest) = stored("left-running", 7);
        let kept = KeptVersions::default();
        kept.keep_sealed(&store, &manifest, SharedMapping::new(file));
        // The rank's session ended; an encoder reads the version before the
        // check is done, and does not wait for it.
        kept.check_later(&store, "app", 0);
        let _ = kept.share(&store, "app", (0, 7), false).expect("kept");
        // The check was not stopped: the restart finds the version intact.
        kept.wait_for_checks();
        assert!(kept.share(&store, "app", (0, 7), true).expect("still kept").intact);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_version_nobody_keeps_is_composed_in_the_background_and_served_unchecked() {
        let (store, root, file, manifest) = stored("composed", 8);
        drop(file);
        let kept = Arc::new(KeptVersions::default());
        // A version the store lacks composes to nothing.
        kept.compose_later(&store, "app", 0, 9);
        kept.compose_later(&store, "app", 0, 8);
        let deadline = Instant::now() + Duration::from_secs(20);
        let shared = loop {
            if let Some(shared) = kept.share(&store, "app", (0, 8), true) {
                break shared;
            }
            assert!(Instant::now() < deadline, "never composed");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(!shared.intact, "composed, not checked: the Fetch checks it");
        assert_eq!(shared.manifest, manifest);
        assert!(manifest.verify(shared.file.as_slice()).is_ok());
        assert!(kept.share(&store, "app", (0, 9), true).is_none());
        // Kept already (or newer): nothing is composed over it.
        kept.keep_intact(&shared.manifest, shared.identity, &shared.file);
        kept.compose_later(&store, "app", 0, 8);
        assert!(kept.share(&store, "app", (0, 8), true).expect("still kept").intact);
        let _ = std::fs::remove_dir_all(root);
    }

    /// Seals version `version` of rank 0 of "app" over version `parent`
    /// (from [`stored`]) as an incremental version: block 3 changed, the
    /// other blocks read from `parent`'s file. Returns its manifest.
    fn stored_delta(store: &Store, parent: &Manifest, version: u64) -> Manifest {
        use icheck_core::delta::{BlockMap, BlockRun, BLOCK_BYTES};
        let mut data = std::fs::read(store.data_path("app", 0, parent.version).unwrap()).unwrap();
        let changed = 3 * BLOCK_BYTES..4 * BLOCK_BYTES;
        data[changed.clone()].iter_mut().for_each(|b| *b = b.wrapping_add(1));
        let mut file = store.create("app", 0, version, BLOCK_BYTES as u64).unwrap();
        file.as_mut_slice()[..BLOCK_BYTES].copy_from_slice(&data[changed]);
        let manifest = Manifest { version, crcs: vec![chunk_crcs(&data)], ..parent.clone() };
        let map = BlockMap::whole(parent.version, parent.total_len).next(version, &[BlockRun { first: 3, count: 1 }]);
        store.seal_delta(&manifest, &map).unwrap();
        manifest
    }

    /// Polls until `rank` 0's `version` is kept and its background check
    /// has ended, then shares it.
    fn shared_once_checked(kept: &KeptVersions, store: &Store, version: u64) -> SharedVersion {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let composed = kept.by_rank.lock().unwrap().get(&0).is_some_and(|k| k.version == version);
            if composed {
                kept.wait_for_checks();
                return kept.share(store, "app", (0, version), true).expect("kept");
            }
            assert!(Instant::now() < deadline, "never composed");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_incremental_version_left_by_its_session_is_composed_and_checked_from_its_files() {
        let (store, root, file, parent) = stored("composed-checked", 1);
        drop(file);
        let manifest = stored_delta(&store, &parent, 2);
        let kept = Arc::new(KeptVersions::default());
        kept.compose_and_check_later(&store, "app", 0, 2);
        let shared = shared_once_checked(&kept, &store, 2);
        assert!(shared.intact, "checked in the background: the restart's Fetch need not");
        assert_eq!(shared.manifest, manifest);
        assert!(manifest.verify(shared.file.as_slice()).is_ok());
        drop(shared);
        kept.clear();

        // A block of the parent's file that the version reads goes bad (not
        // its own file: its identity holds): the check says so, and the
        // Fetch checks for itself and names the damage.
        let parent_path = store.data_path("app", 0, 1).unwrap();
        let mut bytes = std::fs::read(&parent_path).unwrap();
        bytes[(5 << 20) + 9] ^= 1;
        std::fs::write(&parent_path, bytes).unwrap();
        kept.compose_and_check_later(&store, "app", 0, 2);
        let shared = shared_once_checked(&kept, &store, 2);
        assert!(!shared.intact, "the parent's damaged block is the version's");
        assert!(manifest.verify(shared.file.as_slice()).is_err());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_kept_version_whose_file_changed_is_not_served() {
        let (store, root, file, manifest) = stored("changed", 4);
        let kept = KeptVersions::default();
        let file = SharedMapping::new(file);
        kept.keep_sealed(&store, &manifest, file.clone());
        let shared = kept.share(&store, "app", (0, 4), true).expect("kept");
        kept.keep_intact(&shared.manifest, shared.identity, &shared.file);
        // Someone rewrites one byte of the file (through write(2), not the
        // mapping): its change time moves on.
        std::thread::sleep(Duration::from_millis(20));
        let path = root.join("app/rank0/v4.data");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[123] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(kept.share(&store, "app", (0, 4), true).is_none(), "the Fetch opens and checks it again");
        // ...and a result recorded for the old identity is not taken.
        kept.keep_intact(&shared.manifest, shared.identity, &shared.file);
        assert!(kept.share(&store, "app", (0, 4), true).is_none());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn forgetting_drops_only_what_the_condition_names_and_newer_versions_stay() {
        let (store, root, file, manifest) = stored("forget", 5);
        let kept = KeptVersions::default();
        kept.keep_sealed(&store, &manifest, SharedMapping::new(file));
        kept.forget_if(0, |v| v < 5);
        kept.forget_if(1, |_| true);
        let shared = kept.share(&store, "app", (0, 5), true).expect("still kept");
        // An older version does not replace a newer one.
        let older = Manifest { version: 4, ..shared.manifest.clone() };
        kept.keep_intact(&older, shared.identity, &shared.file);
        assert!(kept.share(&store, "app", (0, 5), true).is_some());
        kept.forget_if(0, |v| v >= 5);
        assert!(kept.share(&store, "app", (0, 5), true).is_none());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_file_check_finds_damage_and_stops_when_asked() {
        let (store, root, _file, manifest) = stored("stepwise", 7);
        let path = store.data_path("app", 0, 7).unwrap();
        let stop = AtomicBool::new(false);
        let whole = |file| FileExtent { offset: 0, len: manifest.total_len, file, file_offset: 0 };
        let open = || {
            VersionFiles::new(vec![std::fs::File::open(&path).unwrap()], vec![whole(0)], manifest.total_len).unwrap()
        };
        assert_eq!(check_file(&manifest, &open(), &stop), Some(true));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(13 << 20) + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(check_file(&manifest, &open(), &stop), Some(false));
        // A cut file is not known either way (and does not fault).
        std::fs::write(&path, &bytes[..1 << 20]).unwrap();
        assert_eq!(check_file(&manifest, &open(), &stop), None);
        stop.store(true, Ordering::Relaxed);
        assert_eq!(check_file(&manifest, &open(), &stop), None);
        let _ = std::fs::remove_dir_all(root);
    }
}
