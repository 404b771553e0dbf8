//! Sealed versions kept mapped between a rank's sessions, with the result
//! of checking them.
//!
//! A restart is a new session. Serving a version there used to map its file
//! again (a page-table entry per page: ~20 ms per 256 MiB on tmpfs, and
//! ~13 ms more to unmap it afterwards) and check every byte of it against
//! the manifest (~15 ms more), all while the restarting rank waited.
//! Instead, when a session ends, the newest version it sealed stays mapped
//! here and is checked in the background at low priority; a Fetch of it
//! takes the mapping and, when the check passed and the file is unchanged
//! since (its [`FileIdentity`]), exposes it at once. After the rank's
//! `FetchDone` the mapping comes back, checked, for the next restart. The
//! rank itself still checks every chunk it reads, so damage that happens in
//! memory after the check is still caught, by the rank instead of the agent.
//!
//! Architecture invariant: a kept mapping is read only while its file
//! cannot be cut. The store cuts a file only when it reuses a pruned
//! version's file for a new one, or when a version number is begun again;
//! so a rank's kept version is forgotten (its check stopped and joined
//! first) when a newer version of the rank completes, and when a version
//! at or below it is begun. Forgotten or not, a kept mapping is used only
//! if its file's identity is unchanged, and it holds at most one version's
//! memory per rank.

use super::*;
use crate::store::FileIdentity;
use std::sync::atomic::AtomicBool;

/// Bytes checked between looks at the stop flag of a background check.
const CHECK_STEP: usize = 16 << 20;

/// The versions kept for an application's ranks, one per rank at most.
#[derive(Default)]
pub(super) struct KeptVersions {
    by_rank: Mutex<std::collections::HashMap<u32, Kept>>,
}

struct Kept {
    version: u64,
    manifest: Manifest,
    identity: FileIdentity,
    file: Arc<MappedFile>,
    check: Check,
}

/// Whether a kept version's bytes match its manifest.
enum Check {
    /// Being checked on a low-priority thread; `stop` ends it early (the
    /// thread then answers `false`: not known to be intact).
    Running { stop: Arc<AtomicBool>, thread: JoinHandle<bool> },
    /// Checked (`true`: every chunk matched) or known unchecked.
    Done(bool),
}

impl Check {
    /// The check's result, stopping it if it still runs.
    fn finish(self) -> bool {
        match self {
            Check::Done(intact) => intact,
            Check::Running { stop, thread } => {
                stop.store(true, Ordering::Relaxed);
                thread.join().unwrap_or(false)
            }
        }
    }
}

/// A kept version handed to a Fetch.
pub(super) struct Taken {
    pub manifest: Manifest,
    pub file: MappedFile,
    pub identity: FileIdentity,
    /// Every chunk matched the manifest, and the file has not changed since.
    pub intact: bool,
}

impl KeptVersions {
    /// Keeps `file`, the mapping of `rank`'s sealed `version`, and checks
    /// it in the background; unless a newer version of the rank is kept.
    pub(super) fn keep(&self, store: &Store, app: &str, rank: u32, version: u64, file: MappedFile) {
        // The identity before the manifest and the check: a change after it
        // shows.
        let (identity, manifest) = match (store.data_identity(app, rank, version), store.manifest(app, rank, version)) {
            (Ok(identity), Ok(manifest)) => (identity, manifest),
            // Removed or damaged meanwhile: nothing worth keeping.
            _ => return,
        };
        self.insert(rank, manifest, identity, file, None);
    }

    /// Keeps `file`, a mapping of the version `manifest` describes, which
    /// matched it while its file had `identity`.
    pub(super) fn keep_intact(&self, manifest: Manifest, identity: FileIdentity, file: MappedFile) {
        self.insert(manifest.rank, manifest, identity, file, Some(true));
    }

    fn insert(&self, rank: u32, manifest: Manifest, identity: FileIdentity, file: MappedFile, intact: Option<bool>) {
        let version = manifest.version;
        // An incremental version's own file holds only its changed blocks,
        // packed (all of them in order when every block changed, which is
        // the whole version): a shorter one is kept only once a Fetch has
        // composed the version from its blocks.
        if manifest.total_len > file.len() as u64 {
            return;
        }
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        if by_rank.get(&rank).is_some_and(|kept| kept.version > version) {
            return;
        }
        let file = Arc::new(file);
        let check = match intact {
            Some(intact) => Check::Done(intact),
            None => check_in_background(&manifest, &file, rank),
        };
        let replaced = by_rank.insert(rank, Kept { version, manifest, identity, file, check });
        drop(by_rank);
        if let Some(old) = replaced {
            old.check.finish();
        }
    }

    /// Takes `rank`'s kept `version` for a Fetch, if it is kept and its file
    /// is unchanged. A check still running is stopped (the Fetch checks at
    /// full speed instead of waiting for a low-priority thread).
    pub(super) fn take(&self, store: &Store, app: &str, rank: u32, version: u64) -> Option<Taken> {
        let kept = {
            let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
            match by_rank.get(&rank) {
                Some(kept) if kept.version == version => by_rank.remove(&rank)?,
                _ => return None,
            }
        };
        let Kept { manifest, identity, file, check, .. } = kept;
        let intact = check.finish();
        if store.data_identity(app, rank, version).ok() != Some(identity) {
            tracing::debug!(version, rank, "kept version's file changed since it was kept: opening it again");
            return None;
        }
        // The check thread, the only other holder, has ended.
        let file = Arc::into_inner(file)?;
        Some(Taken { manifest, file, identity, intact })
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
            if let Check::Running { thread, .. } = std::mem::replace(&mut kept.check, Check::Done(false)) {
                kept.check = Check::Done(thread.join().unwrap());
            }
        }
    }

    /// Stops every background check and unmaps every kept version.
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

/// Starts checking `file` against `manifest` on a low-priority thread, one
/// step at a time so a stop is seen within a step.
fn check_in_background(manifest: &Manifest, file: &Arc<MappedFile>, rank: u32) -> Check {
    let stop = Arc::new(AtomicBool::new(false));
    let (manifest, file, stopped) = (manifest.clone(), file.clone(), stop.clone());
    let spawned = std::thread::Builder::new().name("icheck-kept-check".into()).spawn(move || {
        crate::manager::lower_thread_priority();
        let started = Instant::now();
        let intact = check_stepwise(&manifest, file.as_slice(), &stopped);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match intact {
            Some(true) => tracing::debug!(version = manifest.version, rank, ms, "kept version checked"),
            Some(false) => tracing::warn!(
                version = manifest.version,
                rank,
                "kept version does not match its checksums (a Fetch will say where)"
            ),
            None => tracing::debug!(version = manifest.version, rank, ms, "kept version's check stopped"),
        }
        intact == Some(true)
    });
    match spawned {
        Ok(thread) => Check::Running { stop, thread },
        Err(err) => {
            tracing::warn!(%err, "cannot start checking a kept version");
            Check::Done(false)
        }
    }
}

/// Every label of `data` against `manifest`'s chunk checksums, a step at a
/// time: `Some(intact)`, or `None` when `stop` was raised first.
fn check_stepwise(manifest: &Manifest, data: &[u8], stop: &AtomicBool) -> Option<bool> {
    if manifest.validate().is_err() || manifest.chunk_size == 0 {
        return Some(false);
    }
    let chunk = manifest.chunk_size as usize;
    let per_step = (CHECK_STEP / chunk).max(1);
    for (index, crcs) in manifest.crcs.iter().enumerate() {
        let Ok(bytes) = manifest.label_bytes(index, data) else { return Some(false) };
        for (step, crcs) in crcs.chunks(per_step).enumerate() {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            let start = step * per_step * chunk;
            let end = (start + crcs.len() * chunk).min(bytes.len());
            if start > end || first_bad_chunk(&bytes[start..end], crcs).is_some() {
                return Some(false);
            }
        }
    }
    Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::format::{chunk_crcs, samples, DataKind, LabelLayout, CHUNK_SIZE};

    /// A store under the temporary directory holding version `version` of
    /// rank 0 of "app" (20 MiB, sealed), and that version's mapping.
    fn stored(name: &str, version: u64) -> (Store, std::path::PathBuf, MappedFile) {
        let root = std::env::temp_dir().join(format!("icheck-kept-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = Store::new(&root);
        let data: Vec<u8> = (0..20u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let mut file = store.create("app", 0, version, data.len() as u64).unwrap();
        file.as_mut_slice()[..data.len()].copy_from_slice(&data);
        let manifest = Manifest {
            app: "app".into(),
            rank: 0,
            ranks: 1,
            epoch: 0,
            version,
            labels: vec![LabelLayout {
                label: "x".into(),
                kind: DataKind::Binary,
                offset: 0,
                len: data.len() as u64,
                adapt: None,
            }],
            total_len: data.len() as u64,
            chunk_size: CHUNK_SIZE,
            crcs: vec![chunk_crcs(&data)],
            sealed_unix_ms: 0,
        };
        store.seal(&manifest).unwrap();
        (store, root, file)
    }

    #[test]
    fn a_kept_version_is_checked_once_and_served_while_its_file_is_unchanged() {
        let (store, root, file) = stored("served", 3);
        let kept = KeptVersions::default();
        kept.keep(&store, "app", 0, 3, file);
        kept.wait_for_checks();
        // Another version, or another rank, is not served from it.
        assert!(kept.take(&store, "app", 0, 2).is_none());
        assert!(kept.take(&store, "app", 1, 3).is_none());
        let taken = kept.take(&store, "app", 0, 3).expect("kept");
        assert!(taken.intact, "checked in the background and found intact");
        assert_eq!(taken.manifest.version, 3);
        // Taken is gone until it is given back.
        assert!(kept.take(&store, "app", 0, 3).is_none());
        kept.keep_intact(taken.manifest, taken.identity, taken.file);
        assert!(kept.take(&store, "app", 0, 3).is_some_and(|t| t.intact));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_kept_version_whose_file_changed_is_not_served() {
        let (store, root, file) = stored("changed", 4);
        let kept = KeptVersions::default();
        kept.keep(&store, "app", 0, 4, file);
        // Someone rewrites one byte of the file (through write(2), not the
        // mapping): its change time moves on.
        std::thread::sleep(Duration::from_millis(20));
        let path = root.join("app/rank0/v4.data");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[123] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(kept.take(&store, "app", 0, 4).is_none(), "the Fetch opens and checks it again");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn forgetting_drops_only_what_the_condition_names() {
        let (store, root, file) = stored("forget", 5);
        let kept = KeptVersions::default();
        kept.keep(&store, "app", 0, 5, file);
        kept.forget_if(0, |v| v < 5);
        kept.forget_if(1, |_| true);
        let taken = kept.take(&store, "app", 0, 5).expect("still kept");
        kept.keep_intact(taken.manifest, taken.identity, taken.file);
        kept.forget_if(0, |v| v >= 5);
        assert!(kept.take(&store, "app", 0, 5).is_none());
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_stepwise_check_finds_damage_and_stops_when_asked() {
        let data: Vec<u8> = (0..(40u32 << 20) / 4).flat_map(|i| i.to_le_bytes()).collect();
        let manifest = samples::manifest(&data);
        let stop = AtomicBool::new(false);
        assert_eq!(check_stepwise(&manifest, &data, &stop), Some(true));
        let mut damaged = data.clone();
        damaged[(33 << 20) + 5] ^= 1;
        assert_eq!(check_stepwise(&manifest, &damaged, &stop), Some(false));
        stop.store(true, Ordering::Relaxed);
        assert_eq!(check_stepwise(&manifest, &data, &stop), None);
    }
}
